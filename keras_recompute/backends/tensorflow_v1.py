"""The graph path for TensorFlow before 2.4: a recompute that `tf.gradients` differentiates.

NOTE [ recompute in a tf.gradients graph ]
Before TensorFlow 2.4 (NOTE [ TensorFlow versions ] in `_tf_private`) a
recomputed call in a graph that `tf.gradients` differentiates is served
here: TF 1.x graphs (standalone Keras 2.3, or TF 1.x's own tf.keras), and
standalone Keras 2.3's own graph on TF 2.0/2.1 (its `fit` and `K.gradients`
call `tf.gradients`). The forward builds the call's
ops as they are. Its float outputs, its float inputs, and every float
tensor and variable handle its ops read from outside the call (a variable
it reads, a reference variable's snapshot, a tensor it closes over) pass
through one `IdentityN` whose gradient is ours
(`gradient_override_map`). `tf.gradients` then reaches none of the forward's
ops (they receive no gradient), so the runtime frees their outputs once the
forward has used them. Our gradient builds the call again, on its inputs
made to wait for the incoming gradient (NOTE [ ordering the recompute in
graphs ] in `tensorflow`), reading the forward's variable reads (NOTE [ a
recompute reads what its forward read ]) and its random draws (NOTE
[ standalone Keras random draws ] in `_keras2`, NOTE [ tf.keras random
draws before TensorFlow 2.4 ] in `_tf_keras_builtin`), and differentiates it with
`tf.gradients` into each tensor that entered the `IdentityN`, each as a
partial derivative (the others held constant), which the outer gradient
carries on: every source the plain call's gradient reaches gets its part. TensorFlow's
`custom_gradient` is not used: in a TF 1.x graph it finds variables with a
tape (blind while recording is stopped) and records nothing for the
`tf.gradients` of a `tf.cond` v1.
"""

import contextlib
import itertools

import tensorflow as tf

from keras_recompute import _policy
from keras_recompute.backends import _keras2, _tf_keras_builtin
from keras_recompute.backends._tf_private import require_modern, tape_active
from keras_recompute.backends.tensorflow import (
    _arguments,
    _Expected,
    _flatten,
    _ForwardReads,
    _Head,
    _is_differentiable,
    _pack,
    _waiter,
)

# Each recomputed call registers a gradient function of its own, by name.
_names = itertools.count()


def recompute_call(fn, args, kwargs, context, check=True, policy="full"):
    """Calls `fn(*args, **kwargs)` in a graph, keeping only its inputs for the backward.

    Args and returns as `tensorflow.recompute_call`; `policy` must be `"full"`.

    Raises:
        RecomputeError: for what this TensorFlow cannot serve (eager
            execution on TF 1.x, a `GradientTape`, another policy), naming
            what to use instead.
    """
    name, owner = context.name, context.owner
    _refuse_what_cannot_work(name, owner, policy)
    graph = tf.compat.v1.get_default_graph()
    leaves, positions, constant_positions, call_with = _arguments(fn, args, kwargs, context)

    state = _tf_keras_builtin.capture(owner, name) if _tf_keras_builtin.is_layer(owner) else _keras2.capture(owner, name)
    reads = _ForwardReads(context.trains)
    first = graph._last_id
    with state.forward() if state else contextlib.nullcontext(), reads.recording():
        outputs = call_with([leaves[i] for i in positions])
    last = graph._last_id
    out_leaves = _flatten(outputs)
    out_positions = [i for i, leaf in enumerate(out_leaves) if _is_differentiable(leaf)]
    if not out_positions:
        return outputs
    heads = [_Head.of(out_leaves[i]) for i in out_positions]
    expected = _Expected(out_leaves, heads, keep_values=check)
    returned = _Head.differentiated(heads)
    inputs = [leaves[i] for i in positions]
    sources = _read_from_outside(graph, first, last, inputs)

    def grad(op, *upstream):
        upstream = [None if g is None else tf.convert_to_tensor(g) for g in upstream[: len(returned)]]
        if all(g is None for g in upstream):
            return [None] * len(op.inputs)
        # stop_gradient: the inner tf.gradients must not walk into the outer gradient.
        wait = _waiter([tf.stop_gradient(g) for g in upstream if g is not None])
        replay_inputs = [wait(x) for x in inputs]
        constants = [wait(leaves[i]) for i in constant_positions]
        with state.replay(wait) if state else contextlib.nullcontext(), reads.replaying():
            replayed = call_with(replay_inputs, constants, wait)
        replayed_heads, checks = expected.compare(_flatten(replayed), name, wait.exact)
        pairs = [(target, g) for target, g in zip(_Head.differentiated(replayed_heads), upstream) if g is not None]
        # Partial derivatives: a source may be computed from another (a snapshot from its variable).
        differentiated = replay_inputs + sources
        with tf.control_dependencies(checks):
            grads = tf.gradients(
                [target for target, _ in pairs],
                differentiated,
                grad_ys=[g for _, g in pairs],
                stop_gradients=differentiated,
            )
        return [None] * len(returned) + list(grads)

    gradient_name = f"KerasRecompute_{next(_names)}"
    tf.RegisterGradient(gradient_name)(grad)
    with graph.gradient_override_map({"IdentityN": gradient_name}):
        passed = tf.identity_n(returned + inputs + sources)
    new_leaves = list(out_leaves)
    for position, value in zip(out_positions, _Head.rebuild_all(heads, passed[: len(returned)])):
        new_leaves[position] = value
        # Keras 2 feeds the learning phase to a model only when an output says it uses it.
        if getattr(out_leaves[position], "_uses_learning_phase", False):
            value._uses_learning_phase = True
    return _pack(outputs, new_leaves)


def _read_from_outside(graph, first, last, inputs):
    """The float tensors and resource handles made before the forward (ops `first`..`last`) that its ops read, bar `inputs`.

    Without them the `IdentityN` would hide from `tf.gradients` a source the
    plain call's gradient reaches: a reference variable's snapshot, a
    resource variable read before the call, a tensor the call closes over,
    the handle of a variable read inside a cond v2 branch (BatchNormalization
    in inference, on TF 2.x), whose reads the forward cannot record.
    """
    known = {id(x) for x in inputs}
    found = []
    for op in graph.get_operations():
        if not first < op._id <= last:
            continue
        for tensor in op.inputs:
            if id(tensor) in known or tensor.dtype._is_ref_dtype:
                continue
            # A handle is a source wherever it was made: Keras 2.3's graph on TF 2.x
            # captures a variable's handle when the forward first reads it.
            handle = tensor.dtype == tf.resource and not tensor.op.inputs
            if handle or (_is_differentiable(tensor) and tensor.op._id <= first):
                known.add(id(tensor))
                found.append(tensor)
    return found


def _refuse_what_cannot_work(name, owner, policy):
    if policy != _policy.FULL:
        require_modern(f'policy="{policy}" ({name})', 'Use policy="full" here, or upgrade TensorFlow.')
    if tf.executing_eagerly():
        require_modern(
            f"recomputing {name} in eager execution or a tf.function",
            "Build the model in a graph (TensorFlow 1.x's default), or use TensorFlow 2.0 or newer, where "
            "tf.keras recomputes eagerly and in a tf.function.",
        )
    if tape_active():
        require_modern(
            f"recomputing {name} under a tf.GradientTape",
            "Take the gradient with tf.gradients (K.gradients, model.fit), or upgrade TensorFlow.",
        )
