"""Fine-tune a keras-hub BERT classifier with recompute, on the CPU, in a few minutes.

One line makes every keras-hub `TransformerEncoder` (so the encoder blocks of
`BertBackbone`, RoBERTa, DistilBERT, ...) recompute with keras_recompute:

    from keras_recompute.integrations import keras_hub as recompute_keras_hub
    recompute_keras_hub.enable()

The backbone is built from a config (6 layers of 256, nothing downloaded) and
fine-tuned on a synthetic task: is the sentence's first word 7 or 8? It trains once
with RECOMPUTE=0 and once with RECOMPUTE=1, each in its own process with
TensorFlow's BFC allocator (Keras 3 on the TensorFlow backend), and prints
accuracy and peak memory. With downloaded weights, use
`keras_hub.models.BertBackbone.from_preset(...)` instead.

    python examples/keras_hub_finetune.py
    python examples/keras_hub_finetune.py --lora 8   # LoRA fine-tuning: a frozen backbone

With `--lora RANK`, keras-hub's `backbone.enable_lora(RANK)` freezes every layer
of the backbone and adds trainable low-rank kernels to the query and value
projections: the frozen encoder blocks still recompute, and their LoRA
kernels (and the head) get the gradients they get without recompute.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def train():
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    from keras_recompute import is_enabled
    from keras_recompute.integrations import keras_hub as recompute_keras_hub

    recompute_keras_hub.enable()  # the one line

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=1000,
        num_layers=6,
        num_heads=4,
        hidden_dim=256,
        intermediate_dim=1024,
        dropout=0.1,
        max_sequence_length=128,
    )
    lora_rank = _arguments().lora
    if lora_rank:
        backbone.enable_lora(lora_rank)  # everything frozen but the LoRA kernels
    pooled = backbone.output["pooled_output"]
    model = keras.Model(backbone.input, keras.layers.Dense(2, activation="softmax")(pooled))
    model.compile(optimizer=keras.optimizers.Adam(3e-4), loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    arguments = _arguments()
    rng = np.random.RandomState(0)
    tokens = rng.randint(10, 1000, size=(arguments.samples, 128))
    labels = rng.randint(0, 2, size=arguments.samples)
    tokens[:, 1] = 7 + labels
    inputs = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens), "padding_mask": np.ones_like(tokens)}
    head = {key: value[:32] for key, value in inputs.items()}
    model.fit(head, labels[:32], batch_size=32, verbose=0)  # build and trace
    tf.config.experimental.reset_memory_stats("CPU:0")
    history = model.fit(inputs, labels, batch_size=32, epochs=arguments.epochs, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    trained = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    print(
        f"RECOMPUTE={int(is_enabled())}: {trained} trained parameters, loss {history.history['loss'][-1]:.4f}, "
        f"accuracy {history.history['accuracy'][-1]:.3f}, peak {peak:.0f} MB"
    )


def _arguments():
    parser = argparse.ArgumentParser(description="Fine-tune a keras-hub BERT classifier, recompute off and on.")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA fine-tuning of that rank")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of training (default 3)")
    parser.add_argument("--samples", type=int, default=512, help="sentences to train on, at least 32 (default 512)")
    return parser.parse_args()


if __name__ == "__main__":
    _arguments()  # --help, and errors, before any child starts
    from _off_and_on import main  # examples/_off_and_on.py: RECOMPUTE=0, then 1

    main(__file__, train)
