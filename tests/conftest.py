import os

# Before any framework is imported by a test module. CI runs the suite once per
# Keras backend: KERAS_BACKEND=tensorflow (the default), jax and torch.
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.pop("RECOMPUTE", None)

import pytest  # noqa: E402

# These test TensorFlow, tf_keras or backend-free code: the TensorFlow run covers them.
_TENSORFLOW_RUN_ONLY = ["test_config.py", "test_memory.py", "test_semantics.py", "test_tensorflow.py", "test_tf_graph.py"]
collect_ignore = [] if os.environ["KERAS_BACKEND"] == "tensorflow" else _TENSORFLOW_RUN_ONLY


@pytest.fixture(autouse=True)
def _no_recompute_env(monkeypatch):
    """Each test starts with RECOMPUTE unset; it sets it or a scope itself."""
    monkeypatch.delenv("RECOMPUTE", raising=False)
