"""Keras 3 on JAX: the call traced once, and a custom VJP that evaluates it again.

NOTE [ recompute on JAX ]
The call is traced once into a program (`jax.make_jaxpr`); every value it
closes over (weights read through Keras's stateless scope, seed states, masks,
outer tracers) becomes an explicit argument. A `jax.custom_vjp` runs that
program forward and keeps only its arguments; its backward evaluates the
program again and differentiates it (`jax.vjp`). The recompute replays the
traced program, not the Python function, so random draws (their seeds are
arguments) and batch statistics are the forward's by construction, and the
values always agree: `check` has nothing to compare here.

Why not `jax.checkpoint` alone: on XLA's CPU backend it saved nothing (16
blocks of 4096 x 1024 activations: 848 MB of temporaries against 852 MB
without it). XLA expands its optimization barrier before CSE, which then
merges the recomputed matmuls back into the forward, and XLA's default CPU
scheduler runs the recompute early, before the backward needs it. So, as on the
TensorFlow path (NOTE [ ordering the recompute in graphs ] there):
  * the backward adds to each argument a zero made from the incoming
    gradient's data that no compiler can fold (`where(g == g, 0, nan)`): the
    recompute can neither start before that gradient exists nor be merged
    with the forward (124 MB for the stack above; NOTE [ how the recompute
    waits on JAX ] has what that costs, and why on a GPU the backward of
    the saving policies waits at an optimization barrier instead);
  * the forward's integer arguments (seed states) wait for its float inputs
    the same way, or every block's dropout bits, which depend on the seeds
    alone, are drawn at the start of the step and all kept alive.
(Tying the returned gradients together as well cost 5x the compile time on a
24-block stack, for no saving: not done.)

What else needs care:
  * Only the floating-point leaves of the arguments are differentiated;
    `training`, masks, token ids and Python values stay what they are, so
    Python control flow on `training` works (`keras.remat` passes them all
    through `jax.checkpoint`, which traces `training` and makes Dropout and
    BatchNorm fail).
  * Keras layers assign variables (seed states, moving statistics) and call
    `add_loss` inside `call`. Inside the trace those values are tracers;
    stored in a variable or a scope they would leak out of it. The call runs
    in a stateless scope that records them (`_keras3.collect`); they leave the
    program as extra outputs and are assigned, or added as losses, outside
    it, where Keras expects them (the training step's stateless scope, or the
    variables in eager mode).
  * A layer that is not built yet, or a call on symbolic inputs (a functional
    model being built), is called plainly: building inside the trace would
    create variables from tracers.
  * Masks attached to the arguments (NOTE [ the call's context ]) are put on
    the traced arguments, so sub-layers find them; they are closed over, so
    they become arguments like the seeds. Masks the call attaches to its
    outputs leave the program as extra outputs and are attached outside.

NOTE [ forward-mode differentiation on JAX ]
A `jax.custom_vjp` cannot be differentiated in forward mode: `jax.jvp` or
`jax.jacfwd` of a step through a recomputed call raised JAX's "can't apply
forward-mode autodiff (jvp) to a custom_vjp function" (found 2026-12-04; at
once in eager mode, when the step was compiled under `jax.jit`). Where the
call's values are traced for a JVP (`_under_forward_mode`: reverse mode,
`jax.grad`, traces them for a linearization instead), it runs as the plain
call (with a warning once per call): forward mode keeps no activations to
recompute. Forward over reverse (a Hessian-vector product: `jax.jvp` of
`jax.grad`) differentiates the custom VJP's backward, and recomputes. Not
served, with JAX's error: `jax.linearize` (traced as `jax.grad` is; the error
when its linear function is applied) and a JVP of a call that runs in a
`lax.scan`, `cond` or loop body (traced to a program first, and
differentiated as one): turn recompute off there (`recompute_scope(False)`).
"""

import contextlib
import functools
import threading
import warnings

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from keras_recompute import _context, _policy
from keras_recompute._errors import RecomputeError, warn_runs_plain
from keras_recompute.backends import _keras3


def _is_differentiable(value):
    return isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.inexact)


try:  # private names, for `_under_forward_mode`
    from jax._src import core as _jax_private_core
    from jax._src.interpreters import ad as _jax_ad
except ImportError:  # pragma: no cover - depends on the JAX version
    _jax_private_core = _jax_ad = None
# Where JAX linearizes directly (its default since 0.5; a flag before), reverse mode traces with a `LinearizeTrace`.
_DIRECT_LINEARIZE = getattr(jax.config, "jax_use_direct_linearize", True)


def _under_forward_mode(values):
    """Whether `values` are traced for a JVP now (NOTE [ forward-mode differentiation on JAX ]).

    Where JAX linearizes directly, reverse mode traces with a `LinearizeTrace` and only `jax.jvp` (and
    `jax.jacfwd`, its `vmap`) with a `JVPTrace`. Elsewhere, or without these private names, False: JAX's own
    error then says it.
    """
    if _jax_private_core is None or not _DIRECT_LINEARIZE:
        return False
    return isinstance(_jax_private_core.find_top_trace(values), _jax_ad.JVPTrace)


def recompute_call(fn, args, kwargs, context, check=True, policy="full", offload=False):
    """Calls `fn(*args, **kwargs)`, keeping only its arguments for the backward.

    Args:
        fn: the undecorated function (`Layer.call`, a function, a callable).
        args: positional arguments, `self` first for a method.
        kwargs: keyword arguments.
        context: the call's `CallContext` (its layer, the masks on its arguments).
        check: accepted for every backend; on JAX the recompute replays the
            traced program, so its values cannot differ from the forward's.
        policy: `"full"`, or `"save_dots"`: the outputs of the weight matmuls
            are kept (NOTE [ save_dots on JAX ]).
        offload: keep the residuals in host memory (NOTE [ offload ] in `_policy`).

    Returns:
        What `fn` returns, with the same structure.
    """
    del check
    name, owner = context.name, context.owner
    if not _keras3.is_layer(owner):
        owner = None
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
        # The traced arguments are new arrays: they get the masks the call's had.
        with _keras3.collect() as scope, context.masks_attached(call_args, call_kwargs):
            outputs = fn(*call_args, **call_kwargs)
        out_leaves, out_def = jax.tree_util.tree_flatten(outputs)
        arrays = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, jax.Array)]
        variables = list(scope.updated.values())
        # Masks the call attached to its outputs are values of the trace: they
        # leave it as outputs, to be attached outside.
        masks = [(i, _context.get_mask(out_leaves[i])) for i in arrays]
        masks = [(i, mask) for i, mask in masks if mask is not None]
        traced.update(
            out_leaves=out_leaves,
            out_def=out_def,
            arrays=arrays,
            variables=variables,
            loss_layers=[_keras3.loss_owner(owner, loss) for loss in scope.losses],
            masked=[i for i, _ in masks],
        )
        return (
            [out_leaves[i] for i in arrays],
            [scope.state_mapping[id(variable)] for variable in variables],
            list(scope.losses),
            [mask for _, mask in masks],
        )

    # Traces the call (the only time Python runs it); every value it closes
    # over (weights, seeds, masks, outer tracers) becomes an explicit argument.
    masks = _masks_named() if _policy.keeps_dropout_masks(policy) else contextlib.nullcontext([])
    with masks as named:
        closed, shapes = jax.make_jaxpr(pure, return_shape=True)(*[leaves[i] for i in positions])
    closed = closed.replace(jaxpr=_without_refused_dot_algorithms(closed.jaxpr))
    recomputed = _recompute(closed.jaxpr, policy, offload, keep_masks=bool(named))
    arguments = list(closed.consts) + [leaves[i] for i in positions]
    if _under_forward_mode(arguments):  # NOTE [ forward-mode differentiation on JAX ]
        warn_runs_plain(name, "under forward-mode differentiation (jax.jvp, jax.jacfwd): a custom VJP has no JVP")
        return fn(*args, **kwargs)
    flat = recomputed(*arguments)
    arrays, updates, losses, masks = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), flat)

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
    for position, mask in zip(traced["masked"], masks):
        _context.set_mask(out_leaves[position], mask)
    return jax.tree_util.tree_unflatten(traced["out_def"], out_leaves)


# NOTE [ dot algorithms the device refuses ]
# Some library code asks for a dot algorithm and falls back when the device
# refuses it: `jax.nn.dot_product_attention` (what Keras's
# `ops.dot_product_attention` calls, and keras-hub's Llama, Mistral and Gemma
# attention) computes float16 scores with `precision=F16_F16_F32` inside a
# `try`, and on an exception computes them with the default precision. XLA's
# CPU backend refuses that algorithm. Run eagerly, the plain call raises
# there, catches it and takes the fallback; traced, as the recompute traces the
# call, nothing runs, so the trace keeps the algorithm and the device refuses
# the program when it runs ("The precision 'F16_F16_F32' is not supported by
# dot_general on CPU"). So before the traced program runs, each `dot_general`
# whose algorithm the default device refuses gets the default precision, the
# very fallback the plain call took. Whether the device refuses it is asked of
# JAX itself (lowering that one dot for the device, once per algorithm and
# types), so a device that accepts it (a GPU) runs the program unchanged.


def _without_refused_dot_algorithms(jaxpr):
    """`jaxpr` with each dot algorithm the default device refuses replaced by the default precision."""
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        params = {name: _in_param(value) for name, value in eqn.params.items()}
        precision = params.get("precision")
        if eqn.primitive.name == "dot_general" and isinstance(precision, (jax.lax.DotAlgorithmPreset, jax.lax.DotAlgorithm)):
            lhs, rhs = (var.aval.dtype for var in eqn.invars[:2])
            if _refused(precision, lhs, rhs, params.get("preferred_element_type")):
                params["precision"] = None
        if any(params[name] is not value for name, value in eqn.params.items()):
            eqn, changed = eqn.replace(params=params), True
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _in_param(value):
    """A parameter of an equation with the programs inside it (a `jit`'s, a `cond`'s branches) rewritten."""
    if isinstance(value, jax_core.ClosedJaxpr):
        inner = _without_refused_dot_algorithms(value.jaxpr)
        return value if inner is value.jaxpr else value.replace(jaxpr=inner)
    if isinstance(value, jax_core.Jaxpr):
        return _without_refused_dot_algorithms(value)
    if isinstance(value, tuple) and any(isinstance(v, (jax_core.ClosedJaxpr, jax_core.Jaxpr)) for v in value):
        rewritten = tuple(_in_param(v) for v in value)
        return value if all(a is b for a, b in zip(rewritten, value)) else rewritten
    return value


@functools.lru_cache(maxsize=None)
def _refused(precision, lhs_dtype, rhs_dtype, preferred_element_type):
    """Whether the default device refuses a `dot_general` with this algorithm on these types."""
    dimensions = (((1,), (0,)), ((), ()))

    def dot(lhs, rhs):
        return jax.lax.dot_general(lhs, rhs, dimensions, precision=precision, preferred_element_type=preferred_element_type)

    try:
        jax.jit(dot).lower(jax.ShapeDtypeStruct((2, 2), lhs_dtype), jax.ShapeDtypeStruct((2, 2), rhs_dtype))
    except Exception:  # noqa: BLE001 - what the device refuses comes as several error types
        return True
    return False


# NOTE [ dropout masks under the policies on JAX ]
# Under `"save_dots"` and for the cores of `"attention_core"` (NOTE [ policies ]), which trade
# memory for time, the forward keeps each dropout's keep mask, packed to a bit an element (1/16
# of the bfloat16 tensor it masks), and the recompute unpacks it instead of drawing it again.
# Drawing again was most of what these policies' recompute moved: XLA's cost analysis of two
# BERT-base blocks in mixed_bfloat16 at batch 4 (benchmarks/xla_costs.py) had `save_dots` move
# 1.32x plain's bytes with dropout 0.1 and 1.16x without; on the H200 it took 1.46x plain's time,
# `full`'s 1.48x. While such a call is traced, Keras's JAX dropout runs as `_dropout`: Keras's own
# draw (`bernoulli` from the same seed, so the same mask and values as the plain call), then the
# mask packed (`jnp.packbits`), named for `jax.checkpoint`'s policy (`checkpoint_name`), unpacked
# and applied as Keras applies it. The policy saves the named masks beside what it saved before
# (`"save_dots"`: the matmul outputs), and the draw, which only the mask needs, is left out of
# the recompute. Keras's function is replaced once, for good; it acts as before when no such
# call is traced in its thread. `"full"` keeps the least and draws them again.
_MASK_NAME = "keras_recompute_dropout_mask"
_NAMING = threading.local()  # .calls: for each traced call that keeps its masks, outermost first, the masks named


@contextlib.contextmanager
def _masks_named():
    """Within it, Keras's dropout in this thread keeps its masks for the recompute; yields the list of them."""
    from keras.src.backend.jax import random as jax_random

    if jax_random.dropout is not _dropout:
        _dropout.original = jax_random.dropout
        jax_random.dropout = _dropout
    calls = _NAMING.__dict__.setdefault("calls", [])
    calls.append([])
    try:
        yield calls[-1]
    finally:
        calls.pop()


def _dropout(inputs, rate, noise_shape=None, seed=None):
    """Keras's JAX dropout, its keep mask packed and named for the recompute (NOTE [ dropout masks under the policies on JAX ])."""
    from jax.ad_checkpoint import checkpoint_name
    from keras.src.backend.jax import random as jax_random

    calls = getattr(_NAMING, "calls", None)
    if not calls or not isinstance(rate, float) or rate in (0.0, 1.0):
        return _dropout.original(inputs, rate, noise_shape=noise_shape, seed=seed)
    seed = jax_random.jax_draw_seed(seed)
    keep_prob = 1.0 - rate
    noise_shape = jax_random._get_concrete_noise_shape(inputs, noise_shape)
    mask = jax.random.bernoulli(seed, p=keep_prob, shape=noise_shape)
    bits = checkpoint_name(jnp.packbits(mask, axis=None), _MASK_NAME)
    calls[-1].append(bits)
    mask = jnp.unpackbits(bits, count=mask.size).reshape(mask.shape).astype(bool)
    mask = jnp.broadcast_to(mask, inputs.shape)
    return jax.lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))


def _recompute(jaxpr, policy, offload=False, keep_masks=False):
    """`jaxpr` as a function whose backward pass evaluates it again.

    With `offload`, the residuals that are not closed-over values (the call's
    float inputs; under `"save_dots"` also the kept matmul outputs) are
    placed in host memory by the forward and back on the device by the
    backward, before they wait for the incoming gradient (NOTE [ offload ]
    in `_policy`).

    NOTE [ save_dots on JAX ]
    Under `"save_dots"` the forward linearizes the program under
    `jax.checkpoint` with JAX's `dots_with_no_batch_dims_saveable` policy: the
    residuals of that linearization are the program's arguments and the
    outputs of its matmuls without batch dimensions (a Dense kernel, an
    EinsumDense projection; not the scores of attention, which are batched
    over heads). Those residuals are what the custom VJP keeps. Its backward
    makes them wait for the incoming gradient, as every recompute here does,
    and applies the linearization: JAX recomputes what the policy did not
    save, from the kept matmul outputs, and no matmul of the forward runs
    again.
    """
    num_consts = len(jaxpr.constvars)

    def run(*args):
        return jax.core.eval_jaxpr(jaxpr, args[:num_consts], *args[num_consts:])

    @jax.custom_vjp
    def call(*args):
        return run(*args)

    def waited_seeds(args):
        # The seeds wait for the call's inputs, or every block's dropout bits,
        # which depend on the seeds alone, are drawn at the start of the step.
        zero = _zero_from(args[num_consts:])
        return (*_wait(args[:num_consts], zero, floats=False, by=_wait_by(saving=False)), *args[num_consts:])

    policies = jax.checkpoint_policies
    saved = policies.dots_with_no_batch_dims_saveable if policy == _policy.SAVE_DOTS else None
    if keep_masks:  # NOTE [ dropout masks under the policies on JAX ]
        masks = policies.save_only_these_names(_MASK_NAME)
        saved = masks if saved is None else policies.save_from_both_policies(saved, masks)
    if saved is not None:
        saving = jax.checkpoint(run, policy=saved)

        def forward(*args):
            outputs, linearized = jax.vjp(saving, *waited_seeds(args))
            if offload:
                closed_over = {id(a) for a in args[:num_consts]}
                linearized = _placed(linearized, _HOST, lambda leaf: id(leaf) not in closed_over)
            return outputs, linearized

        def backward(linearized, cotangents):
            if offload:
                linearized = _placed(linearized, _DEVICE, _on_host)
            return _wait(linearized, _zero_from(cotangents), by=_wait_by(saving=True))(cotangents)

    else:

        def forward(*args):
            outputs = run(*waited_seeds(args))
            if offload:
                args = (*args[:num_consts], *_placed(list(args[num_consts:]), _HOST))
            return outputs, args

        def backward(args, cotangents):
            if offload:
                args = (*args[:num_consts], *_placed(list(args[num_consts:]), _DEVICE))
            args = _wait(args, _zero_from(cotangents), by=_wait_by(saving=False))
            _, vjp = jax.vjp(run, *args)
            return vjp(cotangents)

    call.defvjp(forward, backward)
    return call


_HOST, _DEVICE = "host", "device"


def _placed(tree, where, chosen=lambda leaf: True):
    """`tree` with its chosen floating-point arrays placed in host memory or on the device (NOTE [ offload ])."""
    space = jax.memory.Space.Host if where == _HOST else jax.memory.Space.Device

    def place(leaf):
        if _is_differentiable(leaf) and leaf.size and chosen(leaf):
            return jax.device_put(leaf, space)
        return leaf

    return jax.tree_util.tree_map(place, tree)


def _on_host(leaf):
    """Whether an array (traced or not) lives in host memory."""
    space = getattr(getattr(leaf, "aval", None), "memory_space", None)
    if space is not None and space != jax.memory.Space.Any:
        return space == jax.memory.Space.Host
    return getattr(getattr(leaf, "sharding", None), "memory_kind", None) in ("pinned_host", "unpinned_host")


def allocator_peak(reset=False):
    """None: JAX's allocator reports the peak of the process so far and cannot set it back, so no step's peak."""
    del reset
    return None


def offload_frees_device_memory():
    """Whether offloaded bytes leave the device's memory: not on a CPU, whose host memory it is."""
    return jax.devices()[0].platform != "cpu"


# NOTE [ how the recompute waits on JAX ]
# What makes the recompute wait for the incoming gradient (NOTE [ recompute on JAX ]) is named
# `keras_recompute_wait` in the compiled program's metadata, so a profile or
# `benchmarks/xla_costs.py` can tell what the waiting itself costs. It is done one of two ways:
#   * "add": each waited array plus a zero made from the gradient. XLA fuses such an add into
#     the array's first elementwise consumer, where it costs nothing; where the consumer is a
#     library call (a cuBLAS matmul on a GPU) the sum can only be written out and read again, a
#     copy of the array per step. On the CPU's compiler such copies are at most 0.03 GB of the
#     8 GB a step of two BERT-base blocks moves (docs/benchmarks.md, "How the recompute waits").
#   * "barrier": the waited arrays and the zero through one `optimization_barrier`, which
#     copies nothing: its outputs exist only once all its inputs do, and no pass may merge what
#     follows it with what precedes it. XLA's CPU compiler removes the barrier before it
#     schedules (there it orders nothing, and the recompute moves back into the forward: `full`'s
#     temporaries grew to plain's); its GPU compiler keeps it.
# `_wait_by` chooses. On a GPU the backward of `"save_dots"` and `"attention_core"` (the
# branch that applies a linearization, whose residuals are kept matmul outputs that cuBLAS
# reads) waits at a barrier; everything else adds. Measured by the H200's compiler
# (docs/gpu.md, sixth session; two BERT-base blocks, batch 32, mixed_bfloat16, dropout 0.1):
# with adds, `save_dots` copied 0.83 GB of kept products a step (0.72 GB without dropout, 7%
# of its step's bytes), `attention_core` 0.10 GB; at a barrier each moved less (19.3 -> 17.7 GB,
# 16.5 -> 15.6 GB) at the same temporaries (within 256 bytes). `full` at a barrier grew its
# temporaries from 1.37 GB to 2.42 GB (plain's: 2.50 GB), so `full` adds there too, and on the
# CPU everything adds. `_WAIT_BY` set to "add" or "barrier" forces one way everywhere
# (benchmarks/xla_costs.py's `--wait`, the tests).
_WAIT_NAME = "keras_recompute_wait"
_WAIT_BY = None


def _wait_by(saving):
    """How a backward waits: "barrier" or "add" (NOTE [ how the recompute waits on JAX ])."""
    if _WAIT_BY is not None:
        return _WAIT_BY
    return "barrier" if saving and _on_gpu() else "add"


def _on_gpu():
    """Whether JAX's default device is a GPU (CUDA or ROCm)."""
    return jax.default_backend() == "gpu"


def _zero_from(tree):
    """A zero that depends on the data of `tree`, and that no compiler can fold.

    `where(s == s, 0, nan)` is NaN when `s` is NaN, so it is not a constant.
    """
    floats = [leaf for leaf in jax.tree_util.tree_leaves(tree) if _is_differentiable(leaf) and leaf.size]
    if not floats:
        return None
    with jax.named_scope(_WAIT_NAME):
        value = floats[0].reshape(-1)[0]
        return jnp.where(value == value, jnp.zeros((), value.dtype), jnp.full((), jnp.nan, value.dtype))


def _wait(tree, zero, floats=True, by="add"):
    """`tree` made to depend on `zero`, its floats (with `floats`) and integers, by `by` (NOTE [ how the recompute waits on JAX ])."""
    if zero is None:
        return tree

    def waits(leaf):
        if not isinstance(leaf, jax.Array) or leaf.dtype == jax.dtypes.float0:
            return False
        return jnp.issubdtype(leaf.dtype, jnp.integer) or (floats and jnp.issubdtype(leaf.dtype, jnp.inexact))

    with jax.named_scope(_WAIT_NAME):
        if by == "barrier":
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            chosen = [i for i, leaf in enumerate(leaves) if waits(leaf)]
            waited, _ = jax.lax.optimization_barrier(([leaves[i] for i in chosen], zero))
            for i, leaf in zip(chosen, waited):
                leaves[i] = leaf
            return jax.tree_util.tree_unflatten(treedef, leaves)
        integer_zero = jnp.isnan(zero).astype(jnp.int32)

        def add(leaf):
            if not waits(leaf):
                return leaf
            if jnp.issubdtype(leaf.dtype, jnp.inexact):
                return leaf + zero.astype(leaf.dtype)
            return leaf + integer_zero.astype(leaf.dtype)

        return jax.tree_util.tree_map(add, tree)


# NOTE [ measuring a unit on JAX ]
# `jax.vjp` returns a backward function whose leaves are the residuals: what
# the forward keeps for the backward, with every policy and custom VJP
# applied (ours keeps its arguments). Traced with `jax.make_jaxpr`, nothing
# runs: the residuals that are not the function's own arguments (weights,
# the call's inputs, which are held anyway) are what the unit keeps. The
# jitted gradient of the stateless call is what `_memory` times, of half the
# sum of the outputs' squares: the gradient of their sum is a constant, from
# which XLA folds the zero a recompute waits on (NOTE [ recompute on JAX ]),
# and then merges the recompute back into the forward. Timed so until
# 2026-12-05, the step of "full" ran the floating-point operations of "none"
# (10.36 M each for tests/test_budget.py's block, by XLA's cost analysis;
# 15.37 M against 9.79 M now), every option's recompute measured 0 to 5 ms
# of noise where "full" costs 34 ms (benchmarks/budget.py's block, a 2-core
# CPU), and the planner chose among policies by that noise.


def measure_unit(layer, args, kwargs, policy, timed=True, execution="compiled", differentiated=True):
    """What one call of `layer` keeps for its backward, and a step of it to time.

    Args:
        layer: the layer, its `call` set to the option being measured.
        args: positional arguments of a recorded call.
        kwargs: keyword arguments of it.
        policy: the option's name (the residuals show what it keeps: unused here).
        timed: whether to return a step (compiled by a first run), else None.
        execution: accepted for every backend: the residuals are what the
            step keeps, run eagerly or compiled (the compiled step is checked
            as a whole: NOTE [ checking a plan on JAX ]).
        differentiated: whether the floating arguments are differentiated
            (not a whole model's batch: NOTE [ a unit no gradient reaches ]
            in `_memory`).

    Returns:
        `(kept_bytes, largest_bytes, step, read_bytes)`, as on TensorFlow;
        `read_bytes` (what a recompute makes again) is `kept_bytes` here.
    """
    del policy, execution
    trainable = [v.value for v in layer.trainable_variables]
    other = [v.value for v in layer.non_trainable_variables]
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda x: x is None)
    positions = [i for i, leaf in enumerate(leaves) if differentiated and _is_differentiable(leaf)]
    masks = [_context.get_mask(leaves[p]) for p in positions]

    def outputs(trainable, differentiated):
        call_leaves = list(leaves)
        for position, value, mask in zip(positions, differentiated, masks):
            call_leaves[position] = value
            if mask is not None:
                _context.set_mask(value, mask)
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, call_leaves)
        result, _ = _keras3.stateless_call(layer, trainable, other, *call_args, **call_kwargs)
        return [o for o in jax.tree_util.tree_leaves(result) if _is_differentiable(o)]

    def residuals(trainable, differentiated):
        return jax.tree_util.tree_leaves(jax.vjp(outputs, trainable, differentiated)[1])

    def loss(trainable, differentiated):  # a gradient made from the outputs (NOTE [ measuring a unit on JAX ])
        return sum(0.5 * jnp.sum(jnp.square(o.astype(jnp.float32))) for o in outputs(trainable, differentiated))

    differentiated = [leaves[p] for p in positions]
    closed = jax.make_jaxpr(residuals)(trainable, differentiated)
    arguments = {id(v) for v in closed.jaxpr.invars}
    counted, kept, largest = set(), 0, 0
    for var in closed.jaxpr.outvars:
        if id(var) in arguments or id(var) in counted or not hasattr(var.aval, "shape"):
            continue
        counted.add(id(var))
        kept, largest = kept + _size(var.aval), max(largest, _size(var.aval))
    if not timed:
        return kept, largest, None, kept
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    jax.block_until_ready(step(trainable, differentiated))
    # Returns once the device has run it (NOTE [ timing a unit on a GPU ] in `_memory`).
    return kept, largest, lambda: jax.block_until_ready(step(trainable, differentiated)), kept


def _size(aval):
    count = 1
    for dim in aval.shape:
        count *= int(dim)
    return count * aval.dtype.itemsize


def step_bytes(model, inputs):
    """The temporary bytes XLA assigns to a training step of `model` on `inputs` as it stands.

    NOTE [ checking a plan on JAX ]
    What a program keeps is XLA's choice: its buffer assignment for the whole
    step can hold more than the sum of the units' residuals (on a 12-block
    encoder the plain step's temporaries were 10% above that sum), or less
    (XLA fuses elementwise work and keeps none of it: keras-hub BERT small's
    step held 0.75-0.84x the sum). XLA states the step's own peak when it
    compiles it, without running it (nothing is allocated: the inputs may be
    `jax.ShapeDtypeStruct`s). The step compiled is Keras's trainer's without
    its loss and metrics, which need labels: the gradient of `0.5 * sum(y**2)`
    over the model's outputs `y` (a loss's gradient is a tensor of the
    outputs' size, made from them, as a cross-entropy's is; the gradient of
    `sum(y)`, a constant, XLA folds away), then the optimizer's own update,
    the weights, optimizer slots and non-trainable state donated as the
    trainer donates them. On a CPU this equalled the temporaries of Keras's
    own `train_step` to the byte, plain and recomputed
    (`tests/test_budget.py::test_the_compiled_step_is_measured_as_keras_runs_it`);
    the gradient alone, which this was until 2026-11-26, was 23% under it
    plain and 12% over it recomputed. The planner checks its plan with it,
    the report predicts with it, and `largest_fit` fits it.
    """
    optimizer, trainable, slots = _trained_state(model)
    other = [v.value for v in model.non_trainable_variables]
    structure = jax.tree_util.tree_structure(inputs)
    leaves = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in jax.tree_util.tree_leaves(inputs)]

    def step(state, leaves):
        trainable, other, slots = state
        values = jax.tree_util.tree_unflatten(structure, leaves)

        def loss(trainable):
            result, other_after = model.stateless_call(trainable, other, values, **_keras3.training_kwargs(model))
            outputs = [o.astype(jnp.float32) for o in jax.tree_util.tree_leaves(result) if _is_differentiable(o)]
            return sum(_stand_in_loss(o) for o in outputs), other_after

        gradients, other = jax.grad(loss, has_aux=True)(trainable)
        if slots is None:  # no optimizer to apply them: the step ends with the gradients
            return gradients, other
        trainable, slots = optimizer.stateless_apply(slots, gradients, trainable)
        return trainable, other, slots

    with warnings.catch_warnings():  # state the step does not write (a frozen weight's slots) is not donated
        warnings.simplefilter("ignore", UserWarning)
        compiled = compiled_for_memory(jax.jit(step, donate_argnums=0).lower((trainable, other, slots), leaves))
    return compiled.memory_analysis().temp_size_in_bytes


def update_bytes(model):
    """The temporary bytes XLA assigns to the optimizer's update of `model`'s weights alone, or 0 without one.

    NOTE [ the compiler's update ]
    Counted as Keras runs it op by op, an update allocates twice the largest
    weight at once (`_memory._update_bytes`); XLA fuses Adam's elementwise
    update into the weights and slots the step donates, and assigns it no
    temporaries: 68 bytes for keras-hub BERT small's, where the count said
    62.5 MB (its 30522 x 256 embedding, twice; CPU, 2026-12-02). With it, the
    count's step at batch 0 (241.2 MB) was above the whole compiled plain step
    at batches 1 and 2 (190.5 and 209.4 MB): calibrating scaled the units to
    almost nothing below batch 8 and not at 8, and `largest_fit`'s fitted
    answers were up to 10x what the compiled steps allowed (619 where 61 fit;
    NOTE [ calibrating the units to the compiler ] in `_model`). So
    where the compiler states the step's peak, the update is the compiler's:
    the update alone, compiled (not run) with the state donated as the
    trainer donates it, the gradients `jax.ShapeDtypeStruct`s.
    """
    optimizer, trainable, slots = _trained_state(model)
    if optimizer is None:
        return 0
    gradients = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in trainable]

    def update(state, gradients):
        trainable, slots = state
        trainable, slots = optimizer.stateless_apply(slots, gradients, trainable)
        return trainable, slots

    with warnings.catch_warnings():  # state the update does not write (a frozen weight's slots) is not donated
        warnings.simplefilter("ignore", UserWarning)
        compiled = compiled_for_memory(jax.jit(update, donate_argnums=0).lower((trainable, slots), gradients))
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _trained_state(model):
    """`(optimizer, trainable values, slot values)` as a training step takes them (slots None without an optimizer),
    the optimizer built first as the first training step builds it."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    slots = None if optimizer is None else [v.value for v in optimizer.variables]
    return optimizer, [v.value for v in model.trainable_variables], slots


# XLA's figures are its buffer assignment, which its HLO passes make before any code is generated; how far LLVM
# then optimizes the code changes none of it. Compiling was two thirds of `largest_fit`'s time on a 2-core CPU
# (tests/test_fit.py's six blocks of 64, 296 of 439 s); unoptimized, eight of its steps compiled in 28.6 s against
# 43.8, their bytes the same to the byte (tests/test_budget.py::test_the_compiled_step_is_measured_as_keras_runs_it).
# Not taken (2026-12-05): `xla_cpu_use_fusion_emitters: False` halved a step's compile on the CPU (a 2-block encoder:
# 0.93 -> 0.48 s a `step_bytes`), but it changes XLA's fusion, not only the code: keras-hub BERT's step had 416
# fusions against 445 and held 256 bytes more under each of plain, full and save_dots, float32 and mixed_bfloat16
# (four other models' 24 such steps the same to the byte). A program measured must be the program that runs.
MEMORY_ONLY = {"xla_backend_optimization_level": 0}


def compiled_for_memory(lowered):
    """`lowered.compile()`, its code generated unoptimized: for its `memory_analysis()`, not to run."""
    try:
        return lowered.compile(compiler_options=MEMORY_ONLY)
    except (TypeError, ValueError, RuntimeError):  # a JAX or a platform without the option: a full compile
        return lowered.compile()


@functools.lru_cache(maxsize=None)
def compiler_scratch_bytes():
    """The temporary bytes XLA assigns to a program of one matrix product on the default device, whatever its size.

    NOTE [ the compiler's scratch ]
    On a GPU, XLA gives a program's matrix products a workspace (cuBLAS's),
    one buffer of a fixed size, in the program's temporaries: a step's
    `step_bytes` hold it at any batch. On the H200 (2026-11-27), tiny test
    models whose units keep 1.9 MB compiled to steps of 35-36 MB; the CPU
    assigns nothing (0 here). Calibrated as a scale of the units' bytes, that
    constant inflated every unit's bytes about 15x, and a budget of 0.75 of the
    activations was refused as below any plan. It is counted once instead:
    held at every point of the step, like the weights
    (`_budget.Model.scratch`). Measured here from a program of one product
    (the workspace's size does not depend on the product's), once per process.
    """
    operand = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    compiled = compiled_for_memory(jax.jit(lambda a, b: a @ b).lower(operand, operand))
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _stand_in_loss(outputs):
    """A loss whose gradient costs what a training loss's does: a cross-entropy's over classes, else a square's."""
    if outputs.ndim >= 2 and outputs.shape[-1] > 1:
        # Keras's (sparse) cross-entropy: log-softmax against one-hot labels, here ones XLA cannot fold away.
        labels = jax.nn.one_hot(jnp.argmax(jax.lax.stop_gradient(outputs), axis=-1), outputs.shape[-1])
        return -jnp.sum(labels * jax.nn.log_softmax(outputs, axis=-1))
    return 0.5 * jnp.sum(outputs * outputs)
