"""Fine-tune a bert4keras BERT classifier with recompute, on the CPU, in a few minutes.

bert4keras 0.11.5 runs on TensorFlow 2.21 through tf_keras (TF_KERAS=1,
TF_USE_LEGACY_KERAS=1). One line makes its attention and feed-forward layers
recompute with keras_recompute:

    from keras_recompute.integrations import bert4keras as recompute_bert4keras
    recompute_bert4keras.enable()

The BERT here is built from a config (6 layers of 256, no checkpoint to
download) and fine-tuned on a synthetic task: is the sentence's first word 7 or 8? It
trains once with RECOMPUTE=0 and once with RECOMPUTE=1, each in its own
process with TensorFlow's BFC allocator, and prints accuracy and peak memory.
With a real checkpoint, pass `config_path=` and `checkpoint_path=` to
`build_transformer_model` instead of the sizes.

    python examples/bert4keras_finetune.py
"""

import os

os.environ.update(TF_KERAS="1", TF_USE_LEGACY_KERAS="1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def train():
    import numpy as np
    import tensorflow as tf
    import tf_keras
    from bert4keras.models import build_transformer_model

    from keras_recompute import is_enabled
    from keras_recompute.integrations import bert4keras as recompute_bert4keras

    recompute_bert4keras.enable()  # the one line

    tf_keras.utils.set_random_seed(0)
    bert = build_transformer_model(
        vocab_size=1000,
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=1024,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=256,
    )
    cls = tf_keras.layers.Lambda(lambda x: x[:, 0])(bert.output)
    model = tf_keras.Model(bert.inputs, tf_keras.layers.Dense(2, activation="softmax")(cls))
    model.compile(optimizer=tf_keras.optimizers.Adam(3e-4), loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    rng = np.random.RandomState(0)
    tokens = rng.randint(10, 1000, size=(512, 128))
    labels = rng.randint(0, 2, size=512)
    tokens[:, 1] = 7 + labels
    tokens[:, 0] = 2  # [CLS]
    segments = np.zeros_like(tokens)
    model.fit([tokens[:32], segments[:32]], labels[:32], batch_size=32, verbose=0)  # build and trace
    tf.config.experimental.reset_memory_stats("CPU:0")
    history = model.fit([tokens, segments], labels, batch_size=32, epochs=3, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    print(
        f"RECOMPUTE={int(is_enabled())}: loss {history.history['loss'][-1]:.4f}, "
        f"accuracy {history.history['accuracy'][-1]:.3f}, peak {peak:.0f} MB"
    )


if __name__ == "__main__":
    from _off_and_on import main  # examples/_off_and_on.py: RECOMPUTE=0, then 1

    main(__file__, train)
