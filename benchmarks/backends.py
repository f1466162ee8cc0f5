"""Peak memory and step time of a BERT encoder on Keras 3's JAX and PyTorch backends.

Compares, in one run, each configuration in a fresh subprocess:
    none        the plain encoder
    ours        keras_recompute.recompute_grad on each block's call (policy "full")
    save_dots   the same with policy="save_dots": the weight matmuls' outputs kept
    attention_core  the same with policy="attention_core": only attention's core recomputes
    offload     "full" with offload=True: each block's input kept in host memory (GPU)
    remat       keras.remat around each block's call (the closure keeps
                `training` a Python bool)
    rematscope  the encoder built inside keras.RematScope(mode="full")
    save_dots_adds, attention_core_adds  (JAX, only when named) the policy whose
                backward waits by adding zeros, where a GPU waits at a barrier

Memory: on a GPU, the allocator's peak (`memory_stats()["peak_bytes_in_use"]`
on JAX, `torch.cuda.max_memory_allocated()` on PyTorch). On the CPU, which has
no allocator statistics, the child's peak RSS (`VmHWM`, with
`MALLOC_MMAP_THRESHOLD_=131072` so freed buffers leave the RSS) minus that of
the same configuration trained on one row: the activations' memory.

Step time: the fastest of `--steps` `train_on_batch` calls after two warm-up
steps (the first compiles), in a child of its own without that malloc setting.
On PyTorch the `none` child also times one training-mode forward: a step plus
one more forward is the floor of full recompute's time. `--predict` adds
`memory_report`'s predicted peak of each configuration as it runs, beside the
allocator's on a GPU. On a GPU each PyTorch
child also measures one forward and backward without the optimizer's update,
the allocator's peak there above what was allocated before it (weights and
Adam's slots): `activations`, what recompute and offload act on. Adam's update
can hold the step's peak (its `torch._foreach_*` copies of all the weights),
where the kept inputs are already freed and offload cannot lower it.

Usage:
    python benchmarks/backends.py --backend jax            # CPU-sized defaults
    python benchmarks/backends.py --backend torch --bert-base --batch 32 --seq 512
    python benchmarks/backends.py --backend jax --bert-base --seq 512 --budget-gib 16
    python benchmarks/backends.py --backend torch --blocks 48 --hidden 768 --heads 12 --ffn 3072 \
        --seq 2048 --batch 2 --dtype mixed_bfloat16 --methods ours offload --budget-gib 16

`--bert-base` sets 12 blocks of hidden 768, 12 heads, FFN 3072. `--budget-gib`
also finds, for none and ours, the largest batch whose peak fits the budget
(doubling, then bisecting).
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

METHODS = ("none", "ours", "save_dots", "attention_core", "offload", "remat", "rematscope")
# JAX only, not run by default: the policy with its backward waiting by adding zeros, as on the CPU, where a GPU
# waits at a barrier (NOTE [ how the recompute waits on JAX ]): the two ways timed in one run.
ADDS = ("save_dots_adds", "attention_core_adds")
# Not run by default: save_dots without the recompute check (check=False), what the check costs (host_overhead.py).
UNCHECKED = ("save_dots_unchecked",)
POLICIES = {"ours": "full", "save_dots": "save_dots", "attention_core": "attention_core", "offload": "full",
            "save_dots_adds": "save_dots", "attention_core_adds": "attention_core", "save_dots_unchecked": "save_dots"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("jax", "torch"), default=os.environ.get("KERAS_BACKEND", "jax"))
    parser.add_argument("--bert-base", action="store_true", help="12 x 768, 12 heads, FFN 3072")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--dtype", choices=("float32", "mixed_bfloat16", "mixed_float16"), default="float32")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of every method, in turns (median and range)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + ADDS + UNCHECKED)
    parser.add_argument("--budget-gib", type=float, help="also find the largest batch that fits")
    parser.add_argument("--profile", action="store_true", help="PyTorch: one more step under torch's profiler, its time by op kind")
    parser.add_argument("--predict", action="store_true",
                        help="also memory_report's predicted peak of each configuration (and where in the step), "
                             "beside the measured one")
    parser.add_argument("--out", help="also write the results as JSON to this file (for benchmarks/plot.py)")
    parser.add_argument("--child", metavar="METHOD", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.backend != "jax" and set(args.methods) & set(ADDS):
        parser.error(f"{', '.join(ADDS)}: JAX only (how JAX's recompute waits); PyTorch has one way")
    if args.bert_base:
        args.blocks, args.hidden, args.heads, args.ffn = 12, 768, 12, 3072
    return args


def build_model(args, method):
    import keras

    from keras_recompute import recompute_grad

    layers = keras.layers

    class EncoderBlock(layers.Layer):
        """Post-norm BERT block: attention, add & norm, FFN, add & norm."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = layers.MultiHeadAttention(args.heads, args.hidden // args.heads, dropout=args.dropout)
            self.attention_dropout = layers.Dropout(args.dropout)
            self.attention_norm = layers.LayerNormalization(epsilon=1e-12)
            self.intermediate = layers.Dense(args.ffn, activation="gelu")
            self.output_dense = layers.Dense(args.hidden)
            self.output_dropout = layers.Dropout(args.dropout)
            self.output_norm = layers.LayerNormalization(epsilon=1e-12)

        def call(self, inputs, training=None):
            attended = self.attention(inputs, inputs, training=training)
            hidden = self.attention_norm(inputs + self.attention_dropout(attended, training=training))
            output = self.output_dropout(self.output_dense(self.intermediate(hidden)), training=training)
            return self.output_norm(hidden + output)

    class PositionEmbedding(layers.Layer):
        def build(self, input_shape):
            self.positions = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal", name="positions")

        def call(self, inputs):
            return inputs + self.positions

    class OursBlock(EncoderBlock):
        call = recompute_grad(
            EncoderBlock.call, policy=POLICIES.get(method, "full"), offload=method == "offload", check=method not in UNCHECKED
        )

    class RematBlock(EncoderBlock):
        def call(self, inputs, training=None):
            return keras.remat(lambda x: EncoderBlock.call(self, x, training=training))(inputs)

    block = OursBlock if method in POLICIES else {"remat": RematBlock}.get(method, EncoderBlock)

    def build():
        ids = keras.Input((args.seq,), dtype="int32")
        hidden = layers.Embedding(args.vocab, args.hidden)(ids)
        hidden = PositionEmbedding()(hidden)
        hidden = layers.Dropout(args.dropout)(layers.LayerNormalization(epsilon=1e-12)(hidden))
        for _ in range(args.blocks):
            hidden = block()(hidden)
        logits = layers.Dense(2)(layers.Dense(args.hidden, activation="tanh")(hidden[:, 0]))
        return keras.Model(ids, logits)

    if method == "rematscope":
        with keras.RematScope(mode="full"):
            model = build()
    else:
        model = build()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def child(args):
    """Trains one configuration; prints a JSON line with its peak and step time."""
    import numpy as np

    os.environ["RECOMPUTE"] = "1" if args.child in POLICIES else "0"
    if args.child in ADDS:
        from keras_recompute.backends import jax as jax_backend

        jax_backend._WAIT_BY = "add"
    import keras

    keras.config.set_dtype_policy(args.dtype)
    keras.utils.set_random_seed(0)
    model = build_model(args, args.child)
    rng = np.random.RandomState(0)
    ids = rng.randint(0, args.vocab, size=(args.batch, args.seq)).astype("int32")
    labels = rng.randint(0, 2, size=(args.batch,)).astype("int32")
    _measure.reset_peak(args.backend)
    times = []
    for step in range(args.steps + 2):
        start = time.perf_counter()
        loss = float(np.asarray(model.train_on_batch(ids, labels)))
        if step >= 2:
            times.append(time.perf_counter() - start)
    record = {"peak": _measure.peak(args.backend), "rss": _measure.rss_peak(), "step": min(times) if times else None, "loss": loss}
    if args.backend == "jax" and args.steps and record["peak"] is None:
        # A CPU's only exact figure. On a GPU the allocator's peak is measured, and this second compile of the step
        # (a BERT-base child printed no row in 192 s on the H200) is left out.
        record["xla_temp"] = _measure.xla_temp_bytes(model, ids, labels)
    if args.backend == "torch" and args.child == "none" and args.steps:
        # One training-mode forward (autograd recording, as full recompute's extra forward does).
        forwards = []
        for _ in range(args.steps):
            start = time.perf_counter()
            outputs = model(ids, training=True)
            forwards.append(time.perf_counter() - start)
            del outputs
        record["forward"] = min(forwards)
    if args.backend == "torch" and args.steps:
        record["activations"] = _torch_activations_peak(model, ids, labels)
    if args.predict:
        import keras_recompute

        report = keras_recompute.memory_report(model, ids)  # the decorated blocks' policy and offload, as they run
        record.update(predicted=report.predicted_peak, predicted_at=report.peak_at, predicted_offload=report.offload)
    if args.backend == "torch" and args.profile:
        record["profile"] = _profile(lambda: model.train_on_batch(ids, labels))
    print(json.dumps(record))


def _torch_activations_peak(model, ids, labels):
    """On a GPU, the allocator's peak over one forward and backward (no optimizer update) above what was allocated
    before it, in bytes; None on the CPU (no allocator statistics)."""
    import keras
    import torch

    if not torch.cuda.is_available():
        return None
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    for variable in variables:
        variable.value.grad = None
    _measure.reset_peak("torch")
    before = torch.cuda.memory_allocated()
    loss = loss_fn(keras.ops.convert_to_tensor(labels), model(ids, training=True))
    loss.backward()
    del loss
    peak = _measure.peak("torch") - before
    for variable in variables:
        variable.value.grad = None
    return peak


def _profile(step):
    """One step under torch's profiler: device (else host) self time in ms by op kind, and the ten costliest ops.

    The kinds are `host_overhead.py`'s (matmul, random, copy, view, reduction,
    elementwise); `step_ms` is the wall time of the profiled step, which on a
    GPU against the kernels' sum says how much of the step the host bounds.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    import host_overhead

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiled:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    by_kind, ops = {}, []
    for event in profiled.key_averages():
        if not event.key.startswith("aten::"):
            continue
        micros = event.self_device_time_total if cuda else event.self_cpu_time_total
        kind = host_overhead.kind_of(event.key[len("aten::"):])
        by_kind[kind] = by_kind.get(kind, 0.0) + micros / 1e3
        ops.append((micros / 1e3, event.key, event.count))
    ops.sort(reverse=True)
    return {
        "clock": "device" if cuda else "host",
        "step_ms": wall * 1e3,
        "by_kind_ms": by_kind,
        "top_ops": [{"op": key, "ms": ms, "count": count} for ms, key, count in ops[:10]],
    }


def child_arguments(args, method, batch, steps=None):
    arguments = ["--child", method, "--backend", args.backend]
    for name in ("blocks", "hidden", "heads", "ffn", "seq", "vocab", "dropout", "dtype"):
        arguments += [f"--{name}", getattr(args, name)]
    if args.profile and steps is None:
        arguments.append("--profile")
    if args.predict and steps is None:
        arguments.append("--predict")
    return arguments + ["--batch", batch, "--steps", args.steps if steps is None else steps]


def measure(args, method, batch, steps=None):
    """Peak bytes (allocator peak, or activations' RSS on the CPU) and step time."""
    script = os.path.abspath(__file__)
    return _measure.measured(
        script, child_arguments(args, method, batch, steps), args.backend, child_arguments(args, method, 1, steps=0)
    )


def largest_batch(args, method, budget):
    """The largest batch whose peak fits `budget` bytes (out of memory counts as not fitting)."""

    def fits(batch):
        record = measure(args, method, batch, steps=0)
        return "error" not in record and record["peak"] <= budget

    return _measure.largest_batch(fits)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    platform = _platform(args.backend)
    print(
        f"keras_recompute benchmark: Keras 3 on {args.backend} ({platform}), {args.blocks} blocks x hidden "
        f"{args.hidden}, {args.heads} heads, FFN {args.ffn}, seq {args.seq}, batch {args.batch}, "
        f"dropout {args.dropout}, Adam, {args.dtype}"
    )
    memory_name = "peak MB" if platform != "cpu" else "activations MB"
    xla = args.backend == "jax"
    print(
        f"{'method':<15} {memory_name:>15} {'vs none':>8} {'step s':>8} {'vs none':>20}  loss"
        + ("     XLA temp MB  vs none" if xla else "")
    )
    script, seen = os.path.abspath(__file__), set()

    def once_then_time(method):
        """The first run measures memory too; the others (`--repeat`) only time a step."""
        if method in seen:
            record = _measure.run(script, child_arguments(args, method, args.batch), args.backend)
        else:
            seen.add(method)
            record = measure(args, method, args.batch)
        # As it comes: a run stopped by its time box (a GPU session's) keeps the methods it finished.
        print(f"# {method}: {json.dumps(record)}", flush=True)
        return record

    runs = _measure.in_turns(args.repeat, [(method,) for method in args.methods], once_then_time)
    results = {}
    for method in args.methods:
        record = _measure.summary(runs[(method,)], "step", runs.get(("none",)))
        results[method] = record
        if "error" in record:
            print(f"{method:<15} failed: {record['error']}")
            continue
        base = results.get("none")
        memory_ratio = step_ratio = ""
        if base and "error" not in base:
            # On the CPU a tiny model's activations are within the RSS noise: no ratio then.
            if record["peak"] > 2**20 and base["peak"] > 2**20:
                memory_ratio = f"{base['peak'] / record['peak']:.2f}x"
            step_ratio = _measure.ratio_text(record)
        line = (
            f"{method:<15} {record['peak'] / 2**20:>15.0f} {memory_ratio:>8} {record['step']:>8.3f} "
            f"{step_ratio:>20}  {record['loss']:.4f}"
        )
        if xla and "xla_temp" in record:
            temp_ratio = f"{base['xla_temp'] / record['xla_temp']:.2f}x" if base and "xla_temp" in base else ""
            line += f"  {record['xla_temp'] / 2**20:>12.0f}  {temp_ratio:>7}"
        print(line, flush=True)
        if record.get("profile"):
            profile = record["profile"]
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(profile["by_kind_ms"].items(), key=lambda kv: -kv[1]))
            print(f"{'':<15} profiled step {profile['step_ms']:.1f} ms; {profile['clock']} ms by kind: {kinds}")
        if record.get("predicted"):
            measured = f" (measured {record['peak'] / record['predicted']:.2f}x it)" if platform != "cpu" else ""
            print(f"{'':<15} memory_report predicted {record['predicted'] / 2**20:.0f} MB{measured}"
                  + (f", {record['predicted_at']}" if record.get("predicted_at") else ""))
        if record.get("activations"):
            print(f"{'':<15} forward and backward, no update: {record['activations'] / 2**20:.0f} MB above the weights and slots")
        if record.get("forward"):
            floor = (record["step"] + record["forward"]) / record["step"]
            print(f"{'':<15} one training forward {record['forward']:.3f} s: full recompute's floor (one more forward) {floor:.2f}x")
    if args.budget_gib:
        budget = int(args.budget_gib * 2**30)
        searched = [m for m in ("none", "ours", "offload") if m in args.methods or m != "offload"]
        batches = {method: largest_batch(args, method, budget) for method in searched}
        print(
            f"largest batch within {args.budget_gib} GiB: "
            + ", ".join(f"{m} {b} ({b / max(batches['none'], 1):.1f}x none)" for m, b in batches.items())
        )
        results["largest_batch"] = batches
    rows = [{"method": method, **record} for method, record in results.items() if method != "largest_batch"]
    _measure.write_json(args.out, vars(args), {"platform": platform, "rows": rows, "largest_batch": results.get("largest_batch")})


def _platform(backend):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    code = (
        "import torch; print('gpu' if torch.cuda.is_available() else 'cpu')"
        if backend == "torch"
        else "import jax; print(jax.devices()[0].platform)"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
