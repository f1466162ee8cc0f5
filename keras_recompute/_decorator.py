"""`recompute_grad`: the decorator, its options, and the dispatch to a backend."""

import functools
import importlib
import inspect
import sys
import types

from keras_recompute import _config, _context, _policy
from keras_recompute._errors import RecomputeError

# Keras passes these to `call` only when its signature accepts them; a
# decorated plain function gets the same courtesy.
_KERAS_CALL_KWARGS = ("training", "mask")


def recompute_grad(fn=None, *, enabled=None, check=True, policy="full", offload=False):
    """Recomputes a call's activations in the backward pass instead of storing them.

    Decorate a Keras `Layer.call` (or any function or callable that runs
    Keras layers, or TensorFlow, JAX or PyTorch ops). When recompute is on, the forward pass
    keeps only the call's inputs; its intermediate activations are computed
    again during the backward pass. Gradients of the inputs and of every
    trainable weight the call reads (found automatically, nested layers and
    layers built in the first call included) equal those of the plain call.

    Recompute is on when `RECOMPUTE` is set to `1`, `true`, `yes` or `on`, or
    inside `recompute_scope(True)`; it is read when the call runs. When off,
    the original function runs unchanged.

    Args:
        fn: the function to decorate. Leave it out to pass options:
            `@recompute_grad(enabled=True)`.
        enabled: `None` (default) follows `RECOMPUTE` and `recompute_scope`;
            `True` or `False` fixes the choice for this function.
        check: `True` (default) compares the recompute's outputs with the
            forward's (under `"save_dots"`, the inputs of each kept matmul
            too) and raises `RecomputeError` if they differ, instead of
            returning the gradient of another function. Their number, shapes
            and dtypes are always compared; `False` skips only the values.
        policy: how much of the call the forward keeps (NOTE [ policies ] in
            `_policy`). `"full"` (default): only its inputs; all of it is
            recomputed. `"save_dots"`: also the outputs of its weight matmuls
            (Dense, EinsumDense, attention projections); what lies between
            them is recomputed. `"attention_core"`: the call runs as it is,
            and only the core of each attention layer in it (scores, softmax,
            attention dropout, weighted sum) is recomputed.
        offload: `True` keeps what the forward keeps for the recompute (the
            call's floating-point inputs; on JAX also what `"save_dots"`
            keeps) in host memory, and copies it back for the recompute
            (NOTE [ offload ] in `_policy`). Keras 3 on JAX and PyTorch; on a
            CPU, whose host memory is its device memory, the same code runs
            and saves nothing. Under `"attention_core"` the inputs of each
            attention core are offloaded.

    Returns:
        The decorated function, with `__wrapped__` set to `fn` and the same
        signature. Decorating a function this decorator already made (an
        instance patched twice, or an instance of a class whose `call` is
        decorated) replaces the earlier options instead of recomputing twice.

    Raises:
        TypeError: if `fn` is not callable or is a class, `enabled` is not a bool or None,
            or `check` or `offload` is not a bool.
        ValueError: if `policy` is not one of `"full"`, `"save_dots"`,
            `"attention_core"`; when a call runs under `"attention_core"`
            with no attention layer in it; when a call with `offload=True`
            runs on TensorFlow.

    Example:

    ```python
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = keras.layers.Dense(512, activation="gelu")
            self.outer = keras.layers.Dense(128)

        @recompute_grad
        def call(self, inputs, training=None):
            return inputs + self.outer(self.inner(inputs))

    # Or one instance of a layer you did not write:
    block.call = recompute_grad(block.call)
    ```
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(
            "keras_recompute: recompute_grad(enabled=...) takes True, False or "
            f"None; received {enabled!r} of type {type(enabled).__name__}."
        )
    if not isinstance(check, bool):
        raise TypeError(
            "keras_recompute: recompute_grad(check=...) takes True or False; "
            f"received {check!r} of type {type(check).__name__}."
        )
    if not isinstance(offload, bool):
        raise TypeError(
            "keras_recompute: recompute_grad(offload=...) takes True or False; "
            f"received {offload!r} of type {type(offload).__name__}."
        )
    _policy.check(policy, "recompute_grad")
    if fn is None:
        return functools.partial(recompute_grad, enabled=enabled, check=check, policy=policy, offload=offload)
    if not callable(fn):
        hint = (
            " To fix the choice, write @recompute_grad(enabled=True)."
            if isinstance(fn, bool)
            else ""
        )
        raise TypeError(
            "keras_recompute: recompute_grad decorates a function, a method "
            f"such as Layer.call, or a callable; received {fn!r} of type "
            f"{type(fn).__name__}.{hint}"
        )

    if isinstance(fn, type):  # `@recompute_grad` over `class Block(Layer)`: it would construct, never recompute
        raise TypeError(
            f"keras_recompute: recompute_grad decorates a function or a method such as Layer.call, not a class; "
            f"received the class {fn.__name__}. Put @recompute_grad on its call method (def call(self, ...)); for "
            f"a class you did not write, recompute_model(model, blocks={fn.__name__}) or, on one instance, "
            "layer.call = recompute_grad(layer.call)."
        )

    fn = _undecorated(fn)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    dropped = _kwargs_to_drop(signature)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        on = _config.is_enabled() if enabled is None else enabled
        if not on or _saving_a_model():
            return fn(*args, **kwargs)
        for key in dropped:
            kwargs.pop(key, None)
        context = _context.capture(fn, args, kwargs, name)
        if policy == _policy.ATTENTION_CORE:
            return _with_cores_recomputed(fn, args, kwargs, context, check, offload)
        call = _dispatch(context, args, kwargs)
        # Inside an attention_core unit, a recomputed call runs outside its cores' patches (NOTE [ a recomputed
        # call inside an attention_core unit ] in `_policy`).
        run = _policy.outside_cores(fn, context.owner) if _policy.cores_patched() else fn
        if offload:  # passed only when asked: a backend without an offload path refuses it
            return call(run, args, kwargs, context, check=check, policy=policy, offload=True)
        return call(run, args, kwargs, context, check=check, policy=policy)

    if offload:  # NOTE [ a functional graph's values until their last use ] in `backends/_keras3`
        from keras_recompute.backends import _keras3

        _keras3.release_graph_values()
    if signature is not None:
        # tf_keras reads a call's arguments with getfullargspec, which ignores
        # __wrapped__ but honours __signature__.
        wrapper.__signature__ = signature
    setattr(wrapper, _MARK, True)
    setattr(wrapper, _OPTIONS, (enabled, policy, offload))
    if "tensorflow" in sys.modules:  # NOTE [ AutoGraph before TensorFlow 2.4 ] in `_tf_private`
        importlib.import_module("keras_recompute.backends._tf_private").leave_to_autograph(wrapper)
    return wrapper


# NOTE [ saving a model ]
# While TensorFlow traces a model's functions to save them (`tf.saved_model.save`,
# Keras 3's `model.export`, tf_keras's SavedModel `save`), a decorated call runs as
# the plain call: the saved functions are the plain model's, for serving, and
# hold none of the recompute's machinery. A restored function differentiated
# after loading gives the plain gradient. Found 2026-11-30: with recompute on,
# `tf.saved_model.save` of a Keras 3 model with a `Dropout` in a recomputed
# block failed ("Tried to export a function which references an 'untracked'
# resource"): the recompute reads the call's seed states before the forward
# (to replay them), also in the serving function's `training=False` trace,
# where the plain call reads none, and Keras 3's seed generators are not in the
# object graph TensorFlow saves. tf_keras saved, with AutoGraph warnings.
def _saving_a_model():
    """Whether TensorFlow is tracing functions to save them (NOTE [ saving a model ])."""
    module = sys.modules.get("tensorflow.python.saved_model.save_context")
    return module is not None and module.in_save_context()


# Set on every function `recompute_grad` returns; `_OPTIONS`: its `(enabled, policy, offload)`.
_MARK = "_keras_recompute_wrapper"
_OPTIONS = "_keras_recompute_options"


def decorated_policy(call):
    """`(policy, offload)` of a call decorated by `recompute_grad` that recomputes now, or None.

    A bound method of a decorated `call` (a class's, or an instance's own) is
    read through; None where it is not decorated, or its switch is off.
    """
    fn = call.__func__ if isinstance(call, types.MethodType) else call
    options = getattr(fn, _OPTIONS, None)
    if options is None:
        return None
    enabled, policy, offload = options
    on = _config.is_enabled() if enabled is None else enabled
    return (policy, offload) if on else None


def decorated_inside(layer):
    """`[(class name, policy)]` of the layers inside `layer` whose own call is decorated and recomputes now."""
    if not _context.is_layer(layer):  # a graph piece's stand-in, or not a layer
        return []
    found = []
    for inner in _context.sublayers(layer):
        options = decorated_policy(getattr(inner, "call", None))
        if options is not None:
            found.append((type(inner).__name__, options[0]))
    return found


def _undecorated(fn):
    """`fn` without our decoration: a wrapper of ours, or a method bound to one, is unwrapped."""
    while True:
        if getattr(fn, _MARK, False) and isinstance(fn, types.FunctionType):
            fn = fn.__wrapped__
        elif isinstance(fn, types.MethodType) and getattr(fn.__func__, _MARK, False):
            fn = types.MethodType(fn.__func__.__wrapped__, fn.__self__)
        else:
            return fn


def _with_cores_recomputed(fn, args, kwargs, context, check, offload):
    """The call as it is, its attention layers' cores recomputed (NOTE [ policies ])."""
    owner = context.owner
    layers = _policy.attention_layers(owner) if _context.is_layer(owner) else []
    if not layers:
        raise ValueError(_policy.no_attention_message([context.name], [owner]))
    with _policy.cores_recomputed(layers, recompute_grad, check, offload):
        return fn(*args, **kwargs)


def _kwargs_to_drop(signature):
    if signature is None:
        return ()
    parameters = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return ()
    names = {p.name for p in parameters}
    return tuple(key for key in _KERAS_CALL_KWARGS if key not in names)


# The module of each backend's path; each has the same `recompute_call`.
_PATHS = {
    "tensorflow": "keras_recompute.backends.tensorflow",
    "jax": "keras_recompute.backends.jax",
    "torch": "keras_recompute.backends.torch",
}


def _dispatch(context, args, kwargs):
    """Returns the `recompute_call` of the backend that runs this call."""
    backend = _backend_of(context.owner, args, kwargs)
    if backend not in _PATHS:
        raise RecomputeError(
            f"keras_recompute: recompute is on (RECOMPUTE or recompute_scope) but "
            f"the {backend!r} backend has no recompute path. Paths exist for "
            f"{', '.join(sorted(_PATHS))}: set KERAS_BACKEND to one of them, or "
            "turn recompute off."
        )
    # `__import__`, a builtin: tf_keras converts a layer's `call` with AutoGraph, and with it this code, and
    # AutoGraph, converting `importlib.import_module`, warned once a process that it could not transform
    # `_gcd_import` (importlib's frozen source).
    __import__(_PATHS[backend])
    return sys.modules[_PATHS[backend]].recompute_call


def _backend_of(owner, args, kwargs):
    """Finds which framework runs the call, importing none of them.

    A Keras 3 layer runs on Keras's backend; otherwise the first tensor among
    the arguments names it (a tf_keras layer's inputs are TensorFlow tensors).
    """
    from keras_recompute.backends import _keras3

    if _keras3.is_layer(owner):
        return _keras3.backend_name()
    for leaf in _context.leaves((args, kwargs)):
        framework = _TENSOR_MODULES.get(type(leaf).__module__.partition(".")[0])
        if framework is not None:
            return framework
    if _keras3.loaded():
        return _keras3.backend_name()
    if "tensorflow" in sys.modules:
        return "tensorflow"
    raise RecomputeError(
        "keras_recompute: recompute is on but neither TensorFlow nor Keras 3 "
        "has been imported, so there is no framework to recompute with. "
        "Import keras or tensorflow before calling the decorated function."
    )


# The top-level module of a tensor's type (a JAX array's type lives in jaxlib).
_TENSOR_MODULES = {"tensorflow": "tensorflow", "jax": "jax", "jaxlib": "jax", "torch": "torch"}

