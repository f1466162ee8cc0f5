"""bert4keras 0.11: make its layers recompute with keras_recompute.

```python
import os
os.environ["TF_KERAS"] = "1"             # bert4keras on tf.keras ...
os.environ["TF_USE_LEGACY_KERAS"] = "1"  # ... which is tf_keras (Keras 2) on TF 2.16+
from keras_recompute.integrations import bert4keras as recompute_bert4keras
recompute_bert4keras.enable()            # the one line
# build_transformer_model(...) models now recompute when RECOMPUTE=1
```

`enable()` replaces the `call` of each bert4keras layer that bert4keras's own
recompute decorates (attention, feed-forward, layer normalization, the
global pointers) by the same `call` decorated with `recompute_grad`. Models
built before or after it are affected alike, since Keras looks `call` up on
every call.

NOTE [ bert4keras's own recompute ]
bert4keras reads the same `RECOMPUTE` variable at import and, if it is on,
wraps those calls in its own recompute, which doubles the gradient of a
tensor passed twice (its self-attention passes `[x, x, x]`) and does nothing
in graph mode. `enable()` unwraps it and puts ours in its place, so setting
`RECOMPUTE=1` before or after importing bert4keras gives the same, exact,
result.
"""

import sys

from keras_recompute._decorator import recompute_grad

# The classes whose `call` bert4keras 0.11.5 decorates with its recompute.
LAYERS = (
    "ScaleOffset",
    "LayerNormalization",
    "MultiHeadAttention",
    "GatedAttentionUnit",
    "FeedForward",
    "GlobalPointer",
    "EfficientGlobalPointer",
)

_MARK = "_keras_recompute_bert4keras"


def enable(layers=LAYERS):
    """Makes bert4keras's attention and feed-forward layers recompute with keras_recompute.

    Call it once, after importing bert4keras (or let it import it). Idempotent.

    Args:
        layers: the names of the `bert4keras.layers` classes to patch.

    Returns:
        The list of patched classes.

    Raises:
        ImportError: if bert4keras cannot be imported.
        ValueError: if a name in `layers` is not a class of `bert4keras.layers`.
    """
    module = sys.modules.get("bert4keras.layers")
    if module is None:
        import bert4keras.layers as module
    patched = []
    # Any other class bert4keras's recompute decorated (RECOMPUTE=1 at its import).
    layers = tuple(layers) + tuple(
        name
        for name, cls in vars(module).items()
        if isinstance(cls, type) and name not in layers and _is_theirs(vars(cls).get("call"))
    )
    for name in layers:
        cls = getattr(module, name, None)
        if not isinstance(cls, type) or "call" not in vars(cls):
            raise ValueError(
                f"keras_recompute: bert4keras.layers has no layer class {name!r} with its own `call` "
                f"(bert4keras {getattr(sys.modules.get('bert4keras'), '__version__', '?')}); "
                f"pass layers= with names from {LAYERS}."
            )
        call = vars(cls)["call"]
        if getattr(call, _MARK, False):
            patched.append(cls)
            continue
        decorated = recompute_grad(_undecorated(call))
        setattr(decorated, _MARK, True)
        cls.call = decorated
        patched.append(cls)
    return patched


def remove_theirs():
    """Puts the plain `call` back where bert4keras's own recompute wrapped it.

    bert4keras reads `RECOMPUTE` at its import and, when it is on, wraps its
    layers in its own recompute (see NOTE [ bert4keras's own recompute ]).
    `recompute_model` calls this before recomputing a bert4keras model.

    Returns:
        The names of the classes put back; empty if bert4keras is not imported
        or its recompute is off.
    """
    module = sys.modules.get("bert4keras.layers")
    if module is None:
        return []
    removed = []
    for name, cls in vars(module).items():
        if isinstance(cls, type) and _is_theirs(vars(cls).get("call")):
            cls.call = _undecorated(vars(cls)["call"])
            removed.append(name)
    return removed


def _is_theirs(call):
    return getattr(call, "__qualname__", "") == "recompute_grad.<locals>.inner" and bool(call.__closure__)


def _undecorated(call):
    """The `call` inside bert4keras's recompute wrapper, or `call` itself."""
    if _is_theirs(call):
        for cell in call.__closure__:
            inner = cell.cell_contents
            if callable(inner) and getattr(inner, "__name__", "") == "call":
                return inner
    return call
