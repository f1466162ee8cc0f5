"""Semantics on Keras 3's JAX and PyTorch backends: the recompute check, second order, `add_loss`.

`test_semantics.py` holds the same for TensorFlow (Keras 3 and tf_keras). Here:
  * A call that branches on a counter it changes itself: PyTorch raises
    `RecomputeError` at the end of the backward (NOTE [ the recompute check on
    PyTorch ]); JAX traces the call once and replays the traced program, so
    its recompute is the forward's function and the gradient is that of the
    forward (the plain call's from the same counter).
  * A gradient penalty (the gradient of a gradient) through a recomputed block.
  * A loss added with `add_loss` inside the call is differentiated, once.
  * A call that reads a state variable it assigns (an EMA codebook) trains as
    its twin (NOTE [ a read after an assign in the recompute ]).
"""

import keras
import numpy as np
import pytest
from keras import layers, ops

from _keras3_twins import (
    BACKEND, FAST_MODE, MODES, _numpy, assert_close, assert_recomputes, build_twins, compare_with_twin, loss_and_gradients,
    recomputed_class, torch_tensor,
)
from test_keras3 import Block

from keras_recompute import RecomputeError, recompute_grad, recompute_scope

pytestmark = pytest.mark.skipif(BACKEND == "tensorflow", reason="test_semantics.py covers TensorFlow")

X = np.random.RandomState(4).standard_normal((3, 16)).astype("float32")


class Drifting(layers.Layer):
    """Branches on a counter it changes itself: not a pure function."""

    def __init__(self, check=True, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0
        self.call = recompute_grad(self.call, check=check)

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")

    def call(self, inputs):
        self.calls += 1
        return ops.matmul(inputs, self.kernel) * (2.0 if self.calls % 2 else 3.0)


def _drifting_gradients(layer, on):
    layer.calls = 0
    with recompute_scope(on):
        return loss_and_gradients(layer, [X], FAST_MODE, lambda layer, xs: layer(xs[0]))


class DriftingBeforeAKeptMatmul(layers.Layer):
    """Its output is a matmul's that `"save_dots"` keeps; the input of that matmul differs in the recompute."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner, self.outer = layers.Dense(4), layers.Dense(3)
        self.calls = 0
        self.call = recompute_grad(self.call, policy="save_dots")

    def call(self, inputs):
        self.calls += 1
        return self.outer(self.inner(inputs) * (2.0 if self.calls % 2 else 3.0))


@pytest.mark.parametrize("layer_class, raised", [
    (Drifting, "recompute of .*drifting.* output 0 .*differ from its forward"),
    # NOTE [ the recompute check under save_dots ] (`backends/tensorflow.py`): the output check passed (the output
    # is the kept matmul's) while the outer kernel's gradient was taken at the recompute's other input, a third off
    # normwise on PyTorch, with no error. Each kept matmul's inputs are checked now.
    (DriftingBeforeAKeptMatmul, "recompute of .*drifting.* weight matmul 1 .*differ from its forward"),
])
def test_a_recompute_that_differs_raises_or_replays_the_forward(layer_class, raised):
    layer = layer_class(name="drifting")
    layer(X)
    if BACKEND == "torch":
        with pytest.raises(RecomputeError, match=raised):
            _drifting_gradients(layer, True)
        return
    assert_close(_drifting_gradients(layer, True)[1], _drifting_gradients(layer, False)[1])


@pytest.mark.skipif(BACKEND != "torch", reason="JAX's recompute cannot differ")
def test_check_false_skips_the_value_check():
    layer = Drifting(check=False)
    layer(X)
    outputs, gradients = _drifting_gradients(layer, True)
    assert all(g is not None for g in gradients)


def _values(layer):
    """JAX: the layer's trainable and non-trainable values, for `stateless_call`."""
    return [v.value for v in layer.trainable_variables], [v.value for v in layer.non_trainable_variables]


def _penalty_gradients(layer):
    """The gradient, by the weights, of the squared norm of the input gradient of `sum(sin(layer(x)))`."""
    if BACKEND == "jax":
        import jax

        trainable, non_trainable = _values(layer)

        def score(trainable, x):
            outputs, _ = layer.stateless_call(trainable, non_trainable, x)
            return jax.numpy.sum(jax.numpy.sin(outputs))

        def penalty(trainable, x):
            return jax.numpy.sum(jax.grad(score, argnums=1)(trainable, x) ** 2)

        value, gradients = jax.value_and_grad(penalty)(trainable, jax.numpy.asarray(X))
        return [np.asarray(value)] + [np.asarray(g) for g in gradients]
    import torch

    x = torch_tensor(X, requires_grad=True)
    (input_gradient,) = torch.autograd.grad(torch.sin(layer(x)).sum(), x, create_graph=True)
    penalty = (input_gradient**2).sum()
    gradients = torch.autograd.grad(penalty, [v.value for v in layer.trainable_variables])
    return [_numpy(penalty)] + [_numpy(g) for g in gradients]


def test_gradient_penalty_through_a_recomputed_block():
    keras.utils.set_random_seed(0)
    plain = Block()
    plain(X)
    recomputed = recomputed_class(Block)()
    with recompute_scope(False):
        recomputed(X)
    recomputed.set_weights(plain.get_weights())
    expected = _penalty_gradients(plain)
    with recompute_scope(True):
        actual = _penalty_gradients(recomputed)
    assert_close(actual, expected, what="penalty and its gradients")
    assert all(np.any(g != 0) for g in actual[1:])


class AttentionWithDropout(layers.Layer):
    """Self-attention with attention dropout, then a Dense with dropout: masks drawn in the call and its core."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(2, 8, dropout=0.2)
        self.dense = layers.Dense(16)
        self.dropout = layers.Dropout(0.3)

    def call(self, inputs, training=None):
        return inputs + self.dropout(self.dense(self.attention(inputs, inputs, training=training)), training=training)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's retain_graph (JAX differentiates functions: no graph kept)")
@pytest.mark.parametrize("policy", ["full", "attention_core", "save_dots"])
def test_a_second_backward_through_the_same_graph(policy):
    """Two losses of one forward, each differentiated with `retain_graph=True` (as a GAN's step), then `.backward()`
    twice: each backward recomputes again and equals the twin's, the masks the forward's (the tape that keeps them
    under `attention_core` was entered only once before 2026-12-04: an AttributeError). `"save_dots"` hands its kept
    matmuls to the first backward and refuses a second, naming `retain_graph`."""
    import torch

    x = np.random.RandomState(5).standard_normal((2, 5, 16)).astype("float32")
    plain, recomputed = build_twins(AttentionWithDropout, [x], policy=policy)

    def gradients(layer):
        inputs = torch_tensor(x, requires_grad=True)
        weights = [v.value for v in layer.trainable_variables]
        for weight in weights:
            weight.grad = None
        outputs = layer(inputs, training=True)
        first, second = torch.sin(outputs).sum(), (outputs**2).sum()
        got = list(torch.autograd.grad(first, [inputs] + weights, retain_graph=True))
        got += list(torch.autograd.grad(second, weights[:4], retain_graph=True))
        first.backward(retain_graph=True)
        first.backward()
        return [_numpy(g) for g in got + [w.grad for w in weights]]

    keras.utils.set_random_seed(1)
    expected = gradients(plain)
    keras.utils.set_random_seed(1)
    with recompute_scope(True):
        if policy == "save_dots":
            with pytest.raises(RecomputeError, match="retain_graph"):
                gradients(recomputed)
            return
        actual = gradients(recomputed)
    assert_close(actual, expected, what="gradients of two backwards through one graph")
    assert_recomputes(recomputed, [x], lambda layer, xs: layer(xs[0], training=True))


class Regularized(layers.Layer):
    """A loss added in the call from the call's own computation, and from a sub-layer's regularizer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = layers.Dense(3, activity_regularizer="l2")

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")

    def call(self, inputs):
        hidden = ops.matmul(inputs, self.kernel)
        self.add_loss(ops.sum(hidden**2))
        return self.inner(hidden)


def _with_losses_gradients(layer):
    """`(number of losses, gradients by the weights of sum(sin(y)) + the added losses)`."""
    if BACKEND == "jax":
        import jax

        trainable, non_trainable = _values(layer)
        counts = []

        def loss(trainable):
            outputs, _, losses = layer.stateless_call(trainable, non_trainable, jax.numpy.asarray(X), return_losses=True)
            counts.append(len(losses))
            return jax.numpy.sum(jax.numpy.sin(outputs)) + sum(losses)

        gradients = jax.grad(loss)(trainable)
        return counts[-1], [np.asarray(g) for g in gradients]
    import torch

    outputs = layer(torch_tensor(X))
    losses = layer.losses
    (torch.sin(outputs).sum() + sum(losses)).backward()
    gradients = [_numpy(v.value.grad).copy() for v in layer.trainable_variables]
    for v in layer.trainable_variables:
        v.value.grad = None
    return len(losses), gradients


def test_add_loss_inside_a_recomputed_call_is_differentiated_once():
    keras.utils.set_random_seed(0)
    plain = Regularized()
    plain(X)
    recomputed = recomputed_class(Regularized)()
    with recompute_scope(False):
        recomputed(X)
    recomputed.set_weights(plain.get_weights())
    expected_count, expected = _with_losses_gradients(plain)
    with recompute_scope(True):
        count, actual = _with_losses_gradients(recomputed)
    assert count == expected_count == 2
    assert_close(actual, expected, what="gradients with the added losses")


class ReadsItsState(layers.Layer):
    """Reads a state variable, assigns it, and reads it again (an EMA codebook: keras-hub's RQ-VAE)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 10), name="kernel")
        self.average = self.add_weight(shape=(10,), initializer="ones", trainable=False, name="average")

    def call(self, inputs, training=None):
        hidden = ops.tanh(ops.matmul(inputs, self.kernel))
        before = hidden + self.average  # the forward's state, before the call assigns it (a sum saves no operand)
        self.average.assign(0.5 * self.average + 0.5 * ops.mean(hidden, axis=0))
        return before + hidden * hidden * self.average  # what it just assigned


@pytest.mark.parametrize("mode", MODES)
def test_a_call_that_reads_the_state_it_assigns(mode):
    """Three steps as the twin's, the state too. Before the fix PyTorch's checkpoint raised (the recompute's read
    after the assign carried a gradient, so it saved more tensors than the forward)."""
    plain, _, _ = compare_with_twin(ReadsItsState, [X], mode, steps=3)
    assert not np.allclose(_numpy(plain.average.value), 1.0)  # the state moved, as the twin's did


class WithAnEmptyOutput(layers.Layer):
    """Returns an empty tensor beside its output (keras-hub's EdRec decoder block: an axis of size 0)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")

    def call(self, inputs, training=None):
        hidden = ops.tanh(ops.matmul(inputs, self.kernel))
        return hidden, hidden[:, :0]


@pytest.mark.parametrize("mode", MODES)
def test_a_call_with_an_empty_output_recomputes(mode):
    """PyTorch's recompute check fingerprints each output: an empty one has no values to differ (it raised)."""
    compare_with_twin(WithAnEmptyOutput, [X], mode)
