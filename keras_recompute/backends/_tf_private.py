"""Private TensorFlow APIs and TensorFlow's versions: the one place that touches them.

Tested on TensorFlow 2.21 (tensorflow-cpu wheel), and on 1.14, 1.15, 2.0, 2.1
and 2.3 (Python 3.7, `tests/legacy/run.py`). What is used:
`tensorflow.python.eager.record` (`stop_recording`, `record_operation`; in
`tape` before it), `forwardprop_util` (whether a forward accumulator
records), `control_flow_util` (whether a graph is XLA's), and
`resource_variable_ops` (`variable_accessed`, and
`BaseResourceVariable`'s `_read_variable_op`, `sparse_read` and `gather_nd`,
hooked: NOTE [ hooking variable reads ]). A TensorFlow that lacks one gets an
error that names it instead of a wrong gradient.

NOTE [ TensorFlow versions ]
TensorFlow 2.4 and newer take the TF2 path (`backends/tensorflow.py`): a
custom gradient that any tape or `tf.gradients` differentiates, in eager
mode, `tf.function` and XLA. Before 2.4 (`LEGACY`):
  * a graph that `tf.gradients` differentiates takes the graph path
    (`backends/tensorflow_v1.py`): TF 1.x graphs (standalone Keras 2.3 or
    TF 1.x's tf.keras), and standalone Keras 2.3's own graph on TF 2.0/2.1;
  * on TF 2.0-2.3, TensorFlow's own tf.keras in eager execution and
    `tf.function` (`fit`) takes the TF2 path, with a custom gradient recorded
    here (NOTE [ custom gradients before TensorFlow 2.4 ]) and tf.keras's
    state kept by `_tf_keras_builtin`.
What neither serves there (`"save_dots"`, `offload=`, memory planning, a
`GradientTape` around standalone Keras 2.3, eager execution on TF 1.x)
raises `RecomputeError` naming the TensorFlow version and what to use
instead (`require_modern`).
"""

import contextlib
import threading

import tensorflow as tf

from keras_recompute._errors import RecomputeError

TESTED_VERSIONS = "2.21; 1.14, 1.15, 2.0, 2.1, 2.3"
_MODERN = (2, 4)
_OLDEST = (1, 14)


def _parse_version(text):
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


TF_VERSION = _parse_version(tf.__version__)
LEGACY = TF_VERSION < _MODERN
if TF_VERSION < _OLDEST:
    raise RecomputeError(
        f"keras_recompute: TensorFlow {tf.__version__} is too old; keras_recompute needs "
        f"{_OLDEST[0]}.{_OLDEST[1]} or newer (tested on {TESTED_VERSIONS}). Upgrade TensorFlow."
    )


def require_modern(what, instead):
    """Raises `RecomputeError` on a TensorFlow before 2.4: `what` needs the TF2 path.

    Args:
        what: what was asked for ("eager execution", "policy='save_dots'").
        instead: what to use on this TensorFlow instead, a sentence.
    """
    if LEGACY:
        raise RecomputeError(
            f"keras_recompute: {what} needs TensorFlow {_MODERN[0]}.{_MODERN[1]} or newer; this is "
            f"TensorFlow {tf.__version__}, where a recomputed call works with policy=\"full\" in a graph "
            "that tf.gradients differentiates (standalone Keras 2.3; TF 1.x's tf.keras) and, on TF 2.0-2.3, "
            f"with tf.keras in eager execution and tf.function. {instead}"
        )


try:
    try:
        from tensorflow.python.eager import record as _record
    except ImportError:  # before TensorFlow 2.5 these lived in `tape`
        from tensorflow.python.eager import tape as _record
    from tensorflow.python.ops import resource_variable_ops

    stop_recording = _record.stop_recording
    # Before TensorFlow 1.15 the resource variable's class was ResourceVariable itself.
    _BASE = getattr(resource_variable_ops, "BaseResourceVariable", None) or resource_variable_ops.ResourceVariable
    _READS = (_BASE._read_variable_op, _BASE.sparse_read, _BASE.gather_nd, resource_variable_ops.variable_accessed)
    _RECORD = _record.record_operation
except (ImportError, AttributeError) as error:  # pragma: no cover - depends on the TF build
    raise RecomputeError(
        f"keras_recompute: TensorFlow {tf.__version__} lacks {error}, which the TF path uses (tested on "
        f"{TESTED_VERSIONS}). Please report this version."
    ) from error


# NOTE [ AutoGraph before TensorFlow 2.4 ]
# Before 2.4, a tf.keras layer's `call` is converted by AutoGraph, and so is
# every function a converted one calls, ours included, with a warning for each
# it cannot convert and its errors wrapped in a `StagingError`. A recomputed
# call's wrapper is marked as converted already (`leave_to_autograph`), and
# AutoGraph is told to call this package's functions as they are. The call's
# own code then runs as written (its Python `if` on a tensor would raise in a
# `tf.function`), as it does anyway once our code runs it unconverted.


def leave_to_autograph(wrapper):
    """Marks a recomputed call's wrapper so that AutoGraph before TensorFlow 2.4 calls it as it is."""
    if LEGACY:
        wrapper.__dict__["__ag_compiled"] = True  # TensorFlow 2.0-2.2's mark
        wrapper.autograph_info__ = {}  # 2.3's


if LEGACY:
    try:
        from tensorflow.python.autograph.core import config as _autograph_config
        from tensorflow.python.autograph.core import config_lib as _autograph_rules

        _autograph_config.CONVERSION_RULES = (
            _autograph_rules.DoNotConvert("keras_recompute"),
        ) + tuple(_autograph_config.CONVERSION_RULES)
    except (ImportError, AttributeError):  # pragma: no cover - TF 1.14 has no such rules; it warns
        pass


def _record_operation(op_type, outputs, inputs, backward):
    if LEGACY:  # `record_operation` took no forward function then
        return _RECORD(op_type, outputs, inputs, backward)
    return _RECORD(op_type, outputs, inputs, backward_function=backward, forward_function=lambda x: [x])


def custom_gradient(f, variables_of):
    """`tf.custom_gradient(f)`; before TensorFlow 2.4 the variables differentiated are `variables_of()`.

    NOTE [ custom gradients before TensorFlow 2.4 ]
    Before 2.4, `tf.custom_gradient` finds the variables a function read with
    a `GradientTape` around it, which sees nothing of a forward run under
    `stop_recording` (a recomputed call's): their gradients would be missing,
    silently. There the custom gradient is recorded here, as TensorFlow's own
    eager decorator records it, with the variables `variables_of()` names,
    called after the forward (the recomputed call's layer's trained weights,
    and the reads the hook saw in a graph); the recompute refuses a trained
    variable read outside them (`tensorflow._refuse_unseen_variables`). The
    gradient is recorded on the tapes only: on these versions the TF2 path
    serves eager execution and `tf.function` under a tape, and a graph that
    `tf.gradients` differentiates takes the graph path.

    Args:
        f: a function of tensors returning `(outputs, grad)`, as for
            `tf.custom_gradient`; `grad(*upstream, variables=...)` returns the
            gradients of the inputs and of the variables.
        variables_of: a function of no argument returning the variables.
    """
    if not LEGACY:
        return tf.custom_gradient(f)

    def decorated(*args):
        outputs, grad = f(*args)
        variables = [v for v in variables_of() if all(v is not arg for arg in args)]
        with stop_recording():
            flat = [tf.raw_ops.Identity(input=x) for x in tf.nest.flatten(outputs)]
        inputs = [tf.convert_to_tensor(x) for x in args] + [tf.convert_to_tensor(v) for v in variables]

        def backward(*upstream):
            input_grads, variable_grads = grad(*upstream, variables=variables)
            return list(tf.nest.flatten(input_grads)) + list(variable_grads)

        _record_operation("RecomputeGrad", flat, inputs, backward)
        return tf.nest.pack_sequence_as(outputs, flat)

    return decorated


def tf_2_behavior():
    """Whether TensorFlow runs eagerly outside functions here (TF 2's way): a graph is a `tf.function`'s."""
    from tensorflow.python.framework import ops

    return ops.executing_eagerly_outside_functions()


def in_xla_context():
    """Whether the graph being built is compiled by XLA (`tf.function(jit_compile=True)`, or inside one)."""
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


try:
    from tensorflow.python.eager import forwardprop_util as _forwardprop_util
except ImportError:  # pragma: no cover - TensorFlow 1.x: no forward accumulators
    _forwardprop_util = None


def forward_accumulator_active():
    """Whether a `tf.autodiff.ForwardAccumulator` records in this thread now (NOTE [ forward-mode differentiation ]
    in `tensorflow`): `pack_tangents` of no tensors lists one entry for each accumulator active."""
    return _forwardprop_util is not None and bool(_forwardprop_util.pack_tangents([]).indices)


try:
    from tensorflow.python import pywrap_tfe as _pywrap_tfe
except ImportError:  # pragma: no cover - before TensorFlow 2.2: used from 2.4 only
    _pywrap_tfe = None
try:
    from tensorflow.python.framework import op_callbacks as _op_callbacks
except ImportError:  # pragma: no cover - TensorFlow 2.0 has none (1.15 has the module, not the callbacks)
    _op_callbacks = None
# Whether `ops_made` sees ops: not on TensorFlow 2.0 (NOTE [ tensors closed over without op callbacks ]).
OP_CALLBACKS = hasattr(_op_callbacks, "add_op_callback")


@contextlib.contextmanager
def ops_made(callback):
    """Within it, in this thread, `callback(op_type, inputs, outputs, graph)` is told of each op made or run.

    TensorFlow's op callbacks: every eager op, and each graph op made through
    TensorFlow's op wrappers (a few made another way are not seen). TensorFlow
    2.0 has no op callbacks: there `callback` is told nothing.
    """
    if not OP_CALLBACKS:  # pragma: no cover - TensorFlow 2.0 (and 1.x)
        yield
        return

    def seen(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        callback(op_type, inputs or (), outputs or (), graph)

    with _OPS_MADE_LOCK:
        _OPS_MADE_ACTIVE[0] += 1
        _op_callbacks.add_op_callback(seen)
    try:
        yield
    finally:
        with _OPS_MADE_LOCK:
            _OPS_MADE_ACTIVE[0] -= 1
            _remove_op_callback(seen)


# NOTE [ op callbacks in threads ]
# TensorFlow keeps op callbacks per thread, but runs an eager op's slow path
# (an op wrapper's "eager fallback", which calls `execute.execute`) through a
# module function it switches for the whole process: `add_op_callback` sets
# `execute_with_callbacks`, and `remove_op_callback` puts back `quick_execute`
# once the calling thread has no callback left, whatever other threads hold.
# A MirroredStrategy runs its replicas' eager steps in threads; one replica
# leaving `ops_made` stopped the slow-path callbacks of another still inside
# it, and a tensor its call closed over that only such an op read went
# unseen: no gradient for what made it. (The fast path, most ops, runs each
# thread's callbacks itself.) So the switch back waits until no thread is
# inside `ops_made`; `execute_with_callbacks` runs only the calling thread's
# callbacks, so leaving it on a little longer changes nothing else.
_OPS_MADE_LOCK = threading.Lock()
_OPS_MADE_ACTIVE = [0]  # threads inside `ops_made`, all of them


def _remove_op_callback(callback):
    """TensorFlow's `remove_op_callback`, `execute.execute` left switched while another thread is inside
    `ops_made` (NOTE [ op callbacks in threads ])."""
    from tensorflow.python.eager import context, execute

    ctx = context.context()
    if not hasattr(ctx, "remove_op_callback") or not hasattr(execute, "quick_execute"):  # pragma: no cover - other TFs
        _op_callbacks.remove_op_callback(callback)
        return
    ctx.remove_op_callback(callback)
    if not _OPS_MADE_ACTIVE[0] and ctx.executing_eagerly() and not ctx.op_callbacks:
        execute.execute = execute.quick_execute


class _NoWatcher:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def watched_variables(self):
        return ()


# Read once: a recomputed call asks for them on every call.
_VARIABLE_WATCHER = None if LEGACY else getattr(_record, "VariableWatcher", None)
_SHOULD_RECORD = getattr(_record, "should_record_backprop", None) or getattr(_record, "should_record", None)


def watching_variables():
    """A context whose `watched_variables()` lists the trainable variables read within it (TensorFlow's own
    `VariableWatcher`, which `tf.custom_gradient` asks); before TensorFlow 2.4, none."""
    return _NoWatcher() if _VARIABLE_WATCHER is None else _VARIABLE_WATCHER()


def tell_variable_watchers(variables):
    """Tells the variable watchers active now that `variables` were read, as a read here would, and nothing else
    (a tape is not told)."""
    if LEGACY:
        return
    for variable in variables:
        _pywrap_tfe.TFE_Py_VariableWatcherVariableAccessed(variable)


def tracked_by_a_tape(tensor):
    """Whether a tape recording now would record an op on `tensor`: its gradient is asked for."""
    return _SHOULD_RECORD([tensor])


def tape_active():
    """Whether a `GradientTape` records in this thread now."""
    return _record.could_possibly_record()


# NOTE [ hooking variable reads ]
# A recomputed call must read the values its forward read (NOTE [ a recompute
# reads what its forward read ] in `backends/tensorflow.py`), so while one
# runs, the reads of resource variables go through a reader of ours. Every
# dense read of a `BaseResourceVariable` (Keras 3's variables hold one; tf_keras
# variables and their `AutoCastVariable` and distributed wrappers read through
# one) ends in its `_read_variable_op` (`value()`, `read_value()`, tensor
# conversion); `sparse_read` and `gather_nd` read rows with their own ops, and
# while a reader is active they gather from a dense read instead (the same
# values; the ReadVariableOp aliases the variable's buffer, no copy). The hook
# is put on the class once, at the first recomputed call, and outside a
# recomputed call it costs one thread-local lookup. Readers nest: each one's
# `read` reads through the readers below it (an inner recomputed call inside
# an outer one's recompute records what the outer one hands out). A value a
# reader hands out is, to the tapes, a read of the variable: the hook records
# it as a `ReadVariableOp` of the variable's handle, as `_read_variable_op`
# records its own reads in a graph, and tells the variable watchers it was
# accessed. So a tape that watches the variable differentiates through it
# (the recompute's; an outer tape taking a second-order gradient), and a
# custom gradient around it (a recomputed call nested in another's
# recompute) asks for the variable's gradient. Reads by the C++ fast path of
# eager ops do not pass through `_read_variable_op` and are not seen: eager
# execution runs ops in the order they are called and needs no reader.
_readers = threading.local()
_hooked = []
_hooking = threading.Lock()


def _reader_stack():
    stack = getattr(_readers, "stack", None)
    if stack is None:
        stack = _readers.stack = []
    return stack


@contextlib.contextmanager
def variable_reads(reader):
    """Within it, in this thread, each resource variable read returns `reader(variable, read)`.

    Args:
        reader: a function of the `tf.Variable` read and of `read`, a function
            of no argument that reads it (through the readers active below).
    """
    if not _hooked:
        with _hooking:  # the replicas of a MirroredStrategy call from threads of their own
            if not _hooked:
                _hook_reads()
    stack = _reader_stack()
    stack.append(reader)
    try:
        yield
    finally:
        stack.pop()


def _read_through(stack, depth, variable, read):
    if depth < 0:
        return read()
    return stack[depth](variable, lambda: _read_through(stack, depth - 1, variable, read))


def _hook_reads():
    base = _BASE
    read_variable_op, sparse_read, gather_nd, variable_accessed = _READS

    def hooked_read(self, *args, **kwargs):
        stack = _reader_stack()
        if not stack:
            return read_variable_op(self, *args, **kwargs)
        fresh = []

        def read():
            fresh.append(read_variable_op(self, *args, **kwargs))
            return fresh[-1]

        value = _read_through(stack, len(stack) - 1, self, read)
        if not any(value is real for real in fresh):
            # Handed out by a reader: to every tape it is this variable's value, as a read in a graph is.
            variable_accessed(self)
            _record_operation("ReadVariableOp", [value], [self.handle], lambda x: [x])
        return value

    def hooked_sparse_read(self, indices, name=None):
        if not _reader_stack() or self.dtype == tf.variant:
            return sparse_read(self, indices, name=name)
        return tf.gather(self.value(), indices, name=name)

    def hooked_gather_nd(self, indices, name=None):
        if not _reader_stack():
            return gather_nd(self, indices, name=name)
        return tf.gather_nd(self.value(), indices, name=name)

    base._read_variable_op = hooked_read
    base.sparse_read = hooked_sparse_read
    base.gather_nd = hooked_gather_nd
    _hooked.append(base)


__all__ = [
    "LEGACY",
    "OP_CALLBACKS",
    "TF_VERSION",
    "TESTED_VERSIONS",
    "custom_gradient",
    "leave_to_autograph",
    "ops_made",
    "require_modern",
    "stop_recording",
    "tape_active",
    "tell_variable_watchers",
    "tf_2_behavior",
    "tracked_by_a_tape",
    "variable_reads",
    "watching_variables",
]
