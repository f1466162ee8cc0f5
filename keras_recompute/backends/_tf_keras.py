"""tf_keras (Keras 2) state around a recomputed call: the one place for private tf_keras APIs.

Imported by the TF path only once `tf_keras` is in `sys.modules`. Tested on
tf_keras 2.21.

NOTE [ tf_keras random draws ]
tf_keras layers draw randomness through `tf_keras.backend.RandomGenerator`,
in one of three ways (its `rng_type`):
  * "stateless": the same seed every call; a recompute draws the same values.
  * "stateful" (after `tf_keras.backend.experimental.enable_tf_random_generator()`):
    a `tf.random.Generator` whose state is a variable. We read the state before
    the forward's first draw and, in the recompute, rewind the generator to it
    and put it back afterwards: the same masks at no memory cost, and the
    stream after the step is where the plain layer leaves it.
  * "legacy_stateful" (the default): TF's stateful random ops, whose state
    lives inside op kernels and cannot be rewound. We record what the forward
    drew and replay it: for dropout the keep mask packed to one bit an
    element (`_Packed`: a bool tensor takes a byte; on bert4keras BERT-base,
    seq 128, that was 3.8 MB a sample of 24.6), for other draws the values
    themselves. Exact, at that memory cost; `enable_tf_random_generator()`
    removes it.
`RandomGenerator`'s four drawing methods are wrapped once, at the first
recomputed call. Outside a recomputed call the wrapper is one attribute read
away from the original method.

NOTE [ tf_keras state updates ]
`BatchNormalization` and other layers assign non-trainable variables in
`call`. tf_keras has no stateless scope, so the forward reads the values of
the weights created non-trainable under the owner (moving statistics, not
frozen kernels, which nothing assigns) before it runs; the recompute saves
their current values, sets the forward's back, runs (its reads see what the
forward's saw, also a read after an assign in the call: an EMA codebook reads
what it just assigned), and assigns the saved values back: the second update
is undone. Starting from the values after the forward instead, the recompute
of a call that reads its state computed another function: caught by the
recompute check, but for XLA, which drops the check's asserts (the kernel's
update came out 0.05 off). In a TF1-style graph the layers
instead register update ops in `_updates`, which the training function runs;
the ones the recompute registers are taken off again (the save and restore ops
are then never run, as nothing fetches them).

NOTE [ tf_keras mixed precision ]
Under a mixed policy, `Layer.__call__` reads `AutoCastVariable`s in the compute
dtype by setting a thread-local dtype. The recompute runs outside `__call__`,
so that dtype is captured with the forward and set again for the recompute.
"""

import contextlib
import sys
import threading

import tensorflow as tf

from keras_recompute import _patch
from keras_recompute._errors import RecomputeError

_local = threading.local()
_METHODS = ("dropout", "random_uniform", "random_normal", "truncated_normal")
_patched = []


def loaded():
    return "tf_keras" in sys.modules


def dense_classes():
    """tf_keras's layers with a weight matmul (see NOTE [ save_dots on TensorFlow ]), or ()."""
    if not loaded():
        return ()
    from tf_keras.src.layers.core import dense, einsum_dense

    return (dense.Dense, einsum_dense.EinsumDense)


def context_training(layer):
    """The `training` a call of `layer` runs with where its `call` takes none (the call context's), else None."""
    if getattr(layer, "_expects_training_arg", True):
        return None
    from tf_keras.src.engine import base_layer_utils

    return base_layer_utils.call_context().call_context_args.get("training")


def current_autocast():
    """A context that sets tf_keras's autocast dtype back to the one in effect now (None if no tf_keras)."""
    if not loaded():
        return None
    from tf_keras.src.mixed_precision import autocast_variable

    return _SetAutocastDtype(autocast_variable._autocast_dtype, getattr(autocast_variable._autocast_dtype, "dtype", None))


class _SetAutocastDtype:
    def __init__(self, holder, dtype):
        self._holder = holder
        self._dtype = dtype

    def __enter__(self):
        self._previous = getattr(self._holder, "dtype", None)
        self._holder.dtype = self._dtype

    def __exit__(self, *exc_info):
        self._holder.dtype = self._previous
        return False


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class RandomTape:
    """The random draws of one recomputed call: recorded, then replayed."""

    def __init__(self, name):
        self.name = name
        self.records = []  # legacy draws: (method, value)
        self.generator_states = {}  # id(generator) -> (generator, state before the forward)
        self.replaying = False
        self.wait = None  # while replaying: makes a tensor wait for the incoming gradient
        self._position = 0
        self._restore = {}  # id(generator) -> (generator, state before the recompute)
        # In a graph: the graph of the call, and a seed drawn there for masks
        # drawn inside control flow (see NOTE [ dropout inside a graph branch ]).
        self.graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        self.base_seed = None
        if self.graph is not None and not isinstance(self.graph, tf.__internal__.FuncGraph):
            self.base_seed = tf.random.uniform([2], maxval=2**31 - 1, dtype=tf.int32)
        self.seeded = 0

    def replay(self, wait=None):
        """Context manager: draws inside it come from this tape; kept masks unpack after `wait`."""
        self.wait = wait
        return _Active(self, replaying=True)

    def record(self):
        """Context manager: draws inside it are recorded on this tape."""
        return _Active(self, replaying=False)

    def _next(self, method):
        if self._position >= len(self.records):
            raise RecomputeError(
                f"keras_recompute: the recompute of {self.name} drew more random "
                f"values ({method}) than its forward did. A recomputed call must "
                "draw the same random values in the same order each time."
            )
        recorded_method, value = self.records[self._position]
        self._position += 1
        if recorded_method != method:
            raise RecomputeError(
                f"keras_recompute: the recompute of {self.name} drew with "
                f"{method} where its forward drew with {recorded_method}. A "
                "recomputed call must draw in the same order each time."
            )
        return value

    def _rewind(self, generator):
        key = id(generator)
        if key in self.generator_states and key not in self._restore:
            self._restore[key] = (generator, tf.identity(generator.state))
            generator.state.assign(self.generator_states[key][1])

    def _finish_replay(self):
        for generator, state in self._restore.values():
            generator.state.assign(state)
        self._restore = {}
        self.wait = None
        if self._position != len(self.records):
            raise RecomputeError(
                f"keras_recompute: the recompute of {self.name} drew "
                f"{self._position} random tensors, its forward {len(self.records)}. "
                "A recomputed call must draw the same random values each time."
            )
        self._position = 0


class _Active:
    def __init__(self, tape, replaying):
        self._tape = tape
        self._replaying = replaying

    def __enter__(self):
        _install()
        self._tape.replaying = self._replaying
        _stack().append(self._tape)
        return self._tape

    def __exit__(self, exc_type, *exc_info):
        _stack().pop()
        if self._replaying and exc_type is None:
            self._tape._finish_replay()
        return False


def _install():
    """Wraps `RandomGenerator`'s drawing methods, once."""
    if _patched:
        return
    from tf_keras.src import backend

    cls = backend.RandomGenerator
    for name in _METHODS:
        original = getattr(cls, name)
        setattr(cls, name, _wrap(name, original))
    _patched.append(cls)


def _wrap(method, original):
    def draw(self, *args, **kwargs):
        stack = getattr(_local, "stack", None)
        if not stack:
            return original(self, *args, **kwargs)
        return _draw(method, original, self, args, kwargs, stack)

    draw.__wrapped__ = original
    draw.__name__ = original.__name__
    draw.__doc__ = original.__doc__
    return draw


def _draw(method, original, generator_owner, args, kwargs, stack):
    generator_owner._maybe_init()
    rng_type = generator_owner._rng_type
    if rng_type == generator_owner.RNG_STATELESS:
        return original(generator_owner, *args, **kwargs)
    replay_index = max((i for i, tape in enumerate(stack) if tape.replaying), default=-1)
    recorders = [tape for tape in stack[replay_index + 1 :] if not tape.replaying]

    if rng_type == generator_owner.RNG_STATEFUL:
        generator = generator_owner._generator
        if replay_index >= 0:
            stack[replay_index]._rewind(generator)
        for tape in recorders:
            if id(generator) not in tape.generator_states:
                tape.generator_states[id(generator)] = (generator, tf.identity(generator.state))
        return original(generator_owner, *args, **kwargs)

    # Legacy stateful ops: record the draw, or replay it.
    if method == "dropout":
        return _legacy_dropout(original, generator_owner, args, kwargs, stack, replay_index, recorders)
    if replay_index >= 0:
        value = stack[replay_index]._next(method)
    else:
        value = original(generator_owner, *args, **kwargs)
    for tape in recorders:
        tape.records.append((method, value))
    return value


class _Seeded:
    """A dropout mask drawn from a tape's seed (see NOTE [ dropout inside a graph branch ])."""

    def __init__(self, tape, index):
        self.tape = tape
        self.index = index

    def keep_mask(self, inputs, rate, noise_shape):
        shape = tf.shape(inputs) if noise_shape is None else noise_shape
        seed = self.tape.base_seed + tf.constant([0, self.index], tf.int32)
        return tf.random.stateless_uniform(shape, seed=seed) >= rate


class _Packed:
    """A dropout keep mask kept at one bit an element (see NOTE [ tf_keras random draws ]).

    Eight elements of the flattened mask make one uint8; the unpacked mask is
    built again in the recompute, made to wait for the incoming gradient
    (else a graph could unpack every mask during the forward, see NOTE
    [ ordering the recompute in graphs ] in `tensorflow`).
    """

    def __init__(self, keep):
        self.shape = keep.shape if keep.shape.is_fully_defined() else tf.shape(keep)
        flat = tf.cast(tf.reshape(keep, [-1]), tf.uint8)
        flat = tf.pad(flat, [[0, tf.math.floormod(-tf.size(flat), 8)]])
        self.bits = tf.reduce_sum(tf.reshape(flat, [-1, 8]) * _bit_values(), axis=1)

    def keep_mask(self, wait):
        bits = wait(self.bits) if wait is not None else self.bits
        keep = tf.not_equal(tf.bitwise.bitwise_and(bits[:, None], _bit_values()), 0)
        if isinstance(self.shape, tf.TensorShape) and self.shape.num_elements() % 8 == 0:
            return tf.reshape(keep, self.shape)  # no padding to cut: no copy
        return tf.reshape(tf.reshape(keep, [-1])[: tf.reduce_prod(self.shape)], self.shape)


def _bit_values():
    return tf.constant([1, 2, 4, 8, 16, 32, 64, 128], tf.uint8)


def _legacy_dropout(original, generator_owner, args, kwargs, stack, replay_index, recorders):
    inputs, rate, noise_shape = _dropout_arguments(*args, **kwargs)
    record = None  # what the recorders keep: a `_Seeded` draw, or else the mask packed
    if replay_index >= 0:
        replayed = stack[replay_index]._next("dropout")
        if isinstance(replayed, _Packed):
            keep = replayed.keep_mask(stack[replay_index].wait)
            record = replayed  # a nested unit keeps the same bits
        else:
            keep = replayed.keep_mask(inputs, rate, noise_shape)
    elif recorders and recorders[0].base_seed is not None and tf.compat.v1.get_default_graph() is not recorders[0].graph:
        # NOTE [ dropout inside a graph branch ]
        # In a TF1-style graph a Dropout driven by the learning-phase
        # placeholder draws inside a `tf.cond` branch; a mask drawn there
        # cannot be used outside it (nor in the recompute's own branch). The
        # mask is then drawn from a seed made before the call, in the call's
        # graph, and the draw's index, which both branches can read.
        record = _Seeded(recorders[0], recorders[0].seeded)
        recorders[0].seeded += 1
        keep = record.keep_mask(inputs, rate, noise_shape)
    else:
        # The same random op with the same seed as tf.nn.dropout(inputs, ...):
        # the same mask the plain layer would draw. Its values are 0 or scale.
        scaled = original(generator_owner, tf.ones_like(inputs), rate, noise_shape)
        keep = tf.not_equal(scaled, 0)
    if recorders and record is None:
        record = _Packed(keep)
    for tape in recorders:
        tape.records.append(("dropout", record))
    scale = tf.convert_to_tensor(1 / (1 - rate), dtype=inputs.dtype)
    return tf.where(keep, inputs * scale, tf.zeros_like(inputs))


def _dropout_arguments(inputs, rate, noise_shape=None):
    return inputs, rate, noise_shape


class CallState:
    """What a tf_keras recompute restores: autocast dtype and state variables."""

    def __init__(self, owner, name):
        from tf_keras.src.mixed_precision import autocast_variable

        self._autocast_module = autocast_variable
        self.autocast_dtype = getattr(autocast_variable._autocast_dtype, "dtype", None)
        self.random = RandomTape(name)
        self._owner = owner
        from tf_keras.src.engine import base_layer_utils

        # The forward's call-context arguments (`training` above all): a
        # sub-layer called without `training` reads it from there, so the
        # recompute must see the forward's, or its dropout would be off.
        self.call_context_args = dict(base_layer_utils.call_context().call_context_args)
        # The state as the forward will read it, before the forward assigns it (NOTE [ tf_keras state updates ]).
        # A read holds no copy: TensorFlow copies a variable's buffer only when an assign finds it shared.
        self.before = [(variable, tf.identity(variable)) for variable in self.updated_variables()]

    def updated_variables(self):
        """The weights created non-trainable under the owner: the state a call may assign."""
        owner = self._owner
        if owner is None or not hasattr(owner, "_flatten_layers"):
            return []
        variables, seen = [], set()
        for layer in owner._flatten_layers(include_self=True, recursive=True):
            for weight in layer._non_trainable_weights:
                if id(weight) not in seen:
                    seen.add(id(weight))
                    variables.append(weight)
        return variables

    def forward(self):
        return self.random.record()

    def replay(self, wait=None):
        return _Replay(self, wait)


def trainability(owner):
    """`{id(variable): trains}` for the weights under `owner`, by tf_keras's flags.

    tf_keras keeps `trainable` on layers: a weight trains when its own flag is
    set and the innermost layer that owns it is trainable (`layer.trainable =
    False` sets the flag of every layer under it; a sub-layer set back to
    True trains again). An `AutoCastVariable`'s inner variable, which a tape
    records, gets the same verdict.
    """
    verdicts = {}
    # Outer layers first: an inner layer's verdict overwrites its ancestors'.
    for layer in owner._flatten_layers(include_self=True, recursive=True):
        for weight in list(layer._trainable_weights) + list(layer._non_trainable_weights):
            verdict = bool(weight.trainable) and bool(layer.trainable)
            verdicts[id(weight)] = verdict
            inner = getattr(weight, "_variable", None)
            if inner is not None:
                verdicts[id(inner)] = verdict
    return verdicts


def loss_lists(owner):
    """The lists that `add_loss` appends to, for `owner` and its sub-layers."""
    if not loaded() or not hasattr(owner, "_flatten_layers") or not hasattr(owner, "_eager_losses"):
        return []
    lists = []
    for layer in owner._flatten_layers(include_self=True, recursive=True):
        lists.append(layer._eager_losses)
        lists.append(layer._losses)
    return lists


def update_lists(owner):
    """The lists that `add_update` appends to in TF1-style graphs (v1 layers)."""
    if not loaded() or not hasattr(owner, "_flatten_layers"):
        return []
    lists = []
    for layer in owner._flatten_layers(include_self=True, recursive=True):
        updates = getattr(layer, "_updates", None)
        if isinstance(updates, list):
            lists.append(updates)
    return lists


class _Replay:
    """The recompute of a tf_keras call: autocast, random draws, state, losses.

    After it exits, `losses` holds what `add_loss` received during the
    recompute; they are taken off the layers again.
    """

    def __init__(self, state, wait=None):
        self._state = state
        self._wait = wait
        self.losses = []

    def __enter__(self):
        state = self._state
        self._loss_lists = loss_lists(state._owner)
        self._loss_counts = [len(losses) for losses in self._loss_lists]
        # In a TF1-style graph, layers register their state updates in
        # `_updates`, run later by the training function: the recompute's must
        # not be among them (see NOTE [ tf_keras state updates ]).
        self._update_lists = update_lists(state._owner)
        self._update_counts = [len(updates) for updates in self._update_lists]
        self._call_context = None
        if state._owner is not None and hasattr(state._owner, "_flatten_layers"):
            from tf_keras.src.engine import base_layer_utils

            # add_loss only takes tensors inside a layer's call.
            self._call_context = base_layer_utils.call_context().enter(
                layer=state._owner,
                inputs=None,
                build_graph=not tf.executing_eagerly(),
                call_context_args=state.call_context_args,
            )
            self._call_context.__enter__()
        self._saved = [(v, tf.identity(v)) for v, _ in state.before]
        for variable, value in state.before:  # the recompute reads the state the forward read
            variable.assign(value)
        holder = state._autocast_module._autocast_dtype
        self._previous_dtype = getattr(holder, "dtype", None)
        holder.dtype = state.autocast_dtype
        self._random = state.random.replay(self._wait)
        self._random.__enter__()
        return self

    def __exit__(self, *exc_info):
        try:
            self._random.__exit__(*exc_info)
        finally:
            for variable, value in self._saved:
                variable.assign(value)
            self._state._autocast_module._autocast_dtype.dtype = self._previous_dtype
            if self._call_context is not None:
                self._call_context.__exit__(*exc_info)
            for losses, count in zip(self._loss_lists, self._loss_counts):
                self.losses.extend(losses[count:])
                del losses[count:]
            for updates, count in zip(self._update_lists, self._update_counts):
                del updates[count:]
        return False


def capture(owner, name):
    """The tf_keras state of a call about to run its forward, or None."""
    if not loaded():
        return None
    return CallState(owner, name)


# NOTE [ a functional graph's pieces ] (see `_keras3`): tf_keras runs a
# functional graph in `Functional._run_internal_graph`, nodes by decreasing
# depth, each filled in from a map of reference tensor ids (as strings) to
# lists of values that each use pops; `training` reaches the layers through
# the call context.


def functional_of(model):
    """`model` if it runs a functional graph (a built Sequential does too), else None."""
    return model if getattr(model, "_is_graph_network", False) else None


def graph_nodes(functional):
    """The graph's nodes in tf_keras's execution order, as `(layer, input ids, output ids, node)`."""
    nodes = []
    for depth in sorted(functional._nodes_by_depth, reverse=True):
        for node in functional._nodes_by_depth[depth]:
            if node.is_input:
                continue
            nodes.append((node.layer, list(node.flat_input_ids), list(node.flat_output_ids), node))
    return nodes


def graph_ends(functional):
    """`(input ids, output ids, float tensor ids)` of the graph."""
    tensors = list(functional.inputs) + list(functional.outputs)
    for depth in functional._nodes_by_depth.values():
        for node in depth:
            tensors.extend(tf.nest.flatten(node.outputs))
    floats = {str(id(x)) for x in tensors if getattr(getattr(x, "dtype", None), "is_floating", False)}
    return [str(id(x)) for x in functional.inputs], [str(id(x)) for x in functional.outputs], floats


_SEGMENT = []


def segment(functional, nodes, input_ids, output_ids, name):
    """A layer holding one piece of the graph; calling it computes the piece (see `_keras3.segment`)."""
    if not _SEGMENT:
        import tf_keras

        class Segment(tf_keras.layers.Layer):
            def __init__(self, functional, nodes, input_ids, output_ids, **kwargs):
                super().__init__(**kwargs)
                layers, seen = [], set()
                for node in nodes:
                    if id(node[0]) not in seen:
                        seen.add(id(node[0]))
                        layers.append(node[0])
                self.segment_layers = layers
                object.__setattr__(self, "_piece", (nodes, list(input_ids), list(output_ids)))
                self.built = True

            def __call__(self, *values, **kwargs):
                # tf_keras's `__call__` is not for a piece: its layers autocast, mask and build themselves.
                return self.call(*values, **kwargs)

            def call(self, *values, training=None):
                """The piece's output values from its input values (in `input_ids` order).

                `training`, when given, reaches the layers as the model's call
                passes it: through the call context (measuring runs a piece alone).
                """
                from tf_keras.src.engine import base_layer_utils

                nodes, input_ids, output_ids = self._piece
                computed = dict(zip(input_ids, values))
                with contextlib.nullcontext() if training is None else base_layer_utils.call_context().enter(
                    layer=self, inputs=None, build_graph=not tf.executing_eagerly(), call_context_args={"training": training}
                ):
                    for layer, node_inputs, node_outputs, node in nodes:
                        if any(i not in computed for i in node_inputs):
                            continue  # not computable, as tf_keras skips it
                        # `map_arguments` pops one value per use of a tensor.
                        args, kwargs = node.map_arguments({i: [computed[i]] * node_inputs.count(i) for i in node_inputs})
                        computed.update(zip(node_outputs, tf.nest.flatten(layer(*args, **kwargs))))
                return [computed[i] for i in output_ids]

        _SEGMENT.append(Segment)
    return _SEGMENT[0](functional, nodes, input_ids, output_ids, name=name)


def install_pieces(functional, pieces, active):
    """Makes `functional` run its graph as `pieces`; see `_keras3.install_pieces`."""
    original = type(functional)._run_internal_graph.__get__(functional)
    output_ids = [str(id(x)) for x in functional.outputs]

    def run_internal_graph(inputs, training=None, mask=None):
        if not active():
            return original(inputs, training=training, mask=mask)
        flat = functional._flatten_to_reference_inputs(inputs)
        masks = [None] * len(flat) if mask is None else functional._flatten_to_reference_inputs(mask)
        for value, value_mask in zip(flat, masks):
            if value is not None:
                value._keras_mask = value_mask
        computed = {
            str(id(x)): functional._conform_to_reference_input(y, ref_input=x) for x, y in zip(functional.inputs, flat)
        }
        for run, piece_inputs, piece_outputs in pieces:
            if any(i not in computed for i in piece_inputs):
                return original(inputs, training=training, mask=mask)  # a graph tf_keras runs partly
            computed.update(zip(piece_outputs, run(*[computed[i] for i in piece_inputs], training=training)))
        return tf.nest.pack_sequence_as(functional._nested_outputs, [computed[i] for i in output_ids])

    object.__setattr__(functional, "_run_internal_graph", run_internal_graph)

    def uninstall():
        if functional.__dict__.get("_run_internal_graph") is run_internal_graph:
            del functional.__dict__["_run_internal_graph"]

    return uninstall


def children(layer):
    """A layer's direct sub-layers, in the order it tracks them."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def _in_tf1_graph(model):
    return not tf.compat.v1.executing_eagerly_outside_functions() and getattr(model, "_is_graph_network", False)


def check_plannable(model):
    """Raises `RecomputeError` if a plan for `model` could not take effect (a compiled TF1-style model)."""
    if _in_tf1_graph(model) and getattr(model, "_is_compiled", False):
        raise RecomputeError(
            f"keras_recompute: {model.name!r} is compiled in a TF1-style graph, where compile builds the "
            "training graph from the model's outputs: call recompute_model before model.compile."
        )


def rebuild_graph_outputs(model):
    """In a TF1-style graph, rebuilds a functional model's outputs so that its plan takes effect.

    tf_keras's v1 `compile` and `fit` train the output tensors built when the
    model was made, not a new call of it: the outputs are made again by
    running the graph (with recompute on, as the switch is read when a graph
    is built), and put back by the returned function. Elsewhere nothing
    needs doing, and None is returned.

    NOTE [ rebuilding a model's outputs in a TF1-style graph ]
    Running the graph again calls every layer again, and a v1 layer registers
    its state updates (`BatchNormalization`'s moving statistics) in
    `_updates` at each call; the training function runs every update that
    depends on the model's inputs, so the old call's and the new one's would
    both run, moving each statistic twice a step (and the old updates would
    run the old forward too). The old call's updates that depend on the
    model's inputs are taken off while the plan holds; those of other inputs
    (a layer shared with another model) stay. And Keras runs the model's
    graph for a new call (`model(tensor)`) by looking its output tensors up
    by identity among the nodes' outputs, which the rebuilt ones are not:
    that run sees the model's own outputs.
    """
    if not _in_tf1_graph(model):
        return None
    from tf_keras.src.utils import tf_utils

    original = model.outputs
    lists = update_lists(model)
    before = [list(updates) for updates in lists]
    rebuilt = tf.nest.flatten(model._run_internal_graph(model.inputs))
    conditional = [u for updates in before for u in updates if not getattr(u, "_unconditional_update", False)]
    reachable = tf_utils.get_reachable_from_inputs(tf.nest.flatten(model.inputs), conditional)
    old = {id(u) for u in conditional if u in reachable}
    for updates, previous in zip(lists, before):
        updates[:] = [u for u in previous if id(u) not in old] + updates[len(previous) :]
    model.outputs = rebuilt
    run_internal_graph = type(model)._run_internal_graph

    def run_with_own_outputs(*args, **kwargs):
        with _patch.instance_attribute(model, "outputs", original):
            return run_internal_graph(model, *args, **kwargs)

    object.__setattr__(model, "_run_internal_graph", run_with_own_outputs)

    def undo():
        model.__dict__.pop("_run_internal_graph", None)
        model.outputs = original
        for updates, previous in zip(lists, before):
            updates[:] = previous

    return undo
