"""Gradient checkpointing (recompute) for Keras layers and models.

`recompute_grad` decorates a layer's `call` (or one instance's);
`recompute_model` recomputes the blocks of an existing model without editing
it; `verify` checks on a model that recompute trains it as without;
`largest_fit` predicts the largest batch or sequence length that fits a budget. `import keras_recompute` imports no framework: each backend path is
imported when a decorated call first runs with recompute on.
"""

from keras_recompute._config import is_enabled, recompute_scope
from keras_recompute._decorator import recompute_grad
from keras_recompute._errors import RecomputeError
from keras_recompute._fit import FitReport
from keras_recompute._model import largest_fit, memory_report, recompute_model
from keras_recompute._verify import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "FitReport",
    "RecomputeError",
    "is_enabled",
    "largest_fit",
    "memory_report",
    "recompute_grad",
    "recompute_model",
    "recompute_scope",
    "verify",
    "VerifyReport",
    "__version__",
]
