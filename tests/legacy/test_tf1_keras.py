"""TensorFlow 1.14/1.15 with its own tf.keras, in its graph: recompute against a plain twin.

The twins are built in one graph from the same weights, once with recompute
off and once on (`recompute_scope` at build time: a TF 1.x graph is built
once), and their Dropout layers have seeds, so the twins' dropout ops draw
the same masks step after step and a recompute that drew again would draw
others. Updates are compared as NOTE [ comparing updates, not losses ] in
`tests/_updates.py` says: SGD at lr 1.0, each weight's first update, the same
step repeated with the weights reset.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_recompute import RecomputeError, recompute_grad, recompute_scope

pytestmark = pytest.mark.skipif(not tf.__version__.startswith("1."), reason="TensorFlow 1.x")

keras = tf.keras
K = keras.backend
layers = keras.layers
TRIALS = 10
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

    @recompute_grad
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
        small = keras.initializers.RandomNormal(stddev=0.1, seed=1)
        self.q = layers.Dense(HIDDEN, kernel_initializer=small)
        self.k = layers.Dense(HIDDEN, kernel_initializer=small)
        self.v = layers.Dense(HIDDEN)
        self.supports_masking = True

    @recompute_grad
    def call(self, inputs, mask=None):
        q, k, v = inputs
        scores = tf.matmul(self.q(q), self.k(k), transpose_b=True) / np.sqrt(HIDDEN)
        if mask is not None and mask[1] is not None:
            scores -= (1.0 - tf.cast(mask[1], scores.dtype))[:, None, :] * 1e4
        return tf.matmul(tf.nn.softmax(scores), self.v(v))

    def compute_mask(self, inputs, mask=None):
        return mask[0] if mask else None


def _model(recompute, blocks=3, seq=None, batch_norm=False, attention=False, rate=0.3):
    with recompute_scope(recompute):
        if seq is None:
            inputs = layers.Input((HIDDEN,))
            h = layers.Dense(HIDDEN, kernel_initializer=keras.initializers.glorot_uniform(seed=3))(inputs)
        else:
            inputs = layers.Input((seq,), dtype="int32")
            unit = keras.initializers.RandomNormal(stddev=1.0, seed=2)
            h = layers.Embedding(50, HIDDEN, embeddings_initializer=unit, mask_zero=True)(inputs)
        for index in range(blocks):
            if attention:
                h = SelfAttention()([h, h, h])
            h = Block(rate=rate, batch_norm=batch_norm, seed=index + 1)(h)
        if seq is not None:
            h = layers.GlobalAveragePooling1D()(h)
        return keras.Model(inputs, layers.Dense(1)(h))


def _twins(**options):
    plain = _model(False, **options)
    recomputed = _model(True, **options)
    recomputed.set_weights(plain.get_weights())
    return plain, recomputed


def _data(seq=None, batch=8):
    random = np.random.RandomState(0)
    if seq is None:
        x = random.randn(batch, HIDDEN).astype("float32")
    else:
        x = random.randint(1, 50, size=(batch, seq)).astype("int32")
        x[:, seq - 2 :] = 0  # padding the mask hides
    return x, random.randn(batch, 1).astype("float32")


def _normwise(got, want):
    got = np.concatenate([np.ravel(g) for g in got])
    want = np.concatenate([np.ravel(w) for w in want])
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _first_updates(model, x, y, trials=TRIALS):
    """Each weight's first update under SGD at lr 1.0, `trials` times from the same weights."""
    model.compile(keras.optimizers.SGD(1.0), "mse")
    start = model.get_weights()
    updates = []
    for _ in range(trials):
        model.set_weights(start)
        model.train_on_batch(x, y)
        updates.append([after - before for after, before in zip(model.get_weights(), start)])
    model.set_weights(start)
    return updates


@pytest.fixture(autouse=True)
def _seeded():
    tf.compat.v1.set_random_seed(0)


@pytest.mark.parametrize(
    "options",
    [dict(), dict(batch_norm=True), dict(seq=6, attention=True), dict(rate=0.0)],
    ids=["dropout", "batch_norm", "masked_attention", "no_dropout"],
)
def test_first_updates_equal_plain_in_every_repeat(options):
    """fit's train function: every weight's update (BatchNorm's statistics included) is plain's, in every trial."""
    x, y = _data(options.get("seq"))
    calls = Block.calls
    plain, recomputed = _twins(**options)
    assert Block.calls - calls == 3 + 3, "each block's forward, once per twin"
    want = _first_updates(plain, x, y)
    calls = Block.calls
    got = _first_updates(recomputed, x, y)
    assert Block.calls - calls == 3, "each recomputed block's call is built again for its gradient"
    assert all(np.abs(w).max() > 0 for w in want[0] if w.ndim == 2)  # every kernel moves
    errors = [_normwise(mine, theirs) for mine, theirs in zip(got, want)]
    assert max(errors) <= 1e-6, errors
    if options.get("rate", 0.3):
        assert _normwise(want[1], want[0]) > 1e-3, "each trial draws new masks"
    # The recompute replays the forward's masks: its gradient draws nothing. (A seeded dropout op
    # made again would draw what the forward's did, here; with no seed, another mask.)
    graph = recomputed.output.graph
    in_gradient = [op.type for op in graph.get_operations() if "IdentityN_grad" in op.name]
    assert "MatMul" in in_gradient and not any(kind.startswith("Random") for kind in in_gradient)


@pytest.mark.parametrize("batch_norm", [False, True])
def test_gradients_of_inputs_and_weights_equal_plain_in_both_phases(batch_norm):
    """`K.gradients` in a Session: the inputs' and every weight's, learning phase 1 and 0."""
    x, y = _data()
    plain, recomputed = _twins(batch_norm=batch_norm)
    values = []
    for model in (plain, recomputed):
        loss = K.mean(K.square(model.output - y))
        values.append(K.gradients(loss, [model.input] + model.trainable_weights))
    function = K.function([plain.input, recomputed.input, K.learning_phase()], values[0] + values[1])
    results = {}
    for phase in (1, 0):
        computed = function([x, x, phase])
        want, got = computed[: len(values[0])], computed[len(values[0]) :]
        assert len(got) == 1 + len(recomputed.trainable_weights)
        assert all(np.abs(g).max() > 0 for g in got)
        assert _normwise(got, want) <= 1e-6, phase
        results[phase] = want
    assert _normwise(results[0], results[1]) > 1e-2  # the learning phase changed the gradient


def test_fit_trains_as_plain_over_epochs():
    """`fit` over 8 steps, with momentum, BatchNormalization and dropout: losses and weights as plain."""
    x, y = _data(batch=32)
    plain, recomputed = _twins(batch_norm=True)
    history = {}
    for model in (plain, recomputed):
        model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")
        history[model] = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(history[recomputed], history[plain], rtol=1e-5)
    for got, want in zip(recomputed.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_the_recompute_is_checked():
    """A call that draws other random values in its recompute raises at run time, naming the layer."""

    class Noisy(layers.Layer):
        @recompute_grad
        def call(self, inputs):
            return inputs * tf.random.uniform(tf.shape(inputs))

    with recompute_scope(True):
        inputs = layers.Input((HIDDEN,))
        model = keras.Model(inputs, Noisy(name="noisy")(layers.Dense(HIDDEN)(inputs)))
    gradient = K.function([inputs], K.gradients(K.sum(model.output), model.trainable_weights))
    with pytest.raises(tf.errors.InvalidArgumentError, match="noisy.*differ from its forward"):
        gradient([_data()[0]])
