"""The TF2 path: a custom gradient that recomputes the call.

Serves Keras 3 on the TensorFlow backend and tf_keras (Keras 2), in eager mode,
inside `tf.function` and inside `tf.function(jit_compile=True)`.

NOTE [ what the forward keeps ]
The forward runs with every gradient tape stopped, so no tape holds its
intermediate tensors; `tf.custom_gradient` records one op from the float
inputs (and the variables the call read) to the float outputs. Its gradient
function reruns the call under a fresh tape and differentiates it. What stays
alive between forward and backward is the inputs, the outputs, and the
snapshot of Keras 3 state (see `_keras3`).

NOTE [ ordering the recompute in graphs ]
In a graph (a `tf.function`, XLA, a TF1 session) nothing in the recompute
depends on the incoming gradient, so the runtime may run it as soon as the
inputs exist, during the forward, and every block's activations are alive at
once again; XLA's CSE may even merge it with the forward. So the recompute's
inputs are made to depend on the data of the incoming gradient: one element of
it is read, turned into a zero that no optimizer can prove to be zero
(`where(g == g, 0, nan)`: it is NaN for a NaN gradient, so it is not a
constant), and added to each input. `tf.recompute_grad` does the same, but only
in graph mode inside `tf.function`; see `_wait_for`.
"""

import tensorflow as tf

from keras_recompute._errors import RecomputeError
from keras_recompute.backends import _keras3
from keras_recompute.backends._tf_private import stop_recording


def _is_differentiable(value):
    return isinstance(value, tf.Tensor) and value.dtype.is_floating


def recompute_call(fn, args, kwargs, name):
    """Calls `fn(*args, **kwargs)`, keeping only its inputs for the backward.

    Args:
        fn: the undecorated function (`Layer.call`, a function, a callable).
        args: positional arguments, `self` first for a method.
        kwargs: keyword arguments.
        name: what to call `fn` in error messages.

    Returns:
        What `fn` returns, with the same structure.
    """
    structure = (args, kwargs)
    leaves = tf.nest.flatten(structure)
    positions = [i for i, leaf in enumerate(leaves) if _is_differentiable(leaf)]
    # Tensors that are closed over rather than differentiated (token ids,
    # boolean masks): the recompute makes them wait for the gradient too.
    constant_positions = [
        i for i, leaf in enumerate(leaves) if isinstance(leaf, tf.Tensor) and i not in positions
    ]

    def call_with(inputs, constants=None):
        new_leaves = list(leaves)
        for position, value in zip(positions, inputs):
            new_leaves[position] = value
        for position, value in zip(constant_positions, constants or ()):
            new_leaves[position] = value
        call_args, call_kwargs = tf.nest.pack_sequence_as(structure, new_leaves)
        return fn(*call_args, **call_kwargs)

    owner = args[0] if args else None
    keras_state = _keras3.capture(owner, tf.convert_to_tensor)
    # Filled by the forward: the output structure, and its non-float leaves,
    # which leave the custom gradient by this side door.
    forward = {}

    @tf.custom_gradient
    def checkpointed(*inputs):
        with stop_recording():
            outputs = call_with(inputs)
        out_leaves = tf.nest.flatten(outputs)
        out_positions = [
            i for i, leaf in enumerate(out_leaves) if _is_differentiable(leaf)
        ]
        forward["outputs"] = outputs
        forward["leaves"] = out_leaves
        forward["positions"] = out_positions

        def grad(*upstream, variables=None):
            variables = list(variables or ())
            frozen = _frozen_variable_ids(owner)
            trainable = [v for v in variables if v.trainable and id(v) not in frozen]
            pairs = [
                (position, g)
                for position, g in zip(out_positions, upstream)
                if g is not None
            ]
            if not pairs:
                return [None] * len(inputs), [None] * len(variables)
            wait = _waiter([g for _, g in pairs])
            replay_inputs = [wait(x) for x in inputs]
            constants = [wait(leaves[i]) for i in constant_positions]
            state = keras_state and keras_state.map_values(wait)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(replay_inputs)
                tape.watch(trainable)
                with _keras3.replay(state):
                    replayed = call_with(replay_inputs, constants)
            replayed_leaves = tf.nest.flatten(replayed)
            if len(replayed_leaves) != len(out_leaves):
                raise RecomputeError(
                    f"keras_recompute: the recompute of {name} returned "
                    f"{len(replayed_leaves)} tensors, the forward "
                    f"{len(out_leaves)}. A recomputed call must be a pure "
                    "function of its inputs and weights."
                )
            targets = [replayed_leaves[position] for position, _ in pairs]
            grads = tape.gradient(
                targets,
                replay_inputs + trainable,
                output_gradients=[g for _, g in pairs],
            )
            input_grads = grads[: len(replay_inputs)]
            by_variable = dict(zip((id(v) for v in trainable), grads[len(replay_inputs):]))
            variable_grads = [by_variable.get(id(v)) for v in variables]
            return input_grads, variable_grads

        return [out_leaves[i] for i in out_positions], grad

    float_outputs = checkpointed(*[leaves[i] for i in positions])
    out_leaves = list(forward["leaves"])
    for position, value in zip(forward["positions"], float_outputs):
        out_leaves[position] = value
    return tf.nest.pack_sequence_as(forward["outputs"], out_leaves)


def _frozen_variable_ids(owner):
    """Ids of the variables a layer holds as non-trainable.

    A tf_keras layer frozen with `layer.trainable = False` keeps trainable
    `tf.Variable`s underneath, which the variable watcher reports; they must
    get no gradient. (Keras 3's are replayed from the snapshot, never read.)
    Only the owner's own list is consulted: a trainable variable it reads but
    does not own (a tied embedding) keeps its gradient.
    """
    ids = set()
    for weight in getattr(owner, "non_trainable_weights", None) or ():
        ids.add(id(weight))
        inner = getattr(weight, "_variable", None)  # tf_keras AutoCastVariable
        if inner is not None:
            ids.add(id(inner))
    return ids


def _waiter(upstream):
    """Returns a function that makes a tensor depend on `upstream`'s data.

    See NOTE [ ordering the recompute in graphs ]. In eager mode the recompute
    runs when the gradient function is called, so nothing needs to wait; the
    function still returns a fresh tensor, so that a tensor passed twice
    (q = k = v in self-attention) is two sources of the tape, not one whose
    gradient would be counted twice.
    """
    if tf.executing_eagerly():
        return tf.identity
    gradient = upstream[0]
    element = tf.reduce_max(tf.reshape(gradient, [-1])[:1])
    # False only for a NaN gradient; no optimizer can fold it to a constant.
    finite = tf.equal(element, element)
    float_zero = tf.where(finite, 0.0, float("nan"))
    int_zero = tf.where(finite, 0, 1)

    def wait(tensor):
        if tensor.dtype.is_floating or tensor.dtype.is_complex:
            return tensor + tf.cast(float_zero, tensor.dtype)
        if tensor.dtype == tf.bool:
            return tf.logical_and(tensor, finite)
        if tensor.dtype.is_integer:
            return tensor + tf.cast(int_zero, tensor.dtype)
        return tf.identity(tensor)

    return wait
