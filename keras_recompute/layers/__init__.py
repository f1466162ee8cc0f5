"""Recompute-enabled layers: `Dense`, `MultiHeadAttention`, `FeedForward`, `TransformerBlock`.

Each is a thin subclass whose `call` is decorated with `recompute_grad`, so it
recomputes when `RECOMPUTE=1` (or inside `recompute_scope(True)`) and is the
plain layer otherwise. They are registered for serialization under the package
name `keras_recompute`, so `keras.models.load_model` finds them once this
module is imported.

One import path serves Keras 3 and tf_keras. `keras_recompute.layers.Dense` is
built on tf_keras when `TF_USE_LEGACY_KERAS` or `TF_KERAS` is set to a true
value, or when tf_keras has been imported and Keras 3 has not; on Keras 3
otherwise. `for_keras(module)` names the framework explicitly:

```python
import tf_keras
from keras_recompute import layers
Dense = layers.for_keras(tf_keras).Dense
```
"""

import os
import sys

from keras_recompute._config import parse_bool

__all__ = ["Dense", "FeedForward", "MultiHeadAttention", "TransformerBlock", "for_keras"]

_BUILT = {}


def for_keras(module):
    """The recompute-enabled layers built on `module` (`keras` 3, `tf_keras`, or `tf.keras`).

    Args:
        module: the Keras module the layers subclass.

    Returns:
        A namespace with `Dense`, `MultiHeadAttention`, `FeedForward` and
        `TransformerBlock`.

    Raises:
        TypeError: if `module` is not a Keras module.
    """
    layers = getattr(module, "layers", None)
    if layers is None or not hasattr(layers, "Dense"):
        raise TypeError(
            f"keras_recompute: layers.for_keras takes the Keras module (keras or tf_keras); received {module!r}."
        )
    key = id(layers.Dense)
    if key not in _BUILT:
        from keras_recompute.layers import _classes

        _BUILT[key] = _classes.build(module)
    return _BUILT[key]


def _default_keras():
    legacy = any(parse_bool(os.environ.get(name, ""), name) for name in ("TF_USE_LEGACY_KERAS", "TF_KERAS"))
    keras3_loaded = hasattr(sys.modules.get("keras"), "StatelessScope")
    if legacy or ("tf_keras" in sys.modules and not keras3_loaded):
        import tf_keras

        return tf_keras
    import keras

    return keras


def __getattr__(name):
    if name in ("Dense", "FeedForward", "MultiHeadAttention", "TransformerBlock"):
        return getattr(for_keras(_default_keras()), name)
    raise AttributeError(f"module 'keras_recompute.layers' has no attribute {name!r}")
