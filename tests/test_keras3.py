"""The correctness battery for Keras 3, on the backend `KERAS_BACKEND` names.

CI runs this file under `KERAS_BACKEND=tensorflow`, `jax` and `torch`. Every
test compares outputs, input gradients and every weight gradient with an
undecorated twin holding the same weights and random state, in each of the
backend's modes (TensorFlow: eager, `tf.function`, XLA; JAX: eager, `jax.jit`;
PyTorch: eager).
"""

import keras
import numpy as np
import pytest
from keras import layers, ops

from _keras3_twins import (
    BACKEND, MODES, assert_close, assert_recomputes, assert_trained_alike, build_twins, compare_on_and_off, compare_with_twin,
    loss_and_gradients,
)
from _compare import RTOL
from _updates import assert_loss_scaled_alike, loss_scaled_steps
from keras_recompute import recompute_grad, recompute_model, recompute_scope

RNG = np.random.RandomState(0)


@pytest.fixture(autouse=True)
def _same_data_whatever_ran_before():
    """Each test draws its data from the start of the stream: a file run alone, or shuffled, gives the same."""
    RNG.seed(0)


def normal(*shape):
    return RNG.standard_normal(shape).astype("float32")


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    keras.config.set_dtype_policy("float32")


class Block(layers.Layer):
    """A pre-norm feed-forward block with a residual."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = layers.LayerNormalization()
        self.inner = layers.Dense(32, activation="gelu")
        self.outer = layers.Dense(16)

    def call(self, inputs):
        return inputs + self.outer(self.inner(self.norm(inputs)))


class Attention(layers.Layer):
    """Self-attention: the same tensor is query, key and value."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(num_heads=2, key_dim=8)

    def call(self, inputs, mask=None):
        return self.attention(inputs, inputs, inputs, attention_mask=mask)


class KeywordBlock(layers.Layer):
    """Keyword arguments: a float tensor, a boolean tensor, a Python float."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(16, activation="tanh")

    def call(self, inputs, bias=None, keep=None, scale=1.0, training=None):
        hidden = self.dense(inputs) * scale + bias
        return ops.where(keep, hidden, ops.zeros_like(hidden))


class TwoOutputs(layers.Layer):
    """A dict in, a tuple out, one output an integer tensor."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(16, activation="relu")

    def call(self, inputs):
        hidden = self.dense(inputs["a"]) * inputs["b"]
        return hidden, ops.argmax(hidden, axis=-1)


class Tokens(layers.Layer):
    """Integer token ids in: the only float input is a weight."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = layers.Embedding(50, 16)
        self.block = Block()

    def call(self, ids):
        return self.block(self.embedding(ids))


class Noisy(layers.Layer):
    """Dropout, Gaussian noise and BatchNorm: random draws and state updates."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(32, activation="relu")
        self.dropout = layers.Dropout(0.5, seed=3)
        self.noise = layers.GaussianNoise(0.3, seed=4)
        self.norm = layers.BatchNormalization()
        self.out = layers.Dense(16)

    def call(self, inputs, training=None):
        hidden = self.dropout(self.dense(inputs), training=training)
        hidden = self.norm(self.noise(hidden, training=training), training=training)
        return self.out(hidden)


class Regularized(layers.Layer):
    """`add_loss` inside the recomputed call, from a sub-layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(16, activity_regularizer="l2")

    def call(self, inputs):
        return self.dense(inputs)


@pytest.mark.parametrize("mode", MODES)
def test_block_matches_twin(mode):
    compare_with_twin(Block, [normal(4, 16)], mode, call=lambda layer, xs: layer(*xs))


@pytest.mark.parametrize("mode", MODES)
def test_repeated_input_gradient_is_not_doubled(mode):
    """q = k = v: bert4keras's recompute doubles this gradient; ours must not."""
    compare_with_twin(Attention, [normal(2, 6, 16)], mode, call=lambda layer, xs: layer(*xs))


@pytest.mark.parametrize("mode", MODES)
def test_keyword_arguments_and_masks(mode):
    mask = RNG.rand(4, 16) > 0.3

    def call(layer, xs):
        return layer(xs[0], bias=xs[1], keep=xs[2], scale=0.5, training=True)

    compare_with_twin(KeywordBlock, [normal(4, 8), normal(16), mask], mode, call=call)


@pytest.mark.parametrize("mode", MODES)
def test_dict_inputs_tuple_outputs_integer_output(mode):
    def call(layer, xs):
        return layer({"a": xs[0], "b": xs[1]})

    _, _, results = compare_with_twin(TwoOutputs, [normal(4, 8), normal(4, 16)], mode, call=call)
    (outputs, _), _ = results[0]
    assert np.asarray(outputs[1]).dtype.kind == "i"


@pytest.mark.parametrize("mode", MODES)
def test_integer_inputs(mode):
    ids = RNG.randint(0, 50, size=(4, 7)).astype("int32")
    compare_with_twin(Tokens, [ids], mode, call=lambda layer, xs: layer(*xs))


@pytest.mark.parametrize("mode", MODES)
def test_dropout_noise_and_batchnorm_replay_the_forward(mode):
    """Three training steps: the masks match the twin's each step, moving stats too."""
    _, _, results = compare_with_twin(Noisy, [normal(8, 16)], mode, steps=3)
    first, second = (np.asarray(expected[0]) for _, expected in results[:2])
    assert not np.allclose(first, second), "dropout did not draw new masks each step"


class UnseededNoise(layers.Layer):
    """Noise from an unseeded `keras.random` draw (Keras's global seed generator), before a kept matmul."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(32, activation="tanh")
        self.out = layers.Dense(16)

    def call(self, inputs):
        hidden = self.dense(inputs)
        return inputs + self.out(hidden * keras.random.uniform(ops.shape(hidden)))


@pytest.mark.skipif(BACKEND == "jax", reason="Keras refuses an unseeded draw in a traced JAX call")
@pytest.mark.parametrize("policy", ["full", "save_dots"])
@pytest.mark.parametrize("mode", MODES)
def test_an_unseeded_draw_replays_the_forward(mode, policy):
    """NOTE [ an unseeded draw ] in `backends/_keras3.py`: Keras's global seed generator, made by the forward's
    draw, was not recorded, and the recompute drew again: on PyTorch and in TensorFlow's eager mode `"full"`
    raised `RecomputeError`; `"save_dots"` gave `out` another gradient (NOTE [ the recompute check under save_dots
    ] catches that now). `set_random_seed` before each step unmakes the generator: each step is a first."""
    compare_with_twin(UnseededNoise, [normal(4, 16)], mode, steps=2, policy=policy)


class Outer(layers.Layer):
    """A recomputed block inside a recomputed block."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = type("InnerRecomputed", (Noisy,), {"call": recompute_grad(Noisy.call)})()
        self.dense = layers.Dense(16, activation="tanh")

    def call(self, inputs, training=None):
        return self.dense(self.inner(inputs, training=training)) + inputs


@pytest.mark.parametrize("mode", MODES)
def test_nested_recompute(mode):
    compare_with_twin(Outer, [normal(8, 16)], mode, steps=2)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch runs a GPU's backward in a thread of its own")
@pytest.mark.parametrize("mode", MODES)
def test_nested_recompute_with_the_backward_in_another_thread(mode, monkeypatch):
    """On a GPU autograd runs the backward, and so the recompute, in its device thread, where the
    forward's `recompute_scope` is not set: the inner call must still recompute as its forward did."""
    import threading

    import torch

    backward = torch.Tensor.backward

    def in_another_thread(self, *args, **kwargs):
        raised = []

        def run():
            try:
                backward(self, *args, **kwargs)
            except BaseException as error:  # noqa: B036 - raised again in the test's thread
                raised.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if raised:
            raise raised[0]

    monkeypatch.setattr(torch.Tensor, "backward", in_another_thread)
    compare_with_twin(Outer, [normal(8, 16)], mode, steps=2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision(mode, policy):
    if BACKEND == "torch" and policy == "mixed_float16":
        pytest.skip("float16 matmul is slow and inexact on PyTorch's CPU; bfloat16 covers the path")
    keras.config.set_dtype_policy(policy)
    _, recomputed, results = compare_with_twin(Noisy, [normal(8, 16)], mode, steps=2, rtol=1e-2)
    assert recomputed.dense.compute_dtype == policy.split("_")[1]
    assert len(results) == 2


def test_a_loss_scaled_step_that_overflows_is_skipped_as_the_plain_models():
    """NOTE [ a NaN gradient ] (backends/tensorflow): the first mixed_float16 steps overflow and are skipped, the
    loss scale halved, in the recomputed model as in the plain one; then the same updates. TensorFlow's recompute
    check stopped such a step; test_semantics.py has the same test for tf_keras."""
    plain = loss_scaled_steps(keras)
    with recompute_scope(True):
        recomputed = loss_scaled_steps(keras, lambda model: recompute_model(model, segments=4))
    assert_loss_scaled_alike(plain, recomputed)
    model, ids, *_ = recomputed
    assert_recomputes(model, [ids], call=lambda layer, xs: layer(*xs, training=True))


class Recurrent(layers.Layer):
    """An LSTM and a bidirectional GRU, with input and recurrent dropout: masks drawn in a loop, per step.

    Not both dropouts in one layer: on PyTorch, Keras 3.15 fails such an LSTM inside a layer's first
    call without recompute ("Tensor on device meta is not on the expected device cpu")."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lstm = layers.LSTM(16, return_sequences=True, dropout=0.3, seed=5)
        self.gru = layers.Bidirectional(layers.GRU(8, return_sequences=True, recurrent_dropout=0.3, seed=6))

    def call(self, inputs, training=None):
        return self.gru(self.lstm(inputs, training=training), training=training)


@pytest.mark.parametrize("mode", MODES)
def test_recurrent_layers_with_dropout(mode):
    _, recomputed, _ = compare_with_twin(Recurrent, [normal(4, 6, 8)], mode, steps=2)
    assert_recomputes(recomputed, [normal(4, 6, 8)])


class RecomputedCell(layers.Layer):
    """An RNN cell whose own call recomputes, once per time step inside the RNN's loop (`tf.while_loop`,
    `lax.scan`, a Python loop): a trained Dense on the input and state, a frozen one on the input, and dropout
    (not on JAX, where a Keras `Dropout` inside a cell fails Keras's own `RNN`, recompute off too)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state_size = 8
        self.dense = layers.Dense(8, activation="tanh")
        self.frozen = layers.Dense(8, trainable=False)
        self.dropout = layers.Dropout(0.2 if BACKEND != "jax" else 0.0, seed=1)

    def build(self, input_shape):
        self.dense.build((input_shape[0], 16))
        self.frozen.build((input_shape[0], 8))

    @recompute_grad
    def call(self, inputs, states, training=None):
        hidden = self.dense(ops.concatenate([inputs, states[0]], -1)) + self.frozen(inputs)
        hidden = self.dropout(hidden, training=training)
        return hidden, [hidden]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_a_recomputed_rnn_cell_matches_the_plain_one(mode, policy):
    """NOTE [ a recompute inside a loop or a branch ] in `backends/tensorflow.py`: on TensorFlow its gradient failed
    to build; on every backend now the cell's weights and the inputs get the plain cell's gradients. Under
    `mixed_bfloat16` on TensorFlow the recompute check allows bfloat16's rounding (NOTE [ the recompute check ]):
    oneDNN's kernels rounded the loop's recompute 2.7e-3 of its norm from its forward, past float32's 1e-3."""
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    rnn = layers.RNN(RecomputedCell(), return_sequences=True)
    xs = normal(4, 5, 8)
    with recompute_scope(False):
        rnn(xs)
    call = lambda layer, inputs: layer(inputs[0], training=True)  # noqa: E731
    compare_on_and_off(rnn, [xs], mode, call, steps=2, rtol=1e-2 if policy != "float32" else RTOL)
    assert_recomputes(rnn, [xs], call)


class RecomputedLSTMCell(layers.LSTMCell):
    call = recompute_grad(layers.LSTMCell.call)


@pytest.mark.parametrize("mode", MODES)
def test_a_recomputed_keras_cell_reuses_the_forwards_cached_masks(mode):
    """NOTE [ an RNN cell's cached masks ] in `backends/_keras3.py`: Keras's LSTMCell with `dropout` and
    `recurrent_dropout` keeps the masks it draws before the RNN's loop in attributes, which the RNN clears after
    it; the recompute, in the backward, drew new ones (the recompute check raised on PyTorch and TensorFlow)."""
    keras.utils.set_random_seed(0)
    cell = RecomputedLSTMCell(8, dropout=0.3, recurrent_dropout=0.3, seed=3)
    rnn = layers.RNN(cell, return_sequences=True)
    xs = normal(4, 5, 8)
    with recompute_scope(False):
        rnn(xs)
    call = lambda layer, inputs: layer(inputs[0], training=True)  # noqa: E731
    compare_on_and_off(rnn, [xs], mode, call, steps=2)
    assert_recomputes(rnn, [xs], call)
    assert cell.__dict__.get("_dropout_mask") is None and cell.__dict__.get("_recurrent_dropout_mask") is None


def test_add_loss_inside_is_kept():
    x = normal(4, 16)
    plain, recomputed = build_twins(Regularized, [x])
    for layer, on in ((plain, False), (recomputed, True)):
        with recompute_scope(on):
            layer(ops.convert_to_tensor(x))
        assert len(layer.losses) == 1
    assert_close(_to_numpy(recomputed.losses[0]), _to_numpy(plain.losses[0]), what="activity loss")


def _to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


def test_recompute_off_is_the_plain_call():
    plain, recomputed = build_twins(Block, [normal(4, 16)])
    assert type(recomputed).call.__wrapped__ is Block.call
    x = normal(4, 16)
    expected = loss_and_gradients(plain, [x], call=lambda layer, xs: layer(*xs))
    actual = loss_and_gradients(recomputed, [x], call=lambda layer, xs: layer(*xs))
    assert_close(actual, expected, rtol=0)


class TransformerBlock(layers.Layer):
    """Post-norm BERT block: attention and feed-forward, each with dropout."""

    def __init__(self, hidden=32, heads=4, intermediate=64, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(heads, hidden // heads, dropout=rate, seed=11)
        self.attention_dropout = layers.Dropout(rate, seed=12)
        self.attention_norm = layers.LayerNormalization(epsilon=1e-12)
        self.up = layers.Dense(intermediate, activation="gelu")
        self.down = layers.Dense(hidden)
        self.ffn_dropout = layers.Dropout(rate, seed=13)
        self.ffn_norm = layers.LayerNormalization(epsilon=1e-12)

    def call(self, inputs, training=None):
        attended = self.attention(inputs, inputs, inputs, training=training)
        hidden = self.attention_norm(inputs + self.attention_dropout(attended, training=training))
        ffn = self.ffn_dropout(self.down(self.up(hidden)), training=training)
        return self.ffn_norm(hidden + ffn)


@pytest.mark.parametrize("mode", MODES)
def test_transformer_block_with_dropout(mode):
    """`keras.remat` raises CheckpointError on this block on PyTorch; ours matches the twin."""
    compare_with_twin(TransformerBlock, [normal(2, 8, 32)], mode, steps=2)


def functional_bert(recompute, layers_count=2, vocab=100, length=16, hidden=32):
    """A functional BERT-like model: `keras.RematScope("full")` crashes building this on JAX."""
    keras.utils.set_random_seed(1)
    block_class = type("RecomputedTransformerBlock", (TransformerBlock,), {"call": recompute_grad(TransformerBlock.call)})
    ids = keras.Input((length,), dtype="int32")
    hidden_states = layers.Embedding(vocab, hidden)(ids)
    hidden_states = layers.LayerNormalization()(hidden_states)
    for _ in range(layers_count):
        hidden_states = (block_class if recompute else TransformerBlock)(hidden)(hidden_states)
    logits = layers.Dense(vocab)(hidden_states)
    model = keras.Model(ids, logits)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_functional_bert_fit_matches_plain():
    """Built and trained with `model.fit` (compiled by default): the same losses and weights."""
    data = np.random.RandomState(3).randint(0, 100, size=(16, 16)).astype("int32")
    results = []
    for recompute in (False, True):
        model = functional_bert(recompute)
        initial = [np.asarray(ops.convert_to_numpy(w), np.float64) for w in model.weights]
        keras.utils.set_random_seed(2)
        with recompute_scope(recompute):
            history = model.fit(data, data, batch_size=8, epochs=2, shuffle=False, verbose=0)
        results.append((history.history["loss"], model))
    (plain_losses, plain_model), (losses, model) = results
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    assert_trained_alike(model, plain_model, initial)


def test_forward_runs_again_in_the_backward():
    """The recompute really happens (TensorFlow and PyTorch call Python again)."""
    if BACKEND == "jax":
        pytest.skip("JAX traces once and replays the traced program; test_memory_falls proves the recompute")
    counts = []

    class Counted(Block):
        def call(self, inputs):
            counts.append(1)
            return super().call(inputs)

    plain, recomputed = build_twins(Counted, [normal(4, 16)], call=lambda layer, xs: layer(*xs))
    for layer, on, expected in ((plain, False, 1), (recomputed, True, 2)):
        counts.clear()
        with recompute_scope(on):
            loss_and_gradients(layer, [normal(4, 16)], call=lambda layer, xs: layer(*xs))
        assert len(counts) == expected, f"recompute {on}: the call ran {len(counts)} times"


def _child_peak(method, rows):
    """Peak in MB of one `_rss_child.py` run: its RSS, or on a GPU its device allocator's (see its docstring)."""
    import os

    import _fresh

    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rss_child.py")
    root = os.path.dirname(os.path.dirname(child))
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="131072",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",  # JAX on a GPU: its peak, not 75% of the device
        PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    )
    done = _fresh.run([child, method, str(rows)], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.split()[-1])


@pytest.mark.in_children
def test_memory_falls():
    """A 12-block stack, one `train_on_batch` each: activation memory falls at least 3x,
    with each block's `call` decorated (`ours`) and with `recompute_model` on the plain model.

    JAX and PyTorch on the CPU have no allocator statistics, so each run is a
    child process whose peak RSS is read, minus a run of the same program on 8
    rows; on a GPU the child reads the device allocator's peak instead.
    (TensorFlow's figure, from its allocator, is test_memory.py's.)
    """
    if BACKEND == "tensorflow":
        pytest.skip("test_memory.py measures the TensorFlow paths with the BFC allocator")
    activations = {}
    for method in ("none", "ours", "model"):
        activations[method] = _child_peak(method, 4096) - _child_peak(method, 8)
    print(f"{BACKEND}: activations (MB) {activations}")
    for method in ("ours", "model"):
        ratio = activations["none"] / max(activations[method], 1.0)
        assert ratio >= 3.0, f"{method}: activation memory fell only {ratio:.2f}x: {activations}"


class ImplicitTraining(layers.Layer):
    """Dropout called without `training`: it reads it from Keras's call context."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(32, activation="relu")
        self.dropout = layers.Dropout(0.5, seed=5)
        self.out = layers.Dense(16)

    def call(self, inputs):
        return self.out(self.dropout(self.dense(inputs)))


@pytest.mark.parametrize("mode", MODES)
def test_training_from_the_call_context(mode):
    """The recompute sees the forward's call context, so its dropout is on as the forward's was."""
    compare_with_twin(ImplicitTraining, [normal(8, 16)], mode, steps=2)
