"""The context of one recomputed call: what Keras keeps outside the call's arguments.

NOTE [ the call's context ]
A Keras call depends on more than the arguments it receives, and a recompute
that sees less than the forward saw computes another function:
  * The layer behind the call. It is `self` of a decorated `Layer.call`; the
    layer a bound method belongs to (`block.call = recompute_grad(block.call)`,
    how one patches a model one did not write: `self` is then not among the
    arguments); or the layer passed as the callable itself. Its seed states,
    moving statistics, losses and sub-layers are what the recompute replays.
  * Masks Keras attaches to tensors (`Embedding(mask_zero=True)`, `Masking`,
    a functional model's padding): sub-layers read them from their inputs
    without being passed `mask=` (`MultiHeadAttention` from its query and
    value, which it also clears on the way). The recompute runs on fresh
    tensors (TensorFlow, JAX) or on tensors whose masks the forward cleared
    (PyTorch), so each argument gets back the mask it carried when the call
    began. The masks are constants: no gradient, and not copied.
  * Which variables train. Keras 3 writes a layer's `trainable` into each of
    its variables, and its trainers train every variable whose own flag is
    set, whatever an ancestor says: keras-hub's `enable_lora` freezes every
    layer, then sets the LoRA targets back, so a frozen block holds trainable
    LoRA kernels. tf_keras keeps the flag on layers: a variable trains when it
    and the innermost layer that owns it are trainable. An ancestor's
    `non_trainable_weights` lists a trainable child's weights too, and must
    never decide. The state to replay (seed states, moving statistics, other
    variables that are not trained weights) is chosen from the same flags.

`capture` reads all of it once, before the forward, and every backend path
works from the `CallContext` it returns instead of looking for it its own way.
"""

import contextlib
import functools
import sys


def capture(fn, args, kwargs, name):
    """Reads the context of a call about to run.

    Args:
        fn: the undecorated function or callable.
        args: its positional arguments (`self` first for a decorated method).
        kwargs: its keyword arguments.
        name: the function's qualified name.

    Returns:
        A `CallContext`.
    """
    owner = find_owner(fn, args)
    layer_name = getattr(owner, "name", None)
    described = f"{name} of layer {layer_name!r}" if isinstance(layer_name, str) else name
    masks = [_get_mask(leaf) if _is_tensor(leaf) else None for leaf in leaves((args, kwargs))]
    return CallContext(owner, described, masks if any(m is not None for m in masks) else None)


def find_owner(fn, args):
    """The layer behind a call: of a bound method, `self` of a method, or the callable itself."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    bound_to = getattr(target, "__self__", None)
    if is_layer(bound_to):
        return bound_to
    if args and is_layer(args[0]):
        return args[0]
    if is_layer(target):
        return target
    return None


def _keras2_layer(obj):
    """Whether `obj` is a standalone Keras 2.3 layer (importing no framework: Keras 2.3 needs TensorFlow)."""
    if "tensorflow" not in sys.modules:
        return False
    from keras_recompute.backends import _keras2

    return _keras2.is_layer(obj)


def _builtin_layer(obj):
    """Whether `obj` is a layer of TensorFlow's own tf.keras before 2.4."""
    if "tensorflow" not in sys.modules:
        return False
    from keras_recompute.backends import _tf_keras_builtin

    return _tf_keras_builtin.is_layer(obj)


def is_layer(obj):
    """Whether `obj` is a Keras 3 or a tf_keras layer, importing neither."""
    if obj is None or isinstance(obj, type):
        return False
    from keras_recompute.backends import _keras3

    if _keras3.is_layer(obj):
        return True
    if _keras2_layer(obj) or _builtin_layer(obj):
        return True
    # tf_keras (Keras 2) by duck type: in a TF1-style graph its layers are
    # swapped onto `base_layer_v1.Layer`, which `tf_keras.layers.Layer` is not.
    return all(hasattr(obj, attribute) for attribute in ("_flatten_layers", "trainable_weights", "non_trainable_weights"))


def children(layer):
    """A Keras 3 or tf_keras layer's direct sub-layers, in the order it tracks them."""
    from keras_recompute.backends import _keras3

    if _keras3.is_layer(layer):
        return _keras3.children(layer)
    if _keras2_layer(layer):
        from keras_recompute.backends import _keras2

        return _keras2.children(layer)
    if _builtin_layer(layer):
        from keras_recompute.backends import _tf_keras_builtin

        return _tf_keras_builtin.children(layer)
    from keras_recompute.backends import _tf_keras  # a tf_keras layer: TensorFlow is imported

    return _tf_keras.children(layer)


def sublayers(layer):
    """Every layer under `layer` (not itself), each once, parents before children, in tracking order."""
    ordered, seen = [], {id(layer)}

    def visit(parent):
        for child in children(parent):
            if id(child) not in seen:
                seen.add(id(child))
                ordered.append(child)
                visit(child)

    visit(layer)
    return ordered


class CallContext:
    """What one call depends on besides its arguments; see NOTE [ the call's context ].

    Attributes:
        owner: the layer behind the call, or None for a plain function.
        name: how messages name the call (`Block.call of layer 'block_3'`).
    """

    def __init__(self, owner, name, masks):
        self.owner = owner
        self.name = name
        # Aligned with `leaves((args, kwargs))`; None when no argument has a mask.
        self._masks = masks
        self._trains = None

    def masks_attached(self, args, kwargs, transform=None):
        """Context manager: the leaves of `(args, kwargs)` carry the masks the call's arguments had.

        Args:
            args: positional arguments with the structure of the call's own;
                their leaves may be other tensors (a recompute's).
            kwargs: keyword arguments, likewise.
            transform: applied to each mask first (in a graph, to make it wait
                for the backward), or None.

        Each leaf's previous mask is put back on exit.
        """
        if self._masks is None:
            return contextlib.nullcontext()
        masks = self._masks if transform is None else [m if m is None else transform(m) for m in self._masks]
        return _MasksAttached(list(leaves((args, kwargs))), masks)

    def trains(self, variable):
        """Whether `variable` is trained, so the backward must give it a gradient.

        `variable` may be a Keras variable or the framework variable that holds
        its value (what TensorFlow's tape records). A variable not under the
        owner (a tied embedding, a `tf.Variable` a function closes over) trains
        when its own `trainable` flag says so.
        """
        if self._trains is None:
            self._trains = _trainability(self.owner)
        verdict = self._trains.get(id(variable))
        if verdict is None:
            if _keras2_layer(self.owner) or _builtin_layer(self.owner):
                # Keras 2.3 marks no variable non-trainable, so the fallback below would say
                # "trains" for a BatchNorm statistic that a sub-layer built in the first call
                # made after the verdicts were read (tf.keras before TF 2.4 keeps a frozen
                # layer's flag on the layer, too): read them again.
                self._trains = _trainability(self.owner)
                verdict = self._trains.get(id(variable))
        if verdict is None:
            return bool(getattr(variable, "trainable", True))
        return verdict


def copy_masks(sources, targets):
    """Puts each source tensor's attached mask on the target at the same position."""
    for source, target in zip(sources, targets):
        if _is_tensor(source) and _is_tensor(target) and source is not target:
            mask = _get_mask(source)
            if mask is not None:
                _set_mask(target, mask)


def get_mask(tensor):
    """The mask Keras attached to `tensor`, or None."""
    return _get_mask(tensor) if _is_tensor(tensor) else None


def set_mask(tensor, mask):
    _set_mask(tensor, mask)


def leaves(tree):
    """The leaves of nested lists, tuples and dicts, in order (dicts by insertion)."""
    if isinstance(tree, (list, tuple)):
        for item in tree:
            yield from leaves(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from leaves(item)
    else:
        yield tree


def rebuild(tree, values):
    """`tree` with its leaves, in `leaves`' order, taken from the iterator `values`."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(rebuild(item, values) for item in tree)
    if isinstance(tree, dict):
        return {key: rebuild(item, values) for key, item in tree.items()}
    return next(values)


class _MasksAttached:
    def __init__(self, targets, masks):
        self._targets = targets
        self._masks = masks
        self._previous = []

    def __enter__(self):
        for target, mask in zip(self._targets, self._masks):
            if mask is not None and _is_tensor(target):
                self._previous.append((target, _get_mask(target)))
                _set_mask(target, mask)
        return self

    def __exit__(self, *exc_info):
        for target, previous in reversed(self._previous):
            _set_mask(target, previous)
        self._previous = []
        return False


def _is_tensor(value):
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type)


def _get_mask(tensor):
    from keras_recompute.backends import _keras3

    if _keras3.loaded():
        return _keras3.get_mask(tensor)
    return getattr(tensor, "_keras_mask", None)


def _set_mask(tensor, mask):
    from keras_recompute.backends import _keras3

    if _keras3.loaded():
        _keras3.set_mask(tensor, mask)
    else:
        try:
            tensor._keras_mask = mask
        except AttributeError:
            pass


def _trainability(owner):
    """`{id(variable): trains}` for the variables under `owner` (see NOTE [ the call's context ])."""
    from keras_recompute.backends import _keras3

    if _keras3.is_layer(owner):
        return _keras3.trainability(owner)
    if _keras2_layer(owner):
        from keras_recompute.backends import _keras2

        return _keras2.trainability(owner)
    if _builtin_layer(owner):
        from keras_recompute.backends import _tf_keras_builtin

        return _tf_keras_builtin.trainability(owner)
    if is_layer(owner):
        from keras_recompute.backends import _tf_keras

        return _tf_keras.trainability(owner)
    return {}
