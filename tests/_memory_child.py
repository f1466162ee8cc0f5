"""Child process of test_memory.py: one training step's peak tensor memory.

Usage: python _memory_child.py FRAMEWORK MODE RECOMPUTE [UNITS]
UNITS: `decorated` (default; each block's `call` is decorated) or `model`
(the blocks are plain, in a functional model given to `recompute_model`).
Prints the BFC allocator's peak in bytes for the second step.
"""

import os
import sys

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import importlib  # noqa: E402

import tensorflow as tf  # noqa: E402

from keras_recompute import recompute_grad, recompute_model  # noqa: E402

framework, mode, recompute = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
units = sys.argv[4] if len(sys.argv) > 4 else "decorated"
os.environ["RECOMPUTE"] = "1" if recompute else "0"
K = importlib.import_module(framework)


class Block(K.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = K.layers.Dense(512, activation="gelu")
        self.down = K.layers.Dense(64)

    def call(self, inputs):
        return inputs + self.down(tf.tanh(self.up(inputs)))


if units == "decorated":
    Block.call = recompute_grad(Block.call)
blocks = [Block() for _ in range(12)]
inputs = K.Input((64,))
hidden = inputs
for block in blocks:
    hidden = block(hidden)
model = K.Model(inputs, hidden)
if units == "model":
    recompute_model(model)
x = tf.random.normal((1024, 64))


def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    weights = model.trainable_weights
    grads = tape.gradient(loss, weights)
    return tf.add_n([tf.reduce_sum(g) for g in grads])


if mode != "eager":
    step = tf.function(step, jit_compile=(mode == "jit"))
step(x).numpy()
tf.config.experimental.reset_memory_stats("CPU:0")
step(x).numpy()
print(tf.config.experimental.get_memory_info("CPU:0")["peak"])
