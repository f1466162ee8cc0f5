"""Child process of test_keras3.py's memory test on JAX and PyTorch.

Usage: python _rss_child.py none|ours|model ROWS [BLOCKS]
Builds a deep stack of feed-forward blocks with dropout (`ours`: their `call`
decorated; `model`: undecorated, and `recompute_model` on the model) and runs
one `train_on_batch` on ROWS rows, then prints its peak RSS in MB (`VmHWM`: the
high-water mark of this process's own memory since `exec`; `os.wait4`'s
`ru_maxrss` would report the parent's if the parent is larger). With `MALLOC_MMAP_THRESHOLD_` set low, large buffers go back to
the system when freed, so the peak RSS follows the peak of live tensors; on
a GPU the device allocator's peak is printed instead (the RSS says nothing of
device memory). A run on a few rows (same program, optimizer and compilation, next to no
activations) is the baseline to subtract.
"""

import os
import sys

method, rows = sys.argv[1], int(sys.argv[2])
blocks = int(sys.argv[3]) if len(sys.argv) > 3 else 12
os.environ["RECOMPUTE"] = "0" if method == "none" else "1"

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_recompute import recompute_grad, recompute_model  # noqa: E402


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(512, activation="gelu")
        self.dropout = keras.layers.Dropout(0.1)
        self.down = keras.layers.Dense(64)

    def call(self, inputs, training=None):
        return inputs + self.down(self.dropout(self.up(inputs), training=training))


if method == "ours":
    Block.call = recompute_grad(Block.call)
model = keras.Sequential([keras.Input((64,))] + [Block() for _ in range(blocks)] + [keras.layers.Dense(1)])
if method == "model":
    recompute_model(model)
model.compile(optimizer="sgd", loss="mse")
model.train_on_batch(np.ones((rows, 64), "float32"), np.ones((rows, 1), "float32"))


def device_peak_mb():
    """The accelerator allocator's peak in MB, or None on the CPU (where the RSS is read)."""
    if keras.config.backend() == "torch":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    if keras.config.backend() == "jax":
        import jax

        device = jax.devices()[0]
        return device.memory_stats()["peak_bytes_in_use"] / 2**20 if device.platform != "cpu" else None
    return None


peak = device_peak_mb()
if peak is None:
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
print(peak)
