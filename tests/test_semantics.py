"""Exact semantics under recompute (TF path): random draws, state updates,
mixed precision, the recompute check, nesting and second-order gradients.

Each test trains an undecorated twin and a recomputed copy from the same
weights and the same random state, in eager mode, `tf.function` and XLA.
"""

import numpy as np
import pytest
tf = pytest.importorskip("tensorflow")  # absent on a JAX or PyTorch GPU machine: the file skips

from _twins import FRAMEWORKS, MODES, RTOL, assert_close, assert_recomputes, compile_mode, copy_weights, framework, recomputed_class
from _updates import assert_loss_scaled_alike, loss_scaled_steps
from keras_recompute import RecomputeError, memory_report, recompute_grad, recompute_model, recompute_scope


@pytest.fixture(params=FRAMEWORKS)
def K(request):
    return framework(request.param)


@pytest.fixture
def tf_keras_generator():
    """tf_keras layers built inside draw from a tf.random.Generator."""
    import tf_keras

    tf_keras.backend.experimental.enable_tf_random_generator()
    yield
    tf_keras.backend.experimental.disable_tf_random_generator()


def reset_random(K, seed=0):
    """The same global random state for the twin and for the copy."""
    if K.__name__ == "keras":
        K.utils.set_random_seed(seed)
    else:
        K.utils.set_random_seed(seed)  # also resets TF's stateful-op counters


def noisy_block(K):
    class Noisy(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = K.layers.Dense(16, activation="relu")
            self.dropout = K.layers.Dropout(0.5, seed=3)
            self.noise = K.layers.GaussianNoise(0.3, seed=4)
            self.out = K.layers.Dense(8)

        def call(self, inputs, training=None):
            hidden = self.dropout(self.dense(inputs), training=training)
            return self.out(self.noise(hidden, training=training))

    return Noisy


def train(layer, x, steps, mode, optimizer=None):
    """`steps` SGD steps on `layer`; returns each step's outputs and gradients."""

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.sin(y) * tf.cos(y * 0.7))
        grads = tape.gradient(loss, [x] + layer.trainable_weights)
        for weight, grad in zip(layer.trainable_weights, grads[1:]):
            weight.assign_sub(0.1 * tf.convert_to_tensor(grad))
        return y, grads

    step = compile_mode(step, mode)
    return [step(x) for _ in range(steps)]


def assert_steps_close(actual, expected, rtol=RTOL):
    """Each step's outputs, then its gradients, equal the twin's (see tests/_compare.py)."""
    for step, ((outputs, gradients), (twin_outputs, twin_gradients)) in enumerate(zip(actual, expected)):
        assert_close(outputs, twin_outputs, rtol, f"step {step} outputs")
        assert_close(gradients, twin_gradients, rtol, f"step {step} gradients")


def build_twins(K, layer_class, x):
    reset_random(K)
    plain = layer_class()
    plain(x)
    reset_random(K)
    recomputed = recomputed_class(layer_class)()
    with recompute_scope(False):
        recomputed(x)
    copy_weights(plain, recomputed)
    return plain, recomputed


def run_twins(K, plain, recomputed, x, steps, mode):
    reset_random(K)
    expected = train(plain, x, steps, mode)
    reset_random(K)
    with recompute_scope(True):
        actual = train(recomputed, x, steps, mode)
    return actual, expected


def skip_legacy_random_under_xla(K, mode):
    if K.__name__ == "tf_keras" and mode == "jit":
        pytest.skip(
            "tf_keras's default (legacy stateful) random ops draw differently on every "
            "XLA run, the plain layer's included: no twin to compare with; see "
            "test_legacy_dropout_under_xla_matches_its_own_forward"
        )


@pytest.mark.parametrize("mode", MODES)
def test_dropout_and_noise_draw_what_the_forward_drew(K, mode):
    skip_legacy_random_under_xla(K, mode)
    assert_random_steps_match(K, noisy_block(K), tf.random.stateless_normal((8, 12), seed=[1, 1]), 3, mode)


def assert_random_steps_match(K, layer_class, x, steps, mode):
    """A layer that draws trains as its twin, `steps` steps, and draws anew each step."""
    plain, recomputed = build_twins(K, layer_class, x)
    actual, expected = run_twins(K, plain, recomputed, x, steps=steps, mode=mode)
    # Each step, the next step too: the random stream stays in step with the twin's.
    assert_steps_close(actual, expected)
    # Dropout really dropped (the masks matter), and differently each step.
    first, second = (np.asarray(outputs) for outputs, _ in expected[:2])
    assert not np.allclose(first, second)


def test_legacy_dropout_under_xla_matches_its_own_forward():
    """Under XLA the gradient uses the mask the forward drew, whatever it was."""
    K = framework("tf_keras")

    class Dropped(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dropout = K.layers.Dropout(0.5)
            self.dense = K.layers.Dense(4)

        def call(self, inputs, training=None):
            dropped = self.dropout(inputs, training=training)
            return dropped, self.dense(dropped)

    layer = recomputed_class(Dropped)()
    x = tf.random.stateless_uniform((64, 12), seed=[3, 3], minval=1.0, maxval=2.0)
    layer(x)

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            dropped, y = layer(x, training=True)
            loss = tf.reduce_sum(tf.sin(y))
        return dropped, tf.cos(y), tape.gradient(loss, x)

    with recompute_scope(True):
        dropped, upstream, gradient = step(x)
    kept = tf.cast(tf.not_equal(dropped, 0.0), tf.float32)
    expected = tf.matmul(upstream, layer.dense.kernel, transpose_b=True) * kept * 2.0
    assert 0.2 < float(tf.reduce_mean(kept)) < 0.8
    assert_close(gradient, expected)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "jit"])
def test_legacy_dropout_masks_of_any_size_replay_exactly(mode):
    """The kept masks are packed eight to a byte: a size no multiple of eight, and a noise shape."""
    K = framework("tf_keras")

    class Odd(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = K.layers.Dense(7)
            self.dropout = K.layers.Dropout(0.5)
            self.rows = K.layers.Dropout(0.4, noise_shape=(None, 1, 7))

        def call(self, inputs, training=None):
            hidden = self.dropout(self.dense(inputs), training=training)  # 3 x 5 x 7 = 105 elements
            return self.rows(hidden, training=training)

    assert_random_steps_match(K, Odd, tf.random.stateless_normal((3, 5, 4), seed=[4, 4]), 2, mode)


def test_legacy_dropout_masks_are_kept_at_one_bit_an_element():
    """What a recomputed call keeps for its legacy dropout: 1/8 byte an element, not a bool's byte."""
    K = framework("tf_keras")

    class Unit(K.layers.Layer):
        def __init__(self, rate, **kwargs):
            super().__init__(**kwargs)
            self.dropout = K.layers.Dropout(rate) if rate else None

        def call(self, inputs, training=None):
            hidden = tf.sin(inputs)
            if self.dropout is not None:
                hidden = self.dropout(hidden, training=training)
            return tf.sin(hidden)

    x = tf.random.stateless_normal((4, 64, 64), seed=[1, 2])
    kept = []
    for rate in (0.5, 0):
        inputs = K.Input((64, 64))
        model = K.Model(inputs, Unit(rate, name="unit")(inputs))
        report = memory_report(model, x, blocks=["unit"], execution="compiled")  # what the traced backward reads
        kept.append(report.rows[0]["kept_bytes"]["full"])
    elements = 4 * 64 * 64
    assert elements // 8 <= kept[0] - kept[1] <= elements // 8 + 64, kept


@pytest.mark.parametrize("mode", MODES)
def test_dropout_with_tf_random_generator(tf_keras_generator, mode):
    K = framework("tf_keras")
    x = tf.random.stateless_normal((8, 12), seed=[2, 1])
    plain, recomputed = build_twins(K, noisy_block(K), x)
    assert recomputed.dropout._random_generator._rng_type == "stateful"
    actual, expected = run_twins(K, plain, recomputed, x, steps=3, mode=mode)
    assert_steps_close(actual, expected)
    # The generator ends where the twin's does.
    np.testing.assert_array_equal(
        recomputed.dropout._random_generator._generator.state,
        plain.dropout._random_generator._generator.state,
    )


@pytest.mark.parametrize("mode", MODES)
def test_batch_norm_statistics_update_once(K, mode):
    class Normed(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            # No bias: BatchNormalization cancels it, its gradient is rounding noise.
            self.dense = K.layers.Dense(10, use_bias=False)
            self.norm = K.layers.BatchNormalization(momentum=0.5)

        def call(self, inputs, training=None):
            return tf.tanh(self.norm(self.dense(inputs), training=training))

    x = tf.random.stateless_normal((16, 6), seed=[3, 1]) * 3.0 + 1.0
    plain, recomputed = build_twins(K, Normed, x)
    actual, expected = run_twins(K, plain, recomputed, x, steps=3, mode=mode)
    assert_steps_close(actual, expected)
    moving = [w for w in recomputed.non_trainable_weights]
    assert len(moving) == 2
    assert_close([tf.convert_to_tensor(w) for w in moving], [tf.convert_to_tensor(w) for w in plain.non_trainable_weights])
    # Three updates happened, not zero: the statistics moved from their start.
    assert not np.allclose(np.asarray(moving[0]), 0.0)


def state_reading_block(K):
    """Reads a state variable, assigns it, and reads it again (an EMA codebook: keras-hub's RQ-VAE)."""

    class ReadsItsState(K.layers.Layer):
        def build(self, input_shape):
            self.dense = K.layers.Dense(10)
            self.average = self.add_weight(name="average", shape=(10,), initializer="ones", trainable=False)

        def call(self, inputs, training=None):
            hidden = tf.tanh(self.dense(inputs))
            before = hidden + self.average  # the forward's state, before the call assigns it (a sum saves no operand)
            self.average.assign(0.5 * self.average + 0.5 * tf.reduce_mean(hidden, axis=0))
            return before + hidden * hidden * self.average  # what it just assigned, with no gradient through it

    return ReadsItsState


@pytest.mark.parametrize("mode", MODES)
def test_a_call_that_reads_the_state_it_assigns(K, mode):
    """NOTE [ a read after an assign in the recompute ] and [ tf_keras state updates ]: the recompute reads the
    state the forward read, before and after the call's own assign, and the gradient does not flow through the
    assign. Before: Keras 3's recompute gave the dense kernel a gradient through the assigned value (0.02 off,
    silently); tf_keras's started from the state after the forward (caught by the check, but for XLA: 0.05 off)."""
    x = tf.random.stateless_normal((8, 6), seed=[5, 2])
    plain, recomputed = build_twins(K, state_reading_block(K), x)
    actual, expected = run_twins(K, plain, recomputed, x, steps=3, mode=mode)
    assert_steps_close(actual, expected)
    assert_close([tf.convert_to_tensor(recomputed.average)], [tf.convert_to_tensor(plain.average)])
    assert not np.allclose(np.asarray(plain.average), 1.0)  # the state moved, three times as plain's did


def bert_block(K):
    class BertBlock(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            seed = {"seed": 5} if K.__name__ == "keras" else {}
            self.attention = K.layers.MultiHeadAttention(2, 8, dropout=0.1, **seed)
            self.norm1 = K.layers.LayerNormalization()
            self.ffn = K.layers.Dense(32, activation="gelu")
            self.out = K.layers.Dense(16)
            self.dropout = K.layers.Dropout(0.1, seed=6)
            self.norm2 = K.layers.LayerNormalization()

        def call(self, inputs, training=None):
            hidden = self.norm1(inputs + self.attention(inputs, inputs, training=training))
            return self.norm2(hidden + self.dropout(self.out(self.ffn(hidden)), training=training))

    return BertBlock


@pytest.fixture
def reproducible_under(request):
    """`reproducible_under(K, mode)`: under XLA, tf_keras draws from a tf.random.Generator.

    Its default legacy ops draw differently on every XLA run, so there would
    be no twin to compare with.
    """
    import tf_keras

    switched = []

    def switch(K, jit):
        if K.__name__ == "tf_keras" and jit:
            tf_keras.backend.experimental.enable_tf_random_generator()
            switched.append(True)

    yield switch
    if switched:
        tf_keras.backend.experimental.disable_tf_random_generator()


def set_policy(K, name):
    if K.__name__ == "keras":
        K.config.set_dtype_policy(name)
    else:
        K.mixed_precision.set_global_policy(name)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_mixed_precision_block_matches_twin(K, policy, mode, reproducible_under):
    reproducible_under(K, mode == "jit")
    set_policy(K, policy)
    try:
        x = tf.random.stateless_normal((4, 6, 16), seed=[4, 1])
        plain, recomputed = build_twins(K, bert_block(K), x)
        actual, expected = run_twins(K, plain, recomputed, x, steps=2, mode=mode)
    finally:
        set_policy(K, "float32")
    compute = tf.float16 if policy == "mixed_float16" else tf.bfloat16
    assert actual[0][0].dtype == compute
    assert recomputed.ffn.kernel.dtype == tf.float32 or "float32" in str(recomputed.ffn.kernel.dtype)
    assert_steps_close(actual, expected, rtol=2e-2)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_mixed_float16_fit_with_loss_scaling(K, jit_compile, reproducible_under):
    reproducible_under(K, jit_compile)
    set_policy(K, "mixed_float16")
    try:
        x = np.random.RandomState(0).normal(size=(16, 6, 16)).astype("float32")
        y = np.random.RandomState(1).normal(size=(16, 6, 16)).astype("float32")
        Block = bert_block(K)

        def fitted(recompute):
            reset_random(K)
            inputs = K.Input((6, 16))
            block = recomputed_class(Block)()
            model = K.Model(inputs, K.layers.Activation("linear", dtype="float32")(block(inputs)))
            optimizer = K.optimizers.SGD(0.05)
            if K.__name__ == "tf_keras":
                optimizer = K.mixed_precision.LossScaleOptimizer(optimizer)
            model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
            reset_random(K)
            with recompute_scope(recompute):
                history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
            return history.history["loss"], model.get_weights()

        plain_loss, plain_weights = fitted(False)
        loss, weights = fitted(True)
    finally:
        set_policy(K, "float32")
    assert np.all(np.isfinite(loss))
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-3)
    for a, e in zip(weights, plain_weights):
        np.testing.assert_allclose(a, e, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("K", ["tf_keras"], indirect=True)  # Keras 3: test_keras3.py, on every backend
def test_a_loss_scaled_step_that_overflows_is_skipped_as_the_plain_models(K):
    """NOTE [ a NaN gradient ]: under mixed_float16 the first steps' scaled gradients overflow (NaN) and the loss
    scale halves, the step skipped. In a tf.function a NaN gradient reaching a unit made its recompute's inputs NaN
    (NOTE [ ordering the recompute in graphs ]): the recompute check stopped the step ("differ from its forward"),
    and, with the check passed, token ids one past the vocabulary made the recompute's gather raise."""
    plain = loss_scaled_steps(K)
    with recompute_scope(True):
        recomputed = loss_scaled_steps(K, lambda model: recompute_model(model, segments=4))
    assert_loss_scaled_alike(plain, recomputed)
    model, ids, *_ = recomputed
    assert_recomputes(lambda x: model(x, training=True), tf.constant(ids), model.trainable_weights)


@pytest.mark.parametrize("mode", MODES)
def test_nested_recompute_matches_twin(K, mode, reproducible_under):
    reproducible_under(K, mode == "jit")
    Inner = bert_block(K)

    class Outer(K.layers.Layer):
        def __init__(self, inner_class=Inner, **kwargs):
            super().__init__(**kwargs)
            self.first = inner_class()
            self.second = inner_class()
            self.dropout = K.layers.Dropout(0.3, seed=8)

        def call(self, inputs, training=None):
            return self.second(self.dropout(self.first(inputs, training=training), training=training), training=training)

    RecomputedInner = recomputed_class(Inner)

    class RecomputedOuter(Outer):
        def __init__(self, **kwargs):
            super().__init__(inner_class=RecomputedInner, **kwargs)

        @recompute_grad
        def call(self, inputs, training=None):
            return super().call(inputs, training=training)

    x = tf.random.stateless_normal((2, 5, 16), seed=[5, 1])
    reset_random(K)
    plain = Outer()
    plain(x)
    reset_random(K)
    recomputed = RecomputedOuter()
    with recompute_scope(False):
        recomputed(x)
    copy_weights(plain, recomputed)
    actual, expected = run_twins(K, plain, recomputed, x, steps=2, mode=mode)
    assert_steps_close(actual, expected)


def counting_layer(K, check=True):
    class Drifting(K.layers.Layer):
        """Branches on a counter it changes itself: not a pure function."""

        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")
            self.calls = 0

        @recompute_grad(check=check)
        def call(self, inputs):
            self.calls += 1
            scale = 2.0 if self.calls % 2 else 3.0
            return tf.matmul(inputs, self.kernel) * scale

    return Drifting


def drifting_before_a_kept_matmul(K):
    class DriftingBeforeAKeptMatmul(K.layers.Layer):
        """Its output is a matmul's that `"save_dots"` keeps; the input of that matmul differs in the recompute."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner, self.outer = K.layers.Dense(4), K.layers.Dense(3)
            self.calls = 0

        @recompute_grad(policy="save_dots")
        def call(self, inputs):
            self.calls += 1
            return self.outer(self.inner(inputs) * (2.0 if self.calls % 2 else 3.0))

    return DriftingBeforeAKeptMatmul


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("where", ["output", "kept_matmul"])
def test_a_recompute_that_differs_raises(K, mode, where):
    """`kept_matmul`: NOTE [ the recompute check under save_dots ]. The output is a kept matmul's, the forward's
    whatever the recompute feeds it, so the output check passed; the kept matmul's gradient was taken at the
    recompute's other input (the outer kernel's a third off, normwise), with no error. Each kept matmul's input is
    checked now."""
    if where == "output":
        layer, raised = counting_layer(K)(name="drifting"), "recompute of .*drifting.*differ"
    else:
        layer, raised = drifting_before_a_kept_matmul(K)(name="drifting"), "recompute of .*drifting.* fed its layer .*differ"
    x = tf.ones((2, 3))
    layer(x)

    def step(x):
        with tf.GradientTape() as tape:
            y = layer(x)
        return tape.gradient(y, layer.trainable_weights)

    step = compile_mode(step, mode)
    with recompute_scope(True):
        with pytest.raises((RecomputeError, tf.errors.InvalidArgumentError), match=raised):
            step(x)


@pytest.mark.parametrize("frozen", [True, False])
def test_a_recompute_no_gradient_reads_is_not_run_in_a_function(K, frozen):
    """NOTE [ a check the runtime may prune ]: a frozen unit before every trained weight (a backbone frozen under a
    head) needs no backward; a `tf.function` prunes its recompute as it prunes the plain backward. The unit here
    differs from its forward: its check fails where its recompute runs. It ran, an assert op being stateful: a
    frozen ResNet50 under a head stepped in 2.7x plain's time at 3.2x its peak."""
    layer = counting_layer(K)(name="drifting")
    layer.trainable = not frozen
    head = K.layers.Dense(2)
    x = tf.ones((2, 3))
    head(layer(x))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(head(layer(x)) ** 2)
        return tape.gradient(loss, layer.trainable_weights + head.trainable_weights)

    with recompute_scope(True):
        if frozen:
            assert all(g is not None for g in step(x))
        else:  # the same unit, trained: its recompute runs, and its check fails
            with pytest.raises(tf.errors.InvalidArgumentError, match="recompute of .*drifting.*differ from its forward"):
                step(x)


def test_shape_change_raises_with_the_layer_name(K):
    class Growing(K.layers.Layer):
        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")
            self.calls = 0

        @recompute_grad
        def call(self, inputs):
            self.calls += 1
            return tf.matmul(inputs, self.kernel)[:, : self.calls]

    layer = Growing(name="growing")
    layer(tf.ones((2, 3)))
    with recompute_scope(True), tf.GradientTape() as tape:
        y = layer(tf.ones((2, 3)))
    with pytest.raises(RecomputeError, match="recompute of .*'growing'.*output 0"):
        tape.gradient(y, layer.trainable_weights)


def test_check_false_skips_the_value_check(K):
    layer = counting_layer(K, check=False)()
    x = tf.ones((2, 3))
    layer(x)
    with recompute_scope(True), tf.GradientTape() as tape:
        y = layer(x)
    assert tape.gradient(y, layer.trainable_weights)[0] is not None


@pytest.mark.parametrize("mode", MODES)
def test_gradient_penalty_through_a_recomputed_block(K, mode):
    x = tf.random.stateless_normal((3, 5, 16), seed=[6, 1])
    Block = bert_block(K)
    plain, recomputed = build_twins(K, Block, x)

    def penalty_gradients(layer):
        def step(x):
            with tf.GradientTape() as outer:
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    y = layer(x, training=False)
                    score = tf.reduce_sum(tf.sin(y))
                input_gradient = inner.gradient(score, x)
                penalty = tf.reduce_sum(input_gradient**2)
            return penalty, outer.gradient(penalty, layer.trainable_weights)

        return compile_mode(step, mode)(x)

    expected = penalty_gradients(plain)
    with recompute_scope(True):
        actual = penalty_gradients(recomputed)
    assert_close(actual[0], expected[0], what="penalty")
    assert_close(actual[1], expected[1], what="gradients of the penalty")


@pytest.mark.parametrize("policy", ["full", "save_dots", "attention_core"])
@pytest.mark.parametrize("mode", MODES)
def test_a_persistent_tape_differentiates_a_recomputed_block_again(K, mode, policy, reproducible_under):
    """A persistent tape's later gradients (two losses of one forward, as a GAN's step takes them) recompute again,
    and each equals the twin's: the dropout masks are the forward's every time."""
    if K.__name__ == "tf_keras" and policy != "full":
        pytest.skip("the policies' TensorFlow paths are Keras 3's: tf_keras's own state under full is enough")
    reproducible_under(K, mode == "jit")
    x = tf.random.stateless_normal((3, 5, 16), seed=[7, 1])
    Block = bert_block(K)
    reset_random(K)
    plain = Block()
    plain(x)
    reset_random(K)
    recomputed = recomputed_class(Block, policy=policy)()
    with recompute_scope(False):
        recomputed(x)
    copy_weights(plain, recomputed)

    def gradients(layer):
        def step(x):
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(x)
                y = layer(x, training=True)
                first, second = tf.reduce_sum(tf.sin(y)), tf.reduce_sum(tf.cos(1.3 * y))  # not y**2: a norm's output fixes it
            weights = layer.trainable_weights
            return [tape.gradient(first, [x] + weights), tape.gradient(second, weights[:4]), tape.gradient(first, weights)]

        reset_random(K)
        return compile_mode(step, mode)(x)

    expected = gradients(plain)
    with recompute_scope(True):
        actual = gradients(recomputed)
    for index, (got, want) in enumerate(zip(actual, expected)):
        assert all(g is not None for g in got)
        assert_close(got, want, what=f"gradient {index} of the persistent tape")
    assert_recomputes(lambda x: recomputed(x, training=True), x, recomputed.trainable_weights)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_raw_random_op_raises_instead_of_a_wrong_gradient(mode):
    """A draw that bypasses Keras's random layers cannot be replayed: it must not pass silently."""
    weight = tf.Variable(tf.ones((6, 6)))

    @recompute_grad
    def noisy(x):
        return tf.matmul(x * tf.random.uniform(tf.shape(x)), weight)

    def step(x):
        with tf.GradientTape() as tape:
            y = noisy(x)
        return tape.gradient(y, weight)

    with recompute_scope(True):
        with pytest.raises((RecomputeError, tf.errors.InvalidArgumentError), match="differ from its forward"):
            compile_mode(step, mode)(tf.ones((4, 6)))


def test_a_function_calls_the_check_traced_once_instead_of_tracing_its_ops_per_call():
    """NOTE [ tracing the check ]: in a `tf.function` each recomputed call's fingerprints (the forward's and the
    recompute's) and their comparison are calls of functions traced once: a few ops a call beyond check=False's
    graph (18 here), where the check's own ops were 157 a call, traced again for every call (catching a recompute that
    differs, so traced: test_a_raw_random_op_raises_instead_of_a_wrong_gradient)."""
    weight = tf.Variable(tf.ones((6, 6)))

    def operations(check):
        layer = recompute_grad(lambda x: tf.tanh(tf.matmul(x, weight)), check=check)

        def step(x):
            with tf.GradientTape() as tape:
                y = tf.reduce_sum(layer(layer(x)))
            return tape.gradient(y, weight)

        with recompute_scope(True):
            graph = tf.function(step, autograph=False).get_concrete_function(tf.ones((4, 6))).graph
        return len(graph.get_operations())

    checked, unchecked = operations(True), operations(False)
    assert 0 < checked - unchecked <= 2 * 40, (checked, unchecked)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_forward_that_overflowed_is_not_called_a_different_recompute(mode):
    """A diverged model's NaN and inf outputs are reproduced by the recompute: the gradients are plain's, no error.

    (The check compared fingerprints that NaN makes unequal to themselves: it
    raised "differ from its forward" for a recompute that was exact.)
    """
    weight = tf.Variable([[1.0, 0.0, -1.0], [2.0, 1.0, 0.0]])

    def overflowing(x):
        return tf.exp(tf.matmul(x, weight)) * tf.constant([1.0, float("nan"), 1.0])

    def step(x, fn):
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(fn(x))
        return tape.gradient(y, weight)

    x = tf.constant([[100.0, 0.0], [1.0, 1.0]])
    expected = compile_mode(lambda x: step(x, overflowing), mode)(x)
    with recompute_scope(True):
        actual = compile_mode(lambda x: step(x, recompute_grad(overflowing)), mode)(x)
    np.testing.assert_array_equal(np.isnan(actual.numpy()), np.isnan(expected.numpy()))
    assert np.isnan(expected.numpy()).any()


@pytest.mark.parametrize("mode", MODES)
def test_add_loss_inside_a_recomputed_call(K, mode):
    """A loss added in the call is differentiated (it is an output), and added once."""

    class Regularized(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = K.layers.Dense(3, activity_regularizer="l2")

        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")

        def call(self, inputs):
            hidden = tf.matmul(inputs, self.kernel)
            self.add_loss(tf.reduce_sum(hidden**2))
            return self.inner(hidden)

    x = tf.random.stateless_normal((2, 4), seed=[7, 7])
    plain, recomputed = build_twins(K, Regularized, x)

    def gradients(layer):
        def step(x):
            with tf.GradientTape() as tape:
                y = layer(x)
                losses = layer.losses
                loss = tf.reduce_sum(tf.sin(y)) + tf.add_n(losses)
            return len(losses), tape.gradient(loss, layer.trainable_weights)

        return compile_mode(step, mode)(x)

    expected_count, expected = gradients(plain)
    with recompute_scope(True):
        count, actual = gradients(recomputed)
    assert count == expected_count == 2
    assert_close(actual, expected)
