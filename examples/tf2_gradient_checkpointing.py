"""The tf2-gradient-checkpointing demo: 40,000 elementwise "layers" under a GradientTape.

A plain Python function of 200 elementwise steps, whose arguments include a
string and a bool, is called 200 times in a row under a `tf.GradientTape` in
eager mode: 40,000 layers' activations for the tape to keep. With
`@recompute_grad` on the function, each call keeps only its input, and its
200 steps run again, one call at a time, in the backward pass. Both runs
print their peak tensor memory (TensorFlow's BFC allocator) and the same
gradient.

    python examples/tf2_gradient_checkpointing.py              # 10,000 elements: plain, then recomputed
    python examples/tf2_gradient_checkpointing.py --full-size  # 100,000 elements, recomputed only

At 100,000 elements the plain run would need about 30 GB: `--full-size` never
runs it.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-size", action="store_true", help="100,000 elements, recomputed only")
    return parser.parse_args()


def train():
    import tensorflow as tf

    from keras_recompute import is_enabled, recompute_grad

    elements = 100_000 if _arguments().full_size else 10_000
    weight = tf.Variable(tf.fill([elements], 1.0))

    @recompute_grad
    def steps(x, name, bounded):
        """200 elementwise steps; `name` and `bounded` are plain Python values."""
        for _ in range(200):
            x = tf.tanh(x * weight) if bounded else tf.sin(x * weight)
        return x

    x = tf.linspace(-1.0, 1.0, elements)
    with tf.GradientTape() as tape:
        hidden = x
        for call in range(200):
            hidden = steps(hidden, f"steps-{call}", call % 2 == 0)
        loss = tf.reduce_sum(hidden**2)
    gradient = tape.gradient(loss, weight)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    print(
        f"RECOMPUTE={int(is_enabled())}, {elements} elements: loss {float(loss):.6f}, "
        f"gradient norm {float(tf.norm(gradient)):.6g}, peak {peak:.0f} MB"
    )


if __name__ == "__main__":
    from _off_and_on import OFF_AND_ON, main  # examples/_off_and_on.py: one child per variant

    main(__file__, train, [("RECOMPUTE=1", {"RECOMPUTE": "1"})] if _arguments().full_size else OFF_AND_ON)
