"""Standalone Keras 2 (`import keras`, 2.3) around a recomputed call: the one place for its private APIs.

Imported by the graph path (`tensorflow_v1`) only; tested on Keras 2.3.1 with
TensorFlow 1.14, 1.15, 2.0 and 2.1. Keras 2.3 builds its models in a graph
(TF 1.x's, or its own on TF 2.x), trains with `K.gradients` and runs the
updates its layers register.

NOTE [ standalone Keras random draws ]
Keras 2.3's layers draw through its backend: `K.dropout` (Dropout, the
recurrent layers' dropout) and `K.random_uniform`, `K.random_normal`,
`K.truncated_normal`, `K.random_binomial` (GaussianNoise, ...), each a
stateful TF op whose seed numpy draws when the layer calls it; a recompute
would draw another mask. While a recomputed call runs these functions are
ours. In the forward, `dropout` draws with the plain function on a tensor of
ones, so the same op with the same seed the plain layer would have made
draws the mask, and the output is computed from it as TensorFlow does
(`x * scale * mask`): bit for bit the plain call. The mask is kept packed to
one bit an element (`_tf_keras._Packed`); other draws keep their values. The
recompute takes them back in order, the mask unpacked after the incoming
gradient.

NOTE [ draws inside the learning phase's cond ]
`K.in_train_phase` (Dropout's) draws inside a `tf.cond` branch on the
learning phase, and a tensor made in a branch cannot be read outside it: in
a cond v2 (TF 2.x, Keras 2.3's own graph) TensorFlow refuses, in a cond v1
it would be dead in a step that does not train. So while a forward records,
`in_train_phase` builds the same `tf.cond` with the draws made in its
training branch as extra outputs (in the other branch, empty tensors of the
same type); the records then hold those outputs, which the recompute's own
cond reads from outside. The branch's output is computed as before: the
model's output is the plain one, bit for bit.

NOTE [ standalone Keras state updates ]
`BatchNormalization` registers `K.moving_average_update(...)` with
`add_update` in `call`, and the training function collects `model.updates`
after the gradients are built: a recompute's updates would run too and move
the statistics twice. During a recompute `K.moving_average_update` builds a
no-op (on TF 1.x it would also create zero-debias variables), and what the
recompute appended to a layer's `_updates`, `_per_input_updates`, `_losses`
and `_per_input_losses` is taken off again. A loss added inside the forward
stays, and is differentiated through the forward's own ops.
"""

import numbers
import sys
import threading

import tensorflow as tf

from keras_recompute._errors import RecomputeError
from keras_recompute.backends._tf_keras import _Packed

_local = threading.local()
# The Keras backend functions that draw, wrapped at the first recomputed call.
_DRAWS = ("dropout", "random_uniform", "random_normal", "truncated_normal", "random_binomial")
_WRAPPED = _DRAWS + ("moving_average_update", "in_train_phase")
_patched = []


def loaded():
    """Whether a standalone Keras 2 (not Keras 3, not tf.keras) has been imported."""
    keras = sys.modules.get("keras")
    return (
        keras is not None
        and str(getattr(keras, "__version__", "")).startswith("2.")
        and "keras.engine.base_layer" in sys.modules
    )


def is_layer(obj):
    """Whether `obj` is a standalone Keras 2 layer, importing nothing."""
    return loaded() and not isinstance(obj, type) and isinstance(obj, sys.modules["keras.engine.base_layer"].Layer)


def children(layer):
    """A layer's direct sub-layers: those set as attributes, and a model's layers."""
    found = list(getattr(layer, "_layers", None) or [])
    return [child for child in found if is_layer(child)]


def trainability(owner):
    """`{id(variable): trains}` for the weights under `owner`.

    Keras 2.3 lists a weight in `trainable_weights` when its layer and every
    layer above it is trainable; what the optimizer trains is that list.
    """
    verdicts = {id(weight): False for weight in owner.weights}
    verdicts.update({id(weight): True for weight in owner.trainable_weights})
    return verdicts


def capture(owner, name):
    """The Keras 2 state of a call about to run its forward, or None without standalone Keras."""
    if not loaded():
        return None
    return CallState(owner, name)


class CallState:
    """The random draws of one recomputed call, and the layers whose updates its recompute must not add."""

    def __init__(self, owner, name):
        self.name = name
        self.owner = owner if is_layer(owner) else None
        self.records = []  # (function name, a `_Packed` mask or the values drawn)
        self.replaying = False
        self.wait = None
        self._position = 0

    def forward(self):
        """Context manager: the draws inside it are recorded."""
        return _Active(self, replaying=False)

    def replay(self, wait):
        """Context manager: the recompute. Draws come back from the forward, masks unpacked after `wait`."""
        return _Active(self, replaying=True, wait=wait)

    def next(self, function):
        if self._position >= len(self.records):
            raise RecomputeError(
                f"keras_recompute: the recompute of {self.name} drew more random values "
                f"(K.{function}) than its forward did. A recomputed call must draw the same "
                "random values in the same order each time."
            )
        recorded, value = self.records[self._position]
        self._position += 1
        if recorded != function:
            raise RecomputeError(
                f"keras_recompute: the recompute of {self.name} drew with K.{function} where "
                f"its forward drew with K.{recorded}. A recomputed call must draw in the same "
                "order each time."
            )
        return value


class _Active:
    def __init__(self, state, replaying, wait=None):
        self._state = state
        self._replaying = replaying
        self._wait = wait
        self._lists = []

    def __enter__(self):
        _install()
        state = self._state
        state.replaying, state.wait, state._position = self._replaying, self._wait, 0
        if self._replaying and state.owner is not None:
            self._lists = [(items, _length(items)) for items in _registered(state.owner)]
        _stack().append(state)
        return state

    def __exit__(self, exc_type, *exc_info):
        _stack().pop()
        state = self._state
        for items, length in self._lists:
            _truncate(items, length)
        if self._replaying and exc_type is None and state._position != len(state.records):
            raise RecomputeError(
                f"keras_recompute: the recompute of {state.name} drew {state._position} random "
                f"tensors, its forward {len(state.records)}. A recomputed call must draw the "
                "same random values each time."
            )
        state.wait = None
        return False


def layers_under(owner, children_of=children):
    """`owner` and every layer under it, each once; `children_of(layer)` gives a layer's direct sub-layers."""
    layers, seen = [owner], {id(owner)}
    for layer in layers:
        for child in children_of(layer):
            if id(child) not in seen:
                seen.add(id(child))
                layers.append(child)
    return layers


def _registered(owner):
    """The lists and dicts of lists that `add_update` and `add_loss` append to, under `owner`."""
    found = []
    for layer in layers_under(owner):
        for attribute in ("_updates", "_losses", "_per_input_updates", "_per_input_losses"):
            items = getattr(layer, attribute, None)
            if isinstance(items, (list, dict)):
                found.append(items)
    return found


def _length(items):
    if isinstance(items, list):
        return len(items)
    return {key: len(values) for key, values in items.items()}


def _truncate(items, length):
    if isinstance(items, list):
        del items[length:]
        return
    for key in list(items):
        if key not in length:
            del items[key]
        else:
            del items[key][length[key] :]


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _install():
    """Wraps the backend's drawing functions and `moving_average_update`, once."""
    if _patched:
        return
    modules = [sys.modules[name] for name in ("keras.backend", "keras.backend.tensorflow_backend") if name in sys.modules]
    for function in _WRAPPED:
        original = getattr(modules[-1], function)
        if function == "moving_average_update":
            wrapped = _wrap_moving_average(original)
        elif function == "in_train_phase":
            wrapped = _wrap_in_train_phase(original)
        else:
            wrapped = _wrap_draw(function, original)
        for module in modules:
            if getattr(module, function, None) is original:
                setattr(module, function, wrapped)
    # A sub-layer built in the first call draws its initial weights in
    # `add_weight`: not a draw of the call, and not made again by the recompute.
    layer_class = sys.modules["keras.engine.base_layer"].Layer
    layer_class.add_weight = _unrecorded(layer_class.add_weight)
    _patched.append(modules)


def _unrecorded(add_weight):
    def unrecorded_add_weight(*args, **kwargs):
        stack = _stack()
        saved = stack[:]
        del stack[:]
        try:
            return add_weight(*args, **kwargs)
        finally:
            stack[:] = saved

    unrecorded_add_weight.__wrapped__ = add_weight
    return unrecorded_add_weight


def _wrap_moving_average(original):
    def moving_average_update(*args, **kwargs):
        stack = getattr(_local, "stack", None)
        if stack and stack[-1].replaying:
            return tf.no_op()  # NOTE [ standalone Keras state updates ]
        return original(*args, **kwargs)

    moving_average_update.__wrapped__ = original
    return moving_average_update


def _wrap_draw(function, original):
    def draw(*args, **kwargs):
        stack = getattr(_local, "stack", None)
        if not stack:
            return original(*args, **kwargs)
        replaying = max((i for i, state in enumerate(stack) if state.replaying), default=-1)
        recorders = stack[replaying + 1 :]
        if function == "dropout":
            return _dropout(original, args, kwargs, stack[replaying] if replaying >= 0 else None, recorders)
        if replaying >= 0:
            drawn = stack[replaying].next(function)
        else:
            drawn = _Drawn(original(*args, **kwargs))
            _drawn_in_branches(drawn)
        for state in recorders:
            state.records.append((function, drawn))
        return drawn.value

    draw.__wrapped__ = original
    draw.__name__ = function
    return draw


def _dropout(original, args, kwargs, replayer, recorders):
    x, level, noise_shape, seed = _dropout_arguments(*args, **kwargs)
    if isinstance(level, numbers.Real) and level == 0:
        return original(*args, **kwargs)  # draws nothing
    if replayer is not None:
        packed = replayer.next("dropout")
        keep = packed.keep_mask(replayer.wait)
    else:
        # The plain call's op and seed draw the mask (NOTE [ standalone Keras random draws ]).
        keep = tf.not_equal(original(tf.ones_like(x), level, noise_shape, seed), 0)
        packed = _Packed(keep)
        _drawn_in_branches(packed)
    for state in recorders:
        state.records.append(("dropout", packed))
    rate = tf.convert_to_tensor(level, dtype=x.dtype)
    scale = 1 / (1 - rate)  # as tf.nn.dropout computes it, in x's dtype
    output = x * scale * tf.cast(keep, x.dtype)
    output.set_shape(x.shape)
    return output


def _dropout_arguments(x, level, noise_shape=None, seed=None):
    return x, level, noise_shape, seed


class _Drawn:
    """The values of a draw other than dropout, kept as they are."""

    def __init__(self, value):
        self.value = value


def _exported(record):
    """The names of a record's tensor attributes (a `_Packed` shape may be a static TensorShape)."""
    if isinstance(record, _Drawn):
        return ["value"]
    return ["bits"] + (["shape"] if isinstance(record.shape, tf.Tensor) else [])


def _empty_like(tensor):
    """A tensor of `tensor`'s type and static shape, its unknown sizes 0: what a branch that drew nothing returns."""
    return tf.zeros([0 if size is None else size for size in tensor.shape.as_list()], tensor.dtype)


def _drawn_in_branches(record):
    for branch in getattr(_local, "branches", None) or ():
        branch.append(record)


def cond_exporting_draws(condition, true_fn, false_fn):
    """`tf.compat.v1.cond(condition, true_fn, false_fn)`, whose draws recorded in `true_fn` can be read outside.

    NOTE [ draws inside the learning phase's cond ]: the records of the draws
    made in `true_fn` then hold extra outputs of the cond (empty in the
    other branch); the cond's own outputs are what `true_fn` or `false_fn`
    returns, a tensor or a structure of them.
    """
    records, structure = [], []

    def trains():
        branches = _local.__dict__.setdefault("branches", [])
        branches.append(records)
        try:
            output = true_fn()
        finally:
            branches.remove(records)
        structure.append(output)
        return tf.nest.flatten(output) + [getattr(record, name) for record in records for name in _exported(record)]

    def does_not_train():
        empty = [_empty_like(getattr(record, name)) for record in records for name in _exported(record)]
        return tf.nest.flatten(false_fn()) + empty

    outputs = tf.compat.v1.cond(condition, trains, does_not_train, strict=True)  # a list, even of one
    count = len(tf.nest.flatten(structure[0]))
    exported = iter(outputs[count:])
    for record in records:
        for name in _exported(record):
            setattr(record, name, next(exported))
    return tf.nest.pack_sequence_as(structure[0], outputs[:count])


def _wrap_in_train_phase(original):
    """NOTE [ draws inside the learning phase's cond ]."""

    def in_train_phase(x, alt, training=None):
        stack = getattr(_local, "stack", None)
        if not stack or any(state.replaying for state in stack):
            return original(x, alt, training=training)  # no draw is made fresh here
        uses_learning_phase = training is None
        condition = sys.modules["keras.backend"].learning_phase() if training is None else training
        if not isinstance(condition, tf.Tensor) or condition.shape.ndims != 0:
            return original(x, alt, training=training)  # a Python flag: no cond
        if condition.dtype != tf.bool:
            condition = tf.cast(condition, tf.bool)
        output = cond_exporting_draws(
            condition, lambda: x() if callable(x) else x, lambda: alt() if callable(alt) else alt
        )
        if uses_learning_phase:
            output._uses_learning_phase = True
        return output

    in_train_phase.__wrapped__ = original
    return in_train_phase
