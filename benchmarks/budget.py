"""Planning to a budget: measured peak and step time of `recompute_model(budget=...)` against hand choices.

The BERT-shaped encoder of `backends.py` (post-norm blocks with attention,
dropout and FFN; embeddings and a classifier head outside the blocks), on
Keras 3 with the backend given. In one run, each configuration in a fresh
subprocess:
    none             nothing recomputed
    full             every block, policy "full"
    limit=n          the first n blocks, "full" (Megatron's "block" method)
    policy=P         every block with policy P ("save_dots", "attention_core")
    budget=B         `recompute_model(budget=B bytes, inputs=batch)`
Budgets lie 25%, 50% and 75% of the way from full recompute's measured peak
to the plain model's. For each, the hand choices that fit it (the smallest
`limit=n` whose peak fits, and each uniform policy that fits) are set beside
the plan. Each child also prints `memory_report`'s predicted peak for its
configuration.

Memory, per backend, of the steps after the first (which compiles):
    tensorflow   the BFC allocator's peak (weights, optimizer, batch and
                 activations; the child sets `TF_CPU_ALLOCATOR_USE_BFC=1`)
    jax          weights, optimizer and batch (the report's resident bytes)
                 plus the temporaries XLA assigns to the compiled step: the
                 step's own peak, exact, on a CPU without allocator stats
    torch        on a GPU the allocator's peak; on the CPU the peak of the
                 second of two more steps from the profiler's allocation
                 records, on top of the weights and optimizer slots
                 (`_measure.torch_cpu_peak`)

Usage:
    python benchmarks/budget.py --backend tensorflow
    python benchmarks/budget.py --backend jax --blocks 12 --seq 512 --batch 4
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402
import backends  # noqa: E402

FRACTIONS = (0.25, 0.5, 0.75)
POLICIES = ("save_dots", "attention_core")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"), default="tensorflow")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after two warm-up steps")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    parser.add_argument("--child", metavar="CONFIG", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(args):
    """Trains one configuration; prints a JSON line: peak, step time, loss, predicted peak, plan."""
    import numpy as np

    import keras

    import keras_recompute

    keras.utils.set_random_seed(0)
    model = backends.build_model(args, "none")
    rng = np.random.RandomState(0)
    ids = rng.randint(0, args.vocab, size=(args.batch, args.seq)).astype("int32")
    labels = rng.randint(0, 2, size=(args.batch,)).astype("int32")
    config, _, value = args.child.partition("=")
    start = time.perf_counter()
    if config == "full":
        keras_recompute.recompute_model(model, enabled=True)
    elif config == "limit":
        keras_recompute.recompute_model(model, limit=int(value), enabled=True)
    elif config == "policy":
        keras_recompute.recompute_model(model, policy=value, enabled=True)
    elif config == "budget":
        keras_recompute.recompute_model(model, budget=int(float(value)), inputs=ids, enabled=True)
    planning = time.perf_counter() - start
    report = keras_recompute.memory_report(model, ids)
    times = []
    for step in range(args.steps + 2):
        if step == 1:
            _measure.reset_peak(args.backend)
            _measure.reset_rss_peak()
        start = time.perf_counter()
        loss = float(np.asarray(model.train_on_batch(ids, labels)))
        if step >= 2:
            times.append(time.perf_counter() - start)
    record = {
        "peak": _measure.peak(args.backend),
        "rss": _measure.rss_peak(),
        "step": min(times) if times else None,
        "loss": loss,
        "predicted": report.predicted_peak,
        "resident": report.resident,
        "plan": [row["policy"] for row in report.rows],
        "planning_seconds": planning,
    }
    if args.backend == "jax" and args.steps:
        record["xla_temp"] = _measure.xla_temp_bytes(model, ids, labels)
    if args.backend == "torch" and record["peak"] is None and args.steps:
        # The gradients are in the records; the batch is converted within the step.
        live = [v.value for v in model.variables + model.optimizer.variables]
        record["peak"] = _measure.torch_cpu_peak(lambda: model.train_on_batch(ids, labels), live)
    print(json.dumps(record))


def child_arguments(args, config, batch=None, steps=None):
    arguments = ["--child", config, "--backend", args.backend]
    for name in ("blocks", "hidden", "heads", "ffn", "seq", "vocab", "dropout"):
        arguments += [f"--{name}", getattr(args, name)]
    return arguments + ["--batch", args.batch if batch is None else batch, "--steps", args.steps if steps is None else steps]


def measure(args, config, cache):
    """A configuration's record, with `peak` as this backend measures it (see the module's docstring)."""
    if config in cache:
        return cache[config]
    script = os.path.abspath(__file__)
    record = _measure.run(script, child_arguments(args, config), args.backend, label=config)
    if "error" not in record:
        if args.backend == "jax" and record.get("peak") is None:
            record["peak"] = record["resident"] + record["xla_temp"]
        elif record.get("peak") is None:
            full = _measure.run(script, child_arguments(args, config), args.backend, low_mmap_threshold=True, label=f"{config} (RSS)")
            one = _measure.run(
                script, child_arguments(args, config, batch=1, steps=0), args.backend, low_mmap_threshold=True, label=f"{config} (one row)"
            )
            record["peak"] = record["resident"] + full["rss"] - one["rss"]
    cache[config] = record
    return record


def smallest_limit(args, budget, cache):
    """The smallest n for which `limit=n` fits `budget`, by bisection (peaks fall as n grows)."""
    low, high = 0, args.blocks  # limit=blocks is full recompute, which fits every budget here
    while low < high:
        middle = (low + high) // 2
        record = measure(args, f"limit={middle}", cache)
        if "error" not in record and record["peak"] <= budget:
            high = middle
        else:
            low = middle + 1
    return low


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    print(
        f"keras_recompute budget benchmark: Keras 3 on {args.backend}, {args.blocks} blocks x hidden {args.hidden}, "
        f"{args.heads} heads, FFN {args.ffn}, seq {args.seq}, batch {args.batch}, dropout {args.dropout}, Adam"
    )
    cache = {}
    none, full = measure(args, "none", cache), measure(args, "full", cache)
    cache[f"limit={args.blocks}"] = full
    cache["limit=0"] = none
    rows = []

    def show(label, config, budget=None):
        record = measure(args, config, cache)
        if "error" in record:
            print(f"  {label:<26} failed: {record['error']}")
            return
        fits = "" if budget is None else ("fits" if record["peak"] <= budget * 1.05 else "OVER")
        error = (record["predicted"] - record["peak"]) / record["peak"]
        print(
            f"  {label:<26} {record['peak'] / 2**20:>9.1f} {record['predicted'] / 2**20:>10.1f} {error:>+7.1%} "
            f"{record['step']:>8.3f} {record['step'] / none['step']:>7.2f}x {fits:>5}  {record['loss']:.4f}"
        )
        rows.append({"label": label, "config": config, "budget": budget, **record})

    header = f"  {'configuration':<26} {'peak MiB':>9} {'predicted':>10} {'error':>7} {'step s':>8} {'vs none':>8} {'':>5}  loss"
    print(header)
    show("none", "none")
    show("full", "full")
    for fraction in FRACTIONS:
        budget = full["peak"] + fraction * (none["peak"] - full["peak"])
        print(f"budget {budget / 2**20:.1f} MiB ({fraction:.0%} of the way from full to none):")
        show("recompute_model(budget=)", f"budget={int(budget)}", budget)
        plan = cache[f"budget={int(budget)}"].get("plan")
        if plan:
            print(f"    plan: {' '.join(p if p != 'none' else '-' for p in plan)}")
        n = smallest_limit(args, budget, cache)
        show(f"limit={n} (smallest that fits)", f"limit={n}", budget)
        for policy in POLICIES:
            if measure(args, f"policy={policy}", cache).get("peak", float("inf")) <= budget:
                show(f"policy={policy}", f"policy={policy}", budget)
    _measure.write_json(args.out, vars(args), {"rows": rows})


if __name__ == "__main__":
    main()
