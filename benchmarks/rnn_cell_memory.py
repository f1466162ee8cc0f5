"""What recomputing an RNN cell saves: its call recomputed once per time step, inside the RNN's loop.

A Keras `RNN` over a cell whose call is decorated (NOTE [ a recompute inside a loop or a branch ] in
`keras_recompute/backends/tensorflow.py`: on TensorFlow its gradient did not build before 2026-11-30).
The cell widens its input and state to `--width` (Dense + gelu), narrows back and normalizes: what a
plain loop's gradient keeps for every step is the wide activations; a recomputed cell's loop keeps the
step's inputs. Each configuration runs in a fresh process: the compiled training step (`fit`'s, SGD)
once to build, then once measured: the peak of TensorFlow's BFC allocator above what the process held
before the step, and the median time of 5 more steps.

```
python benchmarks/rnn_cell_memory.py --out benchmarks/results/rnn_cell_memory_tensorflow.json
```
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

CHILD = r"""
import json, statistics, sys, time
import numpy as np, keras, tensorflow as tf
from keras import layers, ops
from keras_recompute import recompute_grad, recompute_scope
on, steps, batch, width = sys.argv[1] == "recomputed", int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


class Cell(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state_size = 64
        self.up = layers.Dense(width, activation="gelu")
        self.down = layers.Dense(64)
        self.norm = layers.LayerNormalization()

    def build(self, input_shape):
        self.up.build((input_shape[0], input_shape[-1] + 64))
        self.down.build((input_shape[0], width))
        self.norm.build((input_shape[0], 64))

    @recompute_grad
    def call(self, inputs, states, training=None):
        return [self.norm(states[0] + self.down(self.up(ops.concatenate([inputs, states[0]], -1))))] * 2


keras.utils.set_random_seed(0)
sequence = keras.Input((steps, 64))
model = keras.Model(sequence, layers.Dense(1)(layers.RNN(Cell())(sequence)))
model.compile(optimizer="sgd", loss="mse")
x = np.random.RandomState(0).rand(batch, steps, 64).astype("float32")
y = np.random.RandomState(1).rand(batch, 1).astype("float32")
with recompute_scope(on):
    model.train_on_batch(x, y)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model.train_on_batch(x, y)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    times = []
    for _ in range(5):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
print(json.dumps({"peak": peak, "step_s": statistics.median(times)}))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="time steps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024, help="the cell's inner width")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPU_ALLOCATOR_USE_BFC="1")
    results = {}
    for mode in ("plain", "recomputed"):
        child = [sys.executable, "-c", CHILD, mode, str(args.steps), str(args.batch), str(args.width)]
        done = subprocess.run(child, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{mode:10s} peak {results[mode]['peak'] / 2**20:7.1f} MiB  step {results[mode]['step_s']:.3f} s", flush=True)
    results["lower_than_plain"] = results["plain"]["peak"] / results["recomputed"]["peak"]
    results["time_vs_plain"] = results["recomputed"]["step_s"] / results["plain"]["step_s"]
    print(f"recomputed: {results['lower_than_plain']:.2f}x lower peak, {results['time_vs_plain']:.2f}x the time")
    _measure.write_json(args.out, vars(args), results)


if __name__ == "__main__":
    main()
