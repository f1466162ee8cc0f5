"""Quickstart: a BERT-shaped encoder whose blocks recompute their activations.

Trains a few steps with `model.fit`, once with `RECOMPUTE=0` and once with
`RECOMPUTE=1`, each in its own process with TensorFlow's BFC allocator, and
prints the loss and the peak tensor memory of each.

    python examples/quickstart.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def train():
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_recompute import is_enabled, recompute_grad

    class EncoderBlock(keras.layers.Layer):
        def __init__(self, hidden=128, heads=4, ffn=512, dropout=0.1, **kwargs):
            super().__init__(**kwargs)
            self.attention = keras.layers.MultiHeadAttention(heads, hidden // heads, dropout=dropout)
            self.attention_norm = keras.layers.LayerNormalization()
            self.intermediate = keras.layers.Dense(ffn, activation="gelu")
            self.output_dense = keras.layers.Dense(hidden)
            self.dropout = keras.layers.Dropout(dropout)
            self.output_norm = keras.layers.LayerNormalization()

        @recompute_grad  # the one line: on when RECOMPUTE=1
        def call(self, inputs, training=None):
            hidden = self.attention_norm(inputs + self.attention(inputs, inputs, training=training))
            output = self.dropout(self.output_dense(self.intermediate(hidden)), training=training)
            return self.output_norm(hidden + output)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((128, 128))
    hidden = inputs
    for _ in range(8):
        hidden = EncoderBlock()(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer="adam", loss="mse")

    x = np.random.normal(size=(64, 128, 128)).astype("float32")
    y = np.random.normal(size=(64, 128, 1)).astype("float32")
    model.fit(x[:16], y[:16], batch_size=16, verbose=0)  # build and trace
    tf.config.experimental.reset_memory_stats("CPU:0")
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    print(f"RECOMPUTE={int(is_enabled())}: loss {history.history['loss'][-1]:.4f}, peak {peak:.0f} MB")
    return peak


if __name__ == "__main__":
    from _off_and_on import main  # examples/_off_and_on.py: RECOMPUTE=0, then 1

    main(__file__, train)
