"""keras-hub: make its transformer layers recompute with keras_recompute.

```python
from keras_recompute.integrations import keras_hub as recompute_keras_hub
recompute_keras_hub.enable()   # the one line
backbone = keras_hub.models.BertBackbone(...)  # its encoder layers recompute when RECOMPUTE=1
```

`enable()` decorates the `call` of `keras_hub.layers.TransformerEncoder` and
`TransformerDecoder` with `recompute_grad`, so every backbone built from them
(BERT, RoBERTa, DistilBERT, ...) checkpoints each of its blocks. With
`RECOMPUTE` off the layers are unchanged.
"""

from keras_recompute._decorator import recompute_grad

LAYERS = ("TransformerEncoder", "TransformerDecoder")

_MARK = "_keras_recompute_keras_hub"


def enable(layers=LAYERS):
    """Decorates the `call` of keras-hub's transformer layers. Idempotent.

    Args:
        layers: names of `keras_hub.layers` classes to patch.

    Returns:
        The list of patched classes.

    Raises:
        ImportError: if keras_hub cannot be imported.
        ValueError: if a name is not a layer class of `keras_hub.layers`.
    """
    import keras_hub

    patched = []
    for name in layers:
        cls = getattr(keras_hub.layers, name, None)
        if not isinstance(cls, type) or "call" not in vars(cls):
            raise ValueError(
                f"keras_recompute: keras_hub.layers has no layer class {name!r} with its own `call`; "
                f"pass layers= with names such as {LAYERS}."
            )
        call = vars(cls)["call"]
        if not getattr(call, _MARK, False):
            decorated = recompute_grad(call)
            setattr(decorated, _MARK, True)
            cls.call = decorated
        patched.append(cls)
    return patched
