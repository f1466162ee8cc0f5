"""Child process of test_memory.py: one training step's peak tensor memory.

Usage: python _memory_child.py FRAMEWORK MODE RECOMPUTE
Prints the BFC allocator's peak in bytes for the second step.
"""

import os
import sys

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import importlib  # noqa: E402

import tensorflow as tf  # noqa: E402

from keras_recompute import recompute_grad  # noqa: E402

framework, mode, recompute = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
os.environ["RECOMPUTE"] = "1" if recompute else "0"
K = importlib.import_module(framework)


class Block(K.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = K.layers.Dense(512, activation="gelu")
        self.down = K.layers.Dense(64)

    @recompute_grad
    def call(self, inputs):
        return inputs + self.down(tf.tanh(self.up(inputs)))


blocks = [Block() for _ in range(12)]
x = tf.random.normal((1024, 64))


def step(x):
    with tf.GradientTape() as tape:
        hidden = x
        for block in blocks:
            hidden = block(hidden)
        loss = tf.reduce_sum(hidden**2)
    weights = [w for block in blocks for w in block.trainable_weights]
    grads = tape.gradient(loss, weights)
    return tf.add_n([tf.reduce_sum(g) for g in grads])


if mode != "eager":
    step = tf.function(step, jit_compile=(mode == "jit"))
step(x).numpy()
tf.config.experimental.reset_memory_stats("CPU:0")
step(x).numpy()
print(tf.config.experimental.get_memory_info("CPU:0")["peak"])
