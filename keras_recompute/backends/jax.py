"""Keras 3 on JAX: recompute with `jax.checkpoint`.

NOTE [ recompute on JAX ]
`jax.checkpoint` traces the call once into a program; the forward keeps only
that program's inputs and the backward evaluates it a second time. The
recompute replays the traced program, not the Python function, so random draws
(their seeds are values in the program) and batch statistics are the
forward's by construction, and the values always agree: `check` has nothing to
compare here.

What needs care is everything that is not a float array:
  * Only the floating-point leaves of the arguments are arguments of the
    checkpointed function. Everything else (`training`, masks, token ids,
    Python values) is closed over, so Python control flow on `training` works.
    `keras.remat` passes them all through `jax.checkpoint`, which traces
    `training` and makes Dropout and BatchNorm fail.
  * Keras layers assign variables (seed states, moving statistics) and call
    `add_loss` inside `call`. Inside `jax.checkpoint` those values are tracers
    of the inner trace; stored in a variable or a scope they would leak out of
    it. The call runs in a stateless scope that records them
    (`_keras3.collect`); they leave the checkpoint as extra outputs and are
    assigned, or added as losses, outside it, where Keras expects them
    (the training step's stateless scope, or the variables in eager mode).
  * `prevent_cse=True` (JAX's default, stated here on purpose) keeps XLA from
    merging the recompute with the forward, which would undo the saving.
  * A layer that is not built yet is called plainly once: building it inside
    the checkpoint would create its variables from tracers.
"""

import jax
import jax.numpy as jnp

from keras_recompute._errors import RecomputeError
from keras_recompute.backends import _keras3


def _is_differentiable(value):
    return isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.inexact)


def recompute_call(fn, args, kwargs, name, check=True):
    """Calls `fn(*args, **kwargs)` under `jax.checkpoint`.

    Args:
        fn: the undecorated function (`Layer.call`, a function, a callable).
        args: positional arguments, `self` first for a method.
        kwargs: keyword arguments.
        name: what to call `fn` in error messages.
        check: accepted for every backend; on JAX the recompute replays the
            traced program, so its values cannot differ from the forward's.

    Returns:
        What `fn` returns, with the same structure.
    """
    del check
    owner = args[0] if args and _keras3.is_layer(args[0]) else None
    if _keras3.in_symbolic_scope() or _keras3.unbuilt_layers(owner):
        return fn(*args, **kwargs)

    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if _is_differentiable(leaf)]
    traced = {}

    def pure(*inputs):
        new_leaves = list(leaves)
        for position, value in zip(positions, inputs):
            new_leaves[position] = value
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, new_leaves)
        with _keras3.collect() as scope:
            outputs = fn(*call_args, **call_kwargs)
        out_leaves, out_def = jax.tree_util.tree_flatten(outputs)
        arrays = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, jax.Array)]
        variables = list(scope.updated.values())
        traced.update(
            out_leaves=out_leaves,
            out_def=out_def,
            arrays=arrays,
            variables=variables,
            loss_layers=[_keras3.loss_owner(owner, loss) for loss in scope.losses],
        )
        return (
            [out_leaves[i] for i in arrays],
            [scope.state_mapping[id(variable)] for variable in variables],
            list(scope.losses),
        )

    # Traces the call (the only time Python runs it); every value it closes
    # over (weights, seeds, masks, outer tracers) becomes an explicit argument.
    closed, shapes = jax.make_jaxpr(pure, return_shape=True)(*[leaves[i] for i in positions])
    flat = _recompute(closed.jaxpr)(*closed.consts, *[leaves[i] for i in positions])
    arrays, updates, losses = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), flat)

    for variable, value in zip(traced["variables"], updates):
        variable.assign(value)
    for layer, loss in zip(traced["loss_layers"], losses):
        if layer is None:
            raise RecomputeError(
                f"keras_recompute: {name} called `add_loss` inside a recomputed "
                "plain function on JAX, where the loss cannot be given back to "
                "its layer. Decorate the `call` of the layer that adds the loss "
                "(or of a layer that contains it) instead."
            )
        layer.add_loss(loss)
    out_leaves = list(traced["out_leaves"])
    for position, value in zip(traced["arrays"], arrays):
        out_leaves[position] = value
    return jax.tree_util.tree_unflatten(traced["out_def"], out_leaves)


def _recompute(jaxpr):
    """`jaxpr` as a function whose backward pass evaluates it again."""
    num_consts = len(jaxpr.constvars)

    def run(*args):
        return jax.core.eval_jaxpr(jaxpr, args[:num_consts], *args[num_consts:])

    @jax.custom_vjp
    def call(*args):
        return run(*args)

    def forward(*args):
        # The seeds wait for the call's inputs, or every block's dropout bits,
        # which depend on the seeds alone, are drawn at the start of the step.
        waited = _wait(args[:num_consts], _zero_from(args[num_consts:]), floats=False)
        return run(*waited, *args[num_consts:]), args

    def backward(args, cotangents):
        args = _wait(args, _zero_from(cotangents))
        _, vjp = jax.vjp(run, *args)
        return vjp(cotangents)

    call.defvjp(forward, backward)
    return call


def _zero_from(tree):
    """A zero that depends on the data of `tree`, and that no compiler can fold.

    `where(s == s, 0, nan)` is NaN when `s` is NaN, so it is not a constant.
    """
    floats = [leaf for leaf in jax.tree_util.tree_leaves(tree) if _is_differentiable(leaf) and leaf.size]
    if not floats:
        return None
    value = floats[0].reshape(-1)[0]
    return jnp.where(value == value, jnp.zeros((), value.dtype), jnp.full((), jnp.nan, value.dtype))


def _wait(tree, zero, floats=True):
    """`tree` made to depend on `zero`: floats plus it, integers plus its integer zero."""
    if zero is None:
        return tree
    integer_zero = jnp.isnan(zero).astype(jnp.int32)

    def add(leaf):
        if not isinstance(leaf, jax.Array) or leaf.dtype == jax.dtypes.float0:
            return leaf
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            return leaf + zero.astype(leaf.dtype) if floats else leaf
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            return leaf + integer_zero.astype(leaf.dtype)
        return leaf

    return jax.tree_util.tree_map(add, tree)
