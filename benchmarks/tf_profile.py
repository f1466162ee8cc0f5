"""Where a policy's extra step time goes on TensorFlow: op time by op type, against no recompute.

Trains the BERT-shaped encoder of `benchmarks/memory.py` in a `tf.function`
(`--mode eager`: eagerly), one fresh subprocess per method, and records two steps with TensorFlow's profiler.
Each op's duration is summed by op type (`_MklBatchMatMulV2`,
`StatelessRandomUniformV2`, ...), per step; the table prints each method's
milliseconds and what it adds over `none`, largest first.

With `--inter-op 1` the runtime runs one op at a time (each op still uses every
core), so the op times add up to the step time and the added milliseconds are
the step's. With TensorFlow's default, ops run side by side and their times add
up to more than the step.

The step times are taken apart from the profile, in one more process that
builds every method and runs their steps in turns, `--rounds` rounds: a slow
minute of a shared machine then slows every method alike, where one process per
method (as in `memory.py`) puts it on whichever method ran then. The table
prints each method's median and its ratio to none's.

Usage:
    python benchmarks/tf_profile.py --inter-op 1 --out benchmarks/results/tf_profile_inter_op_1.json
    python benchmarks/tf_profile.py --blocks 4 --hidden 768 --heads 12 --ffn 3072 --seq 512 \\
        --batch 2 --methods none save_dots attention_core --inter-op 1
    python benchmarks/tf_profile.py --mode eager --methods none ours tf --blocks 12 --hidden 128 \
        --heads 4 --ffn 512 --seq 256 --batch 16
"""

import argparse
import collections
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402
import memory  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=3072)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=2, help="warm-up steps before the profiled ones")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds, every method a step each")
    parser.add_argument(
        "--methods", nargs="+", default=["none", "save_dots", "attention_core", "ours"], choices=memory.METHODS[:-1]
    )
    parser.add_argument("--mode", default="function", choices=("function", "eager"))
    parser.add_argument("--inter-op", type=int, default=0, help="inter-op threads (0: TensorFlow's default)")
    parser.add_argument("--rows", type=int, default=16, help="op types to print")
    parser.add_argument("--out", help="also write the op times and step medians as JSON to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


PROFILED_STEPS = 2


def child(args):
    """Profiles one method, or times them all in turns ("all"); prints one JSON line."""
    import tensorflow as tf

    if args.inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
    if args.child == "all":
        steps = {method: memory.training_step(args, method, args.mode) for method in args.methods}
        times = {method: [] for method in steps}
        for turn in range(args.rounds + 1):  # the first turn is not timed: a step's first call
            for method, step in steps.items():  # after another model was built is slow
                start = time.perf_counter()
                step().numpy()
                if turn:
                    times[method].append(time.perf_counter() - start)
        print(json.dumps({method: statistics.median(seconds) for method, seconds in times.items()}))
        return
    step = memory.training_step(args, args.child, args.mode)
    for _ in range(args.steps):
        step().numpy()
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for _ in range(PROFILED_STEPS):
            step().numpy()
        tf.profiler.experimental.stop()
        by_type = op_milliseconds(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    print(json.dumps(by_type))


def op_milliseconds(paths):
    """Milliseconds per profiled step, by op type, of the TensorFlow ops the traces in `paths` record."""
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError as error:  # the module moved before; say where to look
        raise SystemExit(f"tf_profile.py reads TensorFlow's profiler traces with {error.name}, missing here") from None
    if not paths:
        raise SystemExit("tf_profile.py: the profiler wrote no trace (*.xplane.pb)")
    by_type = collections.Counter()
    for path in paths:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as file:
            space.ParseFromString(file.read())
        for plane in space.planes:
            for line in plane.lines:
                for event in line.events:
                    kind = _op_type(plane.event_metadata[event.metadata_id].name)
                    if kind:
                        by_type[kind] += event.duration_ps / 1e9 / PROFILED_STEPS
    return dict(by_type)


def run_child(args, which, methods):
    command = [sys.executable, os.path.abspath(__file__), "--child", which, "--methods", *methods]
    for name in ("blocks", "hidden", "heads", "ffn", "seq", "batch", "dropout", "steps", "rounds", "mode", "inter_op"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise SystemExit(f"{which} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def _op_type(name):
    """The op type of a profiler event's name, or None where the event is not one op's run.

    In a graph an op's event is "scope/name:OpType"; in eager mode
    "EagerLocalExecute: OpType" (its dispatch and kernel). The executor's own
    events ("ExecutorState::Process") and a whole traced function's
    ("EagerLocalExecute: __inference_step_12") are not ops.
    """
    if name.startswith("EagerLocalExecute: "):
        kind = name[len("EagerLocalExecute: ") :]
        return None if kind.startswith("__") else kind
    if "::" in name or ": " in name or ":" not in name:
        return None
    return name.rsplit(":", 1)[1]


def main():
    args = parse_args()
    if args.child:
        return child(args)
    methods = ["none"] + [m for m in args.methods if m != "none"]
    ops = {method: run_child(args, method, [method]) for method in methods}
    median = run_child(args, "all", methods)

    threads = args.inter_op or "TensorFlow's default"
    print(
        f"{args.blocks} blocks, hidden {args.hidden}, {args.heads} heads, ffn {args.ffn}, seq {args.seq}, "
        f"batch {args.batch}, dropout {args.dropout}; {args.mode}; inter-op threads: {threads}"
    )
    print("op ms per step, by op type (profiled apart, a process a method); +: added over none")
    others = methods[1:]
    base = ops["none"]
    added = {kind: max(ops[m].get(kind, 0.0) - base.get(kind, 0.0) for m in others) for kind in set().union(*ops.values())}
    print(f"{'':28s}{'none':>9s}" + "".join(f"{m:>16s}{'+':>8s}" for m in others))

    def row(label, values, unit=""):
        text = f"{label:28s}{values['none']:9.1f}"
        for m in others:
            text += f"{values[m]:16.1f}{values[m] - values['none']:+8.1f}"
        print(text + unit)

    for kind in sorted(added, key=lambda k: (-added[k], k))[: args.rows]:
        row(kind, {m: ops[m].get(kind, 0.0) for m in methods})
    totals = {m: sum(ops[m].values()) for m in methods}
    row("all ops", totals)
    print(f"{'all ops vs none':28s}{'1.00x':>9s}" + "".join(f"{totals[m] / totals['none']:15.2f}x{'':8s}" for m in others))
    row(f"step ms (median, {args.rounds} turns)", {m: 1e3 * median[m] for m in methods})
    print(f"{'step vs none':28s}{'1.00x':>9s}" + "".join(f"{median[m] / median['none']:15.2f}x{'':8s}" for m in others))
    _measure.write_json(args.out, vars(args), {
        "op_ms": ops, "all_ops_ms": totals, "step_median_s": median,
        "step_vs_none": {m: median[m] / median["none"] for m in methods},
    })


if __name__ == "__main__":
    main()
