"""TensorFlow 1.14/1.15 with its own tf.keras, in its graph: recompute against a plain twin.

The twins (`_tf_keras_twins`) are built in one graph from the same weights,
the second one's blocks recomputed, and their Dropout layers have seeds, so the twins' dropout ops draw
the same masks step after step and a recompute that drew again would draw
others. Updates are compared as NOTE [ comparing updates, not losses ] in
`tests/_updates.py` says: SGD at lr 1.0, each weight's first update, the same
step repeated with the weights reset.
"""

import numpy as np
import pytest
import tensorflow as tf

from _tf_keras_twins import HIDDEN, MODEL_LEVEL, Block, data as _data, model_level_call, normwise as _normwise, twins as _twins
from keras_recompute import RecomputeError, recompute_grad, recompute_scope

pytestmark = pytest.mark.skipif(not tf.__version__.startswith("1."), reason="TensorFlow 1.x")

keras = tf.keras
K = keras.backend
layers = keras.layers
TRIALS = 10


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


def test_a_nan_gradient_is_nan_as_plain_and_passes_the_check():
    """NOTE [ a NaN gradient ]: a NaN gradient (a diverged step, an overflowed loss-scaled one) made the recompute's
    inputs NaN, and its check raised "differ from its forward"; the step now runs, its gradients NaN as plain's."""
    x, _ = _data()
    plain, recomputed = _twins()
    scale = K.placeholder(())
    values = []
    for model in (plain, recomputed):
        values.append(K.gradients(K.sum(model.output * scale), model.trainable_weights))
    function = K.function([plain.input, recomputed.input, scale, K.learning_phase()], values[0] + values[1])
    for value in (1.0, float("nan")):
        computed = function([x, x, value, 1])
        want, got = computed[: len(values[0])], computed[len(values[0]) :]
        if value == value:
            assert _normwise(got, want) <= 1e-6
        else:
            assert all(np.isnan(w).all() for w in want) and all(np.isnan(g).all() for g in got)


def test_ragged_and_sparse_arguments_and_outputs_are_recomputed_as_plain():
    """NOTE [ composite tensors ]: a ragged argument and output, a sparse argument, in `tf.gradients`."""

    class Composite(layers.Layer):
        def build(self, input_shape):
            self.kernel = self.add_weight("kernel", shape=(HIDDEN, HIDDEN))
            super(Composite, self).build(input_shape)

        def call(self, inputs):
            ragged, sparse = inputs
            mixed = tf.ragged.map_flat_values(lambda v: tf.tanh(tf.matmul(v, self.kernel)), ragged)
            return mixed, tf.sparse.sparse_dense_matmul(sparse, self.kernel)

    class Recomputed(Composite):
        call = recompute_grad(Composite.call)

    rng = np.random.RandomState(0)
    values = tf.constant(rng.normal(size=(7, HIDDEN)).astype("float32"))
    sparse_values = tf.constant([0.5, -1.5, 2.0])
    ragged = tf.RaggedTensor.from_row_lengths(values, [3, 0, 4])
    sparse = tf.SparseTensor([[0, 1], [2, 0], [2, 3]], sparse_values, [3, HIDDEN])
    gradients, kernels = [], []
    for cls in (Composite, Recomputed):
        layer = cls()
        with recompute_scope(cls is Recomputed):
            mixed, dense = layer((ragged, sparse))
        assert isinstance(mixed, tf.RaggedTensor)
        loss = tf.reduce_sum(tf.sin(mixed.flat_values) * tf.cos(values)) + tf.reduce_sum(tf.square(dense))
        with tf.name_scope(cls.__name__ + "_gradient"):
            gradients.append(tf.gradients(loss, [values, sparse_values, layer.kernel]))
        kernels.append(layer.kernel)
    session = K.get_session()
    session.run(tf.compat.v1.variables_initializer(kernels))
    session.run(kernels[1].assign(kernels[0]))
    want, got = session.run(gradients)
    assert all(g is not None and np.abs(g).max() > 0 for g in got)
    assert _normwise(got, want) <= 1e-6
    gradient = [op for op in session.graph.get_operations() if op.name.startswith("Recomputed_gradient/")]
    recomputing = [op.type for op in gradient if "IdentityN_grad" in op.name]
    # Both outputs come through the recompute: no gradient of the forward's own tanh (held for it).
    assert "SparseTensorDenseMatMul" in recomputing and "TanhGrad" in recomputing, recomputing
    assert "TanhGrad" not in [op.type for op in gradient if "IdentityN_grad" not in op.name]


@pytest.mark.parametrize("what", MODEL_LEVEL)
def test_the_model_level_functions_say_what_to_use(what):
    """As on TF 2.0-2.3's tf.keras (tests/legacy/test_tf_keras.py): each raises `RecomputeError` naming the version
    and what works here."""
    function, plain, arguments = model_level_call(what)
    with pytest.raises(RecomputeError, match=what + r" \(on a tf.keras model\) needs TensorFlow 2.4.*Decorate the blocks' call"):
        function(plain, *arguments)
