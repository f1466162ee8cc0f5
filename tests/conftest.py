import os

# Before any framework is imported by a test module.
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.pop("RECOMPUTE", None)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_recompute_env(monkeypatch):
    """Each test starts with RECOMPUTE unset; it sets it or a scope itself."""
    monkeypatch.delenv("RECOMPUTE", raising=False)
