"""`tests/_fresh.py`: a child forked from a zygote runs as a process started from nothing (NOTE [ forked children ])."""

import os
import subprocess

import keras
import pytest

import _fresh

BACKEND = keras.backend.backend()
pytestmark = pytest.mark.in_children  # every test's work is a child's

_FIRST_OP = {
    # Nothing made at import: the eager context (its threads settable), the allocator (BFC, read now), the device.
    "tensorflow": """
import os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"
import tensorflow as tf
from tensorflow.python.eager import context
assert context.context()._context_handle is None, "an eager context was made before this child"
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.matmul(tf.ones((256, 256)), tf.ones((256, 256)))
assert tf.config.experimental.get_memory_info("CPU:0")["peak"] >= 256 * 256 * 4 * 3
assert tf.config.threading.get_inter_op_parallelism_threads() == 1
""",
    "jax": """
from jax._src import xla_bridge
assert not xla_bridge._backends, "JAX's devices were made before this child"
import jax.numpy as jnp
assert float(jnp.ones(3).sum()) == 3.0
""",
    "torch": """
import torch
assert torch.ones(3).sum().item() == 3.0
""",
}


@pytest.fixture(autouse=True)
def _forking():
    if not _fresh.forks():
        pytest.skip("children are started by subprocess here (_fresh.forks)")


def test_a_child_has_its_arguments_folder_environment_and_status(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        "import os, sys\nimport keras\n"
        "print(sys.argv[1:], os.getcwd(), os.environ['ONLY_HERE'], sys.path[0], keras.backend.backend())\n"
        "sys.exit(3)\n"
    )
    done = _fresh.run([str(script), "a", "b"], env=dict(os.environ, ONLY_HERE="yes"), cwd=str(tmp_path))
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout.split() == ["['a',", "'b']", str(tmp_path), "yes", str(tmp_path), BACKEND]
    raised = _fresh.run(["-c", "import sys; print('out'); print('err', file=sys.stderr); raise ValueError('boom')"])
    assert raised.returncode == 1 and raised.stdout == "out\n" and "ValueError: boom" in raised.stderr


def test_nothing_made_at_the_first_op_is_made_before_the_child():
    done = _fresh.run(["-c", _FIRST_OP[BACKEND]], env=dict(os.environ, KERAS_BACKEND=BACKEND))
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_child_that_sets_what_the_frameworks_read_at_import_fails_saying_so():
    done = _fresh.run(["-c", "import os; os.environ['KERAS_BACKEND'] = 'something else'"])
    assert done.returncode == 1 and "set KERAS_BACKEND" in done.stderr and "pass it in the child's env" in done.stderr


def test_a_child_past_its_timeout_is_stopped_and_the_next_runs():
    with pytest.raises(subprocess.TimeoutExpired):
        _fresh.run(["-c", "import time; time.sleep(60)"], timeout=1)
    assert _fresh.run(["-c", "print('next')"]).stdout == "next\n"
