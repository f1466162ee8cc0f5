"""Keras 3 state around a recomputed call: the one place for private Keras APIs.

Every backend path imports this module lazily, after Keras 3 has been imported
by the user. Tested on Keras 3.15.

NOTE [ state during the recompute ]
A recomputed call must see the state the forward saw and must leave no trace:
  * Random ops in Keras 3 draw their seeds from `SeedGenerator` variables that
    each draw advances. The forward advances them; the recompute would draw the
    next seeds, so dropout masks would differ and gradients would be silently
    wrong (the bug users reported against the seed code).
  * Layers such as `BatchNormalization` assign their moving statistics in
    `call`. A second run must not assign them a second time.
Before the forward we read the layer's state (`state_variables`: seed states,
moving statistics, any variable that is not a weight to train; reading is
free on TensorFlow, where the tensor shares the buffer until the variable is
written). The recompute runs inside a `keras.StatelessScope` that maps each of
those variables to that value: reads see the forward's values, assignments are
collected and dropped, losses added by `add_loss` are collected and dropped.
Weights are not mapped, trained or frozen, so the recompute reads the real
variables and the gradient tape sees the trained ones (a frozen block's LoRA
kernels included; see NOTE [ the call's context ] in `_context`). Frozen
weights do not change within a step, and are not copied.
The autocast scope that `Layer.__call__` opened around the forward (mixed
precision) is re-entered as well, so the recompute casts variables the same way.
"""

import sys


def loaded():
    """Whether Keras 3 has been imported (tf_keras alone does not count)."""
    keras = sys.modules.get("keras")
    return keras is not None and hasattr(keras, "StatelessScope")


def is_layer(obj):
    """Whether `obj` is a Keras 3 layer, without importing Keras."""
    return loaded() and isinstance(obj, sys.modules["keras"].Layer)


def dense_classes():
    """Keras 3's layers with a weight matmul (see NOTE [ save_dots on TensorFlow ]), or ()."""
    if not loaded():
        return ()
    keras = sys.modules["keras"]
    return (keras.layers.Dense, keras.layers.EinsumDense)


def backend_name():
    return sys.modules["keras"].config.backend()


class CallState:
    """What the recompute of one call needs to see the forward's state."""

    def __init__(self, snapshot, autocast_scope, call_context=None, attributes=(), global_seeds=None):
        self.snapshot = snapshot
        self.autocast_scope = autocast_scope
        # Keras's global seed generator (NOTE [ an unseeded draw ]): Keras keeps it per thread, and
        # autograd may run the recompute in a thread of its own (NOTE [ the recompute's thread ]).
        self.global_seeds = global_seeds
        # The forward's call context: sub-layers called without `training`
        # read it from there, so the recompute must see the same one.
        self.call_context = call_context
        # `[(layer, name, value)]`: Python attributes the call reads as state (NOTE [ an RNN cell's cached masks ]).
        self.attributes = list(attributes)

    def map_values(self, fn):
        """The same state with `fn` applied to each snapshot value."""
        snapshot = [(variable, fn(value)) for variable, value in self.snapshot]
        return CallState(snapshot, self.autocast_scope, self.call_context, self.attributes, self.global_seeds)


# NOTE [ an RNN cell's cached masks ]
# Keras's RNN cells with `dropout=` or `recurrent_dropout=` (`DropoutRNNCell`:
# LSTMCell, GRUCell, SimpleRNNCell) draw their masks once a batch, before the
# RNN's loop, and keep them in Python attributes that every step's call reads;
# the RNN clears them after the loop. A recomputed cell (a subclass whose call
# is decorated) recomputes after that, in the backward, found no mask and drew
# new ones: the recompute check raised (PyTorch, TensorFlow; JAX traces the
# call once). The forward's masks are kept with the call's state and put back
# on the cell for its recompute, then taken off again.
_CELL_MASKS = ("_dropout_mask", "_recurrent_dropout_mask")
_ABSENT = object()


def _cell_masks(owner):
    """`[(cell, name, value)]`: the cached dropout masks of the Keras RNN cells under `owner`, as they are now."""
    try:
        from keras.src.layers.rnn.dropout_rnn_cell import DropoutRNNCell
    except ImportError:  # pragma: no cover - another Keras 3 layout
        return []
    return [
        (layer, name, layer.__dict__.get(name, _ABSENT))
        for layer in owner._flatten_layers(include_self=True)
        if isinstance(layer, DropoutRNNCell)
        for name in _CELL_MASKS
    ]


class _Attributes:
    """Within it, each `(layer, name, value)` is set as given (`_ABSENT`: not set); after it, as it was."""

    def __init__(self, attributes):
        self._attributes = attributes
        self._before = []

    def __enter__(self):
        self._before = [(layer, name, layer.__dict__.get(name, _ABSENT)) for layer, name, _ in self._attributes]
        self._set(self._attributes)
        return self

    def __exit__(self, *exc_info):
        self._set(self._before)
        return False

    @staticmethod
    def _set(attributes):
        for layer, name, value in attributes:
            if value is _ABSENT:
                layer.__dict__.pop(name, None)
            else:
                object.__setattr__(layer, name, value)


def get_mask(tensor):
    """The mask Keras attached to `tensor` (`_keras_mask`), or None."""
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(tensor)


def set_mask(tensor, mask):
    from keras.src.backend.common.masking import set_keras_mask

    set_keras_mask(tensor, mask)


def trainability(owner):
    """`{id: trains}` for each variable under `owner`, and for the framework variable behind it.

    Keras 3 writes a layer's `trainable` into its variables and trains a
    variable whenever its own flag is set: the flag decides.
    """
    verdicts = {}
    for variable in owner.variables:
        verdicts[id(variable)] = bool(variable.trainable)
        value = getattr(variable, "_value", None)  # the tf.Variable a tape records
        if value is not None:
            verdicts[id(value)] = bool(variable.trainable)
    return verdicts


def state_variables(owner):
    """The variables under `owner` a recompute must read as the forward did.

    Seed states, moving statistics, metric and other variables that are not
    weights to train: the variables that do not train and were not created as
    weights to train (frozen weights stay out: nothing assigns them in a step).
    """
    created_as_weights = set()
    for layer in owner._flatten_layers(include_self=True):
        created_as_weights.update(id(variable) for variable in layer._trainable_variables)
    return [v for v in owner.variables if not v.trainable and id(v) not in created_as_weights]


def capture(owner, to_tensor, wait=None, eager=False, backend=None):
    """Records the state a recompute must replay, before the forward runs.

    Args:
        owner: the layer behind the call (`CallContext.owner`), or None.
        to_tensor: the backend's `convert_to_tensor`, which reads a variable.
        wait: in a graph, a function that makes a tensor depend on the call's
            inputs. The layer's seed states are assigned through it, so the
            forward's random draws wait for the inputs too: a compiler that
            sees seeds available at the start of the step would otherwise
            draw every block's dropout mask up front and keep them all alive
            (seen under XLA: +125 MB on the benchmark's 12-block encoder).
        eager: the call runs op by op (PyTorch, TensorFlow's eager mode):
            Keras's global seed generator, which an unseeded `keras.random`
            draw advances, is made now if no draw has made it yet, so that
            its state is recorded (NOTE [ an unseeded draw ]).
        backend: the Keras backend the call runs on (`"tensorflow"`,
            `"torch"`). Keras's global seed generator is recorded only where
            Keras 3 runs on it: a tf_keras call under Keras 3's PyTorch
            backend draws nothing from it, and its state is a torch tensor.

    Returns:
        A `CallState`, or None when Keras 3 is not in use.
    """
    if not loaded():
        return None
    from keras.src.backend.common import global_state

    variables = []
    if is_layer(owner):
        variables.extend(state_variables(owner))
    here = backend is None or backend_name() == backend
    global_seeds = global_state.get_global_attribute("global_seed_generator") if here else None
    # NOTE [ an unseeded draw ]
    # `keras.random.uniform(shape)` with no seed draws from Keras's global seed
    # generator, which the first such draw makes (and `set_random_seed`
    # unmakes). Made inside the forward, its state was not recorded before the
    # forward, and the recompute drew from the state the forward left: on
    # PyTorch and in TensorFlow's eager mode the first step raised
    # `RecomputeError` under "full", and under "save_dots" the check of the
    # kept matmuls' inputs is what catches it (found 2026-12-03). So it is
    # made before the forward, and the recompute sets it as Keras's global one
    # in its thread (Keras keeps it per thread; autograd's device thread, on a
    # GPU, had none): the draw that would have made it finds it, with
    # the seed it would have had (one draw of Python's `random`, as Keras's
    # draw makes; a call that draws no unseeded value leaves Python's `random`
    # one draw further on than the plain call would). In a `tf.function` a
    # generator the trace makes is replayed alike (exact, measured, with no
    # change); JAX refuses unseeded draws in a traced call.
    if global_seeds is None and eager and here:
        from keras.src.random.seed_generator import global_seed_generator

        global_seeds = global_seed_generator()
    if global_seeds is not None:
        variables.append(global_seeds.state)
    autocast_scope = global_state.get_global_attribute("autocast_scope")
    if wait is not None and is_layer(owner):
        for layer in owner._flatten_layers(include_self=True):
            for generator in layer._seed_generators:
                generator.state.assign(wait(to_tensor(generator.state.value)))
    seen = set()
    snapshot = []
    # Read the stored values, not the autocast ones; through any stateless
    # scope around this call, so a nested recompute sees what its parent saw.
    with _SetAutocast(None):
        for variable in variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                snapshot.append((variable, to_tensor(variable.value)))
    attributes = _cell_masks(owner) if is_layer(owner) else []
    return CallState(
        snapshot, autocast_scope, global_state.get_global_attribute("current_call_ctx"), attributes, global_seeds
    )


def loss_lists(owner):
    """The lists that `add_loss` appends to, for `owner` and its sub-layers."""
    if not is_layer(owner):
        return []
    return [layer._losses for layer in owner._flatten_layers(include_self=True)]


class replay:
    """Context manager for the recompute: the forward's state, no side effects.

    After it exits, `losses` holds what `add_loss` received during the recompute.
    """

    def __init__(self, state, owner=None):
        self._state = state
        self._owner = owner
        self._scopes = ()
        self.losses = []

    def __enter__(self):
        if self._state is not None:
            stateless = _replay_scope_class()(self._state.snapshot, assigned_as_stored=True)
            self._scopes = (
                stateless,
                _SetAutocast(self._state.autocast_scope),
                _SetGlobalSeeds(self._state.global_seeds),
                _CallContext(self._owner, self._state.call_context),
                _Attributes(self._state.attributes),
            )
            for scope in self._scopes:
                scope.__enter__()
        return self

    def __exit__(self, *exc_info):
        for scope in reversed(self._scopes):
            scope.__exit__(*exc_info)
        if self._scopes:
            self.losses = list(self._scopes[0].losses)
        self._scopes = ()
        return False


def collect():
    """A stateless scope for a traced call: reads fall through, writes and losses are kept.

    Reads see the enclosing scope's values (or the variables'); `assign` and
    `add_loss` are recorded in the scope (`updated`, `state_mapping`,
    `losses`) instead of touching the variables, so a tracer made inside a
    trace (the JAX path traces the call once) does not leak into a variable.
    """
    return _replay_scope_class()([])


def in_symbolic_scope():
    """Whether Keras is computing output shapes (a functional model being built)."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope as symbolic

    return symbolic()


def unbuilt_layers(owner):
    """The layers under `owner` (itself included) that are not built yet."""
    if not is_layer(owner):
        return []
    return [layer for layer in owner._flatten_layers(include_self=True) if not layer.built]


def loss_owner(owner, loss):
    """The layer under `owner` whose `add_loss` received `loss` in a stateless scope."""
    if not is_layer(owner):
        return None
    for layer in owner._flatten_layers(include_self=True):
        if id(loss) in layer._loss_ids:
            return layer
    return owner


class _CallContext:
    """Makes the recompute run inside the forward's call context.

    Otherwise each sub-layer called during the recompute would open a call
    context of its own and clear its losses, the forward's included, and a
    sub-layer called without `training` would not see the forward's.
    """

    def __init__(self, owner, context=None):
        self._owner = owner
        self._context = context

    def __enter__(self):
        from keras.src.backend.common import global_state

        self._previous = global_state.get_global_attribute("current_call_ctx")
        if self._previous is None and self._context is not None:
            global_state.set_global_attribute("current_call_ctx", self._context)
        elif self._previous is None and is_layer(self._owner):
            from keras.src.layers.layer import CallContext

            global_state.set_global_attribute("current_call_ctx", CallContext(entry_layer=self._owner))

    def __exit__(self, *exc_info):
        from keras.src.backend.common import global_state

        global_state.set_global_attribute("current_call_ctx", self._previous)


def context_training(layer):
    """The `training` a call of `layer` runs with where its `call` takes none (the call context's), else None."""
    if getattr(layer, "_call_has_training_arg", True):
        return None
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.get_value("training")


def training_kwargs(model):
    """`{"training": True}` where Keras's trainer passes it to `model`, else `{}`.

    Keras 3's trainers (every backend) call a model whose `call` takes no
    `training` without it: no call context holds it, and the model's dropout
    runs off in training. tf_keras's passes it to every model.
    """
    return {} if is_layer(model) and not getattr(model, "_call_has_training_arg", True) else {"training": True}


def stateless_call(layer, trainable, non_trainable, *args, **kwargs):
    """`layer.stateless_call(...)`, its `training=` given as `Layer.__call__` gives it.

    `stateless_call` passes its keywords to `call` as they are: a layer whose
    `call` takes no `training` (a block's `call(self, inputs)`, recorded in a
    forward that gave it one: `_memory`) would be refused it, and its dropout
    would not see it. `__call__` passes it only to a `call` that takes it, and
    its sub-layers called without it read it from the call context: so here,
    in a context of this call's own.
    """
    if "training" not in kwargs or getattr(layer, "_call_has_training_arg", True):
        return layer.stateless_call(trainable, non_trainable, *args, **kwargs)
    with training_context(layer, kwargs.pop("training")):
        return layer.stateless_call(trainable, non_trainable, *args, **kwargs)


def training_context(layer, training):
    """A call context holding `training`, as `__call__` opens one for `layer` where none is open: its sub-layers
    read it there."""
    from keras.src.layers.layer import CallContext

    context = CallContext(entry_layer=layer)
    context.training = training
    return _CallContext(layer, context)


_REPLAY_SCOPE = []


# NOTE [ a read after an assign in the recompute ]
# A call may assign a state variable and read it again (an EMA codebook,
# keras-hub's RQ-VAE: `self.ema_w.assign(...)`, then `self.ema_w / ...`). On
# TensorFlow and PyTorch the forward stores the value and the read gets it as
# a variable holds it: with no gradient back to what it was computed from
# (`AssignVariableOp`; torch's `copy_` under `no_grad`). The recompute runs in
# a stateless scope, where a read after an assign gets the assigned tensor
# itself, so its gradient would flow back through the assignment into the
# call's inputs and weights: TensorFlow gave the kernel an update 0.02 off
# the plain one, silently (the values are the same, so the recompute check
# passes), and PyTorch's checkpoint saw more saved tensors than in the forward
# and raised. The replay stores what is assigned with its gradient stopped, as
# the variable would. JAX's step runs in a stateless scope itself (Keras's
# `stateless_call`), so its forward and recompute read the same tensor:
# `collect` keeps it.


def _replay_scope_class():
    """A `StatelessScope` that falls back on the scope it is nested in."""
    if not _REPLAY_SCOPE:
        import keras
        from keras.src.backend.common.stateless_scope import get_stateless_scope

        class ReplayScope(keras.StatelessScope):
            def __init__(self, state_mapping, assigned_as_stored=False):
                super().__init__(
                    state_mapping=state_mapping,
                    collect_losses=True,
                    initialize_variables=False,
                )
                self._parent = get_stateless_scope()
                self._assigned_as_stored = assigned_as_stored

                # The variables assigned in the scope, by id, in order.
                self.updated = {}

            def add_update(self, update):
                variable, value = update
                if self._assigned_as_stored:
                    # NOTE [ a read after an assign in the recompute ]
                    from keras import ops

                    value = ops.stop_gradient(value)
                super().add_update((variable, value))
                self.updated.setdefault(id(variable), variable)

            def get_current_value(self, variable):
                value = self.state_mapping.get(id(variable))
                if value is None and self._parent is not None:
                    value = self._parent.get_current_value(variable)
                return value

        _REPLAY_SCOPE.append(ReplayScope)
    return _REPLAY_SCOPE[0]


def current_autocast():
    """A context that sets Keras's autocast scope back to the one in effect now (None if no Keras 3)."""
    if not loaded():
        return None
    from keras.src.backend.common import global_state

    return _SetAutocast(global_state.get_global_attribute("autocast_scope"))


class _SetAutocast:
    """Sets Keras's global autocast scope (None included) for a block."""

    def __init__(self, scope):
        self._scope = scope

    def __enter__(self):
        from keras.src.backend.common import global_state

        self._previous = global_state.get_global_attribute("autocast_scope")
        global_state.set_global_attribute("autocast_scope", self._scope)

    def __exit__(self, *exc_info):
        from keras.src.backend.common import global_state

        global_state.set_global_attribute("autocast_scope", self._previous)


class _SetGlobalSeeds:
    """Makes `generator` Keras's global seed generator in this thread for a block (None: leaves it)."""

    def __init__(self, generator):
        self._generator = generator

    def __enter__(self):
        from keras.src.backend.common import global_state

        self._previous = global_state.get_global_attribute("global_seed_generator")
        if self._generator is not None:
            global_state.set_global_attribute("global_seed_generator", self._generator)

    def __exit__(self, *exc_info):
        from keras.src.backend.common import global_state

        if self._generator is not None:
            global_state.set_global_attribute("global_seed_generator", self._previous)


# NOTE [ a functional graph's pieces ]
# `recompute_model(segments=...)` runs a functional model's graph piece by
# piece, each piece one recomputed call. Keras runs a functional graph in
# `Function._run_through_graph`: nodes by decreasing depth, each filled in
# from a map of reference tensor ids to values. The pieces are contiguous runs
# of that same order; `install_pieces` sets an instance attribute that runs
# them instead, so the model's class, config and saved file do not change.
# Each piece is a call of a holder layer, which runs its `call` as the
# instance has it: a piece recomputes, under a policy, as a block does, when
# `recompute_model` sets that instance's `call`, and a budget measures and
# plans it as it does a block (`_memory`).


def functional_of(model):
    """The `Functional` that runs `model`'s graph (a Sequential's inner one), or None."""
    from keras.src.models.functional import Functional
    from keras.src.models.sequential import Sequential

    if isinstance(model, Sequential):
        return model._functional
    if isinstance(model, Functional):
        return model
    return None


def graph_nodes(functional):
    """The graph's nodes in Keras's execution order, as `(layer, input ids, output ids, node)`."""
    nodes = []
    for depth in sorted(functional._nodes_by_depth, reverse=True):
        for node in functional._nodes_by_depth[depth]:
            if node.operation is None or node.is_input:
                continue
            operation = functional._get_operation_for_node(node) if hasattr(functional, "_get_operation_for_node") else node.operation
            nodes.append((operation, [id(x) for x in node.input_tensors], [id(x) for x in node.outputs], node))
    return nodes


def graph_ends(functional):
    """`(input ids, output ids, float tensor ids)` of the graph."""
    tensors = list(functional.inputs) + list(functional.outputs)
    for depth in functional._nodes_by_depth.values():
        for node in depth:
            tensors.extend(node.outputs)
    floats = {id(x) for x in tensors if "float" in str(getattr(x, "dtype", ""))}
    return [id(x) for x in functional.inputs], [id(x) for x in functional.outputs], floats


_SEGMENT = []


def segment(functional, nodes, input_ids, output_ids, name):
    """A layer holding one piece of the graph; calling it computes the piece.

    The layer tracks the piece's layers, so a recompute of its `call` finds
    their state as it finds a block's (see NOTE [ the call's context ]); the
    model does not track it, so it is neither saved nor in `model.layers`.
    Calling it runs its `call` as the instance has it now, so that
    `recompute_model` plans a piece as it plans a layer: by setting `call`.
    """
    if not _SEGMENT:
        import keras
        from keras import tree

        class Segment(keras.layers.Layer):
            def __init__(self, functional, nodes, input_ids, output_ids, **kwargs):
                super().__init__(**kwargs)
                self.segment_layers = _distinct(node[0] for node in nodes)
                # Not tracked: the model is not a sub-layer of its piece.
                object.__setattr__(self, "_piece", (functional, nodes, list(input_ids), list(output_ids)))
                self.built = True

            def __call__(self, *values, training=None, **kwargs):
                # Keras's `__call__` is not for a piece: its layers autocast, mask and build themselves. Called
                # alone with `training` (measured: `_memory`), its layers read it from a call context, as in the
                # model's forward they read the model's.
                if training is None:
                    return self.call(*values, **kwargs)
                with training_context(self, training):
                    return self.call(*values, **kwargs)

            def call(self, *values, operation_fn=None):
                """The piece's output values from its input values (in `input_ids` order)."""
                functional, nodes, input_ids, output_ids = self._piece
                computed = dict(zip(input_ids, values))
                for operation, node_inputs, node_outputs, node in nodes:
                    if any(i not in computed for i in node_inputs):
                        continue  # not computable, as Keras skips it
                    args, kwargs = node.arguments.fill_in(computed)
                    outputs = (operation_fn or (lambda op: op))(operation)(*args, **kwargs)
                    computed.update(zip(node_outputs, tree.flatten(outputs)))
                return [computed[i] for i in output_ids]

        _SEGMENT.append(Segment)
    return _SEGMENT[0](functional, nodes, input_ids, output_ids, name=name)


# NOTE [ a functional graph's values until their last use ]
# Keras's `Function._run_through_graph` keeps every value it computes in one
# map until the whole graph has run. Where the autograd graph keeps a value
# anyway that costs nothing; where only that map does, the value stays on the
# device for the rest of the forward. That defeats `offload=True` on
# PyTorch: each recomputed block's input, copied to host memory by the
# checkpoint's hooks, stayed on the device too, the previous block's output
# in the map (an H200, 96 blocks x 256 at batch 512, mixed_bfloat16: 9058 MiB
# against full's 9702, where memory_report predicted 3971; on the CPU every
# earlier block's input was alive at each block's forward). So, once a
# PyTorch call with `offload=True` is decorated or runs, Keras's functional
# graphs run through `_run_releasing`: the same nodes in the same order, each
# value dropped after the last node that reads it (the graph's outputs kept).
# Values are unchanged; only when they leave the device is. `install_pieces`
# releases a piece's values so too.


def _last_reads(reads_by_step, kept):
    """`{step index: [ids whose last reader it is]}` over steps that read ids, leaving out `kept`."""
    last = {}
    for index, reads in enumerate(reads_by_step):
        for i in reads:
            last[i] = index
    released = {}
    for i, index in last.items():
        if i not in kept:
            released.setdefault(index, []).append(i)
    return released


def _run_releasing(functional, inputs, operation_fn):
    """Keras's `_run_through_graph` without `call_fn`, each value dropped after its last reader."""
    from keras import tree

    nodes = graph_nodes(functional)
    released = _last_reads([node_inputs for _, node_inputs, _, _ in nodes], {id(x) for x in functional.outputs})
    computed = dict(zip([id(x) for x in functional.inputs], tree.flatten(inputs)))
    del inputs
    for index, (operation, node_inputs, node_outputs, node) in enumerate(nodes):
        if all(i in computed for i in node_inputs):  # else not computable: Keras skips it
            args, kwargs = node.arguments.fill_in(computed)
            outputs = operation_fn(operation)(*args, **kwargs)
            del args, kwargs
            computed.update(zip(node_outputs, tree.flatten(outputs)))
            del outputs
        for i in released.get(index, ()):
            computed.pop(i, None)
    missing = [index for index, x in enumerate(functional.outputs) if id(x) not in computed]
    if missing:
        path = ".".join(str(p) for p in tree.flatten_with_path(functional._outputs_struct)[missing[0]][0])
        raise ValueError(f"Output with path `{path}` is not connected to `inputs`")
    return tree.pack_sequence_as(functional._outputs_struct, [computed[id(x)] for x in functional.outputs])


_RELEASING = []  # Keras's own `Function._run_through_graph`, once replaced


def release_graph_values():
    """On PyTorch, makes Keras's functional graphs drop each value after its last reader, once a process
    (NOTE [ a functional graph's values until their last use ])."""
    keras = sys.modules.get("keras")
    config = getattr(keras, "config", None)  # None before Keras is imported, and on Keras 2
    if _RELEASING or config is None or not hasattr(config, "backend") or config.backend() != "torch":
        return
    from keras.src.ops.function import Function

    _RELEASING.append(Function._run_through_graph)
    Function._run_through_graph = releasing_runner(Function._run_through_graph)


def releasing_runner(original):
    """A `Function._run_through_graph` that runs `_run_releasing`, and Keras's `original` for symbolic runs."""

    def _run_through_graph(self, inputs, operation_fn=lambda op: op, call_fn=None):
        if call_fn is not None:  # Keras's symbolic runs
            return original(self, inputs, operation_fn, call_fn)
        return _run_releasing(self, inputs, operation_fn)

    return _run_through_graph


def install_pieces(functional, pieces, active):
    """Makes `functional` run its graph as `pieces`: `(run, input ids, output ids)` each.

    `active()` says, when the model is called, whether the pieces run at all:
    when it is false, Keras's own `_run_through_graph` runs (recompute off is
    the plain model). Returns a function that takes the pieces out again.
    """
    from keras import tree

    original = type(functional)._run_through_graph.__get__(functional)
    input_ids = [id(x) for x in functional.inputs]
    output_ids = [id(x) for x in functional.outputs]
    released = _last_reads([piece_inputs for _, piece_inputs, _ in pieces], set(output_ids))

    def run_through_graph(inputs, operation_fn=lambda op: op, call_fn=None):
        if call_fn is not None or not active():
            return original(inputs, operation_fn, call_fn)
        computed = dict(zip(input_ids, tree.flatten(inputs)))
        for index, (run, piece_inputs, piece_outputs) in enumerate(pieces):
            if any(i not in computed for i in piece_inputs):
                return original(inputs, operation_fn, call_fn)  # a graph Keras runs partly
            computed.update(zip(piece_outputs, run(*[computed[i] for i in piece_inputs], operation_fn=operation_fn)))
            for i in released.get(index, ()):  # NOTE [ a functional graph's values until their last use ]
                del computed[i]
        return tree.pack_sequence_as(functional._outputs_struct, [computed[i] for i in output_ids])

    functional._run_through_graph = run_through_graph

    def uninstall():
        if functional.__dict__.get("_run_through_graph") is run_through_graph:
            del functional.__dict__["_run_through_graph"]

    return uninstall


def children(layer):
    """A layer's direct sub-layers, in the order it tracks them."""
    return list(getattr(layer, "_layers", ()))


def _distinct(items):
    seen, result = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            result.append(item)
    return result
