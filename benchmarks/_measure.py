"""What the benchmarks share: peak memory on each backend, child processes, the largest-batch search.

Memory, by where the program runs:
  * TensorFlow (Keras 3 or tf_keras), CPU or GPU: the allocator's peak,
    `tf.config.experimental.get_memory_info(device)["peak"]`; on the CPU it
    needs `TF_CPU_ALLOCATOR_USE_BFC=1` before TensorFlow starts (`run` sets it).
  * JAX and PyTorch on a GPU: `memory_stats()["peak_bytes_in_use"]`,
    `torch.cuda.max_memory_allocated()`.
  * JAX and PyTorch on the CPU, which keep no allocator statistics: the
    process's peak RSS (`VmHWM`) with `MALLOC_MMAP_THRESHOLD_=131072`, so that
    freed buffers leave the RSS; `measured` subtracts the peak of the same
    program on one row (weights, optimizer, compiled code). On JAX, XLA's
    buffer assignment for the compiled step is exact as well (`xla_temp_bytes`).
Each configuration runs in a fresh process: peaks never mix.
"""

import json
import os
import re
import signal
import subprocess
import sys

from _record import metadata  # this folder is on the path of a script run from it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_BATCH = 1 << 14  # where the largest-batch search stops doubling


def reset_peak(backend):
    """In a child: forgets the peak so far (call after the first, compiling step)."""
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.reset_memory_stats(_tf_device())
    elif backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()


def reset_rss_peak():
    """In a child: the RSS's high-water mark (`rss_peak`) starts again from the RSS now.

    Linux resets `VmHWM` when 5 is written to `clear_refs`: what ran before
    (building, a memory report) is then not counted.
    """
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def peak(backend):
    """In a child: the allocator's peak in bytes since `reset_peak`, or None where there is none."""
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.config.experimental.get_memory_info(_tf_device())["peak"]
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return None
    import jax

    device = jax.devices()[0]
    return None if device.platform == "cpu" else device.memory_stats()["peak_bytes_in_use"]


def xla_temp_bytes(model, inputs, labels):
    """JAX: the temporary buffers XLA assigns to a Keras model's compiled training step, in bytes.

    Every activation, gradient and workspace of the step lives in them, so on
    a CPU without allocator statistics this is the program's own peak, exact
    and the same on every run (the RSS also counts the runtime around it).
    Call after one `train_on_batch` (the model and optimizer are built).

    Compiled as Keras's trainer compiles it, with the state donated: the new
    weights and optimizer slots are written over the old ones, and the buffers
    that takes are temporaries. Without donation the new state is the
    program's output, which this figure does not count: on keras-hub BERT small
    at batch 8, 128 MiB of temporaries against the 194 MiB of the donated step,
    which the process's RSS follows (until 2026-11-26 the JAX rows of
    `largest_fit.py`, `budget.py` and `models.py` were measured undonated).
    """
    return compiled_train_step(model, inputs, labels).memory_analysis().temp_size_in_bytes


def compiled_train_step(model, inputs, labels):
    """JAX: Keras's training step of `model` compiled as its trainer compiles it, the state donated (`xla_temp_bytes`)."""
    import jax

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    return jax.jit(model.train_step, donate_argnums=0).lower(state, (inputs, labels)).compile()


def torch_step_peak(step, live):
    """PyTorch: the peak bytes of one `step()`: what was live when it began (`live`) and what it allocated on top.

    On a GPU, the caching allocator's peak over the step above what it held
    when the step began: what an earlier step left allocated for good and a
    prediction does not count (cuBLAS's workspace, 32 MiB and more) stays out,
    as it does on the CPU. On a CPU, `torch_cpu_peak`.
    """
    import torch

    if not torch.cuda.is_available():
        return torch_cpu_peak(step, live)
    start = _live_bytes(live)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return start + torch.cuda.max_memory_allocated() - before


def _live_bytes(live):
    """The bytes of the tensors in `live`, each counted once."""
    return sum(int(t.untyped_storage().nbytes()) for t in {id(t): t for t in live}.values())


def torch_cpu_peak(step, live):
    """PyTorch on a CPU: the peak bytes of one `step()`, from the profiler's allocation records.

    The CPU allocator keeps no statistics, and the process's RSS does not
    follow what autograd frees (the C library keeps freed pages). The
    profiler records every allocation and free of the CPU allocator, each
    with its size and time, but only of memory allocated while it runs: so
    the step runs twice under it and the second one counts. Its peak is
    `live` (the tensors alive through both, weights and optimizer slots; not
    the gradients) plus the highest running sum of the records in the second
    step, in the order they happened
    (`keras_recompute.backends.torch.allocation_trace`), counted from the
    first's start: what the first left alive, its gradients, is in that sum
    until the second frees it. Keras's trainer frees them after the forward
    (`zero_grad`): counted in `live` instead, through the step, they read
    keras-hub BERT small's `full` step at batch 64 43 MiB (all its gradients)
    high. Summed by op (each op's net at its start, before its children
    allocate) the records read keras-hub Gemma's step at sequence 1792 46 MiB
    low, one attention score tensor; read in order, they agree with the RSS's
    rise under `MALLOC_MMAP_THRESHOLD_` within 3% (tests/test_fit.py).
    """
    import torch

    from keras_recompute.backends.torch import allocation_trace

    mark = "benchmarks: the measured step"

    def twice():
        step()
        with torch.profiler.record_function(mark):
            step()

    running, marks = allocation_trace(twice, (mark,))
    return _live_bytes(live) + max(running[marks[mark]:], default=0)


def planned_policies(model, inputs):
    """The policy `recompute_model(budget=...)` gave each unit, as a short string (`-` for none)."""
    from keras_recompute import memory_report

    return " ".join({"none": "-"}.get(row["policy"], row["policy"]) for row in memory_report(model, inputs).rows)


def applications_under_a_head(name, size, frozen="none"):
    """A keras.applications backbone (no weights) under a pooling and a Dense head, compiled (SGD, MSE).

    `frozen`: `"none"`, `"all"` (feature extraction: the backbone frozen, the head trained) or
    `"lower_half"` (fine-tuning: the lower half of the backbone's layers frozen).
    """
    import keras

    keras.utils.set_random_seed(0)
    backbone = getattr(keras.applications, name)(include_top=False, weights=None, input_shape=(size, size, 3))
    if frozen == "all":
        backbone.trainable = False
    elif frozen == "lower_half":
        for layer in backbone.layers[: len(backbone.layers) // 2]:
            layer.trainable = False
    inputs = keras.Input((size, size, 3))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(backbone(inputs))))
    model.compile(optimizer="sgd", loss="mse")
    return model


def rss_peak():
    """In a child: its peak resident memory in bytes (`VmHWM`)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024


def _tf_device():
    import tensorflow as tf

    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def run(script, arguments, backend, low_mmap_threshold=False, extra_env=None, label=None):
    """Runs `script` with `arguments` in a fresh process; returns its last JSON line, or `{"error": ...}`.

    `low_mmap_threshold` sets `MALLOC_MMAP_THRESHOLD_=131072` (for the RSS
    figure; it slows allocation, so time steps in a child without it).
    `label` is shown, with a spinner and the time so far, while the child runs
    (on a terminal; logs get nothing).
    """
    env = _child_env(backend, ROOT)
    env.update(extra_env or {})
    if low_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    with _console().status(f"{os.path.basename(script)}: {label or ' '.join(map(str, arguments))}"):
        done = subprocess.run([sys.executable, script, *map(str, arguments)], env=env, capture_output=True, text=True, check=False)
    return _last_json(done)


def child(code, arguments, backend, source=ROOT):
    """Runs `code` (a `python -c` script) in a fresh process, on `backend`, with `source` (a checkout's
    `keras_recompute` folder's parent) first on its path; returns its last JSON line, or `{"error": ...}`.

    Its arguments: `arguments`, then this folder (for `import _measure`). TensorFlow's allocator states
    its figures (`TF_CPU_ALLOCATOR_USE_BFC=1`); it runs in `/`, so that `source` alone provides the library.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, arguments), here], env=_child_env(backend, source), capture_output=True, text=True, cwd="/"
    )
    return _last_json(done)


def _child_env(backend, source):
    """A measuring child's environment: `backend`, TensorFlow's allocator stating its figures, its logs quiet, and
    `source` (a checkout's `keras_recompute` folder's parent) first on its path."""
    path = os.pathsep.join(p for p in [source, os.environ.get("PYTHONPATH", "")] if p)
    return dict(os.environ, KERAS_BACKEND=backend, TF_CPU_ALLOCATOR_USE_BFC="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=path)


def _last_json(done):
    """A finished child's last line of output as JSON; where it failed, `{"error": ...}` with the exception's own
    line ("...ResourceExhaustedError: ..."), not a traceback frame, or its exit status and signal."""
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.strip().splitlines() if line.strip()]
        raised = re.compile(r"^[\w.]*(Error|Exception|Exhausted)\b")
        message = next((line for line in reversed(lines) if raised.match(line)), lines[-1] if lines else "")
        return {"error": message[:200] or f"exit {done.returncode} ({_signal_name(done.returncode)})"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _signal_name(returncode):
    """`SIGKILL` for a child killed by signal 9 (the kernel's out-of-memory killer), else ''."""
    try:
        return signal.Signals(-returncode).name if returncode < 0 else ""
    except ValueError:
        return ""


def _console():
    from rich.console import Console  # installed with Keras

    return Console(stderr=True)


def write_json(path, arguments, results):
    """Writes a benchmark's arguments and results to `path` (`--out`), for `benchmarks/plot.py`."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        record = dict(metadata(dtype=str(arguments.get("dtype") or "float32")), benchmark=os.path.basename(sys.argv[0]))
        record.update(arguments=arguments, results=results)
        with open(path, "w") as out:
            json.dump(record, out, indent=1, default=str)
            out.write("\n")


def in_turns(repeat, configurations, run):
    """`{configuration: [record, ...]}`: `run(*configuration)` for each, all once, then again, `repeat` times.

    In turns, so that a slow minute of a shared machine slows every configuration
    of one turn, not every run of one configuration.
    """
    records = {configuration: [] for configuration in configurations}
    for _ in range(max(1, repeat)):
        for configuration in configurations:
            records[configuration].append(run(*configuration))
    return records


def summary(records, time_key, base_records=None):
    """One configuration's runs as one row: the first run's figures, the median time, and the ratios to none.

    `time_vs_none` is the median of the runs' ratios, each to `base_records`'
    run of the same turn; `time_vs_none_range` their least and greatest;
    `<time_key>_runs` every run's time. The first failed run makes the row its error.
    """
    import statistics

    failed = next((record for record in records if "error" in record), None)
    if failed is not None:
        return failed
    row = dict(records[0])
    times = [record[time_key] for record in records]
    row[time_key + "_runs"] = times
    row[time_key] = statistics.median(times)
    if base_records and all("error" not in record for record in base_records):
        ratios = [record[time_key] / base[time_key] for record, base in zip(records, base_records)]
        row["time_vs_none_runs"] = ratios
        row["time_vs_none"] = statistics.median(ratios)
        row["time_vs_none_range"] = [min(ratios), max(ratios)]
    return row


def ratio_text(row):
    """`1.32x`, or `1.32x (1.30-1.41x)` for a row of several runs."""
    if "time_vs_none" not in row:
        return ""
    low, high = row["time_vs_none_range"]
    return f"{row['time_vs_none']:.2f}x" + (f" ({low:.2f}-{high:.2f})" if len(row["time_vs_none_runs"]) > 1 else "")


def measured(script, arguments, backend, one_row_arguments):
    """A child's record, with `peak`: the allocator's, or on a CPU without one the activations' RSS.

    `one_row_arguments`: the same program on one row, the RSS baseline.
    """
    record = run(script, arguments, backend)
    if "error" in record or record.get("peak") is not None:
        return record
    full = run(script, arguments, backend, low_mmap_threshold=True)
    baseline = run(script, one_row_arguments, backend, low_mmap_threshold=True)
    for other in (full, baseline):
        if "error" in other:
            return other
    record["peak"] = full["rss"] - baseline["rss"]
    record["peak_kind"] = "activations (RSS)"
    return record


def largest_batch(fits, limit=MAX_BATCH):
    """The largest batch up to `limit` for which `fits(batch)` is true: doubling, then bisection.

    No batch above `limit` is tried: doubling past it bisects below `limit + 1`.
    """
    low, high = 0, 1
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
