"""Child process of test_policy.py: one training step's peak tensor memory, per policy.

Usage: python _policy_memory_child.py FRAMEWORK POLICY
FRAMEWORK: `keras` or `tf_keras`; POLICY: `none` (no recompute), `full`,
`save_dots` or `attention_core`, given to `recompute_model` over a functional
stack of attention blocks. Prints the BFC allocator's peak in bytes for the
second step of a `tf.function`.
"""

import os
import sys

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import importlib  # noqa: E402

import tensorflow as tf  # noqa: E402

from keras_recompute import recompute_model  # noqa: E402

framework, policy = sys.argv[1], sys.argv[2]
K = importlib.import_module(framework)
K.utils.set_random_seed(0)


class Block(K.layers.Layer):
    """Attention (its B x H x S x S scores dominate), add & norm, FFN, add."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = K.layers.MultiHeadAttention(4, 16, dropout=0.1)
        self.norm = K.layers.LayerNormalization()
        self.up = K.layers.Dense(256, activation="gelu")
        self.down = K.layers.Dense(64)

    def call(self, inputs, training=None):
        hidden = self.norm(inputs + self.attention(inputs, inputs, training=training))
        return hidden + self.down(self.up(hidden))


inputs = K.Input((128, 64))
hidden = inputs
for _ in range(8):
    hidden = Block()(hidden)
model = K.Model(inputs, hidden)
if policy != "none":
    recompute_model(model, policy=policy, enabled=True)
x = tf.random.normal((4, 128, 64))


@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x, training=True) ** 2)
    grads = tape.gradient(loss, model.trainable_weights)
    return tf.add_n([tf.reduce_sum(g) for g in grads])


step(x).numpy()
tf.config.experimental.reset_memory_stats("CPU:0")
step(x).numpy()
print(tf.config.experimental.get_memory_info("CPU:0")["peak"])
