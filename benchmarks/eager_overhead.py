"""What a recomputed call costs in TensorFlow eager mode beyond the recompute itself.

keras-hub `TransformerEncoder` blocks at a tiny batch, where per-call overhead is
all there is: the eager step time of the plain model, of `tf.recompute_grad`
around each block's call, and of `recompute_model` (each block one unit). Both
recomputes run each block's forward twice; what ours costs more per recomputed
call is printed at the end. Keras 3 on TensorFlow, one process, the methods
measured in turns (`--runs` rounds, each the fastest of `--steps` steps).
And what each costs to trace: the same step traced as a `tf.function` (its
graph built, not run; the fastest of `--runs` traces), where ours adds the
recompute check's ops (NOTE [ tracing the check ] in `backends/tensorflow.py`).

Usage:
    python benchmarks/eager_overhead.py
    python benchmarks/eager_overhead.py --blocks 8 --runs 5
    python benchmarks/eager_overhead.py --out benchmarks/results/eager_overhead_tensorflow.json
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

METHODS = ("none", "tf", "ours")


def build(keras, keras_hub, blocks, method):
    import tensorflow as tf

    from keras_recompute import recompute_model

    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 32))
    hidden = inputs
    for _ in range(blocks):
        hidden = keras_hub.layers.TransformerEncoder(64, 4, dropout=0.1)(hidden)
    model = keras.Model(inputs, hidden)
    if method == "ours":
        recompute_model(model, blocks=keras_hub.layers.TransformerEncoder, enabled=True)
    elif method == "tf":
        for layer in model.layers:
            if isinstance(layer, keras_hub.layers.TransformerEncoder):
                layer.call = _tf_recomputed(tf, layer.call)
    return model


def _tf_recomputed(tf, call):
    """`call` (on its inputs, in training mode) under `tf.recompute_grad`."""
    recomputed = tf.recompute_grad(lambda inputs: call(inputs, training=True))
    return lambda inputs, *args, **kwargs: recomputed(inputs)


def train_step(model, inputs):
    """The loss's gradients on `model`'s weights for `inputs`: the step timed eagerly and traced."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        outputs = model(inputs, training=True)
        loss = tf.reduce_sum(outputs * outputs)
    return tape.gradient(loss, model.trainable_variables)


def step_seconds(model, inputs, steps):
    train_step(model, inputs)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(model, inputs)
        times.append(time.perf_counter() - start)
    return min(times)


def trace_seconds(model, inputs):
    """Seconds to trace the step as a `tf.function` (its graph built, not run), and its ops."""
    import tensorflow as tf

    start = time.perf_counter()
    step = tf.function(lambda x: train_step(model, x), autograph=False)
    graph = step.get_concrete_function(tf.constant(inputs)).graph
    return time.perf_counter() - start, len(graph.get_operations())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3, help="rounds of all methods, in turns")
    parser.add_argument("--out", help="also write the step times as JSON to this file")
    args = parser.parse_args(argv)
    import keras
    import keras_hub
    import numpy as np

    inputs = np.random.RandomState(0).standard_normal((2, 16, 32)).astype("float32")
    models = {method: build(keras, keras_hub, args.blocks, method) for method in METHODS}
    seconds = {method: [] for method in METHODS}
    traces, operations = {method: [] for method in METHODS}, {}
    for _ in range(args.runs):
        for method in METHODS:
            seconds[method].append(step_seconds(models[method], inputs, args.steps))
        for method in METHODS:
            traced, operations[method] = trace_seconds(models[method], inputs)
            traces[method].append(traced)
    print(f"{args.blocks} keras-hub TransformerEncoders (hidden 64, 4 heads), batch 2 x 16, eager; "
          f"mean of {args.runs} runs, each the fastest of {args.steps} steps")
    mean = {method: float(np.mean(values)) for method, values in seconds.items()}
    for method in METHODS:
        print(f"{method:<5} {mean[method] * 1000:8.1f} ms  {mean[method] / mean['none']:.2f}x none")
    extra = (mean["ours"] - mean["tf"]) / args.blocks * 1000
    print(f"ours against tf.recompute_grad: {extra:+.2f} ms per recomputed call")
    trace = {method: min(values) for method, values in traces.items()}
    print(f"traced as a tf.function (the fastest of {args.runs} traces):")
    for method in METHODS:
        print(f"{method:<5} {trace[method] * 1000:8.1f} ms  {operations[method]:6d} ops")
    trace_extra = (trace["ours"] - trace["tf"]) / args.blocks * 1000
    operations_extra = (operations["ours"] - operations["tf"]) / args.blocks
    print(f"ours against tf.recompute_grad, traced: {trace_extra:+.2f} ms and {operations_extra:+.0f} ops per recomputed call")
    _measure.write_json(args.out, vars(args), {
        "step_ms": {m: v * 1000 for m, v in mean.items()}, "ours_over_tf_ms_per_call": extra,
        "trace_ms": {m: v * 1000 for m, v in trace.items()}, "operations": operations,
        "ours_over_tf_trace_ms_per_call": trace_extra, "ours_over_tf_operations_per_call": operations_extra,
    })


if __name__ == "__main__":
    main()
