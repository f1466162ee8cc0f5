"""TensorFlow's own tf.keras before 2.4 (`tensorflow.python.keras`) around a recomputed call.

Imported by the TF path only on TensorFlow 2.0 to 2.3, where `tf.keras` is
TensorFlow's own and a tf.keras model trains eagerly, in a `tf.function` or in
`fit` under a `GradientTape` (NOTE [ TensorFlow versions ] in `_tf_private`).
Tested on TensorFlow 2.0.4, 2.1.4 and 2.3.4 (`tests/legacy/test_tf_keras.py`).
Newer TensorFlows' tf.keras is tf_keras or Keras 3 (`_tf_keras`, `_keras3`).

NOTE [ tf.keras random draws before TensorFlow 2.4 ]
Its `Dropout` (and `K.dropout`) draw through `tf.nn.dropout`, a stateful
random op whose state cannot be rewound: a recompute would draw another mask.
While a recomputed call runs, `nn_ops.dropout_v2` (which `tf.nn.dropout`, its
v1 form and the backend call) is ours, as standalone Keras's `K.dropout` is
in `_keras2` (NOTE [ standalone Keras random draws ]): the forward draws the
mask with the plain op and seed on a tensor of ones, keeps it at one bit an
element, and computes the output as TensorFlow does; the recompute takes the
masks back in order. Other stateful draws in a recomputed call are drawn
again, and the recompute check raises when they differ.

NOTE [ tf.keras state before TensorFlow 2.4 ]
`BatchNormalization` assigns its moving statistics in `call` (at once in
eager execution, in program order in a `tf.function`). As `_tf_keras` does
(NOTE [ tf_keras state updates ]), the forward reads the values of the weights
under the owner that do not train before it runs; the recompute saves their
current values, sets the forward's back (a call that reads its state reads
what the forward read), runs, and assigns the saved values back: the
statistics move once. Under a mixed
precision policy `Layer.__call__` sets the graph's variable read dtype; the
recompute runs outside `__call__`, so it sets the forward's again.
"""

import sys
import threading

import tensorflow as tf

from keras_recompute._errors import RecomputeError
from keras_recompute.backends import _keras2
from keras_recompute.backends._tf_keras import _Packed
from keras_recompute.backends._tf_private import LEGACY

_BASE_LAYER = "tensorflow.python.keras.engine.base_layer"
_patched = []
_local = threading.local()  # `stack`: the recorded and replayed calls; `uniform`: what a dropout's draw does


def loaded():
    """Whether TensorFlow's own tf.keras of a TensorFlow before 2.4 is in use."""
    return LEGACY and _BASE_LAYER in sys.modules


def is_layer(obj):
    """Whether `obj` is a layer of TensorFlow's own tf.keras before 2.4, importing nothing."""
    return loaded() and not isinstance(obj, type) and isinstance(obj, sys.modules[_BASE_LAYER].Layer)


def children(layer):
    """A layer's direct sub-layers (tracked as attributes, in lists, or a model's layers)."""
    if hasattr(layer, "_flatten_layers"):  # TensorFlow 2.3
        return [child for child in layer._flatten_layers(include_self=False, recursive=False) if is_layer(child)]
    from tensorflow.python.training.tracking import layer_utils

    found = layer_utils.filter_empty_layer_containers(getattr(layer, "_layers", None) or [])
    return [child for child in found if is_layer(child)]


def trainability(owner):
    """`{id(variable): trains}` under `owner`: tf.keras lists a weight in
    `trainable_weights` when its layer and every layer above it is trainable,
    as Keras 2.3 does. An `AutoCastVariable`'s inner variable gets the same
    verdict."""
    verdicts = _keras2.trainability(owner)
    for weight in owner.weights:
        inner = getattr(weight, "_variable", None)
        if inner is not None:
            verdicts[id(inner)] = verdicts[id(weight)]
    return verdicts


def loss_lists(owner):
    """The lists that `add_loss` appends to, under `owner`."""
    if not is_layer(owner):
        return []
    return [
        items
        for layer in _under(owner)
        for items in (getattr(layer, "_eager_losses", None), getattr(layer, "_losses", None))
        if isinstance(items, list)
    ]


def _under(owner):
    return _keras2.layers_under(owner, children)


def capture(owner, name):
    """The tf.keras state of a call about to run its forward, or None if tf.keras is not this one."""
    if not loaded():
        return None
    return CallState(owner, name)


class CallState(_keras2.CallState):
    """The dropout masks of one recomputed call (as standalone Keras's), its state, its read dtype and training."""

    def __init__(self, owner, name):
        super().__init__(owner, name)
        self.owner = owner if is_layer(owner) else None
        self.read_dtype = tf.compat.v1.get_default_graph()._auto_cast_variable_read_dtype
        self.training = getattr(_call_context(), "training", None)  # the forward's, which sub-layers may read
        # The state as the forward reads it, before it assigns it (NOTE [ tf.keras state before TensorFlow 2.4 ]).
        self.before = []
        if self.owner is not None:
            trains = trainability(self.owner)
            self.before = [(v, tf.identity(v)) for v in self.owner.weights if not trains.get(id(v), True)]

    def forward(self):
        """Context manager: the dropout masks drawn inside it are recorded."""
        return _Active(self, replaying=False)

    def replay(self, wait=None):
        """Context manager: the recompute; after it, `losses` holds what it added with `add_loss`."""
        return _Active(self, replaying=True, wait=wait)


class _Active:
    def __init__(self, state, replaying, wait=None):
        self._state = state
        self._replaying = replaying
        self._wait = wait
        self.losses = []

    def __enter__(self):
        _install()
        state = self._state
        state.replaying, state.wait, state._position = self._replaying, self._wait, 0
        self._saved, self._loss_counts = [], []
        if self._replaying and state.owner is not None:
            self._loss_lists = loss_lists(state.owner)
            self._loss_counts = [len(items) for items in self._loss_lists]
            # In a TF1-style graph the layers register their updates for the training function to run.
            self._update_lists = [
                layer._updates for layer in _under(state.owner) if isinstance(getattr(layer, "_updates", None), list)
            ]
            self._update_counts = [len(items) for items in self._update_lists]
            self._saved = [(v, tf.identity(v)) for v, _ in state.before]
            for variable, value in state.before:  # the recompute reads the state the forward read
                variable.assign(value)
            graph = tf.compat.v1.get_default_graph()
            self._graph, self._read_dtype = graph, graph._auto_cast_variable_read_dtype
            graph._auto_cast_variable_read_dtype = state.read_dtype
            # Inside the layer's call context, as the forward was: outside one, tf.keras would take the
            # recompute for a functional model being built and wrap its ops into layers.
            self._in_call = _enter_call(state.owner, state.training)
            self._in_call.__enter__()
        _stack().append(state)
        return self

    def __exit__(self, exc_type, *exc_info):
        _stack().pop()
        state = self._state
        if self._replaying and state.owner is not None:
            self._in_call.__exit__(exc_type, *exc_info)
            self._graph._auto_cast_variable_read_dtype = self._read_dtype
            for variable, value in self._saved:  # NOTE [ tf.keras state before TensorFlow 2.4 ]
                variable.assign(value)
            for items, count in zip(self._loss_lists, self._loss_counts):
                self.losses.extend(items[count:])
                del items[count:]
            for items, count in zip(self._update_lists, self._update_counts):
                del items[count:]
        if self._replaying and exc_type is None and state._position != len(state.records):
            raise RecomputeError(
                f"keras_recompute: the recompute of {state.name} drew {state._position} dropout "
                f"masks, its forward {len(state.records)}. A recomputed call must draw the same "
                "random values each time."
            )
        state.wait = None
        return False


def _stack():
    """This thread's recomputed calls of tf.keras layers, innermost last (standalone Keras's keep their own)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _call_context():
    from tensorflow.python.keras.engine import base_layer_utils

    context = base_layer_utils.call_context
    return context() if hasattr(base_layer_utils, "CallContext") else None


def _enter_call(layer, training):
    """A context: inside `layer`'s call, as `Layer.__call__` enters it."""
    from tensorflow.python.keras.engine import base_layer_utils

    build_graph = not tf.executing_eagerly()
    if not hasattr(base_layer_utils, "CallContext"):  # TensorFlow 1.14: a function
        return base_layer_utils.call_context(layer, build_graph)
    return base_layer_utils.call_context().enter(layer, None, build_graph, training)


def _install():
    """Wraps `nn_ops.dropout_v2` wherever TensorFlow binds it, and the draw it makes, once."""
    if _patched:
        return
    from tensorflow.python.ops import nn_ops, random_ops

    original, original_uniform = nn_ops.dropout_v2, random_ops.random_uniform

    def random_uniform(shape, *args, **kwargs):
        hook = getattr(_local, "uniform", None)
        if hook is None:
            return original_uniform(shape, *args, **kwargs)
        _local.uniform = None  # the dropout's one draw
        dtype = kwargs.get("dtype", args[2] if len(args) > 2 else tf.float32)
        return hook(lambda: original_uniform(shape, *args, **kwargs), dtype)

    def dropout_v2(x, rate, noise_shape=None, seed=None, name=None):
        stack = _stack()
        if not stack:
            return original(x, rate, noise_shape=noise_shape, seed=seed, name=name)
        replaying = max((i for i, state in enumerate(stack) if state.replaying), default=-1)
        recorders = stack[replaying + 1 :]
        _local.uniform = _replayed(stack[replaying], recorders) if replaying >= 0 else _recorded(rate, recorders)
        try:
            return original(x, rate, noise_shape=noise_shape, seed=seed, name=name)
        finally:
            _local.uniform = None

    from tensorflow.python.keras.utils import tf_utils

    original_cond = tf_utils.smart_cond

    def smart_cond(pred, true_fn=None, false_fn=None, name=None):
        stack = _stack()
        if (
            not stack
            or any(state.replaying for state in stack)
            or not isinstance(pred, tf.Tensor)
            or tf.get_static_value(pred) is not None
        ):
            return original_cond(pred, true_fn=true_fn, false_fn=false_fn, name=name)
        # Dropout's cond on the learning phase: NOTE [ draws inside the learning phase's cond ] in `_keras2`.
        return _keras2.cond_exporting_draws(tf.cast(pred, tf.bool), true_fn, false_fn)

    random_uniform.__wrapped__ = original_uniform
    dropout_v2.__wrapped__ = original
    smart_cond.__wrapped__ = original_cond
    random_ops.random_uniform = random_uniform
    tf_utils.smart_cond = smart_cond
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith(("tensorflow", "tensorflow_core")):
            for attribute in ("dropout", "dropout_v2"):
                if getattr(module, attribute, None) is original:
                    setattr(module, attribute, dropout_v2)
    _patched.append(original)


def _recorded(rate, recorders):
    """The forward's draw: the plain one; its keep mask (`draw >= rate`, as TensorFlow's) is kept packed."""

    def draw_and_record(draw, dtype):
        drawn = draw()
        threshold = rate if isinstance(rate, tf.Tensor) else tf.convert_to_tensor(rate, dtype=drawn.dtype)
        packed = _Packed(drawn >= tf.cast(threshold, drawn.dtype))
        _keras2._drawn_in_branches(packed)
        for state in recorders:
            state.records.append(("dropout", packed))
        return drawn

    return draw_and_record


def _replayed(replayer, recorders):
    """The recompute's draw: 1 where the forward's kept, 0 where it dropped (`rate` is in (0, 1))."""

    def replay(draw, dtype):
        packed = replayer.next("dropout")
        for state in recorders:  # a recomputed call inside this one records the same mask
            state.records.append(("dropout", packed))
        return tf.cast(packed.keep_mask(replayer.wait), dtype)

    return replay
