"""First weight updates of a training step, repeated: what a race with the optimizer changes.

NOTE [ comparing updates, not losses ]
A wrong gradient can hide in a loss: after a step at a small learning rate
the loss moves by the learning rate times the gradient, and a loss compared
at rtol 1e-4 let a `"save_dots"` kernel gradient 0.3 off pass. So these
tests compare what the optimizer wrote: each weight's first update (w1 - w0)
under SGD at lr 1.0, where the update is the gradient itself, against the
plain model's, normwise over the whole model (`_compare`). A gradient that
reads a variable after the optimizer wrote it is wrong only when the
scheduler runs the write first, which it does in a few steps of many (2-5 of
40 on this model under `tf.function`, before the fix): so the same compiled
step runs `TRIALS` times, the weights reset before each, and every trial must
match. Plain runs one trial: it is bitwise the same each time on the CPU.

At a learning rate below 1 the update is rounded where the optimizer stores
`w0 - lr * g` in float32: two gradients a rounding apart can give updates one
unit in the last place of `w` apart (at lr 1e-3 that is ~2e-5 of the update,
in every trial). So each element's difference is first reduced by one
spacing of float32 at the weight's magnitude; what is left is the gradients'
own difference, held to the 1e-5 of `_compare`. A race read at lr 1e-3 was
1e-3 off, two orders above that.

The model is the one the race was found on: Dense 64, two blocks of
MultiHeadAttention (4 heads of 16) + LayerNormalization + Dense 128 gelu +
Dense 64, and a head; with `batch_norm`, a BatchNormalization before the head
(whose moving statistics are weights that `get_weights` returns, so a
statistic moved twice shows as an update twice plain's).
"""

import numpy as np

from _compare import normwise_errors

TRIALS = 80
RATES = (1.0, 1e-3)


def data():
    random = np.random.RandomState(0)
    return random.normal(size=(8, 16, 32)).astype("float32"), random.normal(size=(8, 16, 1)).astype("float32")


def attention_model(K, batch_norm=False, seed=0):
    """The model of the NOTE above, built with `K` (`keras` or `tf_keras`) from a fixed seed."""

    class Block(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = K.layers.MultiHeadAttention(4, 16)
            self.norm = K.layers.LayerNormalization()
            self.up = K.layers.Dense(128, activation="gelu")
            self.down = K.layers.Dense(64)

        def call(self, inputs):
            hidden = self.norm(inputs + self.attention(inputs, inputs))
            return hidden + self.down(self.up(hidden))

    K.utils.set_random_seed(seed)
    inputs = K.Input((16, 32))
    hidden = K.layers.Dense(64)(inputs)
    for _ in range(2):
        hidden = Block()(hidden)
    if batch_norm:
        hidden = K.layers.BatchNormalization()(hidden)
    return K.Model(inputs, K.layers.Dense(1)(hidden))


def repeated_updates(model, step, trials):
    """`(initial weights, [first update] * trials)` of `model` by `step()` (a compiled training step).

    The weights are set back to the initial ones before each trial and after the last.
    """
    initial = [np.array(w) for w in model.get_weights()]
    updates = []
    for _ in range(trials):
        model.set_weights(initial)
        step()
        updates.append([np.array(w, np.float64) - w0 for w, w0 in zip(model.get_weights(), initial)])
    model.set_weights(initial)
    return initial, updates


def worst(updates, reference, initial):
    """`(largest error over the trials, trials above 1e-5)` of `updates` against the plain `reference`.

    The error is normwise (`_compare`), each element's difference less one
    float32 spacing at its weight's magnitude (see the NOTE above).
    """
    errors = []
    for update in updates:
        reduced = []
        for a, e, w0 in zip(update, reference, initial):
            spacing = np.spacing((np.abs(w0) + np.abs(e)).astype(np.float32)).astype(np.float64)
            reduced.append(e + np.sign(a - e) * np.maximum(np.abs(a - e) - spacing, 0.0))
        errors.append(max(normwise_errors(reduced, reference)))
    return max(errors), sum(error > 1e-5 for error in errors)


def loss_scaled_steps(K, recompute=None, steps=12, vocabulary=20):
    """`steps` train_on_batch steps of a `mixed_float16` model whose first loss-scaled steps overflow (NOTE [ a NaN
    gradient ] in `backends/tensorflow`): token ids through an Embedding, three Dense/LayerNorm blocks, a float32
    head, SGD at 1e-4 under dynamic loss scaling (from 2**15, halved at each overflow, each such step skipped).

    `recompute(model)` runs on the model before it compiles. Returns the model, a batch of its ids, its weights
    before and after, and the loss scale after each step.
    """
    random = np.random.RandomState(0)
    ids = random.randint(0, vocabulary, (4 * steps, 16))
    ids[:, 0] = vocabulary - 1  # the id that a wait adding 1 pushed out of the table
    y = 30 * random.normal(size=(4 * steps, 1)).astype("float32")
    K.mixed_precision.set_global_policy("mixed_float16")
    try:
        K.utils.set_random_seed(0)
        inputs = K.Input((16,), dtype="int32")
        h = K.layers.Embedding(vocabulary, 32)(inputs)
        for _ in range(3):
            up = K.layers.Dense(64, activation="relu")(h)
            h = K.layers.LayerNormalization()(K.layers.Add()([h, K.layers.Dense(32)(up)]))
        model = K.Model(inputs, K.layers.Dense(1, dtype="float32")(K.layers.GlobalAveragePooling1D()(h)))
    finally:
        K.mixed_precision.set_global_policy("float32")
    if recompute:
        recompute(model)
    optimizer = K.optimizers.SGD(1e-4)
    if K.__name__ == "tf_keras":  # Keras 3 wraps it itself under mixed_float16
        optimizer = K.mixed_precision.LossScaleOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    initial = [np.asarray(w, "float32") for w in model.get_weights()]
    scales = []
    for step in range(steps):
        model.train_on_batch(ids[4 * step : 4 * step + 4], y[4 * step : 4 * step + 4])
        scale = model.optimizer.dynamic_scale if K.__name__ == "keras" else model.optimizer.loss_scale
        scales.append(float(np.asarray(scale)))
    return model, ids[:4], initial, [np.asarray(w, "float32") for w in model.get_weights()], scales


def assert_loss_scaled_alike(plain, recomputed):
    """The first steps overflowed in both (skipped, the scale halved from 2**15), later ones updated the weights
    (the scale kept), and the recomputed model's weights are the plain one's."""
    _, _, initial, plain_weights, plain_scales = plain
    _, _, _, weights, scales = recomputed
    kept = any(after == before for before, after in zip(scales, scales[1:]))
    assert scales == plain_scales and scales[0] < 2**15 and kept, (scales, plain_scales)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(plain_weights, initial)) > 1e-4
    for a, e in zip(weights, plain_weights):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)
