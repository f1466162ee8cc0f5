"""Forward-mode differentiation and function transforms through a recomputed block: the plain call's derivatives.

NOTE [ forward-mode differentiation ] in `backends/tensorflow.py` and NOTE [ forward-mode differentiation on
JAX ] in `backends/jax.py`. Before them, TensorFlow's JVP of a recomputed block was None (eager) or zero (a
`tf.function` with the accumulator inside), and a Hessian-vector product half the plain one's, silently; JAX
raised its own error. Compared here with an undecorated twin that has the same weights and seeds (dropout on):
  * a JVP (forward mode): TensorFlow's `ForwardAccumulator`, `jax.jvp` and `jax.jacfwd`, PyTorch's dual tensors;
  * a Hessian-vector product (forward over reverse: an accumulator around a tape; `jax.jvp` of `jax.grad`);
  * on TensorFlow, reverse over forward (a tape around an accumulator), and a `tf.function` traced with
    recompute outside any accumulator and called inside one.
And PyTorch's `torch.func` transforms (`grad`, `vmap` of `grad`: per-sample gradients; NOTE [ torch.func
transforms ] in `backends/torch.py`), which raised on the recompute's saved-tensor hooks before.
Where the recompute cannot serve (forward mode on TensorFlow and JAX, any accumulator on TensorFlow, a
torch.func transform) the call runs plain with a warning naming it; where it can (JAX's forward over reverse, the function traced
outside), no warning, and on JAX the step is proven to recompute.
"""

import warnings

import keras
import numpy as np
import pytest
from keras import layers

from _keras3_twins import BACKEND, _numpy, assert_close, assert_recomputes, build_twins, torch_tensor

from keras_recompute import _errors, recompute_scope

X = np.random.RandomState(7).standard_normal((4, 16)).astype("float32")
TANGENT = np.random.RandomState(8).standard_normal((4, 16)).astype("float32")


class DropoutBlock(layers.Layer):
    """Dense, dropout, Dense, with a residual: a mask drawn in the call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = layers.Dense(32, activation="tanh")
        self.dropout = layers.Dropout(0.3)
        self.outer = layers.Dense(16)

    def call(self, inputs, training=None):
        return inputs * self.outer(self.dropout(self.inner(inputs), training=training))


@pytest.fixture
def warned(monkeypatch):
    """The warnings the recomputed calls give (each call's warning is given once a process: reset here)."""
    monkeypatch.setattr(_errors, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _runs_plain(caught):
    return [str(w.message) for w in caught if "runs as the plain call" in str(w.message)]


def _tensorflow(layer, kind, mode):
    import tensorflow as tf

    x, tangent = tf.constant(X), tf.constant(TANGENT)

    def step():
        if kind == "jvp":
            with tf.autodiff.ForwardAccumulator(x, tangent) as accumulator:
                y = layer(x, training=True)
            return y, accumulator.jvp(y)
        if kind == "hvp":  # forward over reverse
            with tf.autodiff.ForwardAccumulator(x, tangent) as accumulator:
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    loss = tf.reduce_sum(tf.sin(layer(x, training=True)))
                gradient = tape.gradient(loss, x)
            return gradient, accumulator.jvp(gradient)
        with tf.GradientTape() as tape:  # reverse over forward: the gradient of a JVP
            tape.watch(x)
            with tf.autodiff.ForwardAccumulator(x, tangent) as accumulator:
                y = layer(x, training=True)
            jvp = accumulator.jvp(y)
            loss = tf.reduce_sum(jvp**2)
        return jvp, tape.gradient(loss, [x] + [v.value for v in layer.trainable_variables])

    return step() if mode == "eager" else tf.function(step)()


def _jax(layer, kind, mode):
    import jax

    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]  # the dropout's seed state

    def forward(x):
        return layer.stateless_call(trainable, non_trainable, x, training=True)[0]

    def loss(x):
        return jax.numpy.sum(jax.numpy.sin(forward(x)))

    def by_weights(weights, x):
        return layer.stateless_call(weights, non_trainable, x, training=True)[0]

    def step(x, t):
        if kind == "hvp":  # forward over reverse
            return jax.jvp(jax.grad(loss), (x,), (t,))
        weight_tangents = [jax.numpy.full_like(w, 0.1) for w in trainable]
        return jax.jvp(forward, (x,), (t,)), jax.jacfwd(forward)(x), jax.jvp(lambda w: by_weights(w, x), (trainable,), (weight_tangents,))

    return (jax.jit(step) if mode == "jit" else step)(jax.numpy.asarray(X), jax.numpy.asarray(TANGENT))


def _torch(layer, kind, mode):
    del mode
    import torch
    import torch.autograd.forward_ad as forward_ad

    x, tangent = torch_tensor(X), torch_tensor(TANGENT)
    if kind == "jvp":
        with forward_ad.dual_level():
            y = layer(forward_ad.make_dual(x, tangent), training=True)
            primal, jvp = forward_ad.unpack_dual(y)
            return primal, jvp
    # forward over reverse: the JVP of the input gradient, by double backward (torch.autograd.functional.hvp)
    x.requires_grad_(True)
    (gradient,) = torch.autograd.grad(torch.sin(layer(x, training=True)).sum(), x, create_graph=True)
    return gradient, torch.autograd.grad(gradient, x, grad_outputs=tangent)[0]


KINDS = {"tensorflow": ["jvp", "hvp", "reverse_over_forward"], "jax": ["jvp", "hvp"], "torch": ["jvp", "hvp"]}[BACKEND]
MODES = {"tensorflow": ["eager", "function"], "jax": ["eager", "jit"], "torch": ["eager"]}[BACKEND]
# Where the recompute cannot serve, the call runs plain (NOTE [ forward-mode differentiation ]).
RUNS_PLAIN = {"tensorflow": {"jvp", "hvp", "reverse_over_forward"}, "jax": {"jvp"}, "torch": set()}[BACKEND]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_mode_through_a_recomputed_block_is_the_plain_blocks(kind, mode, warned):
    run = {"tensorflow": _tensorflow, "jax": _jax, "torch": _torch}[BACKEND]
    plain, recomputed = build_twins(DropoutBlock, [X])
    keras.utils.set_random_seed(1)
    expected = keras.tree.map_structure(_numpy, run(plain, kind, mode))
    keras.utils.set_random_seed(1)
    with recompute_scope(True):
        actual = keras.tree.map_structure(_numpy, run(recomputed, kind, mode))
    assert all(a is not None and np.any(a != 0) for a in keras.tree.flatten(actual)), "a derivative is None or zero"
    assert_close(actual, expected, what=f"{kind} ({mode})")
    said = _runs_plain(warned)
    if kind in RUNS_PLAIN:
        assert len(said) == 1 and recomputed.name in said[0], said
    else:
        assert not said, said
    if BACKEND == "jax" and kind == "hvp":  # forward over reverse still recomputes
        assert_recomputes(recomputed, [X], lambda layer, xs: layer(xs[0], training=True))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a tf.function traced outside an accumulator")
def test_a_function_traced_with_recompute_and_called_in_an_accumulator_recomputes_and_has_the_plain_jvp(warned):
    import tensorflow as tf

    plain, recomputed = build_twins(DropoutBlock, [X])
    x, tangent = tf.constant(X), tf.constant(TANGENT)
    results = []
    for layer, on in ((plain, False), (recomputed, True)):
        step = tf.function(lambda x, layer=layer: layer(x, training=True))
        keras.utils.set_random_seed(1)
        with recompute_scope(on):
            step.get_concrete_function(x)  # traced here, outside any accumulator
            with tf.autodiff.ForwardAccumulator(x, tangent) as accumulator:
                y = step(x)
        results.append((_numpy(y), _numpy(accumulator.jvp(y))))
        graph = step.get_concrete_function(x).graph
        recomputes = any("RecomputeGrad" in op.type or "IdentityN" == op.type for op in graph.get_operations())
        assert recomputes == on, [op.type for op in graph.get_operations()]
    assert results[1][1] is not None and np.any(results[1][1] != 0)
    assert_close(results[1], results[0], what="jvp")
    assert not _runs_plain(warned)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's linearize")
def test_jax_linearize_through_a_recomputed_block_raises_jaxs_error():
    """NOTE [ forward-mode differentiation on JAX ]: `jax.linearize` traces as `jax.grad` does, and its linear
    function raises JAX's error rather than give a wrong JVP."""
    import jax

    _, recomputed = build_twins(DropoutBlock, [X])
    trainable = [v.value for v in recomputed.trainable_variables]
    non_trainable = [v.value for v in recomputed.non_trainable_variables]
    with recompute_scope(True):
        _, linear = jax.linearize(lambda x: recomputed.stateless_call(trainable, non_trainable, x)[0], jax.numpy.asarray(X))
        with pytest.raises(TypeError, match="custom_vjp"):
            linear(jax.numpy.asarray(TANGENT))


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's torch.func")
@pytest.mark.parametrize("transform", ["grad", "per_sample_grad", "jvp"])
def test_torch_func_transforms_through_a_recomputed_block_are_the_plain_blocks(transform, warned):
    import torch

    plain, recomputed = build_twins(DropoutBlock, [X])  # inference: a vmap refuses random draws it was not told of
    x, tangent = torch_tensor(X), torch_tensor(TANGENT)

    def run(layer):
        def loss(rows):
            return torch.sin(layer(rows)).sum()

        if transform == "grad":
            return torch.func.grad(loss)(x)
        if transform == "per_sample_grad":
            return torch.func.vmap(torch.func.grad(lambda row: loss(row[None])))(x)
        return torch.func.jvp(lambda rows: layer(rows), (x,), (tangent,))[1]

    expected = _numpy(run(plain))
    with recompute_scope(True):
        actual = _numpy(run(recomputed))
    assert np.any(actual != 0)
    assert_close(actual, expected, what=f"torch.func {transform}")
    said = _runs_plain(warned)
    assert len(said) == 1 and recomputed.name in said[0] and "torch.func" in said[0], said
