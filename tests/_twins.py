"""Helpers that compare a recomputed call with its undecorated twin (TF path)."""

import importlib

import numpy as np
import tensorflow as tf

from keras_recompute import recompute_grad, recompute_scope

FRAMEWORKS = ("keras", "tf_keras")
MODES = ("eager", "function", "jit")
RTOL = 1e-5


def framework(name):
    return importlib.import_module(name)


def recomputed_class(cls, **options):
    """A subclass of `cls` whose `call` is decorated."""
    return type(f"Recomputed{cls.__name__}", (cls,), {"call": recompute_grad(cls.call, **options)})


def compile_mode(fn, mode):
    if mode == "eager":
        return fn
    return tf.function(fn, jit_compile=(mode == "jit"), reduce_retracing=False)


def _projection(tensor, index):
    """A fixed random tensor shaped like `tensor`, so the loss is not symmetric."""
    values = tf.random.stateless_normal(tf.shape(tensor), seed=[7, index])
    return tf.cast(values, tensor.dtype)


def loss_and_gradients(call, inputs, weights):
    """Runs `call(inputs)` under a tape; returns outputs and gradients.

    The gradients are those of the float leaves of `inputs`, then of each of
    `weights` (None where a weight gets no gradient).
    """
    float_inputs = [x for x in tf.nest.flatten(inputs) if x.dtype.is_floating]
    with tf.GradientTape() as tape:
        tape.watch(float_inputs)
        outputs = call(inputs)
        terms = [
            tf.reduce_sum(tf.cast(tf.sin(out) * _projection(out, i), tf.float32))
            for i, out in enumerate(tf.nest.flatten(outputs))
            if out.dtype.is_floating
        ]
        loss = tf.add_n(terms)
    return outputs, tape.gradient(loss, float_inputs + list(weights))


def assert_close(actual, expected, rtol=RTOL, what="value"):
    actual_leaves = tf.nest.flatten(actual)
    expected_leaves = tf.nest.flatten(expected)
    assert len(actual_leaves) == len(expected_leaves), what
    for index, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
        if e is None:
            assert a is None, f"{what}[{index}]: twin has no gradient, recompute has one"
            continue
        assert a is not None, f"{what}[{index}]: recompute lost a gradient"
        a, e = tf.convert_to_tensor(a), tf.convert_to_tensor(e)  # IndexedSlices
        if not e.dtype.is_floating:
            assert a.dtype == e.dtype, f"{what}[{index}]: dtype {a.dtype} != {e.dtype}"
            np.testing.assert_array_equal(a, e, err_msg=f"{what}[{index}]")
            continue
        a = np.asarray(tf.cast(a, tf.float64))
        e = np.asarray(tf.cast(e, tf.float64))
        assert a.shape == e.shape, f"{what}[{index}]: shape {a.shape} != {e.shape}"
        # A floor for gradients that are zero but for rounding noise (a bias
        # before a normalization, a key bias in attention).
        scale = max(float(np.max(np.abs(e))) if e.size else 0.0, 1e-2)
        error = float(np.max(np.abs(a - e))) / scale if e.size else 0.0
        assert error <= rtol, (
            f"{what}[{index}]: relative error {error:.3g} > {rtol} (largest value {scale:.3g}, shape {e.shape})"
        )


def compare_with_twin(plain, recomputed, inputs, mode, call=None, rtol=RTOL, weights="weights"):
    """Asserts outputs and every gradient of `recomputed` equal `plain`'s.

    Both layers must be built and hold the same weights. `call(layer, inputs)`
    calls a layer (default: `layer(inputs)`). `weights` names the attribute
    listing the weights whose gradients are compared.
    """
    call = call or (lambda layer, x: layer(x))
    plain_weights = getattr(plain, weights)
    recomputed_weights = getattr(recomputed, weights)
    assert len(plain_weights) == len(recomputed_weights)
    assert len(recomputed.trainable_weights) > 0

    def run(layer, weights):
        return compile_mode(lambda x: loss_and_gradients(lambda y: call(layer, y), x, weights), mode)

    expected = run(plain, plain_weights)(inputs)
    with recompute_scope(True):
        actual = run(recomputed, recomputed_weights)(inputs)
    assert_close(actual[0], expected[0], rtol, "outputs")
    assert_close(actual[1], expected[1], rtol, "gradients")
    return actual, expected


def copy_weights(source, target):
    target.set_weights(source.get_weights())
