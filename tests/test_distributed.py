"""Recompute under distribution strategies: the same losses with the switch on and off.

Each run is a fresh process (tests/_distributed_child.py): the device layout
(two logical CPUs, two virtual JAX devices) and a multi-worker strategy must be
set before the framework starts. The model's blocks have attention, dropout and
BatchNormalization inside the recomputed call. That the recompute ran is shown
by the number of Python runs of the blocks' `call` on TensorFlow (the recompute
traces it again), the gelus in the gradient's program on JAX (one more per
block) and, under MirroredStrategy, by the allocator's peak.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import _fresh

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "_distributed_child.py")
TIMEOUT = 300


def _env(**extra):
    root = os.path.dirname(HERE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), TF_CPP_MIN_LOG_LEVEL="3")
    for name in ("KERAS_BACKEND", "TF_USE_LEGACY_KERAS", "TF_KERAS", "TF_CONFIG", "RECOMPUTE"):
        env.pop(name, None)
    env.update(extra)
    return env


def _record(done):
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run(case, switch, size="small"):
    # What the child would set before importing Keras, set here: it is forked from a process that has imported it
    # (NOTE [ forked children ] in `_fresh.py`).
    if case in ("dataparallel", "modelparallel"):
        flags = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"]).strip()
        env = _env(KERAS_BACKEND="jax", XLA_FLAGS=flags)
    else:
        env = _env(KERAS_BACKEND="tensorflow")
    return _record(_fresh.run([CHILD, case, switch, size], env=env, timeout=TIMEOUT))


def _off_and_on(case):
    off, on = _run(case, "0"), _run(case, "1")
    assert off["replicas"] == on["replicas"] == 2
    assert len(off["losses"]) == 6
    np.testing.assert_allclose(on["losses"], off["losses"], rtol=1e-5)
    evidence = "gelus" if case in ("dataparallel", "modelparallel") else "calls"  # JAX replays a traced program
    assert on[evidence] > off[evidence], (evidence, on[evidence], off[evidence])
    return off, on


# The children choose their own backend: each case runs once, in the suite's run for its backend.
tensorflow_run = pytest.mark.skipif(os.environ["KERAS_BACKEND"] != "tensorflow", reason="in the TensorFlow run")
jax_run = pytest.mark.skipif(os.environ["KERAS_BACKEND"] != "jax", reason="in the JAX run")


@tensorflow_run
def test_mirrored_strategy_same_losses():
    _off_and_on("mirrored")


@tensorflow_run
def test_mirrored_strategy_memory_falls():
    # Logical CPU devices share one allocator: the peak is both replicas' together.
    off, on = _run("mirrored", "0", "memory"), _run("mirrored", "1", "memory")
    assert on["calls"] > off["calls"]
    assert off["peaks"][0] > 2.5 * on["peaks"][0], (off["peaks"], on["peaks"])


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def _multiworker(switch):
    workers = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    processes = []
    for index in range(2):
        config = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
        processes.append(_start([CHILD, "multiworker", switch], _env(TF_CONFIG=config)))
    return _records(processes)


def _start(arguments, env):
    return subprocess.Popen([sys.executable] + arguments, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(processes):
    """Each worker's record, once all have ended (all are killed if one fails or times out)."""
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=TIMEOUT)
            results.append(_record(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)))
    finally:
        for process in processes:
            process.kill()
    return results


@tensorflow_run
def test_multi_worker_mirrored_strategy_same_losses_tf_keras():
    # tf_keras: Keras 3's fit fails under this strategy even without recompute (TF 2.21).
    pytest.importorskip("tf_keras")
    off, on = _multiworker("0"), _multiworker("1")
    for worker_off, worker_on in zip(off, on):
        assert worker_off["replicas"] == worker_on["replicas"] == 2
        np.testing.assert_allclose(worker_on["losses"], worker_off["losses"], rtol=1e-5)
        assert worker_on["calls"] > worker_off["calls"]
    np.testing.assert_allclose(off[0]["losses"], off[1]["losses"], rtol=1e-6)


@pytest.mark.skipif(
    os.environ["KERAS_BACKEND"] != "torch" or os.environ.get("KERAS_RECOMPUTE_TESTS_BACKWARD_THREAD") == "1",
    reason="in the PyTorch run (its workers are processes of their own: the GPU-like run would repeat it)",
)
def test_torch_distributed_data_parallel_same_updates(tmp_path):
    """Keras 3 on PyTorch under torch's DistributedDataParallel (two gloo workers, a torch training loop, six SGD
    steps): each worker's weights move as without recompute, and alike on both workers."""
    store = f"file://{tmp_path / 'store'}"
    workers = _records([
        _start([CHILD, "ddp", "both"], _env(RANK=str(rank), WORLD_SIZE="2", DDP_INIT_METHOD=store)) for rank in range(2)
    ])
    for worker in workers:
        off, on = worker["0"], worker["1"]
        assert worker["replicas"] == 2 and len(off["losses"]) == 6
        assert all(norm > 0 for norm in worker["move_norms"]), "a weight did not move"
        for difference, norm in zip(worker["move_differences"], worker["move_norms"]):  # ||on - off||, ||on||
            assert difference <= 1e-5 * norm, (difference, norm)
        assert on["calls"] > off["calls"], (on["calls"], off["calls"])  # the recompute runs each block's call again
    assert workers[0]["moves_digest"] == workers[1]["moves_digest"]  # DDP keeps the workers alike, bit for bit


@jax_run
def test_jax_data_parallel_same_losses():
    _off_and_on("dataparallel")


@jax_run
def test_jax_model_parallel_same_losses():
    off, on = _off_and_on("modelparallel")
    assert any("model" in spec for spec in on["kernel_shardings"]), on["kernel_shardings"]
