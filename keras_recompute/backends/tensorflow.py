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
In a graph (a `tf.function`, XLA) nothing in the recompute depends on the
incoming gradient, so the runtime may run it as soon as the inputs exist,
during the forward, and every block's activations are alive at once again;
XLA's CSE may even merge it with the forward. So the recompute's inputs are
made to depend on the data of the incoming gradient: one element of it is
read, turned into a zero that no optimizer can prove to be zero
(`where(g == g, 0, nan)`: it is NaN for a NaN gradient, so it is not a
constant), and added to each float input (integers and booleans: `_waiter`,
NOTE [ a NaN gradient ]). `tf.recompute_grad` does this for the
differentiated inputs only. We also make the closed-over tensors
(masks, token ids) and the Keras random seeds wait: otherwise every block's
dropout masks, which depend on the seeds alone, are drawn early and all stay
alive until their block's backward. For the same reason the forward's seeds
wait for the forward's inputs (see `_keras3.capture`): under XLA, drawing all
forward masks at the start of the step cost +125 MB on the benchmark encoder.
Likewise a unit's input gradients wait for its weight gradients (`_after`):
the weight gradients read the recomputed activations, and a runtime that
defers them (one inter-op thread) otherwise held every unit's recomputed
activations to the end of the backward (a 6-block encoder under `full`:
156 MB against 87 MB with the wait, batch 64).

NOTE [ forward-mode differentiation ]
Inside a `tf.autodiff.ForwardAccumulator`, a recomputed call runs as the
plain call (with a warning once per call). TensorFlow computes a custom
gradient's JVP by differentiating its gradient function; for ours (and any
whose forward runs with the tapes stopped) it got none: found 2026-12-04,
a block's JVP was None in eager mode, and in a `tf.function` with the
accumulator inside it zero, and a Hessian-vector product (an accumulator
around a tape) half the plain one's norm, silently. `tf.recompute_grad`
raises there instead. Pure forward mode keeps no activations to recompute;
forward-over-reverse keeps the plain call's. A `tf.function` traced with
recompute outside any accumulator and called inside one is differentiated
through its graph's gradient, and its JVP is the plain one's; one first
traced inside an accumulator keeps the plain call when called outside it
(TensorFlow does not trace it again).
"""

import collections.abc
import contextlib
import functools
import os
import threading

import tensorflow as tf

from keras_recompute import _context, _patch, _policy
from keras_recompute._errors import RecomputeError, warn_runs_plain
from keras_recompute.backends import _keras2, _keras3, _tf_keras, _tf_keras_builtin
from keras_recompute.backends._tf_private import (
    LEGACY,
    OP_CALLBACKS,
    TF_VERSION,
    custom_gradient,
    forward_accumulator_active,
    in_xla_context,
    ops_made,
    require_modern,
    stop_recording,
    tell_variable_watchers,
    tf_2_behavior,
    tracked_by_a_tape,
    variable_reads,
    watching_variables,
)


def _read_variables(context, reads):
    """The trained variables a call's forward may have read: its layer's, and those the read hook saw.

    Only for TensorFlow before 2.4 (NOTE [ custom gradients before TensorFlow 2.4 ] in `_tf_private`).
    """
    found = {}
    owner = context.owner
    candidates = list(owner.weights) if _context.is_layer(owner) else []
    for variable in candidates + reads.variables():
        if context.trains(variable):
            variable = getattr(variable, "_variable", variable)  # an AutoCastVariable's: a tape watches that
            found.setdefault(id(variable), variable)
    return list(found.values())


def _refuse_unseen_variables(tape, variables, context):
    """Raises if the recompute read a trained variable the custom gradient does not differentiate.

    Before TensorFlow 2.4 the variables of a recomputed call are its layer's
    and those the read hook saw; eager ops read through a path no hook sees, so
    a trained variable from elsewhere (one a call closes over) would get no
    gradient: the tape of the recompute, which watches what it reads, finds it.
    """
    given = set()
    for variable in variables:
        given.update((id(variable), id(getattr(variable, "_variable", variable))))
    for variable in tape.watched_variables():
        if id(variable) not in given and context.trains(variable):
            require_modern(
                f"recomputing {context.name}, which reads {variable.name!r}, a trained variable that is "
                "not one of its layer's weights, in eager execution,",
                "Track the variable on the layer (set it as an attribute), run the step in a tf.function, "
                "or upgrade TensorFlow.",
            )


def _flatten(structure):
    """The tensors of `structure`, a ragged or sparse tensor's components among them (NOTE [ composite tensors ])."""
    return tf.nest.flatten(structure, expand_composites=True)


def _pack(structure, leaves, masks=True):
    """`structure` rebuilt from `_flatten`'s `leaves`; with `masks`, each tensor with the mask Keras attached to the one
    it replaces.

    NOTE [ composite tensors ]
    A `tf.RaggedTensor` or `tf.SparseTensor` (an argument, or what the call
    returns) is differentiated through its float component (`flat_values`,
    `values`); its index components (row splits, indices, shape) pass as
    token ids do. Taken whole, as one leaf, it was neither an input nor an
    output of the custom gradient: a ragged output carried no gradient at all
    (every weight's and input's None, no error), a ragged input none to the
    layers before. So the call's arguments and outputs are taken apart into
    their components and rebuilt around them (a variable stays one leaf:
    `tf.nest` does not expand it).
    """
    rebuilt = tf.nest.pack_sequence_as(structure, leaves, expand_composites=True)
    if masks:
        _context.copy_masks(tf.nest.flatten(structure), tf.nest.flatten(rebuilt))
    return rebuilt


class _ClosedOver:
    """The float tensors a call's forward reads that it was not given: made before it, and closed over.

    NOTE [ tensors a call closes over ]
    A call may read a tensor it does not take as an argument: one set as an
    attribute of its layer (`self.memory = encoder_output` before the call),
    or one a decorated function closes over (`pos = embed(positions)` read
    inside `@recompute_grad def block(h)`). As an input of the call's ops
    only, not of the custom gradient, it got no gradient: the layers that
    made it did not train (every weight of a position embedding read so had
    the gradient None, with no error; JAX and PyTorch were right). So while
    the forward runs, TensorFlow's op callbacks (`_tf_private.ops_made`)
    list the float tensors its ops read that none of them made and that are
    not its arguments, and these are inputs of the custom gradient too; the
    recompute, which reads the same tensors, differentiates into them. The
    forward runs before the custom gradient is made (it tells TensorFlow's
    variable watchers what it read, for the custom gradient to ask their
    gradients, `_tf_private.tell_variable_watchers`). In eager execution a
    tensor is kept only if a tape records it (`tracked_by_a_tape`: the
    forward runs with the tapes stopped, so nothing it made passes), so a
    constant read costs nothing. In a graph, a tensor made before the
    forward (an op id at most the graph's largest before it; a tensor the
    forward made in an op the callbacks did not see is never taken for one)
    or a capture the forward made of one outside its function is kept
    whether a tape records it or not: the gradient of a `tf.function` may be
    taken by `tf.gradients`, which no tape sees. An argument that is also
    read as an attribute gets its gradient through the argument only.

    NOTE [ tensors closed over without op callbacks ]
    TensorFlow 2.0 has no op callbacks, and its own tf.keras runs a call in
    eager mode or in a `tf.function` (Keras's `fit`) on this path: there a
    tensor the call closed over got no gradient, silently. In a graph the
    ops the forward made are read from the graph instead (every op with an
    id above the graph's largest before it, in order: what the callbacks
    would have told, and the ops made another way too). In eager mode
    nothing lists the ops run, so the tensors the call can reach without
    taking them are taken: those set as attributes of its layer and of the
    layers in it, and those its function closes over (its closure's cells),
    and the globals its code names (a training script's module-level
    tensor), each alone or in a list, tuple or dict, and each kept only if a
    tape records it. One the call reaches another way (an attribute of an
    object that is not a layer, a module's attribute) is not seen in eager
    mode there: pass it as an argument.
    """

    def __init__(self, leaves, owner=None, fn=None):
        self._given = {id(leaf) for leaf in leaves if isinstance(leaf, tf.Tensor)}
        self._found = []
        self._owner, self._fn = owner, fn

    @contextlib.contextmanager
    def watching(self):
        eager = tf.executing_eagerly()
        graph = None if eager else tf.compat.v1.get_default_graph()
        first = None if eager else max(graph._nodes_by_id, default=0)
        produced, captured, candidates = set(), set(), {}
        given = self._given

        def seen(op_type, inputs, outputs, op_graph):
            if op_graph is not graph:  # a function traced inside the forward, or a graph op under eager
                return
            for tensor in inputs:
                key = id(tensor)
                if key not in produced and key not in given and _is_differentiable(tensor):
                    candidates.setdefault(key, tensor)
            if op_type == "Placeholder" and not eager:
                captured.update(id(t) for t in outputs)  # a capture of a tensor outside the function, made now
            else:
                produced.update(id(t) for t in outputs)

        if OP_CALLBACKS:
            with ops_made(seen):
                yield
        else:  # pragma: no cover - TensorFlow 2.0: NOTE [ tensors closed over without op callbacks ]
            yield
            if eager:
                for tensor in _reachable_tensors(self._owner, self._fn):
                    if id(tensor) not in given and _is_differentiable(tensor):
                        candidates.setdefault(id(tensor), tensor)
            else:
                nodes = graph._nodes_by_id
                for key in sorted(key for key in nodes if key > first):
                    op = nodes[key]
                    seen(op.type, list(op.inputs), list(op.outputs), graph)
        if eager:
            self._found = [t for t in candidates.values() if tracked_by_a_tape(t)]
        elif candidates:
            external = {id(internal): outside for outside, internal in getattr(graph, "captures", ())}

            def outside(key, tensor):
                if key in external:  # a capture: of an argument passed in from outside, that argument
                    return id(external[key]) not in given and (tensor.op._id <= first or key in captured)
                return tensor.op._id <= first

            self._found = [tensor for key, tensor in candidates.items() if outside(key, tensor)]

    def tensors(self):
        return list(self._found)


def _reachable_tensors(owner, fn):
    """The tensors the call can reach without taking them: set as attributes of the layer `owner` and of the layers
    in it, closed over by `fn`, or globals its code names; each alone or in a list, tuple or dict (NOTE [ tensors
    closed over without op callbacks ])."""
    layers = [] if owner is None else [owner, *_context.sublayers(owner)]
    values = [value for layer in layers for value in vars(layer).values()]
    function = getattr(fn, "__func__", fn)
    for cell in getattr(function, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    namespace = getattr(function, "__globals__", None) or {}
    values += [namespace[name] for name in _names_read(getattr(function, "__code__", None)) if name in namespace]
    return [tensor for value in values for tensor in _tensors_in(value)]


def _names_read(code):
    """The global names `code` and the functions defined in it (a comprehension's, a lambda's) may read."""
    if code is None:
        return set()
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _names_read(constant)
    return names


def _tensors_in(value):
    """The tensors of `value`: itself, or those in it where it is a list, tuple or dict (Keras's tracked ones too)."""
    if isinstance(value, tf.Tensor):
        return [value]
    if isinstance(value, (list, tuple, dict, collections.abc.Mapping)):
        try:
            return [leaf for leaf in tf.nest.flatten(value) if isinstance(leaf, tf.Tensor)]
        except (TypeError, ValueError):  # a structure nest cannot take apart (keys that do not sort)
            return []
    return []


def _as_read_here(tensor):
    """`tensor` as the recompute's ops read it: in a function traced for a gradient, its capture there."""
    if tf.executing_eagerly() or not hasattr(tensor, "graph"):
        return tensor
    graph = tf.compat.v1.get_default_graph()
    if tensor.graph is graph or not hasattr(graph, "capture"):
        return tensor
    return graph.capture(tensor)


def _is_differentiable(value):
    """A float or complex tensor (a complex one, an FFT's, was taken for a constant: its gradient lost)."""
    return isinstance(value, tf.Tensor) and (value.dtype.is_floating or value.dtype.is_complex)


def recompute_call(fn, args, kwargs, context, check=True, policy="full", offload=False):
    """Calls `fn(*args, **kwargs)`, keeping only its inputs for the backward.

    Args:
        fn: the undecorated function (`Layer.call`, a function, a callable).
        args: positional arguments, `self` first for a method.
        kwargs: keyword arguments.
        context: the call's `CallContext` (its layer, masks, trainable variables).
        check: compare the recompute's outputs with the forward's and raise
            `RecomputeError` when they differ (see NOTE [ the recompute check ]).
        policy: `"full"`, or `"save_dots"`: the outputs of the weight
            matmuls of the Dense and EinsumDense layers in the call are kept
            (NOTE [ save_dots on TensorFlow ]).
        offload: not offered on TensorFlow: `True` raises ValueError (NOTE
            [ offload ] in `_policy`).

    Returns:
        What `fn` returns, with the same structure.
    """
    if offload:
        raise ValueError(_policy.offload_refused_message(context.name, "tensorflow"))
    if forward_accumulator_active():  # NOTE [ forward-mode differentiation ]
        warn_runs_plain(context.name, "inside a tf.autodiff.ForwardAccumulator, where a recomputed call has no JVP")
        return fn(*args, **kwargs)
    if LEGACY and (TF_VERSION < (2, 0) or _keras2.is_layer(context.owner) or not tf_2_behavior()):
        from keras_recompute.backends import tensorflow_v1  # NOTE [ TensorFlow versions ] in `_tf_private`

        return tensorflow_v1.recompute_call(fn, args, kwargs, context, check=check, policy=policy)
    if LEGACY and policy != _policy.FULL:
        require_modern(f'policy="{policy}" ({context.name})', 'Use policy="full" here, or upgrade TensorFlow.')
    name, owner = context.name, context.owner
    leaves, positions, constant_positions, call_with = _arguments(fn, args, kwargs, context)

    tensor_leaves = [leaf for leaf in leaves if isinstance(leaf, tf.Tensor)]
    forward_wait = None
    if tensor_leaves and not tf.executing_eagerly():
        forward_wait = _waiter(tensor_leaves[:1])
    keras_state = _keras3.capture(owner, tf.convert_to_tensor, forward_wait, eager=tf.executing_eagerly(), backend="tensorflow")
    if _tf_keras_builtin.loaded():  # TensorFlow's own tf.keras before 2.4
        legacy_state, loss_lists = _tf_keras_builtin.capture(owner, name), _tf_keras_builtin.loss_lists(owner)
    else:
        legacy_state = None if _keras3.is_layer(owner) else _tf_keras.capture(owner, name)
        loss_lists = _keras3.loss_lists(owner) or _tf_keras.loss_lists(owner)
    dots = _KeptDots(owner, name, context.trains, check) if policy == _policy.SAVE_DOTS else None
    masks = _KeptMasks() if _policy.keeps_dropout_masks(policy) and _keras3.is_layer(owner) else None
    reads = _ForwardReads(context.trains)
    # In a graph, as the custom gradient takes them: an eager tensor passed in, captured.
    eager = tf.executing_eagerly()
    inputs = [leaves[i] if eager else tf.convert_to_tensor(leaves[i]) for i in positions]
    closure = _ClosedOver(leaves + inputs, owner, fn)
    loss_counts = [len(losses) for losses in loss_lists]
    # The forward runs before the custom gradient is made, so that the tensors it
    # closes over can be inputs of it (NOTE [ tensors a call closes over ]).
    with watching_variables() as watcher, closure.watching():
        with stop_recording(), (legacy_state.forward() if legacy_state else contextlib.nullcontext()):
            with reads.recording(), dots.recording() if dots else contextlib.nullcontext():
                with masks.recording() if masks else contextlib.nullcontext():
                    outputs = call_with(inputs)
    read_variables = watcher.watched_variables()
    closed = closure.tensors()
    out_leaves = _flatten(outputs)
    out_positions = [i for i, leaf in enumerate(out_leaves) if _is_differentiable(leaf)]
    heads = [_Head.of(out_leaves[i]) for i in out_positions]
    # NOTE [ add_loss ]: a loss added inside the call is an output of the
    # call: computed with the tapes stopped, it would carry no gradient.
    added = [
        (losses, index)
        for losses, count in zip(loss_lists, loss_counts)
        for index in range(count, len(losses))
        if _is_differentiable(losses[index])
    ]
    expected = _Expected(out_leaves, heads, keep_values=check)

    def grad(*upstream, variables=None):
        variables = list(variables or ())
        trainable = [v for v in variables if context.trains(v)]
        sources = len(inputs) + len(closed)
        if all(g is None for g in upstream):
            return [None] * sources, [None] * len(variables)
        wait = _waiter([g for g in upstream if g is not None])
        replay_inputs = [wait(x) for x in inputs]
        replay_closed = [_as_read_here(x) for x in closed]
        constants = [wait(leaves[i]) for i in constant_positions]
        state = keras_state and keras_state.map_values(wait)
        with tf.GradientTape(watch_accessed_variables=LEGACY) as tape:
            tape.watch(replay_inputs + replay_closed)
            tape.watch(trainable)
            keras_replay = _keras3.replay(state, owner)
            legacy_replay = legacy_state and legacy_state.replay(wait)
            with keras_replay, (legacy_replay or contextlib.nullcontext()), reads.replaying():
                with dots.replaying(wait) if dots else contextlib.nullcontext():
                    with masks.replaying() if masks else contextlib.nullcontext():
                        replayed = call_with(replay_inputs, constants, wait)
        if LEGACY:
            _refuse_unseen_variables(tape, variables, context)
        replayed_heads, checks = expected.compare(_flatten(replayed), name, wait.exact, as_data=True)
        if dots:
            checks += dots.compare(wait.exact, as_data=True)
        replayed_losses = [
            loss
            for loss in keras_replay.losses + (legacy_replay.losses if legacy_replay else [])
            if _is_differentiable(loss)
        ]
        if len(replayed_losses) != len(added):
            raise RecomputeError(
                f"keras_recompute: the recompute of {name} added {len(replayed_losses)} "
                f"losses with add_loss, its forward {len(added)}. A recomputed "
                "call must add the same losses each time."
            )
        targets = _Head.differentiated(replayed_heads) + replayed_losses
        pairs = [(target, g) for target, g in zip(targets, upstream) if g is not None]
        asserts = [check for check in checks if not isinstance(check, tf.Tensor)]
        with tf.control_dependencies(asserts):
            grads = tape.gradient(
                [t for t, _ in pairs],
                replay_inputs + replay_closed + trainable,
                output_gradients=_add_checks([g for _, g in pairs], checks),
            )
        input_grads = _after(grads[:sources], grads[sources:])
        by_variable = dict(zip((id(v) for v in trainable), grads[sources:]))
        variable_grads = [by_variable.get(id(v)) for v in variables]
        return input_grads, variable_grads

    added_losses = [losses[index] for losses, index in added]

    def checkpointed(*_):  # the inputs: the forward ran already
        tell_variable_watchers(read_variables)  # what the forward read, as if read here
        return _Head.differentiated(heads) + added_losses, grad

    results = custom_gradient(checkpointed, lambda: _read_variables(context, reads))(*inputs, *closed)
    count = len(_Head.differentiated(heads))
    for (losses, index), loss in zip(added, results[count:]):
        losses[index] = loss
    out_leaves = list(out_leaves)
    for position, value in zip(out_positions, _Head.rebuild_all(heads, results[:count])):
        out_leaves[position] = value
    return _pack(outputs, out_leaves)


def _arguments(fn, args, kwargs, context):
    """A call's arguments as leaves, and a function that calls `fn` with some of them replaced.

    Returns:
        `(leaves, positions, constant_positions, call_with)`: the leaves of
        `(args, kwargs)`; the positions of the float tensors (differentiated);
        of the other tensors (token ids, boolean masks: closed over, and made
        to wait for the gradient in the recompute too); and
        `call_with(inputs, constants=None, wait=None)`, the call on `inputs`
        (and `constants`) in their places; with `wait`, the recompute: its
        fresh tensors get the call's masks.
    """
    structure = (args, kwargs)
    leaves = _flatten(structure)
    positions = [i for i, leaf in enumerate(leaves) if _is_differentiable(leaf)]
    constant_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, tf.Tensor) and i not in positions]

    def call_with(inputs, constants=None, wait=None):
        new_leaves = list(leaves)
        for position, value in zip(positions, inputs):
            new_leaves[position] = value
        for position, value in zip(constant_positions, constants or ()):
            new_leaves[position] = value
        # The forward's masks copied, should TensorFlow have passed a copy; the recompute's attached below.
        call_args, call_kwargs = _pack(structure, new_leaves, masks=wait is None)
        if wait is None:
            return fn(*call_args, **call_kwargs)
        with context.masks_attached(call_args, call_kwargs, transform=wait):
            return fn(*call_args, **call_kwargs)

    return leaves, positions, constant_positions, call_with


class _ForwardReads:
    """The values a call's forward read from its trained variables, handed to its recompute.

    NOTE [ a recompute reads what its forward read ]
    A gradient must use the weights its forward used. A plain call's does:
    its backward holds the tensors the forward read. A recompute that reads
    its variables again reads them in the backward, and nothing orders that
    read before the optimizer's write of the same variable: in a TF1-style
    graph no edge does; in a `tf.function` automatic control dependencies add
    one, which Grappler's dependency optimizer was seen to drop (the
    `"save_dots"` kernel gradient read its weights under the recompute
    check's control dependencies: 2-5 of 40 repeated steps updated with
    another model's weights, up to 6.7 normwise at lr 1.0; exact with that
    optimizer off or one inter-op thread). So while the forward runs, each
    read of a trained variable in the call's graph is recorded
    (`_tf_private.variable_reads`), and the recompute's reads of it hand out
    the forward's, in order (the k-th read gets the forward's k-th, the last
    one past that): the recompute depends on them by data, which no
    scheduler or optimizer reorders, and reads exactly the forward's values
    even where the call itself assigns a weight between two reads. Each
    value handed out is recorded on the tapes as a read of its variable, so
    the recompute's tape, which watches the trained variables, takes their
    gradients through it, as does an outer tape (a gradient penalty). A read
    in a nested graph (a `tf.cond` branch, a loop body, a nested
    `tf.function`), whose tensors cannot leave it, reads the variable; where
    the whole call runs in a loop body or a branch, through the handle its
    forward read it through (NOTE [ a recompute inside a loop or a branch ]). In
    eager mode ops run in the order they are called, the optimizer's write
    after the whole gradient, and eager ops read variables through a C++
    path that no hook sees: there the recompute reads the variables as
    before, and nothing is recorded. The forward's reads alias
    the variable's buffer: keeping them costs no memory, as a plain call's
    backward keeps them. Variables that do not train are not recorded: the
    seed states and moving statistics a call assigns are replayed by the
    Keras state (`_keras3`, `_tf_keras`), and frozen weights are not written
    in a step.
    """

    def __init__(self, trains):
        self._trains = trains
        self._graph = None
        self._reads = {}  # id(variable) -> the forward's reads of it, in order
        self._variables = {}  # id(variable) -> the variable
        self._handles = {}  # id(variable) -> its handle in a control-flow graph the forward ran in
        self._in_control_flow = False  # whether the forward runs in one
        self._positions = {}
        self._deciding = False

    @contextlib.contextmanager
    def recording(self):
        self._reads.clear()
        self._variables.clear()
        self._handles.clear()
        self._graph = tf.compat.v1.get_default_graph()
        self._in_control_flow = not tf.executing_eagerly() and _is_control_flow_graph(self._graph)
        with contextlib.nullcontext() if tf.executing_eagerly() else variable_reads(self._record):
            yield

    @contextlib.contextmanager
    def replaying(self):
        self._positions.clear()
        with variable_reads(self._replay) if self._reads or self._handles else contextlib.nullcontext():
            yield

    def _record(self, variable, read):
        value = read()
        if self._deciding or tf.compat.v1.get_default_graph() is not self._graph:
            return value
        if self._in_control_flow and getattr(value, "op", None) is not None and value.op.type == "ReadVariableOp":
            self._handles.setdefault(id(variable), value.op.inputs[0])  # NOTE [ a recompute inside a loop or a branch ]
        self._deciding = True  # deciding may read a variable itself (a distributed one's attributes)
        try:
            trains = self._trains(variable)
        finally:
            self._deciding = False
        if trains:
            self._reads.setdefault(id(variable), []).append(value)
            self._variables[id(variable)] = variable
        return value

    def variables(self):
        """The trained variables the forward read (in a graph; eager reads are not seen)."""
        return list(self._variables.values())

    def _replay(self, variable, read):
        reads = self._reads.get(id(variable))
        if tf.compat.v1.get_default_graph() is not self._graph:
            handle = self._handles.get(id(variable))
            if handle is None:
                return read()
            # The forward ran in a loop's body or a branch, its backward in that control flow's gradient graph
            # (NOTE [ a recompute inside a loop or a branch ]).
            from tensorflow.python.ops import gen_resource_variable_ops

            return gen_resource_variable_ops.read_variable_op(handle, variable.dtype)
        if not reads:
            return read()
        position = self._positions.get(id(variable), 0)
        self._positions[id(variable)] = position + 1
        return reads[min(position, len(reads) - 1)]


# NOTE [ a recompute inside a loop or a branch ]
# A recomputed call can run inside a `tf.while_loop` body (a Keras RNN layer's
# cell, in a `tf.function`) or a `tf.cond` branch. Its backward then runs in
# that control flow's gradient graph, another graph than its forward's, and
# TensorFlow builds such a gradient graph only from tensors of the forward's
# graph or of the graph around it. A read of a variable there through its
# handle captured the eager handle itself, which the loop's gradient refused
# ("is in list of internal_captures but not in internal_capture_to_output")
# and the branch's too ("Tensor.graph is undefined when eager execution is
# enabled"); `tf.recompute_grad` fails the same way. So where the forward runs
# in a control-flow graph, `_ForwardReads` records the handle each variable
# was read through there (the body's or branch's placeholder for it), and the
# recompute reads the variable through that handle: a loop invariant, which
# the loop's gradient takes as it is (not stacked per iteration, as a read's
# value would be), and which the branch's gradient maps to the handle outside.
# The read sits inside the gradient's `While` or `If` op, which every
# gradient it computes leaves, so no optimizer's write of that variable can
# come before it. Found 2026-11-30 (a decorated RNN cell in `fit`).
def _is_control_flow_graph(graph):
    """Whether `graph` is a `tf.while_loop` body or condition, or a `tf.cond` branch (control flow v2)."""
    try:
        from tensorflow.python.ops import control_flow_v2_func_graphs as graphs
    except ImportError:  # pragma: no cover - TensorFlow 1.x
        return False
    kinds = tuple(getattr(graphs, name) for name in ("CondBranchFuncGraph", "WhileBodyFuncGraph", "WhileCondFuncGraph")
                  if hasattr(graphs, name))
    return isinstance(graph, kinds)


class _KeptDots:
    """The outputs of a call's weight matmuls, kept by its forward and handed to its recompute.

    NOTE [ save_dots on TensorFlow ]
    TensorFlow has no policy for what a tape saves, so the weight matmuls are
    found as layers: the Dense and EinsumDense layers under the call's layer
    (Keras 3 and tf_keras; attention projections are EinsumDense). In the
    forward each of them runs its own `call` with its activation taken off,
    which gives `x @ kernel + bias` whatever the variant (LoRA, int8); that
    value is kept, and the activation is applied after. In the recompute the
    same layer returns the activation of a kept op: its value is the kept
    tensor, and its gradient runs the layer's linear call again under a tape
    from the recomputed input and differentiates it. In a graph (a
    `tf.function`, XLA, TF1) the gradient of a matmul needs its inputs, not
    its output, so the runtime prunes the matmul of that second run and the
    recompute runs no kernel matmul. In eager mode every op runs as it is
    called: the matmul runs again in the backward, and `"save_dots"` saves
    memory but not time there.

    NOTE [ the recompute check under save_dots ]
    A kept op's value is the forward's whatever the recompute feeds it, so a
    recompute that differs before a kept op (a Python branch on a counter
    the call changes, a random op drawn again) can end in the forward's
    outputs exactly, and the output check (NOTE [ the recompute check ])
    passes; but the kept op's gradient is taken at the recomputed input, and
    the gradients were another function's, with no error (found 2026-12-03:
    `h = dense_1(x) * (2 if calls % 2 else 3); return x + dense_2(h)` gave
    dense_2's kernel a gradient a third off, normwise (2 where 3), in eager
    mode and in a `tf.function`; the same on PyTorch). So with `check=True`
    the forward also takes the fingerprint of each kept op's input, and the
    recompute compares its own, as it compares its outputs (PyTorch: each
    kept matmul's operands but a stored weight, in `_KeepingDots`).
    """

    def __init__(self, owner, name, trains, check=True):
        self._layers = _dense_layers(owner)
        self._name = name
        self._trains = trains
        self._check = check
        self._kept = []
        self._seen = []  # (layer name, the forward's fingerprint of its input, the input's dtype), with check=True
        self._fed = []  # the recompute's inputs of the kept ops, in order, with check=True

    @contextlib.contextmanager
    def recording(self):
        del self._kept[:]
        del self._seen[:]
        with contextlib.ExitStack() as stack:
            for layer in self._layers:
                stack.enter_context(_patch.instance_attribute(layer, "call", self._recorder(layer, layer.call)))
            yield

    @contextlib.contextmanager
    def replaying(self, wait):
        """Within it, the layers hand out the kept outputs, made to `wait` for the incoming gradient."""
        del self._fed[:]
        position = [0]
        with contextlib.ExitStack() as stack:
            for layer in self._layers:
                replayer = self._replayer(layer, layer.call, position, wait)
                stack.enter_context(_patch.instance_attribute(layer, "call", replayer))
            yield
        if position[0] != len(self._kept):
            raise RecomputeError(
                f"keras_recompute: the recompute of {self._name} ran {position[0]} Dense or EinsumDense "
                f"calls, its forward {len(self._kept)}. A recomputed call must compute the same "
                "function of its inputs each time."
            )

    def _recorder(self, layer, call):
        def record(inputs, *args, **kwargs):
            if not _is_differentiable(inputs):
                return call(inputs, *args, **kwargs)
            with _linear(layer):
                kept = call(inputs, *args, **kwargs)
            self._kept.append(kept)
            if self._check:
                self._seen.append((layer.name, _fingerprint(inputs), inputs.dtype))
            return _activate(layer, kept)

        return record

    def compare(self, exact=None, as_data=False):
        """The checks that the recompute fed each kept op what its forward did (NOTE [ the recompute check under
        save_dots ]), as `_Expected.compare` makes them; in eager mode raises `RecomputeError` on a difference."""
        checks = []
        for index, ((layer, before, dtype), fed) in enumerate(zip(self._seen, self._fed)):
            message = (
                f"keras_recompute: the recompute of {self._name} fed its layer {layer!r} (weight matmul {index}, "
                'kept under policy="save_dots") values that differ from its forward\'s: its kept output would be '
                "differentiated at other inputs. A recomputed call must compute the same function of its inputs "
                "each time: no Python branch on state the call changes, no random op outside Keras's random "
                "layers. Pass check=False to recompute_grad to skip this check."
            )
            check = _value_check(before, _fingerprint(fed), dtype, message, exact, as_data)
            if check is not None:
                checks.append(check)
        del self._fed[:]
        return checks

    def _replayer(self, layer, call, position, wait):
        def replay(inputs, *args, **kwargs):
            if not _is_differentiable(inputs):
                return call(inputs, *args, **kwargs)
            if position[0] >= len(self._kept):
                raise RecomputeError(
                    f"keras_recompute: the recompute of {self._name} ran more Dense or EinsumDense calls "
                    "than its forward. A recomputed call must compute the same function of its inputs "
                    "each time."
                )
            # Waits like every input of the recompute (NOTE [ ordering the recompute in
            # graphs ]): else what the recompute computes from it, the attention
            # scores from the kept query and key, could run during the forward.
            kept = wait(self._kept[position[0]])
            position[0] += 1
            if self._check:
                self._fed.append(inputs)
            variables = [_tf_variable(v) for v in layer.trainable_weights if self._trains(v)]
            # The layer's linear call runs again in the kept op's gradient, outside the
            # layer's `__call__` (in a TF1 graph, `__call__` there would open a session):
            # it gets the autocast state this call has, so it reads its kernel cast alike.
            autocasts = [a for a in (_keras3.current_autocast(), _tf_keras.current_autocast()) if a is not None]

            def linear(x):
                with _linear(layer), contextlib.ExitStack() as stack:
                    for autocast in autocasts:
                        stack.enter_context(autocast)
                    return call(x, *args, **kwargs)

            return _activate(layer, _kept_matmul(kept, inputs, linear, variables))

        return replay


class _KeptMasks:
    """Keras 3's dropout keep masks, kept by a policy's forward for its recompute.

    NOTE [ dropout masks on TensorFlow under the policies ]
    The policies trade memory for time, and on TensorFlow's CPU runtime
    drawing a mask again is a large part of their recompute: with one op at
    a time (`benchmarks/tf_profile.py --inter-op 1`, the BERT-base blocks at
    seq 512) the draws were 62% of the op time `"attention_core"` added to
    the step and 41% of what `"save_dots"` added. So a policy's forward
    keeps each mask and its recompute applies it. On TensorFlow a mask is a
    function of its seed: keeping it saves the `stateless_random_uniform`
    and its comparison, not a shift of a global stream. The mask is kept as
    the comparison gave it, a bool, a byte an element (a quarter of the
    float tensor it masks). Packed to a bit an element (as on PyTorch), the
    packing and unpacking took what the draw took: measured in turns in one
    process, `save_dots` and `attention_core` took 1.17x and 1.13x of the
    plain step drawing again, 1.20x and 1.14x with packed bits, 1.11x and
    1.07x with kept bools (docs/benchmarks.md, selective recompute). A
    kept bool needs no wait (NOTE [ ordering the recompute in graphs ]): the
    `where` that applies it also takes the scaled input, which waits, and it
    is no copy. Keras's dropout runs, while the call runs, as
    `tf.nn.experimental.general_dropout` with the sampler
    `stateless_dropout` uses: the same ops, the same values. The recompute
    runs the tail of those ops (the scaling and the `where`) on the kept
    mask. Seeds are drawn as before, so Keras's seed generators advance
    alike. A dropout inside a control-flow branch or loop body (another
    graph than the call's) keeps nothing: its mask could not leave the
    branch; the recompute draws that one again from its seed. Nested units
    keep the outer record's masks. Keras's function is replaced once, for
    good, and acts as before when no such call runs in its thread: the
    replicas of a `MirroredStrategy` run in threads, each with its own
    calls.
    """

    _threads = threading.local()  # .active: (kept masks, replaying), outermost first

    def __init__(self):
        self._masks = []
        self._graph = None
        self._position = 0

    @contextlib.contextmanager
    def recording(self):
        del self._masks[:]
        self._graph = tf.compat.v1.get_default_graph()
        with self._active_as(replaying=False):
            yield

    @contextlib.contextmanager
    def replaying(self):
        self._position = 0
        with self._active_as(replaying=True):
            yield

    @contextlib.contextmanager
    def _active_as(self, replaying):
        from keras.src.backend.tensorflow import random as tf_random

        if tf_random.dropout is not _keras3_dropout:
            _keras3_dropout.original = tf_random.dropout
            tf_random.dropout = _keras3_dropout
        active = _KeptMasks.active()
        active.append((self, replaying))
        try:
            yield
        finally:
            active.pop()

    @staticmethod
    def active():
        if not hasattr(_KeptMasks._threads, "active"):
            _KeptMasks._threads.active = []
        return _KeptMasks._threads.active

    def _next(self):
        if self._position >= len(self._masks):
            raise RecomputeError(
                "keras_recompute: the recompute of a call ran more dropouts than its forward. A recomputed "
                "call must compute the same function of its inputs each time."
            )
        self._position += 1
        return self._masks[self._position - 1]


def _keras3_dropout(inputs, rate, noise_shape=None, seed=None):
    """Keras 3's TensorFlow dropout, its keep masks kept or replayed (see `_KeptMasks`)."""
    from keras.src.backend.tensorflow import random as tf_random
    from keras.src.random.seed_generator import draw_seed
    from tensorflow.python.ops import stateless_random_ops

    active = _KeptMasks.active()
    if not active or not isinstance(rate, float) or rate in (0.0, 1.0):
        return _keras3_dropout.original(inputs, rate, noise_shape=noise_shape, seed=seed)
    seed = tf_random._cast_seed(draw_seed(seed))
    noise_shape = tf_random._get_concrete_noise_shape(inputs, noise_shape)
    replaying = next((kept for kept, replays in active if replays), None)
    recorders = [kept for kept, replays in active if not replays]
    graph = tf.compat.v1.get_default_graph()
    keep = replaying._next() if replaying is not None else None
    if keep is not None:
        # The tail of `stateless_dropout` (nn_ops._dropout), op for op, on the kept mask.
        x = tf.convert_to_tensor(inputs)
        scaled = tf.raw_ops.Mul(x=x, y=tf.convert_to_tensor(1 / (1 - rate), dtype=x.dtype))
        output = tf.where(keep, scaled, tf.constant(0, dtype=x.dtype))
        if not tf.executing_eagerly():
            output.set_shape(x.shape)
    else:
        drawn = []

        def sampler(shape, dtype):
            drawn.append(stateless_random_ops.stateless_random_uniform(shape=shape, seed=seed, dtype=dtype))
            return drawn[0]

        output = tf.nn.experimental.general_dropout(inputs, rate, sampler, noise_shape=noise_shape)
        if any(kept._graph is graph for kept in recorders):
            keep = drawn[0] >= rate
    for kept in recorders:
        kept._masks.append(keep if kept._graph is graph else None)
    return output


def _dense_layers(owner):
    """The Dense and EinsumDense layers under `owner` (not itself), Keras 3's or tf_keras's."""
    if not _context.is_layer(owner):
        return []
    classes = _keras3.dense_classes() + _tf_keras.dense_classes()
    return [layer for layer in _context.sublayers(owner) if isinstance(layer, classes)]


@contextlib.contextmanager
def _linear(layer):
    """Within it, `layer` applies no activation."""
    with _patch.instance_attribute(layer, "activation", None):
        yield


def _activate(layer, value):
    activation = getattr(layer, "activation", None)
    return value if activation is None else activation(value)


def _tf_variable(variable):
    """The `tf.Variable` a tape records for a Keras 3 or tf_keras (autocast) variable."""
    for attribute in ("_value", "_variable"):
        inner = getattr(variable, attribute, None)
        if isinstance(inner, tf.Variable):
            return inner
    return variable


def _kept_matmul(kept, inputs, linear, variables):
    """`kept`, with the gradient of `linear` at `inputs` (NOTE [ save_dots on TensorFlow ]).

    In a graph the gradient runs `linear` on the values of `variables` read
    now, in the recompute, which hands out what the forward read: it never
    reads a variable again (NOTE [ a recompute reads what its forward read ]).
    """

    @tf.custom_gradient
    def kept_op(kept, inputs, *reads):
        def grad(upstream):
            by_variable = {id(variable): value for variable, value in zip(variables, reads)}

            def reader(variable, read):
                value = by_variable.get(id(variable))
                return read() if value is None else value

            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(inputs)
                tape.watch(variables)
                with contextlib.nullcontext() if tf.executing_eagerly() else variable_reads(reader):
                    value = linear(inputs)
            grads = tape.gradient(value, [inputs] + variables, output_gradients=upstream)
            return [None] + list(grads)

        return tf.identity(kept), grad

    return kept_op(kept, inputs, *[tf.identity(v) for v in variables])


class _Head:
    """How one float output leaves the custom gradient, so that a loss finds its logits.

    NOTE [ logits attached to outputs ]
    Keras's softmax and sigmoid attach their input to their output
    (`_keras_logits`), and TensorFlow's cross-entropy losses (Keras 3 and
    tf_keras) compute from those logits instead of the clipped probabilities;
    in a graph they also take the input of a `Softmax` or `Sigmoid` op. An
    output of the custom gradient is a new tensor with neither, so a loss on a
    recomputed call that ends in a softmax would differentiate the clipped
    probabilities: another gradient wherever a probability saturates. So:
      * in a graph, an output made by a `Softmax` or `Sigmoid` op leaves the
        custom gradient as that op's input, and the same op is applied again
        outside: the loss finds the op and its logits as in the plain call;
      * otherwise attached logits leave as an extra output, attached again.
    """

    _TAIL_OPS = {"Softmax": tf.nn.softmax, "Sigmoid": tf.math.sigmoid}

    def __init__(self, returned, tail=None, logits=None, logits_are_input=False):
        self.returned = returned  # what the custom gradient returns for this output
        self.tail = tail  # the op type applied again outside, or None
        self.logits = logits  # attached logits returned as an extra output, or None
        self.logits_are_input = logits_are_input  # the attached logits are the tail op's input

    @classmethod
    def of(cls, output):
        attached = getattr(output, "_keras_logits", None)
        op = None if tf.executing_eagerly() else getattr(output, "op", None)
        if op is not None and op.type in cls._TAIL_OPS and len(op.inputs) == 1:
            if attached is None or attached is op.inputs[0]:
                return cls(op.inputs[0], tail=op.type, logits_are_input=attached is not None)
        if _is_differentiable(attached):
            return cls(output, logits=attached)
        return cls(output)

    def kind(self):
        """How the output ends (its tail op, whether logits are attached): no tensor, so nothing is kept."""
        return (self.tail, self.logits is None)

    @staticmethod
    def differentiated(heads):
        """The tensors the custom gradient returns for `heads`: outputs, then extra logits."""
        return [head.returned for head in heads] + [head.logits for head in heads if head.logits is not None]

    @staticmethod
    def rebuild_all(heads, results):
        """The call's float outputs from what left the custom gradient."""
        logits = iter(results[len(heads) :])
        outputs = []
        for head, returned in zip(heads, results):
            output = returned if head.tail is None else _Head._TAIL_OPS[head.tail](returned)
            if head.logits_are_input:
                output._keras_logits = returned
            if head.logits is not None:
                output._keras_logits = next(logits)
            outputs.append(output)
        return outputs


class _Expected:
    """What the recompute must reproduce: the forward's outputs.

    NOTE [ the recompute check ]
    A recompute that differs from its forward (a Python branch on mutable
    state, a shape that depends on a counter, a random op we cannot replay)
    would silently give the gradient of another function. The number, shapes
    and dtypes of the outputs are compared always, at no cost. With
    `check=True` (the default) the float values are compared too: in eager
    mode in Python, in a `tf.function` by an op that fails, run where a
    gradient is read (NOTE [ a check the runtime may prune ]; XLA drops
    assert ops, so under `jit_compile=True` only the structure is checked).

    The values are compared by fingerprint, not kept: an output nobody uses
    after the forward (the B x H x S x S attention scores that a recomputed
    attention core returns beside its output) would otherwise stay alive
    until the backward, one per layer, and eat the saving. The fingerprint of
    an output x, seen as a matrix X of its last axis by the others, is its
    norm and two projections `u' X v` on fixed pseudo-random vectors u, v
    in [-1, 1]: a few floats, computed with buffers the size of one row and
    one column of X. A recompute that differs by D moves a projection by
    about |D|/3 (random signs), so a redrawn dropout mask or another function
    is caught unless both projections land within 1e-3 |x| of their old
    values by chance (probability ~1e-5); rounding differences of a
    compiler that fuses the recompute otherwise move it by ~1e-6 |x|.
    A bfloat16 or float16 output is allowed four of its own roundings
    (3.1e-2 and 3.9e-3 of |x|) where that is more: oneDNN's bfloat16 kernels
    round the same values differently in another graph (a recomputed RNN
    cell under `mixed_bfloat16`: 2.7e-3 |x| apart, its gradients within the
    plain ones' 2e-2; with oneDNN off, equal). A redrawn dropout mask still
    moves a projection by ~0.1 |x|.
    """

    def __init__(self, out_leaves, heads, keep_values):
        self.count = len(out_leaves)
        self.positions = [i for i, leaf in enumerate(out_leaves) if _is_differentiable(leaf)]
        self.kinds = [head.kind() for head in heads]
        self.specs = [(head.returned.shape, head.returned.dtype) for head in heads]
        self.fingerprints = [_fingerprint(head.returned) for head in heads] if keep_values else None

    def compare(self, replayed_leaves, name, exact=None, as_data=False):
        """Raises `RecomputeError` on a difference.

        `exact`: in a graph, the boolean tensor that is False where the
        recompute's inputs were made NaN by a NaN gradient (`_waiter`): its
        values are then not compared (NOTE [ a NaN gradient ]).

        `as_data`: in a `tf.function`, each check is a float32 zero that fails
        where the values differ, for the gradients to add (NOTE [ a check the
        runtime may prune ]); else, and in eager mode, an assert op.

        Returns:
            The recompute's `_Head`s, and the checks of the values: graph ops, or zeros (`as_data`).
        """
        if len(replayed_leaves) != self.count:
            raise RecomputeError(
                f"keras_recompute: the recompute of {name} returned {len(replayed_leaves)} "
                f"values, its forward {self.count}. A recomputed call must compute the same "
                "function of its inputs each time; pass check=False to recompute_grad only "
                "if you know the difference is harmless."
            )
        heads = []
        for index, (position, (shape, dtype)) in enumerate(zip(self.positions, self.specs)):
            leaf = replayed_leaves[position]
            head = _Head.of(leaf) if isinstance(leaf, tf.Tensor) else None
            if head is None or head.returned.dtype != dtype or not _same_shape(head.returned.shape, shape):
                got = f"{leaf.dtype.name} {leaf.shape}" if isinstance(leaf, tf.Tensor) else repr(leaf)
                raise RecomputeError(
                    f"keras_recompute: the recompute of {name} returned output {index} as "
                    f"{got}, its forward as {dtype.name} {shape}. A recomputed call must "
                    "compute the same function of its inputs each time (no branches on "
                    "state that the call itself changes)."
                )
            if head.kind() != self.kinds[index]:
                raise RecomputeError(
                    f"keras_recompute: the recompute of {name} ended output {index} otherwise "
                    "than its forward (a softmax or sigmoid, or logits attached to it). A "
                    "recomputed call must compute the same function of its inputs each time."
                )
            heads.append(head)
        if self.fingerprints is None:  # check=False
            return heads, []
        checks = []
        for index, (head, before) in enumerate(zip(heads, self.fingerprints)):
            message = (
                f"keras_recompute: the recompute of {name} gave output {index} values that "
                "differ from its forward's. A recomputed call must compute the same function "
                "of its inputs each time: no Python branch on state the call changes, no "
                "random op outside Keras's random layers. Pass check=False to recompute_grad "
                "to skip this check."
            )
            check = _value_check(before, _fingerprint(head.returned), self.specs[index][1], message, exact, as_data)
            if check is not None:
                checks.append(check)
        return heads, checks


_TOLERANCE = 1e-3
_ROUNDINGS = 4  # for a value coarser than float32: this many of its roundings, relative


def _tolerance(dtype):
    """The largest difference allowed, relative to the value's norm (NOTE [ the recompute check ])."""
    epsilon = {tf.bfloat16: 2.0**-7, tf.float16: 2.0**-10}.get(tf.as_dtype(dtype), 0.0)
    return max(_TOLERANCE, _ROUNDINGS * epsilon)


def _value_check(before, after, dtype, message, exact=None, as_data=False):
    """Compares two fingerprints of a value of `dtype`, the forward's and the recompute's (NOTE [ the recompute
    check ]): in eager mode raises `RecomputeError` with `message` where they differ (returns None); in a graph
    returns the op that fails there (`_graph_check`; `exact` and `as_data` as `_Expected.compare` takes them)."""
    tolerance = _tolerance(dtype)
    if tf.executing_eagerly() or _calls_traced():  # NOTE [ tracing the check ]
        difference, limit = _traced_difference(before, after, tf.constant(tolerance, tf.float32))
    else:
        difference, limit = _difference(before, after, tolerance)
    if tf.executing_eagerly():
        if not bool(difference <= limit):
            raise RecomputeError(message + f" Fingerprints differ by {float(difference):.3g}.")
        return None
    same = difference <= limit
    if exact is not None:  # NOTE [ a NaN gradient ]
        same = tf.logical_or(same, tf.logical_not(exact))
    return _graph_check(same, message, difference, limit, as_data)


def _difference(before, after, tolerance):
    """`(difference, limit)` of two fingerprints: the largest difference of their projections (inf where one is
    finite and the other not), and the most allowed, `tolerance` of the forward's norm."""
    # A forward that overflowed (a diverged model) is reproduced when the recompute
    # overflows where it did: NaN and inf compare unequal to themselves.
    finite = tf.math.is_finite(before)
    both = tf.logical_and(finite, tf.math.is_finite(after))
    same = tf.reduce_all(tf.equal(finite, tf.math.is_finite(after)))
    difference = tf.reduce_max(tf.where(both[1:], tf.abs(after[1:] - before[1:]), tf.zeros_like(after[1:])))
    difference = tf.where(same, difference, float("inf"))
    limit = tolerance * tf.where(finite[0], before[0], 0.0) + 1e-6
    return difference, limit


_traced_difference = tf.function(
    _difference, input_signature=[tf.TensorSpec([3], tf.float32)] * 2 + [tf.TensorSpec([], tf.float32)], autograph=False
)


# NOTE [ a check the runtime may prune ]
# A unit none of whose gradients is read (every weight frozen in it and
# before it: a backbone frozen under a head, as transfer learning trains it
# first) must cost the backward nothing, as it does the plain model: a
# `tf.function` prunes the ops no output needs. An assert op is stateful, and
# `tf.function` runs every stateful op, so the check's `tf.debugging.Assert`
# ran the recompute that it reads whether a gradient needed it or not. A
# keras.applications ResNet50 frozen under a head (batch 32, 128x128, BFC)
# stepped in 2.17 s at a 266 MiB peak against plain's 0.80 s and 84 MiB. So in
# a `tf.function` the check is a stateless op that fails with the message:
# `StringToNumber` of "0" where the fingerprints agree, of the message where
# they differ. Its zero is added to the upstream gradients the recompute's
# backward starts from, so every gradient of the unit reads it: it runs where
# a gradient is read, and is pruned with the recompute where none is. Not a
# control dependency: Grappler turns a stateless op whose outputs nothing
# reads into a NoOp, and the check never ran. Under XLA, which has no string
# ops (and drops assert ops, NOTE [ the recompute check ]), before TensorFlow
# 2.4 and in TF1 graphs (a session runs only what its fetches need) the check
# stays an assert.


def _graph_check(same, message, difference, limit, as_data):
    """An op that fails with `message` where `same` is False, or with `as_data` in a `tf.function`, a float32 zero
    that does (NOTE [ a check the runtime may prune ])."""
    in_function = getattr(tf.compat.v1.get_default_graph(), "building_function", False)
    if LEGACY or not as_data or not in_function or in_xla_context():
        return tf.debugging.Assert(same, [message, "Fingerprints differ by", difference, "allowed", limit])
    text = tf.strings.join([message, " Fingerprints differ by ", tf.strings.as_string(difference), ", allowed ", tf.strings.as_string(limit), "."])
    return tf.strings.to_number(tf.where(same, "0", text), out_type=tf.float32)


def _add_checks(upstream, checks):
    """`upstream`, each plus the zeros among `checks` (NOTE [ a check the runtime may prune ])."""
    zeros = [check for check in checks if isinstance(check, tf.Tensor)]
    if not zeros:
        return upstream
    zero = tf.add_n(zeros) if len(zeros) > 1 else zeros[0]
    return [_wait_gradient(lambda g: g + tf.cast(zero, g.dtype), g) for g in upstream]


def _fingerprint(x):
    """`[norm, projection, projection]` of `x` in float32 (NOTE [ the recompute check ]).

    In eager mode and in a `tf.function` it runs as one traced function,
    traced once for all shapes: op by op, its dozen small ops cost more than
    the recomputed call's own difference from `tf.recompute_grad` (0.1 s of a
    3 s step over 12 blocks), and tracing them took 12 ms a fingerprint, two
    per output of each recomputed call (`_calls_traced`).
    """
    x = tf.cast(x, tf.float32)
    if tf.executing_eagerly():
        return _traced_fingerprint(x)
    with tf.name_scope(CHECK_SCOPE):  # a graph's reader can tell the check's ops from the recompute's
        return _traced_fingerprint(x) if _calls_traced() else _fingerprint_ops(x)


CHECK_SCOPE = "keras_recompute_check"


def _fingerprint_ops(x):
    # The last axis of `x` as columns, with a scalar as one column; written for
    # any rank, known or not, so that one trace serves every shape.
    columns = tf.concat([[1], tf.shape(x)], 0)[-1]
    matrix = tf.reshape(x, [-1, columns])
    left = tf.random.stateless_uniform([tf.shape(matrix)[0], 2], seed=[1234, 5678], minval=-1.0)
    right = tf.random.stateless_uniform([columns, 2], seed=[8765, 4321], minval=-1.0)
    projections = tf.reduce_sum(left * tf.matmul(matrix, right), axis=0)
    # l2_loss is one pass with no temporary; tf.norm writes the squares out first.
    return tf.concat([[tf.sqrt(2.0 * tf.nn.l2_loss(matrix))], projections], 0)


_traced_fingerprint = tf.function(
    _fingerprint_ops, input_signature=[tf.TensorSpec(None, tf.float32)], autograph=False
)


def _calls_traced():
    """Whether the graph being built calls the check's traced functions rather than holding their ops.

    NOTE [ tracing the check ]
    The check's ops are the same for every recomputed call, and each call's
    forward and recompute made them afresh while a `tf.function` was traced:
    about 60 ops a fingerprint and 30 a comparison, 12 ms each to trace on a
    2-core CPU, where a call of a function traced once (`_traced_fingerprint`,
    `_traced_difference`) is one op and 1.5 ms. So is the read of each weight
    gradient's first element that orders the recompute (`_after`: 8 ops a
    weight; `_traced_first_element`). On 4 keras-hub TransformerEncoders
    (benchmarks/eager_overhead.py) ours traced 263 ops and 66.9 ms a
    recomputed call more than `tf.recompute_grad`; now 12 ops and 16.4 ms.
    Planning to a budget traces a step per unit and option: the suite's
    tests/test_budget.py on TensorFlow took 412 s, 358 s with the check's
    functions alone. In a `tf.function` (XLA too, which compiles the called
    function's body in place) the graph calls them; in a TF1-style graph,
    which the legacy path builds and a session runs, and before TensorFlow
    2.4 (`LEGACY`), it holds the ops themselves.
    """
    return not LEGACY and getattr(tf.compat.v1.get_default_graph(), "building_function", False)


def _same_shape(a, b):
    if a.rank is None or b.rank is None:
        return True
    return a.rank == b.rank and all(x is None or y is None or x == y for x, y in zip(a.as_list(), b.as_list()))


def _after(tensors, values):
    """`tensors`, made to depend on the data of every one of `values` in a graph (NOTE [ ordering the recompute in graphs ]).

    The input gradients of a recomputed unit wait for its weight gradients:
    the unit before it recomputes only once they are made, and so once this
    unit's recomputed activations, which they read, are freed. Without it a
    runtime that defers the weight gradients (TensorFlow's executor with one
    inter-op thread) held every unit's recomputed activations to the end of
    the backward: twice the predicted peak for `full`.
    """
    values = [v.values if isinstance(v, tf.IndexedSlices) else v for v in values if v is not None]
    if tf.executing_eagerly() or not values:
        return tensors
    first = _traced_first_element if _calls_traced() else _first_element  # NOTE [ tracing the check ]
    elements = [first(v) for v in values]
    wait = _waiter([tf.add_n(elements) if len(elements) > 1 else elements[0]])
    return [None if t is None else _wait_gradient(wait, t) for t in tensors]


def _first_element(value):
    """The first element of `value` as a float32 scalar: a read of its data, for `_after` to wait on."""
    return tf.cast(tf.reduce_max(tf.reshape(value, [-1])[:1]), tf.float32)


def _traced_first_element(value):
    """`_first_element` as a call of a function traced once per dtype, for all shapes (NOTE [ tracing the check ])."""
    traced = _TRACED_FIRST_ELEMENT.get(value.dtype)
    if traced is None:
        traced = tf.function(_first_element, input_signature=[tf.TensorSpec(None, value.dtype)], autograph=False)
        _TRACED_FIRST_ELEMENT[value.dtype] = traced
    return traced(value)


_TRACED_FIRST_ELEMENT = {}


def _wait_gradient(wait, gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(wait(gradient.values), gradient.indices, gradient.dense_shape)
    return wait(gradient)


def _waiter(upstream):
    """Returns a function that makes a tensor depend on `upstream`'s data.

    See NOTE [ ordering the recompute in graphs ]. In eager mode the recompute
    runs when the gradient function is called, so nothing needs to wait; the
    function still returns a fresh tensor, so that a tensor passed twice
    (q = k = v in self-attention) is two sources of the tape, not one whose
    gradient would be counted twice.

    NOTE [ a NaN gradient ]
    The zero added to floats is NaN where the element waited for is NaN: a
    diverged step, or one whose loss-scaled gradient overflowed (a
    `LossScaleOptimizer` under `mixed_float16` skips it and halves the scale;
    its first steps do this routinely). The recompute's float inputs are then
    NaN, and so are all of its gradients, where the plain backward's are NaN
    in the entries the NaN reaches: both steps are non-finite (a loss-scaled
    optimizer skips both, any other writes NaN in both). Two things had
    stopped such a step that the plain model takes: the recompute check,
    comparing NaN outputs with the forward's ("differ from its forward"), and
    the integer wait, then `+ 1`, which moved a token id past the vocabulary
    and made the recompute's gather raise. So the wait's flag (`wait.exact`,
    False after a NaN) lets the check pass, and integers are kept whatever the
    gradient (a minimum with a bound no value reaches; a minimum with either
    of two values is not a constant to any optimizer). Booleans become False:
    a mask changes only in a step whose gradients are NaN.
    """
    if tf.executing_eagerly():
        # TensorFlow 2.0's eager tf.identity hands back its input: the op is run instead.
        # A lambda either way: `wait.exact` must not be set on tf.identity itself.
        wait = (lambda tensor: tf.raw_ops.Identity(input=tensor)) if LEGACY else (lambda tensor: tf.identity(tensor))
        wait.exact = None
        return wait
    gradient = upstream[0]
    if gradient.dtype == tf.bool:  # a forward's first tensor may be a mask (Embedding(mask_zero=True))
        gradient = tf.cast(gradient, tf.int8)
    first = tf.reshape(gradient, [-1])[:1]
    element = tf.reduce_max(tf.abs(first) if first.dtype.is_complex else first)
    # False only for a NaN gradient; no optimizer can fold it to a constant.
    finite = tf.equal(element, element)
    float_zero = tf.where(finite, 0.0, float("nan"))
    largest = tf.int64.max
    int64_bound = tf.where(finite, tf.constant(largest, tf.int64), tf.constant(largest - 1, tf.int64))

    def wait(tensor):
        if tensor.dtype.is_floating or tensor.dtype.is_complex:
            return tensor + tf.cast(float_zero, tensor.dtype)
        if tensor.dtype == tf.bool:
            return tf.logical_and(tensor, finite)
        if tensor.dtype.is_integer:
            # Not `+ where(finite, 0, 1)`: after a NaN gradient a token id one
            # past the vocabulary made the recompute's gather raise. In int64
            # (Minimum takes no uint8 in TensorFlow 1.x) a bound no value of a
            # narrower type reaches: the values are kept whatever the gradient.
            widened = tf.cast(tensor, tf.int64)
            return tf.cast(tf.minimum(widened, int64_bound), tensor.dtype)
        return tf.identity(tensor)

    wait.exact = finite  # False: what waited is NaN (NOTE [ a NaN gradient ])
    return wait


# NOTE [ measuring a unit on TensorFlow ]
# What a call keeps for its backward is read from the graph of one training
# step of it, traced by `tf.function`: the tensors made by the forward that an
# op of the gradient reads. The runtime frees every other forward tensor as
# soon as its last forward reader has run, so these are what the step holds
# from its forward until its backward. Views (Identity, Reshape, ...) are
# counted as the tensor they view, and variables and the call's own inputs
# are not counted: they are held in any case. No environment variable or
# allocator is needed, in eager Keras 3 and tf_keras alike. The same traced
# step is what `_memory` times.
#
# Only the backward's ops that the gradients asked for need are counted
# (`_needed`): a gradient function makes every input's gradient, and the
# runtime prunes those nothing reads. A frozen weight's is one (LoRA's frozen
# kernels, a norm's frozen scale), and what it would read of the forward is
# not kept. A keras-hub Gemma block with LoRA (hidden 256, sequence 768)
# reads 36.2 MiB of its forward with them and 30.6 MiB without, where a step
# of the whole model held 26.0-30.8 MiB of each block's forward and 3.0-4.1 of
# its backward begun (`benchmarks/tf_memory_timeline.py`). An eager tape runs
# each gradient function whole: there every op is counted. What a recompute
# makes again is still everything the traced backward reads, needed or not
# (`read`; a recomputed unit's transient in `_memory._unit_costs`): the
# forward made again makes those tensors whether a gradient reads them or
# not. Counted with the pruned figure there, bert4keras BERT-base's `full`
# was answered 49 in 2500 MiB, where 45 runs (44 as counted). Grappler's other
# rewrites keep a little less again (29.8 MiB for that block, its rotary
# tables folded as constants); its Python binding is private and is not used.
# Tried on 2026-11-28 and not kept: reading the allocator between the forward
# and the backward (the gradient seeded by a `tf.py_function` reading the
# bytes in use). The BFC allocator holds a tensor in a block of up to twice
# its size (NOTE [ the allocator's blocks ] in `_fit`), so that reading moved
# by a unit's largest tensors from size to size (the Gemma block: 31.1, 44.1,
# 42.3 and 58.3 MiB at 768, 832, 896 and 960) and the answers by a step from
# one process to the next.
#
# NOTE [ measuring for eager execution ]
# A step that runs eagerly (a custom `tf.GradientTape` loop not wrapped in
# `tf.function`, `run_eagerly=True`) keeps more: the eager tape holds, for
# every op it records, each input and output its gradient may need (a list
# fixed per op type, wider than what the gradient reads), and no graph
# optimization drops a temporary. On a keras-hub TransformerEncoder block
# (hidden 256, seq 256, batch 8) the eager forward held 153 MB, the traced
# step's reads 69 MB; 8 such blocks peaked at 1574 MB eager against 741 MB in
# a `tf.function`. So for eager execution a unit is run eagerly under a tape,
# and what it keeps is what the allocator holds after its forward beyond its
# outputs (`get_memory_info`: a GPU's allocator, or the CPU's BFC allocator
# with `TF_CPU_ALLOCATOR_USE_BFC=1`). Where the allocator keeps no figures (the
# CPU's default allocator) the plain call's is bounded from the traced graph
# instead: every input and output of the ops on the differentiable path, views
# counted once, a figure above the measured one (216 MB for the block above).
# A recomputed call's internals run unrecorded, so the graph cannot tell them
# apart from recorded ops: its figure is then the traced one, what its custom
# gradient keeps, which for `"save_dots"` and `"attention_core"` misses what
# their unrecomputed parts keep eagerly. Set `TF_CPU_ALLOCATOR_USE_BFC=1` for
# measured figures. The step timed is the eager one.
#
# NOTE [ timing a unit on TensorFlow ]
# The traced step differentiates its outputs' sum times `scale`, a float
# argument of the `tf.function` (1.0): the gradient flowing in is the sum's,
# and Grappler cannot fold it. Of the sum alone the gradient is a constant of
# ones; Grappler folded the zero a recompute waits on (`where(g == g, 0,
# nan)`, NOTE [ ordering the recompute in graphs ]) and merged with the
# forward every op of the recompute that then read what the forward's had
# (here all before the attention's dropout, whose seeds the recompute reads
# from its snapshot), as XLA did on JAX (NOTE [ measuring a unit on JAX ]).
# Measured so until 2026-12-05 (TensorFlow's profiler, ops run by the step of
# tests/test_budget.py's block): "full" ran 25 matrix products and softmaxes
# against 20 for "none" (29 now: the projections, the scores and their softmax
# ran once), "save_dots" 21 (23 now). On benchmarks/budget.py's block the
# recompute's seconds were full 23.5 ms, save_dots 9.3, attention_core 7.3;
# now 26.6, 13.1, 9.8 (one run each, a 2-core CPU). A model's loss reaches its
# units through its head's weights, not as a constant; only a unit whose
# outputs a step sums directly would be merged so (memory kept, the gradient
# the same).
_VIEWS = frozenset(("Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze", "StopGradient", "Snapshot"))


def measure_unit(layer, args, kwargs, policy, timed=True, execution="compiled", differentiated=True):
    """What one call of `layer` keeps for its backward, and a step of it to time.

    Args:
        layer: the layer, its `call` set to the option being measured.
        args: positional arguments of a recorded call (tensors, masks attached).
        kwargs: keyword arguments of it.
        policy: the option's name (the graph shows what it keeps; used only
            for eager execution without allocator figures).
        timed: whether to return a step (else None).
        execution: `"compiled"` (a `tf.function` or XLA step) or `"eager"`
            (NOTE [ measuring for eager execution ]).
        differentiated: whether the floating arguments are differentiated
            (not a whole model's batch: NOTE [ a unit no gradient reaches ]
            in `_memory`).

    Returns:
        `(kept_bytes, largest_bytes, step, read_bytes)`: bytes the forward
        keeps beyond the inputs and variables, the largest tensor among them,
        a function that runs one forward and backward (already warmed up),
        and the bytes any op of the traced backward reads of the forward,
        needed or not (what a recompute makes again: NOTE [ measuring a unit
        on TensorFlow ]).
    """
    require_modern(
        "planning to a budget (budget=, memory_report)",
        "Pass policy= (or blocks=) to recompute_model by hand, or upgrade TensorFlow.",
    )
    if not tf.executing_eagerly():
        raise RecomputeError(
            "keras_recompute: planning to a budget measures each unit by running it, which needs eager "
            "TensorFlow (TF2 behaviour); in a TF1-style graph (disable_eager_execution) pass limit= or "
            "policy= to recompute_model by hand."
        )
    flat = list(_context.leaves((args, kwargs)))
    positions = [i for i, leaf in enumerate(flat) if differentiated and _is_differentiable(leaf)]
    variables = [_tf_variable(v) for v in layer.trainable_weights]
    forward_ops = {}

    def step(scale, *differentiated):
        leaves = list(flat)
        for position, value in zip(positions, differentiated):
            leaves[position] = value
        _context.copy_masks([flat[p] for p in positions], differentiated)
        call_args, call_kwargs = _context.rebuild((args, kwargs), iter(leaves))
        with tf.GradientTape() as tape:
            tape.watch(differentiated)
            outputs = layer(*call_args, **call_kwargs)
            # `scale` (1.0), an argument: a gradient Grappler cannot fold (NOTE [ timing a unit on TensorFlow ]).
            sums = [tf.reduce_sum(tf.cast(o, tf.float32)) for o in _flatten(outputs) if _is_differentiable(o)]
            loss = scale * tf.add_n(sums)
        forward_ops["count"] = len(tf.compat.v1.get_default_graph().get_operations())
        gradients = tape.gradient(loss, list(differentiated) + variables)
        return [g for g in gradients if g is not None]

    function = tf.function(step, autograph=False)
    values = [tf.constant(1.0)] + [flat[p] for p in positions]
    concrete = function.get_concrete_function(*values)
    operations = concrete.graph.get_operations()
    # An eager tape runs every gradient function whole; a graph runs what the gradients fetched need.
    kept, largest, read = _kept_bytes(operations, forward_ops["count"], None if execution == "eager" else concrete.outputs)
    if execution == "eager":
        measured = _eager_kept_bytes(layer, flat, positions, args, kwargs)
        if measured is not None:
            kept = measured
        elif policy == "none":  # no allocator figures: the plain call's bound; a recomputed call keeps what its gradient saves
            kept = max(kept, _eager_kept_bound(operations[: forward_ops["count"]]))
        read = kept
        run = lambda: step(*values)  # noqa: E731
    else:
        run = lambda: concrete(*values)  # noqa: E731
    if not timed:
        return kept, largest, None, read

    def timed_step():  # returns once the device has run it (NOTE [ timing a unit on a GPU ] in `_memory`)
        run()
        synchronize()

    timed_step()
    return kept, largest, timed_step, read


def synchronize():
    """Returns once the devices have run what was queued on them: at once without a GPU (TensorFlow runs the CPU's
    ops as they are called); a GPU runs kernels after the host queues them (NOTE [ timing a unit on a GPU ] in
    `_memory`). Eager only, where a step is timed: `sync_devices` (TensorFlow 2.14 and later) refuses a graph."""
    sync_devices = getattr(getattr(tf.test, "experimental", None), "sync_devices", None)
    if sync_devices is not None and tf.executing_eagerly() and _has_gpu():
        sync_devices()


@functools.lru_cache(maxsize=None)
def _has_gpu():
    return bool(tf.config.list_logical_devices("GPU"))


def loss_peak(outputs, model=None):
    """What a loss holds at the end of the forward, on `outputs` (a model's, from a forward without gradients), in bytes.

    NOTE [ the loss's point on TensorFlow ]
    A language model's logits are the largest tensors of its step, and what
    its loss's forward and backward hold on them is counted nowhere else: the
    units keep what their backward reads, the logits are read by no
    backward. A stand-in for the user's loss, as on JAX and PyTorch (NOTE
    [ checking a plan on JAX ]): a sparse cross-entropy over the last axis
    where it has classes, else a square's, traced as a graph and counted as a
    unit is (`_kept_bytes`: what the loss's gradient reads of its forward, the
    fused cross-entropy's `backprop`), with the outputs themselves, alive
    until the loss has read them, and its gradient on them, made in float32:
    three times the logits. Where `model` computes metrics on its outputs
    (Keras's trainer does so after the backward, so the logits stay alive
    through it and the loss's kernels cannot reuse their buffer), once more.
    Measured under TensorFlow's BFC allocator (`tests/test_budget.py::
    test_a_graph_step_that_peaks_at_its_loss_is_predicted_there`: two small
    blocks, a head of 4000 classes, logits of 8.2 MB): the step held 1.4 times
    the logits above its resident bytes without metrics (Keras 3 and tf_keras),
    2.2 times with tf_keras's accuracy metric and 3.95 times with Keras 3's;
    keras-hub Gemma with LoRA (4 blocks of 256, vocabulary 32000, sequence 256,
    Keras's sparse cross-entropy and keras-hub's default accuracy metric, Adam)
    peaked 188.0 MB without recompute and 167.6 MB with `full`, where the
    prediction without this point was 113.8 and 87.0 MB (0.61x and 0.52x). An
    answer that fits: over by up to twice the logits where the step held less.
    """
    leaves = [o for o in _flatten(outputs) if _is_differentiable(o) and o.shape.num_elements() is not None]
    if not leaves:
        return 0
    forward_ops = {}

    def step(*values):
        with tf.GradientTape() as tape:
            tape.watch(values)
            loss = tf.add_n([_stand_in_loss(value) for value in values])
        forward_ops["count"] = len(tf.compat.v1.get_default_graph().get_operations())
        return tape.gradient(loss, list(values))

    specs = [tf.TensorSpec(leaf.shape, leaf.dtype) for leaf in leaves]
    concrete = tf.function(step, autograph=False).get_concrete_function(*specs)
    kept, _, _ = _kept_bytes(concrete.graph.get_operations(), forward_ops["count"], concrete.outputs)
    held = sum(leaf.shape.num_elements() * leaf.dtype.size for leaf in leaves)
    gradients = sum(leaf.shape.num_elements() * 4 for leaf in leaves)
    return held * (2 if _computes_metrics(model) else 1) + kept + gradients


def _computes_metrics(model):
    """Whether Keras's trainer computes metrics on `model`'s outputs: what `compile` was given (Keras 3 keeps it in
    `_compile_metrics`, None without metrics; tf_keras in `compiled_metrics`)."""
    if model is None:
        return False
    container = model._compile_metrics if hasattr(model, "_compile_metrics") else getattr(model, "compiled_metrics", None)
    if container is None:
        return False
    return any(tf.nest.flatten(getattr(container, name, None) or []) for name in ("_user_metrics", "_user_weighted_metrics"))


def _stand_in_loss(outputs):
    """A loss whose gradient costs what a training loss's does: a cross-entropy's over classes, else a square's."""
    outputs = tf.cast(outputs, tf.float32)
    if outputs.shape.rank >= 2 and outputs.shape[-1] > 1:
        labels = tf.argmax(tf.stop_gradient(outputs), axis=-1)
        return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=outputs))
    return 0.5 * tf.reduce_sum(outputs * outputs)


def allocator_peak(reset=False):
    """The peak bytes the default device's allocator has held (since the last reset); or None without figures.

    With `reset`, the peak is set back to what it holds now first. A GPU's
    allocator keeps figures; the CPU's only as BFC (`TF_CPU_ALLOCATOR_USE_BFC=1`).
    """
    device = _statistics_device()
    if device is None:
        return None
    try:
        if reset:
            tf.config.experimental.reset_memory_stats(device)
        return tf.config.experimental.get_memory_info(device)["peak"]
    except (ValueError, tf.errors.OpError):  # the CPU's default allocator: no statistics
        return None


def states_step_bytes(model):
    """Whether `step_bytes` measures `model`'s step: a convolutional network's, where the allocator keeps figures and
    no distribution strategy holds the weights (NOTE [ calibrating a CNN to TensorFlow's allocator ])."""
    from keras_recompute import _memory

    if not _memory._has_convolution(model) or allocator_peak() is None or tf.distribute.has_strategy():
        return False
    return not any(isinstance(_tf_variable(v), tf.distribute.DistributedValues) for v in model.variables)


def step_bytes(model, inputs):
    """What a training step of `model` on `inputs` holds above what is resident, from the allocator's peak.

    NOTE [ calibrating a CNN to TensorFlow's allocator ]
    A convolutional network's compiled step held 12-26% more than the tensors
    its backward reads, varying from run to run of one graph, and Grappler
    kept an activation-sized constant between steps under recompute (NOTE
    [ a CNN on TensorFlow's allocator ] in `_memory`): MobileNetV2's step
    under "full" peaked 1.36x the count. No count of the graph foresees that;
    the allocator's figures do, as XLA's buffer assignment does on JAX (NOTE
    [ checking a plan on JAX ] in `backends/jax.py`). So where the allocator
    keeps figures (a GPU; the CPU with `TF_CPU_ALLOCATOR_USE_BFC=1`), such a
    model's step is run: a `tf.function` as Keras's trainer's (the model
    called in training under a tape, a stand-in loss on its outputs, the
    optimizer's update), traced and run once, then run three times more; its
    figure is the largest of those peaks above what the allocator held before
    the first (what the step keeps between steps counts: Grappler's
    constant). The peak varies from run to run of one step (by 8% on a small
    MobileNetV2), from one trace to the next (MobileNetV2 under "full" at
    batch 16: 248 and 279 MB, 2026-12-02) and with the allocator's history
    in the process (likely its free chunks: BFC hands out one of under twice
    a request whole, and counts it whole, NOTE [ the allocator's blocks ] in
    `_fit`): four blocks of 32 channels at 32x32 read 14.8-19.1 MB at 8 rows
    where 16 read 29.5-31.7 (64 processes, 2026-12-05), and the line through
    them moved by twice that spread. Collecting Python's garbage first
    steadied a process's first measure, not its later ones (not taken).
    Every variable and optimizer slot is copied to the host first and put
    back after: the model and its optimizer are as they were. Not at the
    batch itself, which may not fit, where the batch can be cut (NOTE
    [ measuring below the batch ] in `_memory`): at a quarter and at a half of
    it, extrapolated along the line through them (never below the half's).
    A line, not a proportion: without oneDNN, TensorFlow's convolutions hold
    a scratch of a fixed size (36 MB on 4 blocks of 32 channels at 32x32: 46,
    56 and 78 MB at 8, 16 and 32 rows; twice the half's read 112). Where the
    peaks grow faster than the batch the line reads low: MobileNetV2 under
    "full" at 128x128, 119, 248 and 515 MB at 8, 16 and 32 rows, the line
    506; a MobileNetV2 of width 0.35 at 64x64, 8.1, 15.0 and 34.8 MB at 4, 8
    and 16 rows, the line 28.8.
    The planner calibrates its units to these figures and checks mixed plans
    with them (NOTE [ calibrating the units to the compiler ] in `_model`).
    Only a convolutional network's: a transformer's count is the allocator's
    to a few percent, and a language model's step peaks at its loss on the
    logits, where a stand-in loss is not the user's (calibrating keras-hub
    Gemma so, tried on 2026-11-27, answered past what fits: docs/benchmarks.md,
    "The largest fit").
    """
    from keras_recompute import _memory  # the planner's module imports the backends

    below = _memory._measured_below(model, inputs)
    if below is None:
        return _step_bytes_at(model, inputs)
    batch, (quarter, half), parts = below
    low, high = (_step_bytes_at(model, part) for part in parts)
    return round(max(high, high + (high - low) * (batch - half) / (half - quarter)))


_STEP_RUNS = 3  # its peak varies from run to run of one step (a small MobileNetV2's by 8%): the largest is taken


def _step_bytes_at(model, inputs):
    """`step_bytes` of `model` at `inputs`, its step run there."""
    from keras_recompute import _memory

    optimizer = getattr(model, "optimizer", None)
    state = list(model.variables) + _memory.optimizer_variables(model)  # the optimizer built, as a first step builds it
    saved = [variable.numpy() for variable in state]
    values = tf.nest.map_structure(tf.convert_to_tensor, inputs)
    trainable = model.trainable_variables
    kwargs = _keras3.training_kwargs(model)

    def step(values):
        with tf.GradientTape() as tape:
            outputs = [o for o in _flatten(model(values, **kwargs)) if _is_differentiable(o)]
            loss = tf.add_n([_stand_in_loss(output) for output in outputs]) if outputs else tf.zeros(())
        gradients = tape.gradient(loss, trainable)
        pairs = [(g, v) for g, v in zip(gradients, trainable) if g is not None]
        if optimizer is not None and pairs:
            optimizer.apply_gradients(pairs)
        return loss

    try:
        before = _bytes_in_use()
        step = tf.function(step).get_concrete_function(values)  # its function traced once (no retracing warning)
        step(values)  # run: what it keeps between steps is made
        peaks = []
        for _ in range(_STEP_RUNS):
            allocator_peak(reset=True)
            step(values)
            peaks.append(allocator_peak())
    finally:
        for variable, value in zip(state, saved):
            variable.assign(value)
    return max(0, max(peaks) - before)


def compiler_scratch_bytes():
    """What every step holds whatever its size, outside the units' scale: none counted apart on TensorFlow (what the
    allocator gives a convolution's workspace is in the step's figure, `step_bytes`)."""
    return 0


def _statistics_device():
    """The device whose allocator's figures count: a GPU, or the CPU under BFC; None otherwise.

    On some CPUs (seen on an Intel Xeon with TensorFlow 2.21) the CPU's default
    allocator answers `get_memory_info` without raising, but its figures miss
    what a Keras training step allocates (a peak of 0 bytes around one): only
    `TF_CPU_ALLOCATOR_USE_BFC=1` makes the CPU's figures the step's.
    """
    if tf.config.list_logical_devices("GPU"):
        return "GPU:0"
    bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").strip().lower() in ("1", "true")  # as TensorFlow reads it
    return "CPU:0" if bfc else None


def _bytes_in_use():
    """What the default device's allocator holds now, or None where it keeps no figures."""
    device = _statistics_device()
    if device is None:
        return None
    try:
        return tf.config.experimental.get_memory_info(device)["current"]
    except (ValueError, tf.errors.OpError):  # the CPU's default allocator: no statistics
        return None


def _eager_kept_bytes(layer, flat, positions, args, kwargs):
    """What one eager forward of `layer` under a tape holds beyond its outputs, from the allocator; or None."""
    differentiated = [tf.identity(flat[p]) for p in positions]
    leaves = list(flat)
    for position, value in zip(positions, differentiated):
        leaves[position] = value
    _context.copy_masks([flat[p] for p in positions], differentiated)
    call_args, call_kwargs = _context.rebuild((args, kwargs), iter(leaves))
    before = _bytes_in_use()
    if before is None:
        return None
    with tf.GradientTape() as tape:
        tape.watch(differentiated)
        outputs = layer(*call_args, **call_kwargs)
    held = _bytes_in_use() - before
    outputs_bytes = sum(o.shape.num_elements() * o.dtype.size for o in _flatten(outputs) if isinstance(o, tf.Tensor))
    del tape, outputs
    return max(0, held - outputs_bytes)


def _eager_kept_bound(forward):
    """An upper bound of what an eager tape keeps of `forward`'s ops (NOTE [ measuring for eager execution ])."""
    differentiable = set()
    for operation in forward:
        if operation.type in ("Placeholder", "ReadVariableOp") or any(t.ref() in differentiable for t in operation.inputs):
            differentiable.update(t.ref() for t in operation.outputs if t.dtype.is_floating)
    counted, total = set(), 0
    for operation in forward:
        if operation.type in ("Placeholder", "ReadVariableOp") or not any(t.ref() in differentiable for t in operation.inputs):
            continue
        for tensor in list(operation.inputs) + list(operation.outputs):
            while tensor.op.type in _VIEWS and tensor.op.inputs:
                tensor = tensor.op.inputs[0]
            if tensor.op.type in ("Placeholder", "Const", "ReadVariableOp", "VarHandleOp") or tensor.dtype == tf.resource:
                continue
            if tensor.ref() in counted or tensor.shape.num_elements() is None:
                continue
            counted.add(tensor.ref())
            total += tensor.shape.num_elements() * tensor.dtype.size
    return total


def _needed(fetches):
    """The ops `fetches` (tensors of one graph) are computed from: what the runtime runs of it."""
    needed, waiting = set(), [tensor.op for tensor in fetches]
    while waiting:
        operation = waiting.pop()
        if operation not in needed:
            needed.add(operation)
            waiting.extend(tensor.op for tensor in operation.inputs)
            waiting.extend(operation.control_inputs)
    return needed


def _kept_bytes(operations, forward_count, fetches=None):
    """`(kept, largest, read)`: what the backward of a traced step (its ops after the first `forward_count`) reads
    of its forward, in bytes, where it is run for `fetches` (all of it without them: NOTE [ measuring a unit on
    TensorFlow ]); the largest tensor any of its ops reads; and what they all read."""
    forward = set(operations[:forward_count])
    needed = None if fetches is None else _needed(fetches)
    counted, read, total, largest, everything = set(), set(), 0, 0, 0
    for operation in operations[forward_count:]:
        for tensor in operation.inputs:
            if tensor.op not in forward:
                continue
            while tensor.op.type in _VIEWS and tensor.op.inputs:
                tensor = tensor.op.inputs[0]
            # A variable's read is the variable's own buffer (resident), not a copy the forward keeps.
            if tensor.op.type in ("Placeholder", "Const", "VarHandleOp", "ReadVariableOp") or tensor.dtype == tf.resource:
                continue
            if tensor.shape.num_elements() is None:
                continue
            size = tensor.shape.num_elements() * tensor.dtype.size
            if tensor.ref() not in read:
                read.add(tensor.ref())
                largest, everything = max(largest, size), everything + size
            if tensor.ref() not in counted and (needed is None or operation in needed):
                counted.add(tensor.ref())
                total += size
    return total, largest, everything
