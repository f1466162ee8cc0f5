"""What `recompute_model(model)` saves on a keras.applications CNN fine-tuned under a new head.

Transfer learning nests a whole model in another (`x = backbone(inputs)`, a pooling and a Dense):
"auto" cuts the backbone's graph into its repeated blocks (NOTE [ a model inside a model ] and
NOTE [ blocks that are pieces of a graph ] in `keras_recompute/_model.py`). Each configuration runs in
a fresh process on TensorFlow: `fit`'s compiled step (SGD, MSE) once to build, then once measured:
the peak of TensorFlow's BFC allocator above what the process held before the step, then the median
time of 3 more steps. `plain`: no recompute; `auto`: `recompute_model(model)`; with `--before DIR`
(a checkout's `keras_recompute` folder's parent), `auto` as that version of the library plans it too.
With `--frozen all` the backbone is frozen (feature extraction, Keras's transfer learning guide's first
phase), with `--frozen lower_half` the lower half of its layers (fine-tuning the upper half): a recompute
no gradient reads must cost nothing (NOTE [ a check the runtime may prune ] in
`keras_recompute/backends/tensorflow.py`).

```
python benchmarks/applications_memory.py --out benchmarks/results/applications_memory_tensorflow.json
python benchmarks/applications_memory.py --frozen all --out benchmarks/results/applications_memory_frozen_tensorflow.json
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
import keras_recompute
from keras_recompute import _model
name, mode, batch, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, sys.argv[6])
import _measure
model = _measure.applications_under_a_head(name, size, sys.argv[5])
units = 0
if mode != "plain":
    keras_recompute.recompute_model(model, enabled=True)
    units = len(_model.recomputed_units(model))
x = np.random.RandomState(0).rand(batch, size, size, 3).astype("float32")
y = np.random.RandomState(1).rand(batch, 1).astype("float32")
model.train_on_batch(x, y)
tf.config.experimental.reset_memory_stats("CPU:0")
before = tf.config.experimental.get_memory_info("CPU:0")["current"]
model.train_on_batch(x, y)
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
times = []
for _ in range(3):
    start = time.perf_counter()
    model.train_on_batch(x, y)
    times.append(time.perf_counter() - start)
print(json.dumps({"peak": peak, "step_s": statistics.median(times), "units": units}))
"""

MODELS = ["ResNet50", "EfficientNetB0", "ConvNeXtTiny", "MobileNetV2", "VGG16"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=128, help="the images' height and width")
    parser.add_argument("--frozen", choices=["none", "all", "lower_half"], default="none",
                        help="the backbone's layers frozen (`trainable = False`): none, all (feature extraction), "
                        "or the lower half of them (fine-tuning the upper ones)")
    parser.add_argument("--before", help="the parent folder of an earlier keras_recompute, measured as `auto_before`")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    modes = [("plain", None), ("auto", _measure.ROOT)] + ([("auto_before", os.path.abspath(args.before))] if args.before else [])
    results = {}
    for name in args.models:
        row = results[name] = {}
        for mode, source in modes:
            path = os.pathsep.join(p for p in [source or _measure.ROOT, os.environ.get("PYTHONPATH", "")] if p)
            env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPU_ALLOCATOR_USE_BFC="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=path)
            here = os.path.dirname(os.path.abspath(__file__))
            child = [sys.executable, "-c", CHILD, name, "plain" if mode == "plain" else "auto", str(args.batch), str(args.size), args.frozen, here]
            done = subprocess.run(child, env=env, capture_output=True, text=True, cwd="/")
            if done.returncode:
                row[mode] = {"error": done.stderr.strip().splitlines()[-1][:200]}
                print(f"{name:15s} {mode:11s} failed: {row[mode]['error']}", flush=True)
                continue
            row[mode] = json.loads(done.stdout.strip().splitlines()[-1])
            if mode != "plain" and "peak" in row.get("plain", {}):
                row[mode]["lower_than_plain"] = row["plain"]["peak"] / row[mode]["peak"]
                row[mode]["time_vs_plain"] = row[mode]["step_s"] / row["plain"]["step_s"]
            shown = row[mode]
            extra = f"  {shown['lower_than_plain']:.2f}x lower, {shown['time_vs_plain']:.2f}x the time" if "lower_than_plain" in shown else ""
            print(f"{name:15s} {mode:11s} {shown['units']:3d} units  peak {shown['peak'] / 2**20:7.1f} MiB  step {shown['step_s']:.3f} s{extra}", flush=True)
    _measure.write_json(args.out, vars(args), results)


if __name__ == "__main__":
    main()
