"""Twin comparisons for Keras 3 on whichever backend `KERAS_BACKEND` names.

Each backend takes its gradients the way its users do: `tf.GradientTape` on
TensorFlow, `jax.value_and_grad` over `Layer.stateless_call` on JAX (what
Keras's JAX trainer does), `loss.backward()` on PyTorch.
"""

import keras
import numpy as np
from keras import ops

import _compare

from keras_recompute import recompute_grad, recompute_scope

BACKEND = keras.config.backend()
MODES = {"tensorflow": ("eager", "function", "jit"), "jax": ("eager", "jit"), "torch": ("eager",)}[BACKEND]
# For a test that one mode is enough for: the cheapest (JAX runs op by op in eager mode).
FAST_MODE = "jit" if BACKEND == "jax" else "eager"
RTOL = _compare.RTOL


def recomputed_class(cls, **options):
    """A subclass of `cls` whose `call` is decorated."""
    return type(f"Recomputed{cls.__name__}", (cls,), {"call": recompute_grad(cls.call, **options)})


def _is_float(x):
    return "float" in str(ops.dtype(x))


def _projection(shape, index):
    """A fixed random tensor, so that the loss is not symmetric."""
    return np.random.RandomState(100 + index).standard_normal(shape).astype("float32")


def _loss(outputs):
    leaves = [out for out in keras.tree.flatten(outputs) if _is_float(out)]
    terms = [
        ops.sum(ops.sin(ops.cast(out, "float32")) * ops.convert_to_tensor(_projection(tuple(out.shape), i))) for i, out in enumerate(leaves)
    ]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def torch_tensor(array, requires_grad=False):
    """A torch tensor of `array` where Keras keeps its weights (a GPU when there is one)."""
    import torch
    from keras.src.backend.torch.core import get_device

    return torch.tensor(np.asarray(array), device=get_device(), requires_grad=requires_grad)


def _numpy(x):
    if x is None:
        return None
    if BACKEND == "torch":
        return x.detach().cpu().float().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32") if _is_float(x) else x))


def loss_and_gradients(layer, inputs, mode="eager", call=None):
    """Calls `layer` on `inputs` (a list) and differentiates a fixed loss.

    Non-trainable updates (moving statistics, seed states) are applied to the
    layer, as a training step would.

    Returns:
        `(outputs, gradients)` as NumPy: `gradients` lists the float inputs'
        gradients, then each trainable variable's (None where it gets none).
    """
    call = call or (lambda layer, xs: layer(*xs, training=True))
    floats = [i for i, x in enumerate(inputs) if np.issubdtype(np.asarray(x).dtype, np.floating)]
    return {"tensorflow": _tensorflow, "jax": _jax, "torch": _torch}[BACKEND](layer, inputs, floats, mode, call)


def _tensorflow(layer, inputs, floats, mode, call):
    import tensorflow as tf

    step = _tensorflow_step(layer, floats, call)
    if mode != "eager":
        step = tf.function(step, jit_compile=(mode == "jit"))
    outputs, grads = step([tf.convert_to_tensor(x) for x in inputs])
    return keras.tree.map_structure(_numpy, outputs), [_numpy(g) for g in grads]


def _tensorflow_step(layer, floats, call):
    import tensorflow as tf

    def step(xs):
        with tf.GradientTape() as tape:
            watched = [xs[i] for i in floats]
            tape.watch(watched)
            outputs = call(layer, xs)
            loss = _loss(outputs)
        return outputs, tape.gradient(loss, watched + list(layer.trainable_variables))

    return step


def _jax_step(layer, inputs, floats, call):
    """The loss-and-gradients function of a JAX training step, and its arguments."""
    import jax

    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    def stateless(trainable, float_inputs, others):
        xs = list(others)
        for i, x in zip(floats, float_inputs):
            xs[i] = x

        mapping = list(zip(layer.trainable_variables, trainable)) + list(zip(layer.non_trainable_variables, non_trainable))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            outputs = call(layer, xs)
        updated = [scope.get_current_value(v) for v in layer.non_trainable_variables]
        updated = [u if u is not None else v for u, v in zip(updated, non_trainable)]
        return _loss(outputs), (outputs, updated)

    grad_fn = jax.value_and_grad(stateless, argnums=(0, 1), has_aux=True)
    others = [None if i in floats else jax.numpy.asarray(x) for i, x in enumerate(inputs)]
    return grad_fn, (trainable, [jax.numpy.asarray(inputs[i]) for i in floats], others)


def step_program(layer, inputs, call):
    """JAX: the program of one training step (loss and gradients), as text.

    JAX traces a recomputed call once and replays the traced program, so a
    counter of Python calls cannot show the recompute; the program can: each
    recomputed operation appears in it once more, in the backward.
    """
    import jax

    floats = [i for i, x in enumerate(inputs) if np.issubdtype(np.asarray(x).dtype, np.floating)]
    grad_fn, arguments = _jax_step(layer, inputs, floats, call)
    return str(jax.make_jaxpr(grad_fn)(*arguments))


def step_op_count(layer, inputs, call=None):
    """How many operations one training step of `layer` runs: what a recompute adds to.

    TensorFlow: the ops of the step traced by `tf.function` (the recompute is
    built into the gradient). JAX: the equations of the step's program.
    PyTorch: the ATen ops dispatched in the forward and the backward. With
    recompute on, the recomputed ops are there a second time, in the backward;
    a decorator that did nothing leaves the count as it is.
    """
    call = call or (lambda layer, xs: layer(*xs, training=True))
    floats = [i for i, x in enumerate(inputs) if np.issubdtype(np.asarray(x).dtype, np.floating)]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        from _twins import graph_op_count

        step = tf.function(_tensorflow_step(layer, floats, call))
        return graph_op_count(step.get_concrete_function([tf.convert_to_tensor(x) for x in inputs]).graph)
    if BACKEND == "jax":
        return step_program(layer, inputs, call).count(" = ")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.count += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        _torch(layer, inputs, floats, "eager", call)
    return Counting.count


def assert_recomputes(layer, inputs, call=None):
    """Asserts that a step of `layer` with recompute on runs more operations than with it off."""
    with recompute_scope(False):
        plain = step_op_count(layer, inputs, call)
    with recompute_scope(True):
        recomputed = step_op_count(layer, inputs, call)
    assert recomputed > plain, f"{layer.name}: {recomputed} ops with recompute on, {plain} off: nothing was recomputed"
    return plain, recomputed


def _jax(layer, inputs, floats, mode, call):
    import jax

    grad_fn, arguments = _jax_step(layer, inputs, floats, call)
    if mode == "jit":
        grad_fn = jax.jit(grad_fn)
    (_, (outputs, updated)), (weight_grads, input_grads) = grad_fn(*arguments)
    for variable, value in zip(layer.non_trainable_variables, updated):
        variable.assign(value)
    return keras.tree.map_structure(_numpy, outputs), [_numpy(g) for g in list(input_grads) + list(weight_grads)]


def _torch(layer, inputs, floats, mode, call):
    import torch

    xs = [torch_tensor(x) for x in inputs]  # where Keras keeps the weights
    for i in floats:
        xs[i].requires_grad_(True)
    for variable in layer.trainable_variables:
        variable.value.grad = None
    outputs = call(layer, xs)
    _loss(outputs).backward()
    grads = [xs[i].grad for i in floats] + [v.value.grad for v in layer.trainable_variables]
    return keras.tree.map_structure(_numpy, outputs), [_numpy(g) for g in grads]


def assert_trained_alike(model, plain_model, initial, rtol=1e-4):
    """Asserts two models moved their weights alike from `initial` (the moves, normwise: `_compare`).

    For `fit` twins, trained with SGD: Adam divides each update by the
    gradient's own size, so a gradient doubled everywhere moved its weights
    the same, and such a twin passed.
    """
    weights = [np.asarray(ops.convert_to_numpy(w), np.float64) for w in model.weights]
    plain = [np.asarray(ops.convert_to_numpy(w), np.float64) for w in plain_model.weights]
    assert_close([w - w0 for w, w0 in zip(weights, initial)], [p - w0 for p, w0 in zip(plain, initial)], rtol, "weight moves")


def assert_close(actual, expected, rtol=RTOL, what="value"):
    """`_compare.assert_close` on NumPy leaves: equal up to float reassociation."""
    _compare.assert_close(keras.tree.flatten(actual), keras.tree.flatten(expected), rtol, what)


def build_twins(layer_class, inputs, call=None, **options):
    """A plain layer and a recomputed copy with the same weights and seeds."""
    call = call or (lambda layer, xs: layer(*xs, training=True))
    keras.utils.set_random_seed(0)
    plain = layer_class()
    call(plain, [ops.convert_to_tensor(x) for x in inputs])
    keras.utils.set_random_seed(0)
    recomputed = recomputed_class(layer_class, **options)()
    with recompute_scope(False):
        call(recomputed, [ops.convert_to_tensor(x) for x in inputs])
    recomputed.set_weights(plain.get_weights())
    return plain, recomputed


def compare_with_twin(layer_class, inputs, mode, call=None, steps=1, rtol=RTOL, **options):
    """Asserts that outputs and every gradient match the undecorated twin's, step after step."""
    plain, recomputed = build_twins(layer_class, inputs, call, **options)
    results = []
    for step in range(steps):
        keras.utils.set_random_seed(step)
        expected = loss_and_gradients(plain, inputs, mode, call)
        keras.utils.set_random_seed(step)
        with recompute_scope(True):
            actual = loss_and_gradients(recomputed, inputs, mode, call)
        assert_close(actual[0], expected[0], rtol, f"step {step} outputs")
        assert_close(actual[1], expected[1], rtol, f"step {step} gradients")
        assert len(actual[1]) > len(inputs) - 1
        results.append((actual, expected))
    assert_close(
        [_numpy(v.value) for v in recomputed.non_trainable_variables],
        [_numpy(v.value) for v in plain.non_trainable_variables],
        rtol,
        "non-trainable variables",
    )
    return plain, recomputed, results


def compare_on_and_off(layer, inputs, mode, call=None, steps=1, rtol=RTOL):
    """One layer (or model) with recompute off, then on, from the same variables and seeds.

    Each step's outputs and gradients must match, the same trainable
    variables must get a gradient (None stays None, a gradient stays one),
    and the state after the steps (moving statistics, seed states) too.

    Returns:
        `{False: results, True: results}`, each a list of `(outputs, gradients)` per step.
    """
    start = [np.array(ops.convert_to_numpy(v.value)) for v in layer.variables]
    runs, state = {}, {}
    for on in (False, True):
        for variable, value in zip(layer.variables, start):
            variable.assign(value)
        runs[on] = []
        for step in range(steps):
            keras.utils.set_random_seed(step)  # torch's own RNG too: unseeded dropout draws from it
            with recompute_scope(on):
                runs[on].append(loss_and_gradients(layer, inputs, mode, call))
        state[on] = [np.array(ops.convert_to_numpy(v.value)) for v in layer.non_trainable_variables]
    paths = [v.path for v in layer.trainable_variables]
    assert paths, "nothing to compare: the layer has no trainable variable"
    for step, ((outputs, gradients), (plain_outputs, plain_gradients)) in enumerate(zip(runs[True], runs[False])):
        missing = [p for p, a, e in zip(paths, gradients[-len(paths) :], plain_gradients[-len(paths) :]) if (a is None) != (e is None)]
        assert not missing, f"step {step}: these variables get a gradient only with recompute off, or only on: {missing}"
        assert_close(outputs, plain_outputs, rtol, f"step {step} outputs")
        assert_close(gradients, plain_gradients, rtol, f"step {step} gradients")
    assert_close(state[True], state[False], rtol, "non-trainable variables after the steps")
    return runs
