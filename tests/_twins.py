"""Helpers that compare a recomputed call with its undecorated twin (TF path)."""

import importlib

import numpy as np
import tensorflow as tf

import _compare

from keras_recompute import recompute_grad, recompute_scope

FRAMEWORKS = ("keras", "tf_keras")
MODES = ("eager", "function", "jit")
RTOL = _compare.RTOL


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


def leaves(structure):
    """The leaves of `structure`, a ragged or sparse tensor's components in its place (IndexedSlices stay whole)."""
    found = []
    for leaf in tf.nest.flatten(structure):
        composite = isinstance(leaf, (tf.RaggedTensor, tf.SparseTensor))
        found.extend(tf.nest.flatten(leaf, expand_composites=True) if composite else [leaf])
    return found


def loss_and_gradients(call, inputs, weights):
    """Runs `call(inputs)` under a tape; returns outputs and gradients.

    The gradients are those of the float leaves of `inputs`, then of each of
    `weights` (None where a weight gets no gradient).
    """
    float_inputs = [x for x in leaves(inputs) if x.dtype.is_floating]
    with tf.GradientTape() as tape:
        tape.watch(float_inputs)
        outputs = call(inputs)
        terms = [
            tf.reduce_sum(tf.cast(tf.sin(out) * _projection(out, i), tf.float32))
            for i, out in enumerate(leaves(outputs))
            if out.dtype.is_floating
        ]
        loss = tf.add_n(terms)
    return outputs, tape.gradient(loss, float_inputs + list(weights))


def _numpy(value):
    if value is None:
        return None
    value = tf.convert_to_tensor(value)  # IndexedSlices
    return np.asarray(tf.cast(value, tf.float64)) if value.dtype.is_floating else np.asarray(value)


def assert_close(actual, expected, rtol=RTOL, what="value"):
    """`_compare.assert_close` on TensorFlow values: equal up to float reassociation."""
    _compare.assert_close(
        [_numpy(a) for a in leaves(actual)], [_numpy(e) for e in leaves(expected)], rtol, what
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


def step_op_count(call, inputs, weights):
    """The ops of one training step of `call` (loss and gradients), traced by `tf.function`."""
    step = tf.function(lambda x: loss_and_gradients(call, x, weights), autograph=False)
    return graph_op_count(step.get_concrete_function(inputs).graph)


# The recompute check's functions, traced once and called (NOTE [ tracing the check ] in backends/tensorflow.py).
_CHECK_FUNCTIONS = ("_fingerprint_ops", "_difference", "_first_element")


def graph_op_count(graph):
    """The ops of a traced step: its graph's and those of the functions it calls (a while loop's body and condition,
    where an RNN's recompute runs), but the recompute check's: what a recompute adds is its forward again."""
    definition = graph.as_graph_def()
    called = [f for f in definition.library.function if not any(name in f.signature.name for name in _CHECK_FUNCTIONS)]
    return len(definition.node) + sum(len(f.node_def) for f in called)


def assert_recomputes(call, inputs, weights):
    """Asserts that a step with recompute on has more ops than with it off: the recompute is in its backward."""
    with recompute_scope(False):
        plain = step_op_count(call, inputs, weights)
    with recompute_scope(True):
        recomputed = step_op_count(call, inputs, weights)
    assert recomputed > plain, f"{recomputed} ops with recompute on, {plain} off: nothing was recomputed"


def copy_weights(source, target):
    target.set_weights(source.get_weights())


def on_and_off(K, build, inputs, mode, steps=2):
    """A model from `build()`, recompute off, then another from `build()`, recompute on.

    Two builds, not one model twice: tf_keras's seeded dropout advances a
    Python counter with each draw, which no seed setting rewinds.
    """
    runs = {}
    for on in (False, True):
        model = build()
        runs[on] = []
        for step in range(steps):
            K.utils.set_random_seed(step)

            def train_step(x):
                with tf.GradientTape() as tape:
                    outputs = model(x, training=True)
                    loss = tf.reduce_sum(tf.sin(outputs) * tf.cos(0.7 * outputs))
                return outputs, tape.gradient(loss, model.trainable_weights)

            with recompute_scope(on):
                runs[on].append(compile_mode(train_step, mode)(inputs))
        runs[on].append(([tf.convert_to_tensor(w) for w in model.non_trainable_weights], []))
    for step, (actual, expected) in enumerate(zip(runs[True], runs[False])):
        assert_close(actual[0], expected[0], what=f"step {step} outputs")
        assert_close(actual[1], expected[1], what=f"step {step} gradients")
    return runs
