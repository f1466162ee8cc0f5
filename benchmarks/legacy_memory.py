"""A training step's peak memory on standalone Keras 2.3 (TF 1.x or 2.0/2.1): plain, ours, `tf.recompute_grad`.

Run it with a legacy environment's Python (`tests/legacy/run.py` builds them
under `~/.cache/keras_recompute/legacy`):

```
PY=$(ls -d ~/.cache/keras_recompute/legacy/tf1.15-keras2.3-*)/bin/python
PYTHONPATH=. $PY benchmarks/legacy_memory.py --out benchmarks/results/legacy_memory_tf1.15_cpu.json
```

The model: a Keras 2.3 functional encoder of `--blocks` blocks (single-head
self-attention over `--seq` positions, then a feed-forward of `--ffn`, each
with a residual), float32, SGD. Each method runs in a fresh process: it builds
the model, runs one `train_on_batch` to build and warm everything, then
measures a second step's peak resident memory above what the process held
before it (Linux: the peak is reset through `/proc/self/clear_refs`; glibc
returns buffers of 128 KB and up at once, `MALLOC_MMAP_THRESHOLD_`). The
methods: `none`; `ours` (`recompute_grad` on each block's `call`,
`RECOMPUTE=1`); `ours_unchecked` (`check=False`: no value check of the
recompute); `tf_recompute_grad` (the block's body under
`tf.recompute_grad`, TensorFlow's own). No dropout, so all three compute the
same function; the losses printed beside each peak show it.
"""

import argparse
import json
import os
import platform
import subprocess
import sys

import _record  # this folder is on the path of a script run from it

METHODS = ("none", "ours", "ours_unchecked", "tf_recompute_grad")


def child(args):
    import numpy as np
    import tensorflow as tf

    import keras
    from keras import backend as K
    from keras_recompute import recompute_grad, recompute_scope

    hidden, ffn = args.hidden, args.ffn

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super(Block, self).__init__(**kwargs)
            small = keras.initializers.RandomNormal(stddev=0.02)  # as BERT's: 12 residual blocks stay finite
            self.q = keras.layers.Dense(hidden, kernel_initializer=small)
            self.k = keras.layers.Dense(hidden, kernel_initializer=small)
            self.v = keras.layers.Dense(hidden, kernel_initializer=small)
            self.up = keras.layers.Dense(ffn, activation="relu", kernel_initializer=small)
            self.down = keras.layers.Dense(hidden, kernel_initializer=small)

        def body(self, x):
            scores = K.batch_dot(self.q(x), self.k(x), axes=[2, 2]) / float(np.sqrt(hidden))
            h = x + K.batch_dot(K.softmax(scores), self.v(x))
            return h + self.down(self.up(h))

        def call(self, x):
            if args.method == "tf_recompute_grad":
                for layer in (self.q, self.k, self.v, self.up, self.down):  # built outside the recompute
                    if not layer.built:
                        layer.build(K.int_shape(x) if layer is not self.down else K.int_shape(x)[:-1] + (ffn,))
                return tf.recompute_grad(self.body)(x)
            return self.body(x)

        def compute_output_shape(self, input_shape):
            return input_shape

    if args.method in ("ours", "ours_unchecked"):
        Block.call = recompute_grad(Block.call, check=args.method == "ours")
    np.random.seed(0)
    with recompute_scope(args.method.startswith("ours")):
        inputs = keras.layers.Input((args.seq, hidden))
        h = inputs
        for _ in range(args.blocks):
            h = Block()(h)
        model = keras.models.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(h)))
    model.compile(keras.optimizers.SGD(lr=1e-3), "mse")
    random = np.random.RandomState(0)
    x = random.randn(args.batch, args.seq, hidden).astype("float32")
    y = random.randn(args.batch, 1).astype("float32")
    losses = [float(model.train_on_batch(x, y))]
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak (VmHWM) starts again from now
    losses.append(float(model.train_on_batch(x, y)))
    peak = _status("VmHWM")
    print(json.dumps({"step_peak_bytes": peak - before, "losses": losses}))


def _status(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field + " not in /proc/self/status")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.method:
        return child(args)

    import tensorflow as tf
    import keras

    results = {}
    for method in args.methods:
        command = [sys.executable, os.path.abspath(__file__), "--method", method] + [
            "--%s=%s" % (name, getattr(args, name)) for name in ("blocks", "hidden", "ffn", "seq", "batch")
        ]
        environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", TF_CPP_MIN_LOG_LEVEL="3")
        environment.pop("RECOMPUTE", None)
        process = subprocess.run(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
        lines = [line for line in process.stdout.splitlines() if line.startswith("{")]
        if process.returncode != 0 or not lines:
            error = (process.stderr.strip().splitlines() or ["exit %d" % process.returncode])[-1]
            results[method] = {"error": error}
            print("%-18s failed: %s" % (method, error))
            continue
        results[method] = json.loads(lines[-1])
    plain = results.get("none", {}).get("step_peak_bytes")
    print("TensorFlow %s, Keras %s, %d blocks, hidden %d, ffn %d, seq %d, batch %d, float32, CPU" % (
        tf.__version__, keras.__version__, args.blocks, args.hidden, args.ffn, args.seq, args.batch))
    for method, result in results.items():
        if "error" in result:
            continue
        peak = result["step_peak_bytes"]
        ratio = " (%.2fx lower than none)" % (plain / peak) if plain and method != "none" else ""
        print("%-18s step peak %7.1f MB%s  losses %s" % (method, peak / 2**20, ratio, ["%.6f" % v for v in result["losses"]]))
    if args.out:
        record = {
            "command": "PYTHONPATH=. python " + " ".join(["benchmarks/legacy_memory.py"] + (argv if argv is not None else sys.argv[1:])),
            "device": _record.device(),
            "dtype": "float32",
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "python": platform.python_version(),
            "model": {name: getattr(args, name) for name in ("blocks", "hidden", "ffn", "seq", "batch")},
            "results": results,
        }
        with open(args.out, "w") as out:
            json.dump(record, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
