import os

# Before any framework is imported by a test module. CI runs the suite once per
# Keras backend: KERAS_BACKEND=tensorflow (the default), jax and torch.
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.pop("RECOMPUTE", None)

import pytest  # noqa: E402

# These test TensorFlow, tf_keras or backend-free code: the TensorFlow run covers them.
_TENSORFLOW_RUN_ONLY = [
    "test_config.py",
    "test_budget_solver.py",
    "test_budget_tf_keras.py",
    "test_context_tensorflow.py",
    "test_memory.py",
    "test_model_tensorflow.py",
    "test_semantics.py",
    "test_tensorflow.py",
    "test_tf_graph.py",
]
collect_ignore = [] if os.environ["KERAS_BACKEND"] == "tensorflow" else _TENSORFLOW_RUN_ONLY


@pytest.fixture(autouse=True)
def _no_recompute_env(monkeypatch):
    """Each test starts with RECOMPUTE unset; it sets it or a scope itself."""
    monkeypatch.delenv("RECOMPUTE", raising=False)


@pytest.fixture
def keras_hub_enabled():
    """`integrations.keras_hub.enable()` for one test: the classes' own `call` is put back after."""
    keras_hub = pytest.importorskip("keras_hub")
    from keras_recompute.integrations import keras_hub as recompute_keras_hub

    classes = (keras_hub.layers.TransformerEncoder, keras_hub.layers.TransformerDecoder)
    original = {cls: vars(cls)["call"] for cls in classes}
    recompute_keras_hub.enable()
    yield keras_hub
    for cls, call in original.items():
        cls.call = call
