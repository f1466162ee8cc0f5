"""Check before you train: `keras_recompute.verify` on a keras-hub BERT classifier with LoRA.

`verify` runs your model's own compiled training step twice, plain and with
the blocks recompute would take, from the same weights and seed, and compares
the first update of every weight (the recomputed step repeated, so that a
race would show) with the plain step's own spread from run to run. It prints
a table (each recomputed block's largest difference and its verdict) and the
steps' time and peak; `report.ok` is what a test asserts. Your model, its
weights, optimizer and compile settings are left as they were.

    python examples/verify_model.py                          # policy="full"
    python examples/verify_model.py --policy save_dots
    KERAS_BACKEND=jax python examples/verify_model.py        # any Keras 3 backend

The backbone is built from a config (4 layers of 128, nothing downloaded);
with downloaded weights, use `keras_hub.models.BertBackbone.from_preset(...)`.
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", default="full", choices=("full", "save_dots", "attention_core"))
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args(argv)

    import keras
    import keras_hub
    import numpy as np

    import keras_recompute

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=1000, num_layers=4, num_heads=4, hidden_dim=128, intermediate_dim=512, dropout=0.1,
        max_sequence_length=64,
    )
    backbone.enable_lora(8)  # a frozen backbone with trainable low-rank kernels
    inputs = {name: keras.Input((64,), dtype="int32", name=name) for name in ("token_ids", "segment_ids", "padding_mask")}
    pooled = backbone(inputs)["pooled_output"]
    model = keras.Model(inputs, keras.layers.Dense(2)(pooled))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    rng = np.random.RandomState(0)
    batch = {
        "token_ids": rng.randint(1, 1000, size=(8, 64)).astype("int32"),
        "segment_ids": np.zeros((8, 64), "int32"),
        "padding_mask": np.ones((8, 64), "int32"),
    }
    batch["padding_mask"][::2, 48:] = 0
    labels = rng.randint(0, 2, size=(8,))

    report = keras_recompute.verify(model, batch, labels, policy=args.policy, trials=args.trials)
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
