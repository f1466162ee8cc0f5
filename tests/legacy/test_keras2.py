"""Standalone Keras 2.3 in its graph (TF 1.14/1.15, or Keras's own on TF 2.0/2.1): recompute against a plain twin.

Each test builds the model twice in one graph from the same weights, once
with recompute off and once on (`recompute_scope` at build time), each from
the same numpy state: Keras 2.3's Dropout (seed None, as users leave it)
draws its op seed from numpy, so both twins draw the same masks in their
forwards, and a recompute that called `K.dropout` again would draw with a
new seed. Any difference is the recompute's. Updates are compared as NOTE [ comparing
updates, not losses ] in `tests/_updates.py` says: SGD at lr 1.0, each
weight's first update, the same step repeated with the weights reset.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
from _tf_keras_twins import data as _data, normwise as _normwise
from keras import backend as K
from keras_recompute import RecomputeError, recompute_grad, recompute_scope

TRIALS = 20
HIDDEN = 16


class Block(keras.layers.Layer):
    """Dense, Dropout, Dense, a residual; optionally BatchNormalization; counts its calls."""

    calls = 0

    def __init__(self, rate=0.3, batch_norm=False, **kwargs):
        super(Block, self).__init__(**kwargs)
        self.inner = keras.layers.Dense(4 * HIDDEN, activation="tanh")
        self.drop = keras.layers.Dropout(rate)
        self.outer = keras.layers.Dense(HIDDEN)
        self.norm = keras.layers.BatchNormalization() if batch_norm else None
        self.supports_masking = True

    @recompute_grad
    def call(self, inputs, training=None):
        Block.calls += 1
        h = self.outer(self.drop(self.inner(inputs), training=training))
        if self.norm is not None:
            h = self.norm(h, training=training)
        output = inputs + h
        # As a Keras 2 layer must, to have the training function feed the learning phase.
        output._uses_learning_phase = getattr(h, "_uses_learning_phase", False)
        return output

    def compute_output_shape(self, input_shape):
        return input_shape


class SelfAttention(keras.layers.Layer):
    """Takes [q, k, v] as bert4keras's attention does: the model passes one tensor three times."""

    def __init__(self, **kwargs):
        super(SelfAttention, self).__init__(**kwargs)
        small = keras.initializers.RandomNormal(stddev=0.1, seed=1)  # scores that do not saturate
        self.q = keras.layers.Dense(HIDDEN, kernel_initializer=small)
        self.k = keras.layers.Dense(HIDDEN, kernel_initializer=small)
        self.v = keras.layers.Dense(HIDDEN)

    @recompute_grad
    def call(self, inputs, mask=None):
        q, k, v = inputs
        scores = K.batch_dot(self.q(q), self.k(k), axes=[2, 2]) / np.sqrt(HIDDEN)
        if mask is not None and mask[1] is not None:
            scores -= (1.0 - K.cast(mask[1], K.floatx()))[:, None, :] * 1e4
        return K.batch_dot(K.softmax(scores), self.v(v))

    def compute_mask(self, inputs, mask=None):
        return mask[0] if mask else None

    def compute_output_shape(self, input_shape):
        return input_shape[0]


def _model(recompute, blocks=3, seq=None, batch_norm=False, attention=False, rate=0.3):
    """A model built with recompute on or off, from numpy's state 0 (the Dropout seeds)."""
    np.random.seed(0)
    with recompute_scope(recompute):
        if seq is None:
            inputs = keras.layers.Input((HIDDEN,))
            h = keras.layers.Dense(HIDDEN)(inputs)
        else:
            inputs = keras.layers.Input((seq,), dtype="int32")
            unit = keras.initializers.RandomNormal(stddev=1.0, seed=2)
            h = keras.layers.Embedding(50, HIDDEN, embeddings_initializer=unit, mask_zero=True)(inputs)
        for index in range(blocks):
            if attention:
                h = SelfAttention()([h, h, h])
            h = Block(rate=rate, batch_norm=batch_norm)(h)
        if seq is not None:
            h = keras.layers.GlobalAveragePooling1D()(h)
        return keras.models.Model(inputs, keras.layers.Dense(1)(h))


def _twins(**options):
    plain = _model(False, **options)
    recomputed = _model(True, **options)
    recomputed.set_weights(plain.get_weights())
    return plain, recomputed


def _registered_updates(layer):
    """How many updates the layers under `layer` registered (`model.updates` leaves out a block's own)."""
    return len(layer._updates) + sum(_registered_updates(child) for child in getattr(layer, "_layers", []))


def _first_updates(model, x, y, trials):
    """Each weight's first update under SGD at lr 1.0, `trials` times from the same weights."""
    model.compile(keras.optimizers.SGD(lr=1.0), "mse")
    start = model.get_weights()
    updates = []
    for _ in range(trials):
        model.set_weights(start)
        model.train_on_batch(x, y)
        updates.append([after - before for after, before in zip(model.get_weights(), start)])
    model.set_weights(start)
    return updates


@pytest.mark.parametrize(
    "options",
    [dict(), dict(batch_norm=True), dict(seq=6, attention=True), dict(rate=0.0)],
    ids=["dropout", "batch_norm", "masked_attention", "no_dropout"],
)
def test_first_updates_equal_plain_in_every_repeat(options):
    """fit's train function: every weight's update (BatchNorm's statistics included) is plain's, in every trial."""
    x, y = _data(options.get("seq"))
    plain, recomputed = _twins(**options)
    calls = Block.calls
    want = _first_updates(plain, x, y, TRIALS)
    assert Block.calls == calls, "the plain gradient calls no block again"
    got = _first_updates(recomputed, x, y, TRIALS)
    assert Block.calls - calls == 3, "each recomputed block's call is built again for its gradient"
    assert _registered_updates(recomputed) == _registered_updates(plain)  # the recompute registered none
    assert all(np.abs(w).max() > 0 for w in want[0] if w.ndim == 2)  # every kernel moves
    # Trial k draws the k-th masks of each twin's dropout ops: the same seeds, so the same masks.
    errors = [_normwise(mine, theirs) for mine, theirs in zip(got, want)]
    assert max(errors) <= 1e-6, errors
    if options.get("rate", 0.3):
        assert _normwise(want[1], want[0]) > 1e-3, "each trial draws new masks"


@pytest.mark.parametrize("batch_norm", [False, True])
def test_gradients_of_inputs_and_weights_equal_plain_in_both_phases(batch_norm):
    """`K.gradients` through `K.function` (the Session on TF 1.x): the inputs' and every weight's.

    In the training phase dropout is on; in the test phase BatchNormalization
    reads its weights inside the learning phase's cond (on TF 2.x a cond v2).
    """
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


@pytest.mark.skipif(tf.__version__.startswith("2."), reason="Keras 2.3's own graph on TF 2.x runs its updates in fit")
def test_a_custom_k_function_update_trains_as_plain():
    """The Keras 2 idiom on TF 1.x: `K.function(..., updates=optimizer.get_updates(...) + model.updates)`, run thrice.

    `model.updates` lists every update a layer registered, BatchNormalization's
    included: one its recompute registered would move the statistics twice.
    """
    x, y = _data()
    plain, recomputed = _twins(batch_norm=True)
    losses = {}
    for model in (plain, recomputed):
        target = K.placeholder((None, 1))
        loss = K.mean(K.square(model.output - target))
        updates = keras.optimizers.SGD(lr=0.5).get_updates(loss, model.trainable_weights) + model.updates
        step = K.function([model.input, target, K.learning_phase()], [loss], updates=updates)
        losses[model] = [step([x, y, 1])[0] for _ in range(3)]
    np.testing.assert_allclose(losses[recomputed], losses[plain], rtol=1e-6)
    for got, want in zip(recomputed.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_fit_trains_as_plain_over_epochs():
    """`fit` over 8 steps, with momentum, BatchNormalization and dropout: losses and weights as plain.

    (Not Adam: two plain twins of this model trained with Keras 2.3's Adam
    already part after a step, on TF 1.15 and 2.1 alike.)
    """
    x, y = _data(batch=32)
    plain, recomputed = _twins(batch_norm=True)
    history = {}
    for model in (plain, recomputed):
        model.compile(keras.optimizers.SGD(lr=0.01, momentum=0.9), "mse")
        history[model] = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(history[recomputed], history[plain], rtol=1e-5)
    for got, want in zip(recomputed.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_the_recompute_is_checked():
    """A call that computes another function the second time raises, naming the layer."""

    class Drifting(keras.layers.Layer):
        def build(self, input_shape):
            self.kernel = self.add_weight("kernel", (HIDDEN, HIDDEN), initializer="glorot_uniform")
            self.count = 0

        @recompute_grad
        def call(self, inputs):
            self.count += 1
            return K.dot(inputs, self.kernel) * float(self.count)

    with recompute_scope(True):
        inputs = keras.layers.Input((HIDDEN,))
        model = keras.models.Model(inputs, Drifting(name="drifting")(inputs))
    gradient = K.function([inputs], K.gradients(K.sum(model.output), model.trainable_weights))
    with pytest.raises(tf.errors.InvalidArgumentError, match="drifting.*differ from its forward"):
        gradient([_data()[0]])


@pytest.mark.parametrize(
    "what, match",
    [
        ("save_dots", 'policy="save_dots".*needs TensorFlow 2.4.*Use policy="full"'),
        ("tape", "under a tf.GradientTape needs TensorFlow 2.4.*tf.gradients"),
        ("recompute_model", "recompute_model takes a Keras 3 or tf_keras model.*decorate the blocks' call"),
        ("memory_report", "memory_report takes a Keras 3 or tf_keras model"),
        ("verify", "verify takes a Keras 3 or tf_keras model"),
    ],
)
def test_what_cannot_work_here_says_what_to_use(what, match):
    if what == "tape" and not tf.__version__.startswith("2."):
        pytest.skip("a GradientTape in a graph is a TF 2 idiom")
    if what in ("recompute_model", "memory_report", "verify"):
        import keras_recompute

        model, _ = _twins(blocks=1)
        with pytest.raises(RecomputeError, match=match):
            getattr(keras_recompute, what)(model, _data()[0])
        return

    class Plain(keras.layers.Dense):
        @recompute_grad(policy="save_dots" if what == "save_dots" else "full")
        def call(self, inputs):
            return super(Plain, self).call(inputs)

    with recompute_scope(True), pytest.raises(RecomputeError, match=match):
        inputs = keras.layers.Input((HIDDEN,))
        if what == "tape":
            with tf.GradientTape():
                Plain(4)(inputs)
        else:
            Plain(4)(inputs)


def test_the_recompute_reads_no_trained_weight_again():
    """NOTE [ a recompute reads what its forward read ]: the gradient reads no trained variable itself.

    A read in the backward could come after the optimizer's write of the same
    variable; the recompute takes the forward's reads instead. Counted in the
    graph: the ops our gradient built that read a trained variable.
    """
    x, y = _data()
    _, recomputed = _twins(batch_norm=True)
    recomputed.compile(keras.optimizers.SGD(lr=1.0), "mse")
    recomputed.train_on_batch(x, y)  # builds the training function and its gradient
    graph = recomputed.output.graph
    if tf.executing_eagerly():  # Keras 2.3's graph on TF 2.x reads its variables' handles as captures
        captured = {id(external): internal for external, internal in graph.captures}
        handles = {id(captured[id(weight.handle)].op) for weight in recomputed.trainable_weights}
    else:
        handles = {id(weight.handle.op) for weight in recomputed.trainable_weights}
    gradient_reads = [
        op.name
        for op in graph.get_operations()
        if op.type == "ReadVariableOp" and "IdentityN_grad" in op.name and id(op.inputs[0].op) in handles
    ]
    recompute_ops = [op for op in graph.get_operations() if "IdentityN_grad" in op.name and op.type == "MatMul"]
    assert recompute_ops, "the gradient recomputes the blocks' matmuls"
    assert gradient_reads == []


class Outer(keras.layers.Layer):
    """Two recomputed blocks inside a recomputed layer: the inner recomputes run inside the outer's."""

    def __init__(self, **kwargs):
        super(Outer, self).__init__(**kwargs)
        self.first = Block()
        self.second = Block(batch_norm=True)

    @recompute_grad
    def call(self, inputs, training=None):
        return self.second(self.first(inputs, training=training), training=training)

    def compute_output_shape(self, input_shape):
        return input_shape


def test_nested_recomputes_update_as_plain(monkeypatch):
    """Each weight's first update in 5 repeated steps, dropout on: within 1e-6 of plain (bitwise on TF 1.x).

    `RECOMPUTE=1` for the whole test: the gradient (the outer's recompute and
    the inner blocks in it) is built at the first step, outside the scope the
    model was built in. The plain twin is built with the scope off.
    """
    monkeypatch.setenv("RECOMPUTE", "1")

    def build(recompute):
        np.random.seed(0)
        with recompute_scope(recompute):
            inputs = keras.layers.Input((HIDDEN,))
            outer = Outer()(keras.layers.Dense(HIDDEN)(inputs))
            return keras.models.Model(inputs, keras.layers.Dense(1)(outer))

    plain, recomputed = build(False), build(True)
    recomputed.set_weights(plain.get_weights())
    x, y = _data()
    calls = Block.calls
    want = _first_updates(plain, x, y, 5)
    got = _first_updates(recomputed, x, y, 5)
    # Each block again for the outer's recompute, and again for its own inside it.
    assert Block.calls - calls == 4
    errors = [_normwise(mine, theirs) for mine, theirs in zip(got, want)]
    assert max(errors) <= 1e-6, errors
    assert _normwise(want[1], want[0]) > 1e-3


def test_dropout_replays_once_beside_tf_keras_recompute():
    """tf.keras's recompute wraps `tf.nn.dropout` (which `K.dropout` calls) for its own calls only.

    With its wrapper installed (a tf.keras layer recomputed in the same
    process), a standalone Keras layer's dropout draws and replays its mask
    once, as before.
    """
    from keras_recompute.backends import _tf_keras_builtin

    _tf_keras_builtin._install()
    x, y = _data()
    plain, recomputed = _twins()
    want = _first_updates(plain, x, y, 3)
    got = _first_updates(recomputed, x, y, 3)
    assert max(_normwise(mine, theirs) for mine, theirs in zip(got, want)) <= 1e-6
