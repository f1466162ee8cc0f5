"""Patching one instance for a while: the lowest module, imported by the Keras flavours' adapters and above them.

It imports nothing of keras_recompute, so that the adapters (`backends/_keras3.py`, `backends/_tf_keras.py`, ...)
import only what lies below them, and every import runs one way: `_context` and the backends above the adapters.
"""

import contextlib


@contextlib.contextmanager
def instance_attribute(obj, name, value):
    """Within it, `obj.name` is `value` on the instance (a method patched, an attribute changed)."""
    had_own = name in obj.__dict__
    previous = obj.__dict__.get(name)
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        if had_own:
            object.__setattr__(obj, name, previous)
        else:
            obj.__dict__.pop(name, None)
