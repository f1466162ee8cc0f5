"""The tf.keras twins of the legacy tests (TensorFlow 1.14-2.3's own tf.keras): blocks, models, data.

A plain model and a recomputed one built from the same weights; their Dropout
layers have seeds, so both draw the same masks (NOTE in each test file).
"""

import numpy as np
import tensorflow as tf

from keras_recompute import recompute_grad

layers = tf.keras.layers
HIDDEN = 16


class Block(layers.Layer):
    """Dense, Dropout, Dense, a residual; optionally BatchNormalization; counts its calls."""

    calls = 0

    def __init__(self, rate=0.3, batch_norm=False, seed=1, **kwargs):
        super(Block, self).__init__(**kwargs)
        self.inner = layers.Dense(4 * HIDDEN, activation="tanh")
        self.drop = layers.Dropout(rate, seed=seed)
        self.outer = layers.Dense(HIDDEN)
        self.norm = layers.BatchNormalization() if batch_norm else None
        self.supports_masking = True

    def call(self, inputs, training=None, mask=None):
        Block.calls += 1
        h = self.outer(self.drop(self.inner(inputs), training=training))
        if self.norm is not None:
            h = self.norm(h, training=training)
        if mask is not None:
            h *= tf.cast(mask, h.dtype)[..., None]
        return inputs + h


class SelfAttention(layers.Layer):
    """Takes [q, k, v]: the model passes one tensor three times; masks the padded keys."""

    def __init__(self, **kwargs):
        super(SelfAttention, self).__init__(**kwargs)
        small = tf.keras.initializers.RandomNormal(stddev=0.1, seed=1)
        self.q = layers.Dense(HIDDEN, kernel_initializer=small)
        self.k = layers.Dense(HIDDEN, kernel_initializer=small)
        self.v = layers.Dense(HIDDEN)
        self.supports_masking = True

    def call(self, inputs, mask=None):
        q, k, v = inputs
        scores = tf.matmul(self.q(q), self.k(k), transpose_b=True) / np.sqrt(HIDDEN)
        if mask is not None and mask[1] is not None:
            scores -= (1.0 - tf.cast(mask[1], scores.dtype))[:, None, :] * 1e4
        return tf.matmul(tf.nn.softmax(scores), self.v(v))

    def compute_mask(self, inputs, mask=None):
        return mask[0] if mask else None


class RecomputedBlock(Block):
    @recompute_grad(enabled=True)  # whatever RECOMPUTE says
    def call(self, inputs, training=None, mask=None):
        return super(RecomputedBlock, self).call(inputs, training=training, mask=mask)


class RecomputedAttention(SelfAttention):
    @recompute_grad(enabled=True)
    def call(self, inputs, mask=None):
        return super(RecomputedAttention, self).call(inputs, mask=mask)


def model(recompute, blocks=3, seq=None, batch_norm=False, attention=False, rate=0.3):
    """A functional model of `blocks` blocks (and attentions); with `recompute`, theirs recompute."""
    if seq is None:
        inputs = layers.Input((HIDDEN,))
        h = layers.Dense(HIDDEN)(inputs)
    else:
        inputs = layers.Input((seq,), dtype="int32")
        unit = tf.keras.initializers.RandomNormal(stddev=1.0, seed=2)
        h = layers.Embedding(50, HIDDEN, embeddings_initializer=unit, mask_zero=True)(inputs)
    for index in range(blocks):
        if attention:
            h = (RecomputedAttention if recompute else SelfAttention)()([h, h, h])
        h = (RecomputedBlock if recompute else Block)(rate=rate, batch_norm=batch_norm, seed=index + 1)(h)
    if seq is not None:
        h = layers.GlobalAveragePooling1D()(h)
    return tf.keras.Model(inputs, layers.Dense(1)(h))


def twins(**options):
    """Two models of the same weights; the second one's blocks recompute (when recompute is on)."""
    plain = model(False, **options)
    recomputed = model(True, **options)
    recomputed.set_weights(plain.get_weights())
    return plain, recomputed


def data(seq=None, batch=8):
    random = np.random.RandomState(0)
    if seq is None:
        x = random.randn(batch, HIDDEN).astype("float32")
    else:
        x = random.randint(1, 50, size=(batch, seq)).astype("int32")
        x[:, seq - 2 :] = 0  # padding the mask hides
    return x, random.randn(batch, 1).astype("float32")


def normwise(got, want):
    got = np.concatenate([np.ravel(g) for g in got])
    want = np.concatenate([np.ravel(w) for w in want])
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# The functions that plan or check a whole model, which TensorFlow's own tf.keras before 2.4 does not run.
MODEL_LEVEL = ("recompute_model", "memory_report", "largest_fit", "verify")


def model_level_call(what):
    """`(function, model, arguments)`: `what`, one of `MODEL_LEVEL`, with a compiled plain twin and what it takes."""
    import keras_recompute

    plain, _ = twins(blocks=2)
    plain.compile("sgd", "mse")
    x, y = data()
    arguments = {"recompute_model": (), "memory_report": (x,), "largest_fit": ("1GB", lambda n: x[:n]), "verify": (x, y)}
    return getattr(keras_recompute, what), plain, arguments[what]
