"""The legacy tests: standalone Keras 2.3 (and TensorFlow before 2.4) on Python 3.7.

Run by `python tests/legacy/run.py`, which builds each environment's virtual
environment and runs this folder there; the main suite does not collect it.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.pop("RECOMPUTE", None)

import pytest  # noqa: E402

try:
    import keras  # noqa: E402
except ImportError:  # TensorFlow 2.3 with its tf.keras only (test_tf_keras.py)
    keras = None


@pytest.fixture(autouse=True)
def _fresh_graph(monkeypatch):
    """Each test builds in a new graph and session (standalone Keras's and tf.keras's), with RECOMPUTE unset."""
    monkeypatch.delenv("RECOMPUTE", raising=False)
    backends = [__import__("tensorflow").keras.backend] + ([keras.backend] if keras is not None else [])
    for backend in backends:
        backend.clear_session()
    yield
    for backend in backends:
        backend.clear_session()
