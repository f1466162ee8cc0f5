"""Keras 3 on PyTorch: recompute with `torch.utils.checkpoint` (non-reentrant).

NOTE [ recompute on PyTorch ]
Non-reentrant `torch.utils.checkpoint` replaces every tensor that autograd
would save inside the call by a handle, and reruns the call when the backward
first needs one of them. Torch's own RNG state is saved and restored
(`preserve_rng_state=True`) and torch's autocast state is re-entered. That is
not enough for Keras: Keras draws dropout masks from its own `SeedGenerator`
variables (which the forward advanced), keeps its mixed-precision policy in a
Keras autocast scope, and assigns moving statistics in `call`. So before the
forward we snapshot the layer's non-trainable variables and the global seed
generator (cloned: torch variables are assigned in place), and the recompute
runs inside `_keras3.replay` through `context_fn`: reads see the snapshot,
assignments and losses are dropped, the autocast scope and the call context
(`training` for sub-layers called without it) are the forward's. This is what
`keras.remat` lacks: around a transformer block with seeded dropout its
recompute draws other masks, and the input gradient came out 400.0 where the
plain block's is 0.0001 (same shapes, so torch's determinism check is silent;
seen on Keras 3.15 with PyTorch 2.13).

Early stopping is turned off: it stops the recompute by raising an exception
inside it, and the exception's traceback ties the frames of the layers'
`call` (Keras's traceback filter keeps them) into a reference cycle that keeps
the recomputed tensors alive until Python's garbage collector runs. Measured
on a 12-block stack: the backward's memory grew by one block's activations per
block (+155 MB), which is the memory recompute is meant to save. The recompute
is the whole call in any case, since the backward needs nearly all of it.

`check=True` keeps torch's determinism check (shapes, dtypes and devices of
the recomputed tensors); `check=False` turns it off.
"""

import contextlib

import keras
import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from keras_recompute import _policy
from keras_recompute.backends import _keras3


def _snapshot(value):
    return value.detach().clone()


def recompute_call(fn, args, kwargs, context, check=True, policy="full"):
    """Calls `fn(*args, **kwargs)` under `torch.utils.checkpoint`.

    Args:
        fn: the undecorated function (`Layer.call`, a function, a callable).
        args: positional arguments, `self` first for a method.
        kwargs: keyword arguments.
        context: the call's `CallContext` (its layer, the masks on its arguments).
        check: keep torch's determinism check of the recompute.
        policy: `"full"`, or `"save_dots"`: the outputs of the weight matmuls
            are kept (NOTE [ save_dots on PyTorch ]).

    Returns:
        What `fn` returns.
    """
    owner = context.owner if _keras3.is_layer(context.owner) else None
    if not torch.is_grad_enabled() or _keras3.in_symbolic_scope():
        # Nothing is saved for a backward that will not run.
        return fn(*args, **kwargs)
    state = _keras3.capture(owner, _snapshot)

    def run(*call_args, **call_kwargs):
        # NOTE [ inputs written in place ]: a call may write its inputs in
        # place (keras-hub's Gemma attention scales its query with `q *= c`),
        # and the recompute must see them as they were: the call gets copies
        # (one copy of the unit's inputs per run, freed with the run). The
        # copies get the masks the inputs had when the call began.
        call_args, call_kwargs = keras.tree.map_structure(_copy, (call_args, call_kwargs))
        with context.masks_attached(call_args, call_kwargs):
            return fn(*call_args, **call_kwargs)

    def context_fn():
        forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
        if policy == _policy.SAVE_DOTS:
            forward, recompute = torch_checkpoint.create_selective_checkpoint_contexts(_save_dots)
        return forward, _Recomputing(_keras3.replay(state, owner), recompute)

    with torch_checkpoint.set_checkpoint_early_stop(False):
        return torch_checkpoint.checkpoint(
            run,
            *args,
            use_reentrant=False,
            context_fn=context_fn,
            preserve_rng_state=True,
            determinism_check="default" if check else "none",
            **kwargs,
        )


# NOTE [ save_dots on PyTorch ]
# Torch's selective checkpoint keeps the outputs of the ops a policy marks.
# Ours marks the matmuls without a batch dimension, as JAX's
# `dots_with_no_batch_dims_saveable`: a Dense kernel's `mm`/`addmm`, and the
# `bmm` of batch 1 that `einsum` makes of an EinsumDense projection. The
# scores of attention are a `bmm` over batch and heads (or a fused attention
# op): recomputed.
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _save_dots(ctx, op, *args, **kwargs):
    del ctx, kwargs
    keep = op in _MATMULS or (op is torch.ops.aten.bmm.default and args[0].shape[0] == 1)
    return torch_checkpoint.CheckpointPolicy.MUST_SAVE if keep else torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


class _Recomputing:
    """The recompute's context: Keras's replayed state, and torch's own."""

    def __init__(self, replay, torch_context):
        self._stack = contextlib.ExitStack()
        self._contexts = (replay, torch_context)

    def __enter__(self):
        for context in self._contexts:
            self._stack.enter_context(context)
        return self

    def __exit__(self, *exc_info):
        return self._stack.__exit__(*exc_info)



# NOTE [ measuring a unit on PyTorch ]
# Saved-tensor hooks see every tensor autograd keeps for the backward, and
# torch's checkpoint saves the call's inputs under them (the recomputed
# internals go to its own hooks, nested inside ours). Counted once per storage,
# without the weights and the call's inputs (held anyway), they are what the
# unit keeps. Under `"save_dots"` the selective checkpoint also keeps the
# outputs of the matmuls its policy marks, in a cache the hooks do not see: a
# dispatch mode adds them up with the same test (`_save_dots`). Its forward and
# backward is what `_memory` times.


def measure_unit(layer, args, kwargs, policy, timed=True):
    """What one call of `layer` keeps for its backward, and a step of it to time.

    Args:
        layer: the layer, its `call` set to the option being measured.
        args: positional arguments of a recorded call.
        kwargs: keyword arguments of it.
        policy: the option's name: `"save_dots"` adds the matmul outputs its
            checkpoint keeps.
        timed: whether to return a step (else None).

    Returns:
        `(kept_bytes, largest_bytes, step)`, as on TensorFlow.
    """
    weights = [v.value for v in layer.trainable_variables]

    def run(measure):
        flat = keras.tree.flatten((args, kwargs))
        inputs = []
        for index, leaf in enumerate(flat):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                copy = leaf.detach().clone().requires_grad_(True)
                mask = _keras3.get_mask(leaf)
                if mask is not None:
                    _keras3.set_mask(copy, mask)
                flat[index] = copy
                inputs.append(copy)
        call_args, call_kwargs = keras.tree.pack_sequence_as((args, kwargs), flat)
        held = {t.untyped_storage().data_ptr() for t in weights + inputs}
        kept = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in held:
                kept[storage.data_ptr()] = storage.nbytes()
            return tensor

        dots = _DotBytes() if measure and policy == _policy.SAVE_DOTS else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), dots:
            outputs = layer(*call_args, **call_kwargs)
        if measure:  # no backward: what the forward keeps is known, and is freed with `outputs`
            sizes = list(kept.values()) + (dots.sizes if policy == _policy.SAVE_DOTS else [])
            return sum(sizes), max(sizes, default=0)
        float_outputs = [o for o in keras.tree.flatten(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
        loss = sum(o.float().sum() for o in float_outputs)
        wanted = [t for t in inputs + weights if t.requires_grad]
        torch.autograd.grad(loss, wanted, allow_unused=True)
        return None

    kept, largest = run(measure=True)
    return kept, largest, (lambda: run(measure=False)) if timed else None


class _DotBytes(TorchDispatchMode):
    """Adds up the bytes of the outputs `_save_dots` marks to keep."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _save_dots(None, func, *args) == torch_checkpoint.CheckpointPolicy.MUST_SAVE:
            self.sizes.append(out.untyped_storage().nbytes() if isinstance(out, torch.Tensor) else 0)
        return out
