"""What `recompute_model(model)` ("auto") saves on keras-hub models with a head: its rule now against before.

`--model vit` (the default): keras-hub's ViT keeps its blocks in a list of its encoder layer; until
604aad5 "auto" found no run of blocks there and cut the graph into two pieces, the whole backbone one
of them (NOTE [ blocks held by a layer ] in `keras_recompute/_model.py`). `--model t5gemma`: an
encoder-decoder (T5Gemma, 4 + 4 blocks); until this script's T5Gemma record "auto" took the longest
run of blocks only, the decoder's, and left the encoder plain (NOTE [ every run of blocks ]). This
runs, each in a fresh process, the plain model's compiled training step, the step planned by "auto"
as before ("old": the graph's pieces for the ViT, the decoder's blocks for T5Gemma) and as now, and
prints each step's peak (TensorFlow's BFC allocator on the CPU) and the ratios.

```
python benchmarks/auto_blocks_vit.py --out benchmarks/results/auto_blocks_vit_tensorflow.json
python benchmarks/auto_blocks_vit.py --model t5gemma --batch 16 --out benchmarks/results/auto_blocks_t5gemma_tensorflow.json
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
name, mode, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
keras.utils.set_random_seed(0)
if name == "vit":
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(64, 64, 3), patch_size=8, num_layers=6, num_heads=4, hidden_dim=128, mlp_dim=512)
    images = keras.Input((64, 64, 3))
    model = keras.Model(images, keras.layers.Dense(10)(backbone(images)[:, 0]))
    x = np.random.RandomState(0).rand(batch, 64, 64, 3).astype("float32")
    old = dict(blocks=None)  # no run found: "auto" cut the graph into pieces
else:
    side = dict(hidden_dim=128, intermediate_dim=512, num_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, layer_types=["full_attention"] * 4)
    backbone = keras_hub.models.T5GemmaBackbone(
        vocabulary_size=1000, dropout_rate=0.1, attention_dropout=0.1, rms_norm_eps=1e-6, tie_word_embeddings=True,
        query_pre_attn_scalar=1.0, attention_bias=False, hidden_activation="gelu_approximate", sliding_window=128,
        cross_attention_hidden_size=128, attn_logit_softcapping=50.0, rope_max_wavelength=10000.0,
        **{f"{part}_{key}": value for part in ("encoder", "decoder") for key, value in side.items()})
    inputs = {key: keras.Input((128,), dtype="int32", name=key) for key in backbone.input}
    model = keras.Model(inputs, keras.layers.Dense(10)(backbone(inputs)["decoder_sequence_output"][:, 0]))
    ids = np.random.RandomState(0).randint(1, 1000, size=(batch, 128)).astype("int32")
    x = {key: (ids if "token" in key else np.ones_like(ids)) for key in backbone.input}
    old = dict(blocks=lambda layer: layer.name.startswith("decoder_layer_"))  # the longest run, the first found
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
if mode == "old" and old["blocks"] is None:
    _model._auto_blocks = lambda model, framework: None
if mode == "old" and old["blocks"] is not None:
    keras_recompute.recompute_model(model, blocks=old["blocks"], enabled=True)
elif mode != "plain":
    keras_recompute.recompute_model(model, enabled=True)
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
    parser.add_argument("--model", choices=["vit", "t5gemma"], default="vit")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPU_ALLOCATOR_USE_BFC="1")
    results = {}
    for mode in ("plain", "old", "new"):
        done = subprocess.run([sys.executable, "-c", CHILD, args.model, mode, str(args.batch)], env=env, capture_output=True, text=True)
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
