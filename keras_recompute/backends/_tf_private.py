"""Private TensorFlow APIs: the one place that touches them.

Tested on TensorFlow 2.21 (tensorflow-cpu wheel). Each name below has had the
same meaning since TensorFlow 2.4; an older or a future TensorFlow that lacks
one gets an error that names it instead of a wrong gradient.
"""

import tensorflow as tf

from keras_recompute._errors import RecomputeError

TESTED_VERSIONS = "2.21"
_MINIMUM = (2, 4)


def _parse_version(text):
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


TF_VERSION = _parse_version(tf.__version__)
if TF_VERSION < _MINIMUM:
    raise RecomputeError(
        f"keras_recompute: TensorFlow {tf.__version__} is too old; the TF "
        f"path needs {_MINIMUM[0]}.{_MINIMUM[1]} or newer (tested on "
        f"{TESTED_VERSIONS}). Upgrade TensorFlow."
    )

try:
    from tensorflow.python.eager.record import stop_recording
except ImportError as error:  # pragma: no cover - depends on the TF build
    raise RecomputeError(
        f"keras_recompute: TensorFlow {tf.__version__} lacks "
        "tensorflow.python.eager.record.stop_recording, which the TF path "
        f"uses (tested on {TESTED_VERSIONS}). Please report this version."
    ) from error

__all__ = ["TF_VERSION", "TESTED_VERSIONS", "stop_recording"]
