"""Peak memory and step time of a BERT-shaped encoder, with and without recompute.

Each configuration trains in a fresh subprocess with TensorFlow's BFC allocator
on the CPU (`TF_CPU_ALLOCATOR_USE_BFC=1`), so
`tf.config.experimental.get_memory_info("CPU:0")["peak"]` is the true peak of
tensor memory. The table prints the peak and the fastest step time of each
configuration, and both as ratios against no recompute from the same run.

Usage:
    python benchmarks/memory.py                      # 12 blocks, a few minutes
    python benchmarks/memory.py --blocks 4 --seq 64  # quicker
    python benchmarks/memory.py --modes eager function jit --methods none ours
    python benchmarks/memory.py --modes function --methods none ours tf --repeat 3

`--repeat N` runs every configuration N times, in turns (all of them once,
then again), each in a fresh process: the step time is then the median of the
runs, and its ratio to none's is the median and the range of the runs' ratios
(each run against none's run of the same turn). Memory is the first run's.

Modes: eager, function (`tf.function`), jit (`jit_compile=True`), all with
Keras 3; graph: a TF1-style graph (`tf.compat.v1`, a Session) with tf_keras.

Methods:
    none        the plain encoder
    ours        keras_recompute.recompute_grad on each block's call (policy "full")
    save_dots   the same with policy="save_dots": the weight matmuls' outputs kept
    attention_core  the same with policy="attention_core": only attention's core recomputes
    tf          tf.recompute_grad around each block's call
    rematscope  the encoder built inside keras.RematScope(mode="full")
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

METHODS = ("none", "ours", "save_dots", "attention_core", "tf", "rematscope")
POLICIES = {"ours": "full", "save_dots": "save_dots", "attention_core": "attention_core"}
MODES = ("eager", "function", "jit", "graph")


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every configuration, in turns (time: median and range)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", help="also write the results as JSON to this file (for benchmarks/plot.py)")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "MODE"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_encoder(args, method, keras):
    """Returns a functional encoder of `args.blocks` blocks (Keras 3 or tf_keras)."""
    import tensorflow as tf

    from keras_recompute import recompute_grad

    class EncoderBlock(keras.layers.Layer):
        """Post-norm BERT block: attention, add & norm, FFN, add & norm."""

        def __init__(self, hidden, heads, ffn, dropout, **kwargs):
            super().__init__(**kwargs)
            self.attention = keras.layers.MultiHeadAttention(
                heads, hidden // heads, dropout=dropout
            )
            self.attention_dropout = keras.layers.Dropout(dropout)
            self.attention_norm = keras.layers.LayerNormalization(epsilon=1e-12)
            self.intermediate = keras.layers.Dense(ffn, activation="gelu")
            self.output_dense = keras.layers.Dense(hidden)
            self.output_dropout = keras.layers.Dropout(dropout)
            self.output_norm = keras.layers.LayerNormalization(epsilon=1e-12)

        def call(self, inputs, training=None):
            attended = self.attention(inputs, inputs, training=training)
            attended = self.attention_dropout(attended, training=training)
            hidden = self.attention_norm(inputs + attended)
            output = self.output_dense(self.intermediate(hidden))
            output = self.output_dropout(output, training=training)
            return self.output_norm(hidden + output)

    class OursBlock(EncoderBlock):
        @recompute_grad(enabled=True, policy=POLICIES.get(method, "full"))
        def call(self, inputs, training=None):
            return super().call(inputs, training=training)

    class TfBlock(EncoderBlock):
        def call(self, inputs, training=None):
            plain_call = super().call
            return tf.recompute_grad(lambda x: plain_call(x, training=training))(inputs)

    block_class = OursBlock if method in POLICIES else {"tf": TfBlock}.get(method, EncoderBlock)

    def make():
        inputs = keras.Input((args.seq, args.hidden))
        hidden = inputs
        for _ in range(args.blocks):
            hidden = block_class(args.hidden, args.heads, args.ffn, args.dropout)(hidden)
        outputs = keras.layers.Dense(1)(hidden)
        return keras.Model(inputs, outputs)

    if method == "rematscope":
        with keras.RematScope(mode="full"):
            return make()
    return make()


def training_step(args, method, mode):
    """The encoder of `method` with Adam, and its training step on a fixed batch, run once.

    Returns the step as a function of no arguments; `mode` is "eager",
    "function" (a `tf.function`) or "jit" (`jit_compile=True`). Keras 3.
    """
    import tensorflow as tf
    import keras

    keras.utils.set_random_seed(0)
    model = build_encoder(args, method, keras)
    optimizer = keras.optimizers.Adam(1e-4)
    optimizer.build(model.trainable_variables)
    x = tf.random.normal((args.batch, args.seq, args.hidden))
    y = tf.random.normal((args.batch, args.seq, 1))

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    if mode != "eager":
        step = tf.function(step, jit_compile=(mode == "jit"))
    step(x, y).numpy()  # build, trace, compile
    return lambda: step(x, y)


def child(args):
    """Trains one configuration and prints one JSON line."""
    method, mode = args.child
    if mode == "graph":
        return graph_child(args, method)
    import tensorflow as tf

    step = training_step(args, method, mode)
    resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    print(json.dumps({"peak_mb": peak / 2**20, "step_mb": (peak - resident) / 2**20, "step_s": min(times)}))


def graph_child(args, method):
    """A TF1-style graph (tf.compat.v1, a Session) with tf_keras: the graph path."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    import tf_keras

    if method == "rematscope":
        print(json.dumps({"error": "keras.RematScope is Keras 3 only; no graph mode"}))
        return
    tf_keras.utils.set_random_seed(0)
    model = build_encoder(args, method, tf_keras)
    x = tf.random.normal((args.batch, args.seq, args.hidden))
    y = tf.random.normal((args.batch, args.seq, 1))
    loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    train = tf.compat.v1.train.AdamOptimizer(1e-4).minimize(loss, var_list=model.trainable_variables)
    with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(train)
        resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            session.run(train)
            times.append(time.perf_counter() - start)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    print(json.dumps({"peak_mb": peak / 2**20, "step_mb": (peak - resident) / 2**20, "step_s": min(times)}))


def run_child(args, method, mode):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    command = [sys.executable, os.path.abspath(__file__), "--child", method, mode]
    for name in ("blocks", "hidden", "heads", "ffn", "seq", "batch", "dropout", "steps"):
        command += [f"--{name}", str(getattr(args, name))]
    with _measure._console().status(f"memory.py: {method} ({mode})"):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    if done.returncode == 0 and not done.stdout.strip():
        return {"error": "no output"}
    return {"error": _last_error_line(done.stderr)}


def _last_error_line(text):
    """The line of a child's stderr that says why it failed."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith(("WARNING", "I0000"))]
    for line in reversed(lines):
        if "custom_gradient" in line or "Error:" in line:
            return line[:110]
    return (lines or ["no output"])[-1][:110]


def main():
    args = parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(
        f"encoder: {args.blocks} blocks, hidden {args.hidden}, {args.heads} heads, "
        f"FFN {args.ffn}, seq {args.seq}, batch {args.batch}, dropout {args.dropout}; "
        f"Adam; fastest of {args.steps} steps after one warm-up step"
    )
    print("step MB: the peak above what lives between steps (weights, optimizer state): activations,")
    print("gradients and workspace of one step.")
    header = (
        f"{'mode':<9} {'method':<15} {'peak MB':>9} {'step MB':>9} {'step s':>8} {'peak vs none':>13} "
        f"{'step MB vs none':>16} {'time vs none':>20}"
    )
    print(header)
    print("-" * len(header))
    runs = _measure.in_turns(args.repeat, [(mode, method) for mode in args.modes for method in args.methods],
                             lambda mode, method: run_child(args, method, mode))
    rows = []
    for mode in args.modes:
        base = None
        for method in args.methods:
            records = runs[(mode, method)]
            result = _measure.summary(records, "step_s", runs.get((mode, "none")))
            rows.append({"mode": mode, "method": method, **result})
            if "error" in result:
                print(f"{mode:<9} {method:<15} failed: {result['error']}")
                continue
            if method == "none":
                base = result
            peak_ratio = step_ratio = time_ratio = ""
            if base:
                peak_ratio = f"{base['peak_mb'] / result['peak_mb']:.2f}x lower"
                step_ratio = f"{base['step_mb'] / result['step_mb']:.2f}x lower"
                time_ratio = _measure.ratio_text(result)
            print(
                f"{mode:<9} {method:<15} {result['peak_mb']:>9.0f} {result['step_mb']:>9.0f} {result['step_s']:>8.2f} "
                f"{peak_ratio:>13} {step_ratio:>16} {time_ratio:>20}",
                flush=True,
            )
    _measure.write_json(args.out, vars(args), {"rows": rows})


if __name__ == "__main__":
    main()
