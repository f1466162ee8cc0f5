import os
import sys

# Before any framework is imported by a test module. CI runs the suite once per
# Keras backend: KERAS_BACKEND=tensorflow (the default), jax and torch.
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.pop("RECOMPUTE", None)


def _jax_gpu_installed():
    import importlib.util

    return any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin"))


if os.environ["KERAS_BACKEND"] == "jax" and _jax_gpu_installed():
    # NOTE [ twins on a GPU ]: plain JAX on a GPU is not reproducible from run to run
    # (autotuned kernels, TF32 matmuls, unordered reductions): ~4e-4 normwise between two plain
    # runs, far above the 1e-5 the twin tests allow for reassociation. Deterministic XLA and
    # full-precision float32 matmuls make plain reproducible, so the twins can be held to it.
    # Two backends share the GPU under run_backends.py: JAX takes what it needs, not 75%.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if not _jax_gpu_installed() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # NOTE [ XLA's LLVM at -O0 in the suite ]: on the CPU most of an XLA test's time is XLA compiling its
    # programs, and most of the compile is LLVM optimizing each kernel's machine code. The suite's programs
    # are small and run a few steps, so it compiles them at LLVM -O0 (as `backends/jax.py` compiles the
    # programs it only measures: MEMORY_ONLY). XLA's HLO passes, fusion, scheduling and buffer assignment
    # (every memory figure and program the suite reads) run as by default; only the code emitted for each
    # fused kernel differs (the dots call the same Eigen/oneDNN kernels). A twin and its recompute are
    # compiled alike, and the twins' tolerance held at -O0 on AVX-512, AVX2 and AVX (tests/_compare.py).
    # Measured on 2 cores, the same tests back to back: TensorFlow's test_every_policy_matches_the_twin[jit-*]
    # 45 -> 32 s, JAX's mask and policy twins 157 -> 85 s; the whole suite (README's command, as long as its
    # TensorFlow run) 47.4 -> 41.5 minutes, its JAX run 34.4 -> 23.4 (clean clones of 2e58765 and 6fd7bc7,
    # between which test_fit's largest-fit test lost half a minute per run of its own).
    # XLA_FLAGS=--xla_backend_optimization_level=3 runs the suite as users' programs are compiled.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

if os.environ["KERAS_BACKEND"] == "jax":
    # One XLA compile of each program per run: many tests, and the children they measure in, compile the same
    # programs (a model's plain step beside each policy's; a child's step that the test compiled before).
    # JAX's persistent cache, every program kept, in a folder of this run's own unless one is set (in the
    # environment: the children share it). Only XLA's compile is skipped: every trace still runs, and a cached
    # program states what its compile did (test_budget.py::test_a_program_from_the_runs_compile_cache_...).
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        import atexit
        import shutil
        import tempfile

        _cache = tempfile.mkdtemp(prefix="keras_recompute_tests_jax_cache_")
        _owner = os.getpid()
        atexit.register(lambda: os.getpid() == _owner and shutil.rmtree(_cache, ignore_errors=True))
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

if os.environ.get("KERAS_RECOMPUTE_TESTS_WITHOUT_TENSORFLOW") == "1":
    # As on a machine without TensorFlow (the GPU machine has none): `import tensorflow` and
    # `import tf_keras` fail here and in every child a test starts (tests/_hidden on PYTHONPATH).
    if os.environ["KERAS_BACKEND"] == "tensorflow":
        raise RuntimeError("KERAS_RECOMPUTE_TESTS_WITHOUT_TENSORFLOW=1 needs KERAS_BACKEND=jax or torch")
    _hidden = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hidden")
    sys.path.insert(0, _hidden)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (_hidden, os.environ.get("PYTHONPATH"))))

import pytest  # noqa: E402

# These test TensorFlow, tf_keras or backend-free code: the TensorFlow run covers them.
_TENSORFLOW_RUN_ONLY = [
    "test_config.py",
    "test_budget_solver.py",
    "test_fit_solver.py",
    "test_budget_tf_keras.py",
    "test_context_tensorflow.py",
    "test_memory.py",
    "test_model_tensorflow.py",
    "test_semantics.py",
    "test_tensorflow.py",
    "test_tf_graph.py",
    "test_updates_tensorflow.py",
]
collect_ignore = [] if os.environ["KERAS_BACKEND"] == "tensorflow" else list(_TENSORFLOW_RUN_ONLY)
if sys.version_info >= (3, 8):
    # Standalone Keras 2.3 and TensorFlow before 2.4 run on Python 3.7, in the
    # environments `tests/legacy/run.py` builds.
    collect_ignore.append("legacy")


# PyTorch's run with each backward in a thread of its own (the fixture below; the torch-gpu-like run).
_BACKWARD_THREAD = os.environ.get("KERAS_RECOMPUTE_TESTS_BACKWARD_THREAD") == "1" and os.environ["KERAS_BACKEND"] == "torch"


@pytest.fixture(autouse=True, scope="session")
def _backward_in_another_thread():
    """KERAS_RECOMPUTE_TESTS_BACKWARD_THREAD=1 (PyTorch): every backward runs in a thread of its own, as
    autograd runs a GPU's (NOTE [ the recompute's thread ] in `backends/torch.py`), on any machine.

    As autograd's device thread, it has the caller's torch state (its dispatch modes, which the op
    counting tests use) and not the caller's Python state (context variables, thread locals)."""
    if not _BACKWARD_THREAD:
        yield
        return
    import threading

    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    from keras_recompute.backends.torch import _functorch_transforms_active

    originals = {"backward": torch.autograd.backward, "grad": torch.autograd.grad}

    def threaded(name):
        def run_elsewhere(*args, **kwargs):
            if _functorch_transforms_active():  # torch.func's levels live in this thread: kept here
                return originals[name](*args, **kwargs)
            result, raised = [], []
            modes = _get_current_dispatch_mode_stack()

            def run():
                for mode in modes:
                    _push_mode(mode)
                try:
                    result.append(originals[name](*args, **kwargs))
                except BaseException as error:  # noqa: B036 - raised again in the caller's thread
                    raised.append(error)
                finally:
                    for _ in modes:
                        _pop_mode()

            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
            if raised:
                raise raised[0]
            return result[0]

        run_elsewhere.__wrapped__ = originals[name]  # what `inspect.unwrap` finds (a measured step runs here)
        return run_elsewhere

    torch.autograd.backward, torch.autograd.grad = threaded("backward"), threaded("grad")
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad = originals["backward"], originals["grad"]


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "in_children: the test's work runs in child processes (`_fresh.run`), which the torch-gpu-like run's backward "
        "thread does not reach: that run skips it, the torch run has run it as it would",
    )


def pytest_collection_modifyitems(config, items):
    """The torch-gpu-like run on a CPU skips `in_children` tests: their children run PyTorch's own backward, as the
    torch run's do, so they repeated that run's (about 35 s of the suite). On a GPU they run: there a child is the
    device's."""
    if not _BACKWARD_THREAD:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="its children are the torch run's: the backward thread is this process's only")
    for item in items:
        if item.get_closest_marker("in_children"):
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With KERAS_RECOMPUTE_TESTS_FAILURES=path, each failure's traceback is appended there as it happens.

    The GPU machine's calls are time-boxed: a suite stopped at its deadline prints no summary, and the first GPU
    run of the fixed suite lost every traceback that way (`benchmarks/gpu_session.sh` sets it).
    """
    path = os.environ.get("KERAS_RECOMPUTE_TESTS_FAILURES")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: its controller writes
        with open(path, "a") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


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
