"""TensorFlow 2.0-2.3 with its own tf.keras: eager, `tf.function` and `fit` against a plain twin.

The twins are built from the same weights, with recompute off and on, and
their Dropout layers have seeds: each step runs after `tf.random.set_seed(0)`
(eager), or in a function of its own whose dropout ops start from the same
seeds (`tf.function`, `fit`), so both twins draw the same masks in their
forwards and a recompute that drew again would draw others. Updates are
compared as NOTE [ comparing updates, not losses ] in `tests/_updates.py`
says: SGD at lr 1.0, each weight's first update, the step repeated.
"""

import numpy as np
import pytest
import tensorflow as tf

from _tf_keras_twins import HIDDEN, MODEL_LEVEL, Block, data as _data, model_level_call, normwise as _normwise, twins
from keras_recompute import RecomputeError, recompute_grad, recompute_scope

pytestmark = pytest.mark.skipif(not tf.__version__.startswith(("2.0", "2.1", "2.2", "2.3")), reason="TF 2.0-2.3")

layers = tf.keras.layers
TRIALS = 10


def _twins(**options):
    tf.random.set_seed(0)  # the same initial weights for each test
    return twins(**options)


def _gradients(model, x, y, training=True):
    """The gradients of the input (a float one) and of every trainable weight."""
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        if x.dtype.is_floating:
            tape.watch(x)
        output = tf.cast(model(x, training=training), tf.float32)
        loss = tf.reduce_mean(tf.square(output - y))
    sources = ([x] if x.dtype.is_floating else []) + model.trainable_weights
    return [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, sources)]


def _first_updates(model, x, y, how, trials=TRIALS):
    """Each weight's first update under SGD at lr 1.0, `trials` times from the same weights."""
    optimizer = tf.keras.optimizers.SGD(1.0)
    start = model.get_weights()
    if how == "fit":
        model.compile(optimizer, "mse")

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_weights), model.trainable_weights))

    function = tf.function(step)
    updates = []
    for _ in range(trials):
        model.set_weights(start)
        if how == "eager":
            tf.random.set_seed(0)
            step()
        elif how == "function":
            function()
        else:
            model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        updates.append([after - before for after, before in zip(model.get_weights(), start)])
    model.set_weights(start)
    return updates


CASES = [dict(), dict(batch_norm=True), dict(seq=6, attention=True), dict(rate=0.0)]
CASE_IDS = ["dropout", "batch_norm", "masked_attention", "no_dropout"]


@pytest.mark.parametrize("how", ["eager", "function", "fit"])
@pytest.mark.parametrize("options", CASES, ids=CASE_IDS)
def test_first_updates_equal_plain_in_every_repeat(options, how):
    """Every weight's update (BatchNorm's statistics included) is plain's, in every repeat."""
    x, y = _data(options.get("seq"))
    plain, recomputed = _twins(**options)
    calls = Block.calls
    want = _first_updates(plain, x, y, how)
    plain_calls, calls = Block.calls - calls, Block.calls
    got = _first_updates(recomputed, x, y, how)
    # Eagerly each step calls each block, traced each trace does: the recompute calls it again.
    assert Block.calls - calls == 2 * plain_calls > 0, "each block's forward, then its recompute"
    assert all(np.abs(w).max() > 0 for w in want[0] if w.ndim == 2)  # every kernel moves
    errors = [_normwise(mine, theirs) for mine, theirs in zip(got, want)]
    assert max(errors) <= 1e-6, errors
    if options.get("rate", 0.3) and how != "eager":
        assert _normwise(want[1], want[0]) > 1e-3, "each repeat draws new masks"


@pytest.mark.parametrize("options", [dict(), dict(batch_norm=True)], ids=["dropout", "batch_norm"])
def test_gradients_of_inputs_and_weights_equal_plain_training_or_not(options):
    x, y = _data()
    plain, recomputed = _twins(**options)
    for training in (True, False):
        tf.random.set_seed(0)
        want = _gradients(plain, x, y, training)
        tf.random.set_seed(0)
        got = _gradients(recomputed, x, y, training)
        assert len(got) == 1 + len(recomputed.trainable_weights)
        assert all(np.abs(g).max() > 0 for g in got)
        assert _normwise(got, want) <= 1e-6, training


def test_batch_norm_statistics_move_once():
    x, y = _data()
    plain, recomputed = _twins(batch_norm=True)
    for model in (plain, recomputed):
        tf.random.set_seed(0)
        _gradients(model, x, y)
    for got, want in zip(recomputed.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(got, want)
    assert all(np.abs(w.numpy()).max() > 0 for w in plain.non_trainable_weights)  # the statistics moved


class ReadsItsState(layers.Layer):
    """Reads a state variable, assigns it, and reads it again (an EMA codebook)."""

    def build(self, input_shape):
        self.dense = layers.Dense(HIDDEN)
        self.average = self.add_weight(name="average", shape=(HIDDEN,), initializer="ones", trainable=False)

    def call(self, inputs):
        hidden = tf.tanh(self.dense(inputs))
        before = hidden + self.average  # the forward's state, before the call assigns it
        self.average.assign(0.5 * self.average + 0.5 * tf.reduce_mean(hidden, axis=0))
        return before + hidden * hidden * self.average  # what it just assigned


class RecomputedReadsItsState(ReadsItsState):
    call = recompute_grad(ReadsItsState.call)


@pytest.mark.parametrize("how", ["eager", "function"])
def test_a_call_that_reads_the_state_it_assigns(how):
    """NOTE [ tf.keras state before TensorFlow 2.4 ]: the recompute reads what the forward read (before: the state
    after the forward, another function)."""
    x, y = _data()
    models = []
    for cls in (ReadsItsState, RecomputedReadsItsState):
        tf.random.set_seed(0)
        inputs = tf.keras.Input((HIDDEN,))
        models.append(tf.keras.Model(inputs, layers.Dense(1)(cls()(inputs))))
    plain, recomputed = models
    recomputed.set_weights(plain.get_weights())
    want = _first_updates(plain, x, y, how, trials=2)
    with recompute_scope(True):
        got = _first_updates(recomputed, x, y, how, trials=2)
    assert all(np.abs(w).max() > 0 for w in want[0])  # every weight moves, the state too
    assert max(_normwise(mine, theirs) for mine, theirs in zip(got, want)) <= 1e-6


def test_a_frozen_block_and_a_frozen_kernel_train_as_plain():
    x, y = _data()
    plain, recomputed = _twins()
    for model in (plain, recomputed):
        model.layers[2].trainable = False  # the first block
        model.layers[3].inner.trainable = False  # the second block's first Dense
    want = _first_updates(plain, x, y, "function", trials=2)
    got = _first_updates(recomputed, x, y, "function", trials=2)
    assert max(_normwise(mine, theirs) for mine, theirs in zip(got, want)) <= 1e-6
    frozen = {id(w) for w in plain.layers[2].weights + plain.layers[3].inner.weights}
    assert all(not np.any(u) for u, w in zip(want[0], plain.weights) if id(w) in frozen)


def test_mixed_float16_gradients_equal_plain():
    from tensorflow.keras.mixed_precision import experimental as mixed_precision

    mixed_precision.set_policy("mixed_float16")
    try:
        x, y = _data()
        plain, recomputed = _twins()
        tf.random.set_seed(0)
        want = _gradients(plain, x, y)
        tf.random.set_seed(0)
        got = _gradients(recomputed, x, y)
    finally:
        mixed_precision.set_policy("float32")
    assert recomputed.layers[2].inner.kernel.dtype == tf.float32  # float32 weights, read in float16
    assert _normwise(got, want) == 0.0


def test_the_recompute_is_checked():
    """A call that draws other random values in its recompute raises, naming the layer."""

    class Noisy(layers.Layer):
        @recompute_grad(enabled=True)
        def call(self, inputs):
            return inputs * tf.random.uniform(tf.shape(inputs))

    model = tf.keras.Sequential([layers.Dense(HIDDEN, input_shape=(HIDDEN,)), Noisy(name="noisy")])
    with pytest.raises(RecomputeError, match="noisy.*differ from its forward"):
        _gradients(model, *_data())


def test_a_trained_variable_the_layer_does_not_track_is_refused_eagerly():
    """Eager ops read variables where no hook sees them: one the call closes over would get no gradient."""
    hidden = tf.Variable(tf.ones((HIDDEN, HIDDEN)), name="closed_over")

    class Closing(layers.Layer):
        @recompute_grad(enabled=True)
        def call(self, inputs):
            return tf.matmul(inputs, hidden)

    model = tf.keras.Sequential([layers.Dense(HIDDEN, input_shape=(HIDDEN,)), Closing(name="closing")])
    x, y = _data()
    with pytest.raises(RecomputeError, match="closing.*'closed_over:0'.*Track the variable on the layer"):
        _gradients(model, x, y)
    # In a tf.function the read hook sees it: its gradient is plain's.
    plain = tf.keras.Sequential([model.layers[0], layers.Lambda(lambda h: tf.matmul(h, hidden))])

    def gradients(model):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        return tape.gradient(loss, [hidden] + model.trainable_weights)

    want = tf.function(lambda: gradients(plain))()
    got = tf.function(lambda: gradients(model))()
    assert _normwise([g.numpy() for g in got], [g.numpy() for g in want]) <= 1e-6


def test_save_dots_names_what_to_use():
    class Dots(layers.Dense):
        @recompute_grad(policy="save_dots", enabled=True)
        def call(self, inputs):
            return super(Dots, self).call(inputs)

    with pytest.raises(RecomputeError, match='policy="save_dots".*needs TensorFlow 2.4.*Use policy="full"'):
        tf.keras.Sequential([Dots(4)])(np.ones((2, 3), "float32"))


def test_off_it_is_the_plain_layer():
    class Switched(Block):
        @recompute_grad
        def call(self, inputs, training=None, mask=None):
            return super(Switched, self).call(inputs, training=training, mask=mask)

    model = tf.keras.Sequential([Switched(input_shape=(HIDDEN,))])
    x, y = _data()
    for recompute, calls in ((False, 1), (True, 2)):
        before = Block.calls
        with recompute_scope(recompute):
            _gradients(model, x, y)
        assert Block.calls - before == calls, recompute


@pytest.mark.parametrize("how", ["eager", "function"])
def test_a_tensor_the_call_reads_as_an_attribute_gets_its_gradient(how):
    """NOTE [ tensors a call closes over ]: a tensor set on the layer before its call, made from a variable (on
    TensorFlow 2.0, which has no op callbacks: NOTE [ tensors closed over without op callbacks ])."""

    class Scaled(layers.Layer):
        calls = 0

        def __init__(self, **kwargs):
            super(Scaled, self).__init__(**kwargs)
            self.dense = layers.Dense(HIDDEN)

        def call(self, inputs):
            Scaled.calls += 1
            return tf.tanh(self.dense(inputs) * self.scale)

    class Recomputed(Scaled):
        call = recompute_grad(Scaled.call)

    x = tf.convert_to_tensor(_data()[0])
    scale = tf.Variable(np.linspace(0.5, 1.5, HIDDEN).astype("float32"))

    def gradients(layer):
        with tf.GradientTape() as tape:
            tape.watch(x)
            layer.scale = scale * 2.0
            loss = tf.reduce_sum(tf.sin(layer(x)))
        return tape.gradient(loss, [scale, x] + layer.trainable_weights)

    plain, recomputed = Scaled(), Recomputed()
    plain.scale = recomputed.scale = scale
    plain(x), recomputed(x)
    recomputed.set_weights(plain.get_weights())
    run = (lambda f: f) if how == "eager" else tf.function
    want = run(lambda: gradients(plain))()
    calls = Scaled.calls
    with recompute_scope(True):
        got = run(lambda: gradients(recomputed))()
    assert got[0] is not None, "the gradient of the tensor the call read was lost"
    assert _normwise([g.numpy() for g in got], [g.numpy() for g in want]) <= 1e-6
    assert Scaled.calls - calls == 2, "the forward and its recompute"


@pytest.mark.parametrize("how", ["eager", "function"])
def test_a_tensor_a_decorated_function_closes_over_gets_its_gradient(how):
    """NOTE [ tensors closed over without op callbacks ]: a tensor made from a trained variable, closed over by a
    decorated function; its gradient is the plain function's, and the function runs twice."""
    x = tf.convert_to_tensor(_data()[0])
    scale = tf.Variable(np.linspace(0.5, 1.5, HIDDEN).astype("float32"))
    kernel = tf.constant(np.random.RandomState(0).standard_normal((HIDDEN, HIDDEN)).astype("float32") / 4)
    calls = []

    def gradients(decorate):
        with tf.GradientTape() as tape:
            tape.watch(x)
            shift = scale * 2.0  # made under the tape, read by the function without being passed

            def block(h):
                calls.append(1)
                return tf.tanh(tf.matmul(h, kernel) + shift)

            loss = tf.reduce_sum(tf.sin((recompute_grad(block) if decorate else block)(x)))
        return tape.gradient(loss, [scale, x])

    run = (lambda f: f) if how == "eager" else tf.function
    want = run(lambda: gradients(False))()
    before = len(calls)
    with recompute_scope(True):
        got = run(lambda: gradients(True))()
    assert got[0] is not None, "the gradient of the tensor the function closed over was lost"
    assert _normwise([g.numpy() for g in got], [g.numpy() for g in want]) <= 1e-6
    assert len(calls) - before == 2, "the forward and its recompute"


# Read by `_global_block` as a global (a training script's module-level tensor): set in each test's tape, by
# `_set_shift` (TensorFlow 2.0's autograph runs a nested function's `global` statement in a copy of its globals).
_SHIFT = None


def _set_shift(value):
    global _SHIFT
    _SHIFT = value


def _global_block(h):
    _global_block.calls += 1
    return tf.tanh(h * 0.5 + _SHIFT)


_global_block.calls = 0


@pytest.mark.parametrize("how", ["eager", "function"])
@pytest.mark.parametrize("where", ["global", "list attribute"])
def test_a_tensor_read_as_a_global_or_from_a_list_attribute_gets_its_gradient(where, how):
    """NOTE [ tensors closed over without op callbacks ]: a tensor made from a trained variable under the tape,
    read by a decorated function as a global of its module, or by a layer's call from a list set on the layer
    (Keras tracks it as its own list); its gradient is the plain one's, and the forward runs twice."""

    class Listed(layers.Layer):
        def call(self, inputs):
            Listed.calls += 1
            return tf.tanh(inputs * 0.5 + self.shifts[0])

    Listed.calls = 0

    class Recomputed(Listed):
        call = recompute_grad(Listed.call)

    x = tf.convert_to_tensor(_data()[0])
    scale = tf.Variable(np.linspace(0.5, 1.5, HIDDEN).astype("float32"))
    plain, recomputed = Listed(), Recomputed()

    def gradients(decorate):
        with tf.GradientTape() as tape:
            tape.watch(x)
            shift = scale * 2.0
            if where == "global":
                _set_shift(shift)
                outputs = (recompute_grad(_global_block) if decorate else _global_block)(x)
            else:
                layer = recomputed if decorate else plain
                layer.shifts = [shift]
                outputs = layer(x)
            loss = tf.reduce_sum(tf.sin(outputs))
        return tape.gradient(loss, [scale, x])

    run = (lambda f: f) if how == "eager" else tf.function
    want = run(lambda: gradients(False))()
    counter = _global_block if where == "global" else Listed
    before = counter.calls
    with recompute_scope(True):
        got = run(lambda: gradients(True))()
    assert got[0] is not None, "the gradient of the tensor the call read was lost"
    assert _normwise([g.numpy() for g in got], [g.numpy() for g in want]) <= 1e-6
    assert counter.calls - before == 2, "the forward and its recompute"


@pytest.mark.parametrize("what", MODEL_LEVEL)
def test_the_model_level_functions_say_what_to_use(what):
    """On TensorFlow's own tf.keras before 2.4 the functions that plan or check a whole model do not run: each
    raises `RecomputeError` naming the version and what works there (decorating the blocks' call). On TensorFlow
    2.0 and 2.1 they raised an `AttributeError` from deep inside until 2026-12-05."""
    function, plain, arguments = model_level_call(what)
    with pytest.raises(RecomputeError, match=what + r" \(on a tf.keras model\) needs TensorFlow 2.4.*Decorate the blocks' call"):
        function(plain, *arguments)
