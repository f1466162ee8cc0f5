"""What `recompute_model(model)` ("auto") saves on a keras-hub ViT with a head: its blocks, against two graph pieces.

keras-hub's ViT keeps its blocks in a list of its encoder layer; until 604aad5 "auto" found no run of
blocks there and cut the graph into two pieces, the whole backbone one of them (NOTE [ blocks held by
a layer ] in `keras_recompute/_model.py`). This runs, each in a fresh process, the plain model's
compiled training step, the step planned by "auto" as before (`--old`: the rule for a layer's list
off) and as now, and prints each step's peak (TensorFlow's BFC allocator on the CPU) and the ratios.

```
python benchmarks/auto_blocks_vit.py --out benchmarks/results/auto_blocks_vit_tensorflow.json
```
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _record  # noqa: E402

CHILD = r"""
import json, os, sys
import numpy as np, keras, keras_hub, tensorflow as tf
import keras_recompute
from keras_recompute import _model
mode, batch = sys.argv[1], int(sys.argv[2])
keras.utils.set_random_seed(0)
backbone = keras_hub.models.ViTBackbone(
    image_shape=(64, 64, 3), patch_size=8, num_layers=6, num_heads=4, hidden_dim=128, mlp_dim=512)
images = keras.Input((64, 64, 3))
model = keras.Model(images, keras.layers.Dense(10)(backbone(images)[:, 0]))
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
if mode == "old":
    _model._longest_run_in_layers = lambda model: []
if mode != "plain":
    keras_recompute.recompute_model(model, enabled=True)
x = np.random.RandomState(0).rand(batch, 64, 64, 3).astype("float32")
y = np.zeros(batch, "int32")
model.train_on_batch(x, y)
tf.config.experimental.reset_memory_stats("CPU:0")
model.train_on_batch(x, y)
units = _model.recomputed_units(model)
print(json.dumps({"units": len(units), "first_units": units[:3],
                  "peak": tf.config.experimental.get_memory_info("CPU:0")["peak"]}))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPU_ALLOCATOR_USE_BFC="1")
    results = {}
    for mode in ("plain", "old", "new"):
        done = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.batch)], env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{mode:5s} units {results[mode]['units']:2d}  peak {results[mode]['peak'] / 2**20:8.1f} MiB", flush=True)
    for mode in ("old", "new"):
        results[mode]["lower_than_plain"] = results["plain"]["peak"] / results[mode]["peak"]
        print(f"{mode}: {results[mode]['lower_than_plain']:.2f}x lower than plain")
    if args.out:
        record = dict(_record.metadata(), backend="tensorflow", arguments=vars(args), results=results)
        with open(args.out, "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
