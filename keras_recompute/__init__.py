"""Gradient checkpointing (recompute) for Keras layers.

`import keras_recompute` imports no framework: each backend path is imported
when a decorated call first runs with recompute on.
"""

from keras_recompute._config import is_enabled, recompute_scope
from keras_recompute._decorator import recompute_grad
from keras_recompute._errors import RecomputeError

__version__ = "0.1.0"

__all__ = [
    "RecomputeError",
    "is_enabled",
    "recompute_grad",
    "recompute_scope",
    "__version__",
]
