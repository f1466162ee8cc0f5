"""`budget=` for an eager TensorFlow loop against a `tf.function` loop: does each plan fit its budget?

The case of the report that found the planner planning for compiled steps only: 8 keras-hub
`TransformerEncoder` blocks (hidden 256, 8 heads, FFN 1024, seq 256, batch 8, dropout 0.1), a model
not compiled, trained in the custom loop the Keras guides show (`tf.GradientTape`, Adam), eagerly
or inside `tf.function`. Each configuration runs in a fresh process; the figure is the step's
peak on TensorFlow's BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC=1`), weights and slots included.

For each loop: the plain model's and full recompute's peaks, a budget half-way between them, and
the plan `recompute_model(model, budget=..., inputs=x)` makes for it: inferred (eager, since the
model is not compiled) in the eager loop, and `execution="compiled"` in the `tf.function` loop;
also the compiled plan run eagerly, which is what the planner did before it knew of eager steps.

Usage:
    python benchmarks/eager_budget.py --out benchmarks/results/eager_budget_tensorflow.json
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", help="also write the results as JSON to this file")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "LOOP", "BUDGET"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def planned_loop_peak(model, x, labels, method, loop, budget):
    """Plans `model` by `method` and trains it two steps in a custom loop; returns the plan and the step's BFC peak.

    `method`: "none", "full", "inferred" (`budget=` with `execution` inferred) or an
    execution ("eager", "compiled"); `loop`: "eager" or "function" (`tf.function`).
    Also the child of `tests/test_budget.py`'s loop test.
    """
    import keras
    import tensorflow as tf

    from keras_recompute import memory_report, recompute_model

    record = {}
    if method == "full":
        recompute_model(model, enabled=True)
    elif method != "none":
        recompute_model(model, enabled=True, budget=budget, inputs=x, execution=None if method == "inferred" else method)
        report = memory_report(model, x)
        record.update(plan=[row["policy"] for row in report.rows], predicted=report.predicted_peak, execution=report.execution)
    optimizer = keras.optimizers.Adam(1e-4)
    optimizer.build(model.trainable_variables)
    loss_function = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_function(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    step = tf.function(step) if loop == "function" else step
    step(x, labels)
    tf.config.experimental.reset_memory_stats("CPU:0")
    step(x, labels)
    record["peak"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return record


def child(args):
    method, loop, budget = args.child[0], args.child[1], int(args.child[2])
    import keras
    import keras_hub
    import numpy as np

    keras.utils.set_random_seed(0)
    inputs = keras.Input((args.seq, args.hidden))
    hidden = inputs
    for _ in range(args.blocks):
        hidden = keras_hub.layers.TransformerEncoder(args.ffn, args.heads, dropout=0.1)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden[:, 0]))
    x = np.random.RandomState(0).standard_normal((args.batch, args.seq, args.hidden)).astype("float32")
    record = planned_loop_peak(model, x, np.zeros((args.batch,), "int32"), method, loop, budget)
    print(json.dumps(record))


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    script = os.path.abspath(__file__)
    sizes = []
    for name in ("blocks", "hidden", "heads", "ffn", "seq", "batch"):
        sizes += [f"--{name}", getattr(args, name)]

    def run(method, loop, budget=0):
        record = _measure.run(script, ["--child", method, loop, budget, *sizes], "tensorflow")
        print(f"{loop:<9} {method:<9} budget {budget / 1e6:7.1f} MB  {json.dumps(record)}", flush=True)
        return record

    rows = []
    for loop, planned in (("eager", ["inferred", "compiled"]), ("function", ["compiled"])):
        plain, full = run("none", loop), run("full", loop)
        budget = (plain["peak"] + full["peak"]) // 2
        rows += [dict(loop=loop, method="none", **plain), dict(loop=loop, method="full", **full)]
        for method in planned:
            record = run(method, loop, budget)
            rows.append(dict(loop=loop, method=f"budget ({method})", budget=budget, over_budget=record["peak"] / budget, **record))
    _measure.write_json(args.out, vars(args), {"device": "cpu", "dtype": "float32", "rows": rows})


if __name__ == "__main__":
    main()
