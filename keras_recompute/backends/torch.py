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
the recomputed tensors) and adds a check of the values: see NOTE [ the
recompute check on PyTorch ]. `check=False` turns both off.

NOTE [ torch.func transforms ]
Under `torch.func.grad`, `vjp`, `jacrev` or `vmap` a recomputed call runs as
the plain call (with a warning once per call). Found 2026-12-04: torch's
checkpoint raised there ("torch.func.{grad, vjp, jacrev, hessian} don't yet
support saved tensor hooks"; under `vmap`, its RNG state saved by a random
op vmap refuses). The functorch transforms keep what they need themselves;
per-sample gradients (`vmap` of `grad`) are the plain call's. PyTorch's own
reverse mode, its dual tensors (forward mode) and `torch.compile` (which does
not run the transforms where the call's Python runs) recompute.
"""

import bisect
import contextlib
import functools
import inspect
import itertools
import threading
import weakref

import keras
import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from keras_recompute import _config, _policy
from keras_recompute._errors import RecomputeError, warn_runs_plain
from keras_recompute.backends import _keras3


def _snapshot(value):
    return value.detach().clone()


# NOTE [ Keras's tree keeps a call's tensors in a cycle ]
# Keras on PyTorch flattens a layer's arguments (`Layer.__call__`, `keras.tree`) with torch's
# `_pytree.tree_flatten` and an `is_leaf` that closes over the structure (`lambda x: x is not
# structure`, keras/src/tree/torchtree_impl.py, Keras 3.15). `tree_flatten` recurses through a
# closure, `helper`, that refers to itself and to `is_leaf`: a reference cycle, garbage that holds
# every tensor of the structure until Python's collector runs (keras-team/keras#23110). In a
# recomputed call those tensors are the copies of the unit's inputs and, in the backward, the
# recomputed activations the layers inside pass on, which recompute exists to free. Measured on
# PyTorch 2.13 (CPU), tests/test_fit.py's six blocks of 64 at batch 32, full recompute: the step's
# peak 59.2 MB with the collector off, 42.2 MB where it happened to run, 40.6 MB either way with
# this (no tensor left in the garbage; plain: 143.0 and 137.0 MB, 137.0 with this). A plan's
# measure of a unit read the copies or not as the collector ran: full's backward 131 KB (one
# input) apart from one model to the next in a process, a few percent of a largest fit; on the
# H200 likely most of the 7% between two fits in one process. So Keras's tree sees a `tree_flatten`
# whose `is_leaf` is dropped as the call returns: the cycle holds nothing then.
class _TreeWithoutCycles:
    """torch's `_pytree` as Keras's tree sees it, its `tree_flatten` holding `is_leaf` only for the call."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):  # once per name: Keras's tree reads them at every layer call
        value = getattr(self._module, name)
        setattr(self, name, value)
        return value

    def tree_flatten(self, tree, is_leaf=None):
        if is_leaf is None:
            return self._module.tree_flatten(tree)
        held = [is_leaf]
        try:
            return self._module.tree_flatten(tree, is_leaf=lambda node: held[0](node))
        finally:
            held.clear()


def _keras_tree_without_cycles():
    try:
        from keras.src.tree import torchtree_impl
    except ImportError:  # another Keras: nothing to mend
        return
    tree = getattr(torchtree_impl, "torch_tree", None)
    if tree is not None and not isinstance(tree, _TreeWithoutCycles):
        torchtree_impl.torch_tree = _TreeWithoutCycles(tree)


_keras_tree_without_cycles()


# Whether a torch.func transform is active in this thread (NOTE [ torch.func transforms ]); a torch without this
# private query raises its own error under the transforms, as before.
_functorch_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def recompute_call(fn, args, kwargs, context, check=True, policy="full", offload=False):
    """Calls `fn(*args, **kwargs)` under `torch.utils.checkpoint`.

    Args:
        fn: the undecorated function (`Layer.call`, a function, a callable).
        args: positional arguments, `self` first for a method.
        kwargs: keyword arguments.
        context: the call's `CallContext` (its layer, the masks on its arguments).
        check: keep torch's determinism check of the recompute.
        policy: `"full"`, or `"save_dots"`: the outputs of the weight matmuls
            are kept (NOTE [ save_dots on PyTorch ]).
        offload: keep the inputs the checkpoint saves in host memory (NOTE
            [ offload ] in `_policy`).

    Returns:
        What `fn` returns.
    """
    owner = context.owner if _keras3.is_layer(context.owner) else None
    if not torch.is_grad_enabled() or _keras3.in_symbolic_scope():
        # Nothing is saved for a backward that will not run.
        return fn(*args, **kwargs)
    if _functorch_transforms_active():  # NOTE [ torch.func transforms ]
        warn_runs_plain(context.name, "under a torch.func transform (grad, vjp, vmap), which takes no saved-tensor hooks")
        return fn(*args, **kwargs)
    state = _keras3.capture(owner, _snapshot, eager=True, backend="torch")
    # NOTE [ the recompute's thread ]: on a GPU autograd runs the backward, and so the recompute,
    # in a thread of its own, outside the caller's `recompute_scope` (a context variable); Keras's
    # thread-local state comes back with `state`, and the scope with this. A recomputed call inside
    # this one then recomputes in the recompute as it did in the forward (were it plain there, its
    # ops would save into this call's recompute, which torch refuses).
    enabled = _config.is_enabled()
    values = _RecomputedValues(context.name) if check else None
    tape = _DropoutTape() if _policy.keeps_dropout_masks(policy) and _dropout_replayable() else None

    def run(*call_args, **call_kwargs):
        # NOTE [ inputs written in place ]: a call may write its inputs in
        # place (keras-hub's Gemma attention scales its query with `q *= c`),
        # and the recompute must see them as they were: the call gets copies
        # (one copy of the unit's inputs per run, freed with the run). The
        # copies get the masks the inputs had when the call began.
        call_args, call_kwargs = keras.tree.map_structure(_copy, (call_args, call_kwargs))
        with context.masks_attached(call_args, call_kwargs):
            outputs = fn(*call_args, **call_kwargs)
        if values is not None:
            values.see(outputs)
        return outputs

    def context_fn():
        versions = _SavedVersions(context.name)
        forward, recompute = versions.forward(), versions.recompute()
        if policy == _policy.SAVE_DOTS:
            cache, seen = [], ([] if check else None)  # NOTE [ the recompute check under save_dots ]
            forward = _Contexts(forward, _InMatmuls(_KeepingDots(cache, seen)))
            recompute = _Contexts(recompute, _InMatmuls(_KeptDots(cache, seen, context.name)))
        replay = _Contexts(_config.recompute_scope(enabled), _keras3.replay(state, owner))
        if tape is None:
            return forward, _Contexts(replay, recompute)
        return _Contexts(tape.recording(), forward), _Contexts(replay, recompute, _Fresh(tape.replaying))

    if offload:  # decorated before Keras was imported (NOTE [ a functional graph's values until their last use ])
        _keras3.release_graph_values()
    offloading = _offloaded(context.name) if offload else contextlib.nullcontext()
    # The checkpoint saves the call's inputs under the hooks active when it is
    # called (`offloading`); what the call saves inside goes to its own hooks.
    with torch_checkpoint.set_checkpoint_early_stop(False), offloading:
        return torch_checkpoint.checkpoint(
            run,
            *args,
            use_reentrant=False,
            context_fn=context_fn,
            preserve_rng_state=True,
            determinism_check="default" if check else "none",
            **kwargs,
        )


# NOTE [ the recompute check on PyTorch ]
# Torch's determinism check compares the shapes, dtypes and devices of what
# the recompute saves, not values: a call that branches on a counter it
# changes itself (`scale = 2 if calls % 2 else 3`) recomputed another
# function, and the backward returned that function's gradient with no
# error (the TensorFlow path has raised since its first version). So, as on
# TensorFlow (NOTE [ the recompute check ] in `backends/tensorflow.py`), the
# forward takes a fingerprint of each floating-point output (its norm and a
# projection u'Xv on fixed pseudo-random vectors, in float32) and the
# recompute compares its own. Comparing needs the values on the host, and a
# wait for the device in the middle of the backward would stall a GPU once
# per unit, so the differences are collected on the device and read once,
# when the backward ends (a callback queued on autograd's engine): the
# backward raises `RecomputeError` before any optimizer step can use the
# gradient. JAX needs no such check: it traces a call once and its recompute
# replays the traced program, which cannot differ from its forward.
_PROJECTIONS = {}  # (rows, columns, device) -> the fixed vectors of a fingerprint (a few shapes a model)
_PROJECTIONS_KEPT = 64
_PENDING = {}  # autograd graph task -> [(name, output index, difference, limit)] to read when its backward ends
_PENDING_LOCK = threading.Lock()
_TOLERANCE = 1e-3


def _fingerprint(tensor):
    """`(norm, u'Xv)` of `tensor` as a matrix of its last axis, in float32, on its device."""
    if tensor.numel() == 0:  # no value to differ (an empty cache, an axis of size 0): as a tensor of zeros
        return torch.zeros(2, device=tensor.device)
    matrix = tensor.detach().float().reshape(-1, tensor.shape[-1] if tensor.dim() else 1)
    key = (matrix.shape[0], matrix.shape[1], matrix.device)
    if key not in _PROJECTIONS:
        if len(_PROJECTIONS) >= _PROJECTIONS_KEPT:  # shapes that change every step (sequence lengths)
            _PROJECTIONS.clear()
        generator = torch.Generator().manual_seed(1234)  # a generator of its own: no global state moves
        left = torch.rand(matrix.shape[0], generator=generator) * 2 - 1
        right = torch.rand(matrix.shape[1], generator=generator) * 2 - 1
        _PROJECTIONS[key] = (left.to(matrix.device), right.to(matrix.device))
    left, right = _PROJECTIONS[key]
    return torch.stack([torch.linalg.vector_norm(matrix), left @ (matrix @ right)])


class _RecomputedValues:
    """The forward's fingerprints of a call's outputs, which its recompute's must equal."""

    def __init__(self, name):
        self._name = name
        self._expected = None

    def see(self, outputs):
        leaves = [x for x in keras.tree.flatten(outputs) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        with torch.no_grad():
            fingerprints = [_fingerprint(x) for x in leaves]
        if self._expected is None:  # the forward
            self._expected = fingerprints
            return
        with torch.no_grad():
            for index, (before, after) in enumerate(zip(self._expected, fingerprints)):
                _defer_check(self._name, f"output {index}", (after[1] - before[1]).abs(), _TOLERANCE * before[0] + 1e-6)


def _defer_check(name, what, difference, limit):
    """Reads `difference <= limit` when the running backward ends (NOTE [ the recompute check on PyTorch ])."""
    task = torch._C._current_graph_task_id()
    with _PENDING_LOCK:
        pending = _PENDING.get(task)
        if pending is None:
            pending = _PENDING[task] = []
            if task != -1:
                torch.autograd.Variable._execution_engine.queue_callback(lambda: _read_checks(task))
        pending.append((name, what, difference, limit))
    if task == -1:  # not inside a backward (an unpack called by hand): read it now
        _read_checks(task)


def _read_checks(task):
    with _PENDING_LOCK:
        pending = _PENDING.pop(task, [])
    if not pending:
        return
    device = pending[0][2].device  # one read for all of them (units on other devices copy theirs over)
    exceeded = torch.stack([(difference > limit).to(device) for _, _, difference, limit in pending]).tolist()
    for (name, what, difference, _), bad in zip(pending, exceeded):
        if bad:
            raise RecomputeError(
                f"keras_recompute: the recompute of {name} gave {what} values that differ from its "
                f"forward's (a fingerprint moved by {float(difference):.3g}). A recomputed call must compute the "
                "same function of its inputs each time: no Python branch on state the call changes, no random "
                "op outside Keras's random layers and torch's generator. Pass check=False to recompute_grad to "
                "skip this check."
            )


def _offloaded(name):
    """Saved-tensor hooks that keep each saved tensor in host memory until it is unpacked (NOTE [ offload ]).

    The copy loses autograd's check that a saved tensor was not written in
    place before the backward, so the hooks make it themselves (NOTE [ in-place
    writes to what a recompute saves ]).
    """

    def pack(tensor):
        pinned = tensor.device.type == "cuda"
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
        host.copy_(tensor, non_blocking=pinned)
        copied = None
        if pinned:  # the copy back may be made on another stream (the backward's): it waits for this one
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(tensor.device))
        return tensor.device, host, copied, _Saved(tensor)

    def unpack(packed):
        device, host, copied, saved = packed
        saved.check(name, "an input of")
        if copied is not None:
            torch.cuda.current_stream(device).wait_event(copied)
        return host.to(device, non_blocking=host.is_pinned())

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


# NOTE [ in-place writes to what a recompute saves ]
# Autograd refuses a backward that needs a tensor written in place after an op
# saved it ("one of the variables needed for gradient computation has been
# modified by an inplace operation"): its gradient would be computed from the
# written value. Under torch's checkpoint that check is lost: the forward saves
# nothing (a handle each), and the recompute saves through hooks that keep the
# tensor without its version. A call that saves a tensor and then writes it in
# place (`y = block(h); h.add_(1)` inside one recomputed graph piece) gave no
# error and a gradient 0.53 off normwise, where the plain model raises. So
# around the checkpoint's own hooks, ours note each saved tensor's version
# counter: in the forward, with a weak reference to the tensor (a write after
# the forward, outside the call, shows in it while the tensor lives); in the
# recompute, which makes the same writes in the same order as the forward,
# the version each recomputed tensor had when it was saved. When the backward
# unpacks it, a version that moved since raises `RecomputeError` (a
# RuntimeError, as autograd's) naming the unit, where the plain model raises.
# The checkpoint hands back the recomputed tensors in the order they were
# saved (its own matching rule), so the k-th of the forward is the k-th of the
# recompute. `offload=True` copies the inputs the checkpoint saves to host
# memory, which loses the same check for them: its hooks make it too.


class _Saved:
    """A saved tensor's version counter when it was saved, and a weak reference to the tensor."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor):
        self.tensor = weakref.ref(tensor)
        self.version = tensor._version

    def check(self, name, what):
        """Raises `RecomputeError` if the tensor, while it lives, was written in place since it was saved."""
        tensor = self.tensor()
        if tensor is not None:
            _check_version(name, what, self.version, tensor._version)


def _check_version(name, what, saved, now):
    if now != saved:
        raise RecomputeError(
            f"keras_recompute: a tensor the backward of {name} needs ({what} it, saved at version {saved}) was "
            f"modified by an in-place operation after it was saved (now at version {now}). The same model "
            "without recompute raises too: torch's 'one of the variables needed for gradient computation has "
            "been modified by an inplace operation'. Write that operation out of place (h = h + 1 for "
            "h.add_(1), torch.relu(h) for torch.relu_(h))."
        )


class _SavedVersions:
    """Autograd's in-place check for one recomputed call (NOTE [ in-place writes to what a recompute saves ]).

    `forward()` and `recompute()` are contexts for `context_fn`: each puts
    saved-tensor hooks around the checkpoint's own.
    """

    def __init__(self, name):
        self._name = name
        self._forward = []  # `_Saved` of each tensor the forward saved, in order
        self._recomputed = []  # the version of each tensor the recompute saved, when it saved it

    def forward(self):
        return _AroundSavedTensors(self._pack_forward, self._unpack)

    def recompute(self):
        return _AroundSavedTensors(self._pack_recomputed, lambda inner, outer: outer(inner), self._recomputed.clear)

    def _pack_forward(self, tensor, outer):
        self._forward.append(_Saved(tensor))
        return len(self._forward) - 1, outer(tensor)

    def _pack_recomputed(self, tensor, outer):
        self._recomputed.append(tensor._version)
        return outer(tensor)

    def _unpack(self, packed, outer):
        index, inner = packed
        value = outer(inner)  # the first unpack runs the recompute
        self._forward[index].check(self._name, "made inside")
        if index < len(self._recomputed):
            _check_version(self._name, "made inside", self._recomputed[index], value._version)
        return value


class _AroundSavedTensors:
    """Saved-tensor hooks that wrap the ones active when entered: `pack(tensor, outer_pack)`, `unpack(packed, outer_unpack)`."""

    def __init__(self, pack, unpack, on_enter=None):
        self._pack, self._unpack, self._on_enter = pack, unpack, on_enter
        self._hooks = None

    def __enter__(self):
        if self._on_enter is not None:
            self._on_enter()
        outer_pack, outer_unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda tensor: self._pack(tensor, outer_pack), lambda packed: self._unpack(packed, outer_unpack)
        )
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info):
        hooks, self._hooks = self._hooks, None
        return hooks.__exit__(*exc_info)


def allocator_peak(reset=False):
    """The peak bytes CUDA's caching allocator has held (since the last reset); None on a CPU (no figures).

    With `reset`, the peak is set back to what it holds now first.
    """
    if not torch.cuda.is_available():
        return None
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.max_memory_allocated()


def allocation_trace(step, marks=()):
    """Runs `step()` under the profiler; `(running, at_marks)`: what it allocated, in order.

    `running` is the running sum of the bytes allocated and freed on the
    device the model runs on, one entry per allocation or free, in the order
    they happened (NOTE [ measuring a unit on PyTorch ]); `at_marks[name]` is
    the index in `running` where the `record_function(name)` region named
    `name` began, for each of `marks` that ran. Memory allocated before the
    step is not in it, nor is its free (NOTE [ frees the profiler misreads ]).
    """
    from torch.profiler import ProfilerActivity, profile

    device = str(_device()).split(":")[0]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as profiled:
        step()
    # Each allocation's own record (by when it happened), not the ops' self usage: an op's net is
    # counted at its start, before its children allocate, and read a step's peak up to a tensor short.
    records, starts, pending = [], {}, list(profiled.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.name in marks:
            starts[event.name] = min(starts.get(event.name, event.start_time_ns), event.start_time_ns)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == device:
            records.append((event.start_time_ns, fields.id, fields.ptr, fields.alloc_size))
    records.sort()
    times, sizes, allocated = [], [], {}
    for when, _, pointer, size in records:
        if size > 0:
            allocated[pointer] = size
        elif allocated.pop(pointer, None) is None:
            continue  # memory from before the step (NOTE [ frees the profiler misreads ])
        times.append(when)
        sizes.append(size)
    running = list(itertools.accumulate(sizes))
    return running, {name: bisect.bisect_left(times, when) for name, when in starts.items()}


# NOTE [ frees the profiler misreads ]
# The profiler learns a free's size from the allocator. PyTorch's CPU
# allocator keeps each block's size in a table it fills only while a profiler
# records memory, and empties only at a free seen while one records: a block
# allocated under one profiler and freed outside any stays in the table, and
# when another block later gets its address outside a profiler and is freed
# under one, the free is reported with the old block's size (torch 2.13: 32 KB
# blocks freed under a profiler, read as 64 KB ones from an earlier profile;
# measuring units profiles again and again in one process). A free of memory
# from before the step is reported as such a wrong size or not at all. So
# frees are paired with the step's own allocations by address, and a free
# with none (the step freeing what was there before it) is left out: the
# trace starts from the step's own allocations, as it did when the size was
# unknown. (Keras's optimizer steps in the suite read 0.66x of the model's
# weights low, or a third high, depending on the tests that ran before.)


def offload_frees_device_memory():
    """Whether offloaded bytes leave the device's memory: not on a CPU, whose host memory it is."""
    return str(_device()).split(":")[0] != "cpu"


# NOTE [ save_dots on PyTorch ]
# The forward keeps the outputs of the matmuls without a batch dimension, as
# JAX's `dots_with_no_batch_dims_saveable`: a Dense kernel's `mm`/`addmm`,
# and the `bmm` of batch 1 that `einsum` makes of an EinsumDense projection;
# the recompute, which runs the call again, is handed each of them in turn
# instead of running that matmul. The scores of attention are a `bmm` over
# batch and heads (or a fused attention op): recomputed. Both run as dispatch
# modes below autograd, so the recompute's autograd records the same nodes
# and saved tensors as the forward's, as torch's selective checkpoint does.
#
# Why not torch's selective checkpoint itself: it sees ops through a Python
# dispatch mode over the whole call, and such a mode costs host time on every
# op it sees, whatever it does with it. On a 12-block encoder small enough
# that a step is all host time (hidden 32, seq 8, batch 2,
# `mixed_bfloat16`, CPU), a step took 98 ms under "full", 156 ms under
# "save_dots" with torch's selective checkpoint, and 153 ms with a mode that
# only calls each op, against 112 ms with no mode. A GPU step of Keras on
# PyTorch in bfloat16 is host-bound the same way (BERT-base, seq 512:
# "save_dots" 2.47x the plain step, "full" 1.80x). So our modes are entered
# only around the calls of Keras's matmul functions (`_MATMUL_FUNCTIONS` of
# its torch backend, which Dense, EinsumDense and keras-hub's layers call):
# the ops the policy can mark, a few per call, not the hundreds of other ops
# of a block. (Torch's modes cannot be entered call by call: entering its
# recompute mode resets its count of the ops handed back, torch 2.13.) The
# forward and the recompute run the same Python, so the same calls enter the
# modes in the same order and the recompute is handed what the forward kept,
# in order.
#
# What is kept is a copy of the matmul's output, not the output itself: the
# call may write to the output in place after (`h = dense(x); h += x` on
# PyTorch, with a Dense without bias), and the recompute must get what the
# matmul gave. Torch's selective checkpoint keeps the output itself and
# checks its version counter, which does not see such a write: `matmul` and
# `einsum` return a reshape of the `mm`/`bmm` output (`_unsafe_view`), whose
# version counter is its own. There the recompute got the written value and
# wrote it again, and the gradient of the next layer's kernel came out wrong
# by 0.38 normwise, with no error (torch 2.13;
# `test_save_dots_runs_a_call_that_writes_a_matmul_output_in_place`). The
# copy costs one copy kernel per kept output, and no memory after the
# forward. A matmul a unit makes outside Keras's
# functions (a raw `torch.nn.Linear` inside a layer) is recomputed, as under
# "full".
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
_MATMUL_FUNCTIONS = ("matmul", "einsum", "dot", "tensordot")


def _kept_by_save_dots(op, args):
    """Whether "save_dots" keeps the output of ATen `op` on `args`: a matmul without a batch dimension."""
    return op in _MATMULS or (op is torch.ops.aten.bmm.default and args[0].shape[0] == 1)


class _KeepingDots(TorchDispatchMode):
    """The forward's mode: runs each op, and appends a copy of each output `_kept_by_save_dots` marks to `cache`
    (and, given `seen`, the fingerprints of the op's inputs to it: NOTE [ the recompute check under save_dots ] in
    `backends/tensorflow.py`)."""

    def __init__(self, cache, seen=None):
        super().__init__()
        self.cache = cache
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _kept_by_save_dots(func, args):
            self.cache.append(out.detach().clone())  # a copy: the call may write to `out` in place after
            if self.seen is not None:
                with torch.no_grad():
                    self.seen.append([_fingerprint(x) for x in _matmul_operands(args)])
        return out


def _matmul_operands(args):
    """The floating-point tensors among a matmul op's arguments (its operands, and `addmm`'s bias) that the
    recompute computes again: not a weight as it is stored, which it reads as the forward read it."""
    return [x for x in args if isinstance(x, torch.Tensor) and x.is_floating_point() and not _a_stored_weight(x)]


# Autograd's nodes of a cast and of a view: what lies between a weight and a matmul reading it under mixed precision.
_CAST_OR_VIEW = frozenset({
    "ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0", "TBackward0",
    "TransposeBackward0", "PermuteBackward0", "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
    "SqueezeBackward1",
})


def _a_stored_weight(tensor):
    """Whether `tensor` is a weight as it is stored (a `Parameter`, or a view of one), or a cast or view of one made
    in this call: Keras's `mixed_bfloat16` reads each kernel as a cast of it, made again by the recompute from the
    same `Parameter`. Such a tensor differs from the forward's only if the weight changed between the forward and
    the backward, which is read so for every weight as stored; its fingerprints were half the check's ops under
    `"save_dots"` in bfloat16 (`benchmarks/host_overhead.py`). Found through autograd's graph: each node between it
    and the weight a cast or a view of one input."""
    if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
        return True
    node = tensor.grad_fn
    while node is not None and type(node).__name__ in _CAST_OR_VIEW:
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
        if type(node).__name__ == "AccumulateGrad":
            return isinstance(node.variable, torch.nn.Parameter)
    return False


class _KeptDots(TorchDispatchMode):
    """The recompute's mode: hands back what `_KeepingDots` kept, in order, for the ops it marked; runs the others."""

    def __init__(self, cache, seen=None, name=None):
        super().__init__()
        self.cache = cache
        self.seen = seen
        self.name = name
        self.position = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _kept_by_save_dots(func, args):
            return func(*args, **(kwargs or {}))
        if self.position >= len(self.cache) or self.cache[self.position] is None:
            raise RecomputeError(
                "keras_recompute: the recompute of a policy='save_dots' call ran more weight matmuls than its "
                "forward, or its backward ran twice (retain_graph). A recomputed call must compute the same "
                "function of its inputs each time; for a second backward use policy='full'."
            )
        kept = self.cache[self.position]
        self.cache[self.position] = None  # handed over: the backward holds it as long as it needs it
        if self.seen is not None:  # the op is fed what the forward fed it (NOTE [ the recompute check under save_dots ])
            what = (
                f'the inputs of its weight matmul {self.position} (kept under policy="save_dots": its kept output '
                "would be differentiated at other inputs)"
            )
            with torch.no_grad():
                for before, x in zip(self.seen[self.position], _matmul_operands(args)):
                    after = _fingerprint(x)
                    _defer_check(self.name, what, (after[1] - before[1]).abs(), _TOLERANCE * before[0] + 1e-6)
            self.seen[self.position] = None
        self.position += 1
        return kept


class _InMatmuls:
    """Within it, Keras's matmul functions, called in this thread, run inside `mode` (NOTE [ save_dots on PyTorch ])."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        _install_matmul_functions()
        _matmul_modes().append(self.mode)
        return self

    def __exit__(self, *exc_info):
        popped = _matmul_modes().pop()
        assert popped is self.mode, "keras_recompute: the matmul modes of a thread were left out of order"


def _matmul_modes():
    if not hasattr(_THREADS, "matmul_modes"):
        _THREADS.matmul_modes = []
    return _THREADS.matmul_modes


def _install_matmul_functions():
    """Replaces Keras's torch matmul functions, once and for good, by ones that enter the thread's modes."""
    from keras.src.backend.torch import numpy as torch_numpy

    for name in _MATMUL_FUNCTIONS:
        function = getattr(torch_numpy, name)
        if not getattr(function, "_keras_recompute_original", None):
            setattr(torch_numpy, name, _in_matmul_modes(function))


def _in_matmul_modes(original):
    def run(*args, **kwargs):
        modes = _matmul_modes()
        if not modes or getattr(_THREADS, "in_matmul", False) or _batched(original.__name__, args):
            return original(*args, **kwargs)  # nothing to keep, or a matmul function inside another: entered once
        _THREADS.in_matmul = True
        try:
            with contextlib.ExitStack() as stack:
                for mode in modes:  # outermost first, as the whole call's modes would stack
                    stack.enter_context(mode)
                return original(*args, **kwargs)
        finally:
            _THREADS.in_matmul = False

    run._keras_recompute_original = original
    run.__name__, run.__qualname__, run.__doc__ = original.__name__, original.__qualname__, original.__doc__
    return run


def _batched(name, args):
    """Whether a call of Keras's matmul function `name` is a matmul over a batch dimension (kept by no policy).

    As `_kept_by_save_dots`, but before the call, from its arguments: an einsum whose
    two operands share an index that its output keeps (attention's scores
    and weighted sum), a `matmul` of two operands of 3 or more dimensions. A
    batched matmul is not entered in the modes: they would only cost host
    time on every op of it (NOTE [ save_dots on PyTorch ]).
    """
    if name == "einsum" and len(args) == 3 and isinstance(args[0], str):
        inputs, _, output = args[0].replace(" ", "").partition("->")
        operands = inputs.split(",")
        if len(operands) != 2 or not output:
            return False
        shared = set(operands[0]) & set(operands[1]) & set(output)
        return bool(shared - {"."}) or all("..." in o for o in (operands[0], operands[1], output))
    if name == "matmul" and len(args) == 2:
        return all(len(getattr(a, "shape", ())) >= 3 for a in args)
    return False


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


class _Contexts:
    """Several contexts as one, entered in order (`context_fn` returns one for each run)."""

    def __init__(self, *contexts):
        self._stack = contextlib.ExitStack()
        self._contexts = contexts

    def __enter__(self):
        for context in self._contexts:
            self._stack.enter_context(context)
        return self

    def __exit__(self, *exc_info):
        return self._stack.__exit__(*exc_info)


class _Fresh:
    """A context made afresh by `factory()` each time it is entered.

    Torch enters a call's recompute context once per recompute, and a second
    backward through the same graph (`retain_graph=True`) recomputes again: a
    generator's context (`_DropoutTape.replaying`) can be entered only once
    (an `AttributeError` from contextlib the second time, found 2026-12-04).
    """

    def __init__(self, factory):
        self._factory = factory
        self._entered = []

    def __enter__(self):
        context = self._factory()
        self._entered.append(context)
        return context.__enter__()

    def __exit__(self, *exc_info):
        return self._entered.pop().__exit__(*exc_info)



# NOTE [ dropout masks under the policies ]
# On the CPU, torch draws dropout's random bits slowly: `bernoulli_` on a
# B x H x S x S attention tensor took five times the softmax and the score
# matmul together (2 x 12 x 512 x 512: 70 ms against 6.5 and 8 ms). A
# recompute that draws the masks again pays that once more. Under
# `"save_dots"` and for the cores of `"attention_core"` (NOTE [ policies ]),
# which trade memory for time, the forward keeps each dropout's keep mask, a
# bit an element (1/32 of the float tensor it masks), and the recompute
# builds the same noise from it instead of drawing. While such a call runs,
# Keras's dropout on torch runs as `_dropout`: the same ops in the same
# order (the fast path is `F.dropout`, whose CPU kernel is `empty_like`,
# `bernoulli_(1 - p)`, `div_(1 - p)` and a product; `_dropout_replayable`
# checks once that they agree bit for bit, and else nothing is replaced), so
# the forward draws what the plain call draws, and the recompute computes the
# same values from the kept bits. Keras's seed generators advance as they
# would. The fast path draws from torch's global generator; if anything else
# in the call draws from it too, replaying the dropouts would shift that
# draw, so the tape checks the generator's state around each draw and, if it
# moved otherwise, the recompute draws everything again (torch restores the
# generator for it: `preserve_rng_state`). Seeded dropouts (Keras's slow path:
# `torch.bernoulli` with a generator of their own) are kept on every device,
# by the same code. Unseeded ones are kept on the CPU only: on an accelerator
# `F.dropout` is a fused kernel (`native_dropout`) whose bits other ops do not
# reproduce, so there they draw again, from the generator state torch's
# checkpoint restores for the recompute (as under `"full"`).
# Keras's function is replaced once, for good; it acts as before when no such
# call runs in its thread.
#
# NOTE [ the one-time check touches no generator ]
# `_dropout_replayable` draws with torch's default CPU generator inside
# `fork_rng(devices=[])`, which restores that generator only. It must seed
# that generator alone (`torch.default_generator.manual_seed`): the first
# version called `torch.manual_seed`, which also seeds every CUDA generator,
# so on a GPU the first recompute under a policy reset CUDA's generator and
# every dropout after it drew other masks than the plain model's (a different
# model, silently; on the CPU nothing showed, as the CPU state was restored).
_THREADS = threading.local()  # .active: (tape, mode) of the calls running now in the thread, outermost first
_BIT_WEIGHTS = {}  # device -> 1, 2, ..., 128 as uint8 there: the bits of a packed byte
_MEASURING = []  # lists the bytes of the masks recorded are added to (`measure_unit`)


class _DropoutTape:
    """The keep masks one recomputed call's forward drew, packed, for its recompute."""

    def __init__(self):
        self.masks = []
        self.replayable = True
        self.expected_rng = None
        self.position = 0

    @contextlib.contextmanager
    def recording(self):
        del self.masks[:]
        self.replayable = True
        self.expected_rng = torch.get_rng_state()
        with _active(self, "record"):
            yield
        self._check_rng()

    @contextlib.contextmanager
    def replaying(self):
        self.position = 0
        with _active(self, "replay" if self.replayable else "draw"):
            yield

    def _check_rng(self):
        if self.replayable and not torch.equal(torch.get_rng_state(), self.expected_rng):
            self.replayable = False  # something else drew from torch's generator

    def next_mask(self, shape):
        if self.position >= len(self.masks):
            raise RecomputeError(
                "keras_recompute: the recompute of a call ran more dropouts than its forward. A recomputed "
                "call must compute the same function of its inputs each time."
            )
        packed, count = self.masks[self.position]
        self.position += 1
        return _unpack(packed, count).reshape(shape)


@contextlib.contextmanager
def _active(tape, mode):
    """Within it, `tape` records or replays the dropouts of its thread (Keras's function is replaced for good)."""
    from keras.src.backend.torch import random as torch_random

    if torch_random.dropout is not _dropout:
        _dropout.original = torch_random.dropout
        torch_random.dropout = _dropout
    active = _active_calls()
    active.append((tape, mode))
    try:
        yield
    finally:
        active.pop()


def _active_calls():
    if not hasattr(_THREADS, "active"):
        _THREADS.active = []
    return _THREADS.active


def _dropout(inputs, rate, noise_shape=None, seed=None):
    """Keras's torch dropout, its keep masks recorded or replayed (NOTE [ dropout masks under the policies ])."""
    from keras.src.backend.torch import random as torch_random
    from keras.src.random.seed_generator import SeedGenerator

    active = _active_calls()
    if not active or not isinstance(rate, float) or rate in (0.0, 1.0):
        return _dropout.original(inputs, rate, noise_shape=noise_shape, seed=seed)
    seeded = (seed is not None and not (isinstance(seed, SeedGenerator) and seed._initial_seed is None)) or (
        noise_shape is not None
    )
    if not seeded and inputs.device.type != "cpu":  # F.dropout's fused kernel: drawn again in the recompute
        return _dropout.original(inputs, rate, noise_shape=noise_shape, seed=seed)
    keep_prob = 1.0 - rate
    shape = torch_random._get_concrete_noise_shape(inputs, noise_shape) if seeded else inputs.shape
    source = next(((tape, mode) for tape, mode in active if mode != "record"), None)
    recorders = [tape for tape, mode in active if mode == "record"]
    if source is not None and source[1] == "replay":
        with _disable_current_modes():  # bookkeeping: the selective checkpoint's mode sees only the call's ops
            mask = source[0].next_mask(shape)
        if seeded:
            torch_random.torch_seed_generator(seed)  # the seed generator advances as in the forward
    elif seeded:
        generator = torch_random.torch_seed_generator(seed)
        mask = torch.bernoulli(torch.full(shape, keep_prob, device=inputs.device), generator=generator).bool()
    else:  # F.dropout's ops on the CPU, each as it runs them
        for tape in recorders:
            tape._check_rng()
        noise = torch.empty_like(inputs)
        noise.bernoulli_(keep_prob)
        noise.div_(keep_prob)
        if recorders:
            after = torch.get_rng_state()
            for tape in recorders:
                tape.expected_rng = after
            with _disable_current_modes():
                mask = noise.ne(0)
    if recorders:
        with _disable_current_modes():
            packed = _pack(mask)
        for tape in recorders:
            tape.masks.append((packed, mask.numel()))
        for sizes in _MEASURING:
            sizes.extend([packed.nbytes] * len(recorders))
    if seeded:
        return torch.where(torch.broadcast_to(mask, inputs.shape), inputs / keep_prob, torch.zeros_like(inputs))
    if source is not None and source[1] == "replay":
        with _disable_current_modes():
            noise = mask.to(inputs.dtype)  # what bernoulli_ wrote: ones and zeros
            noise.div_(keep_prob)
    return inputs * noise


def _bit_weights(device):
    if device not in _BIT_WEIGHTS:
        _BIT_WEIGHTS[device] = (2 ** torch.arange(8, device=device)).to(torch.uint8)
    return _BIT_WEIGHTS[device]


def _pack(mask):
    flat = mask.reshape(-1)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8).view(torch.uint8) * _bit_weights(flat.device)).sum(1, dtype=torch.uint8)


def _unpack(packed, count):
    return packed.unsqueeze(1).bitwise_and(_bit_weights(packed.device)).ne(0).reshape(-1)[:count]


def _dropout_replayable():
    """Whether `_dropout`'s ops draw and compute what `F.dropout` does on the CPU (checked once).

    NOTE [ the one-time check touches no generator ]: only the default CPU
    generator is seeded, and `fork_rng` restores it.
    """
    if not hasattr(_dropout_replayable, "result"):
        x = torch.linspace(-1.0, 1.0, 999)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(1234)
            plain = torch.nn.functional.dropout(x, p=0.3, training=True)
            torch.default_generator.manual_seed(1234)
            noise = torch.empty_like(x)
            noise.bernoulli_(0.7)
            noise.div_(0.7)
        rebuilt = _unpack(_pack(noise.ne(0)), x.numel()).to(x.dtype)
        rebuilt.div_(0.7)
        _dropout_replayable.result = bool(torch.equal(plain, x * noise) and torch.equal(plain, x * rebuilt))
    return _dropout_replayable.result


# NOTE [ measuring a unit on PyTorch ]
# Saved-tensor hooks see every tensor autograd keeps for the backward, and
# torch's checkpoint saves the call's inputs under them (the recomputed
# internals go to its own hooks, nested inside ours). Counted once per storage,
# without the weights and the call's inputs (held anyway), they are what the
# unit keeps. Under `"save_dots"` the unit also keeps copies of its weight
# matmuls' outputs, in a cache the hooks do not see: the forward's own mode
# (`_KeepingDots`, entered as the call enters it) fills one, whose bytes are
# added; and the policies keep packed dropout masks (NOTE [ dropout masks under the
# policies ]), which `_dropout` reports. Its forward and backward is what
# `_memory` times, and then runs once more under the profiler (`step_peaks`):
# the highest bytes its forward held, and its backward, read from the
# allocations in the order they happened (`allocation_trace`; on a GPU, the
# allocator's peak between marks, since autograd's device thread allocates
# there and the profiler records only the thread it started in). Those are the
# unit's forward and transient (NOTE [ the peak of a plan ] in `_budget`):
# measured, not counted in largest tensors, which no one count matched (the
# masked softmax of keras-hub Gemma holds four tensors of its scores' size in
# its forward; Keras's seeded dropout makes five in its backward).


FORWARD_MARK = "keras_recompute: a measured unit's forward"
BACKWARD_MARK = "keras_recompute: a measured unit's backward"
_MARKS = []  # called with each mark as a measured step passes it (`None`: at its end), where step_peaks listens


def _autograd_grad(*args, **kwargs):
    """`torch.autograd.grad`, unwrapped: a measured step's backward runs in the caller's thread, as autograd runs a
    CPU's, even where a test runs every other backward in a thread of its own (the profiler records only the
    allocations of the thread it was started in)."""
    return inspect.unwrap(torch.autograd.grad)(*args, **kwargs)


def _marked(name):
    for listener in _MARKS:
        listener(name)


@contextlib.contextmanager
def _phase(name):
    """A phase of a measured step, marked for the profiler (`allocation_trace`) and for `_cuda_step_peaks`."""
    _marked(name)
    with torch.profiler.record_function(name):
        yield


def step_peaks(step):
    """What a measured unit's `step` (from `measure_unit`) holds, from its allocations (NOTE [ measuring a unit on PyTorch ]).

    Returns:
        `(forward, after_forward, backward)`, in bytes above what the step
        held as its forward began: the highest in its forward, what was alive
        when the forward returned, the highest in its backward.
    """
    if torch.cuda.is_available() and str(_device()).startswith("cuda"):
        return _cuda_step_peaks(step)
    running, marks = allocation_trace(step, (FORWARD_MARK, BACKWARD_MARK))
    if FORWARD_MARK not in marks or BACKWARD_MARK not in marks:
        raise RuntimeError("keras_recompute: the profiler recorded no measured forward and backward")
    begin, split = marks[FORWARD_MARK], marks[BACKWARD_MARK]
    base = running[begin - 1] if begin else 0
    after = running[split - 1] if split else 0
    forward = max(running[begin:split], default=after)
    backward = max(running[split:], default=after)
    return forward - base, after - base, backward - base


def loss_peak(outputs, model=None):
    """What a loss's backward holds on `outputs` (a model's, from a forward without gradients), in bytes above them.

    `model` is not read: Keras's PyTorch trainer holds the outputs for its metrics as the measure does.

    A stand-in for the user's loss, as on JAX (NOTE [ checking a plan on JAX ]): Keras's sparse
    cross-entropy over the last axis where it has classes, else a square's, and its gradient with
    respect to the outputs, measured as `step_peaks` measures a unit's backward.
    """
    leaves = [o for o in keras.tree.flatten(outputs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    copies = [o.detach().clone().requires_grad_(True) for o in leaves]

    def step():
        with _phase(FORWARD_MARK):
            pass
        with _phase(BACKWARD_MARK):
            loss = 0
            for output in copies:
                output = output.float()
                if output.ndim >= 2 and output.shape[-1] > 1:
                    labels = output.detach().argmax(-1)
                    loss = loss + keras.losses.sparse_categorical_crossentropy(labels, output, from_logits=True).sum()
                else:
                    loss = loss + 0.5 * (output * output).sum()
            if copies:
                _autograd_grad(loss, copies)
        _marked(None)

    return step_peaks(step)[2]


def _cuda_step_peaks(step):
    """`step_peaks` from CUDA's allocator: its peak, reset at each mark (autograd's device thread allocates too)."""
    _blas_workspaces(str(_device()))
    seen = {}

    def listen(name):
        torch.cuda.synchronize()
        seen[name] = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()

    _MARKS.append(listen)
    try:
        step()
    finally:
        _MARKS.remove(listen)
    base = seen[FORWARD_MARK][0]
    after, forward = seen[BACKWARD_MARK]
    backward = seen[None][1]
    return forward - base, after - base, backward - base


@functools.lru_cache(maxsize=None)
def _blas_workspaces(device):
    """Has cuBLAS make its workspaces on `device` before anything is measured there, once.

    PyTorch allocates cuBLAS's workspace (MiBs; most on a Hopper GPU) through its caching
    allocator at a thread's first matrix product, and autograd's device thread
    is a thread of its own: the first unit measured in a process counted its
    forward's and its backward's workspaces, which every later step has
    already. Likely why `tests/test_fit.py`'s batch fit found no answer for
    "none" when it ran first in a fresh process on the H200 (2026-11-27; it
    passed in a worker that had run other tests), not yet checked there.
    """
    for dtype in (torch.float32, torch.bfloat16):
        operand = torch.ones((16, 16), device=device, dtype=dtype, requires_grad=True)
        torch.autograd.grad((operand @ operand).sum(), operand)
    torch.cuda.synchronize()


def _device():
    from keras.src.backend.torch.core import get_device

    return get_device()


def measure_unit(layer, args, kwargs, policy, timed=True, execution="compiled", differentiated=True):
    """What one call of `layer` keeps for its backward, and a step of it to time.

    Args:
        layer: the layer, its `call` set to the option being measured.
        args: positional arguments of a recorded call.
        kwargs: keyword arguments of it.
        policy: the option's name: `"save_dots"` adds the matmul outputs its
            checkpoint keeps.
        timed: whether to return a step (else None).
        execution: accepted for every backend: PyTorch runs eagerly, and the
            saved-tensor hooks see what its eager step keeps.
        differentiated: whether the floating arguments are differentiated
            (not a whole model's batch: NOTE [ a unit no gradient reaches ]
            in `_memory`).

    Returns:
        `(kept_bytes, largest_bytes, step, read_bytes)`, as on TensorFlow;
        `read_bytes` (what a recompute makes again) is `kept_bytes` here.
    """
    del execution
    weights = [v.value for v in layer.trainable_variables]

    def run(measure):
        flat = keras.tree.flatten((args, kwargs))
        inputs = []
        for index, leaf in enumerate(flat):
            if differentiated and isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                copy = leaf.detach().clone().requires_grad_(True)
                mask = _keras3.get_mask(leaf)
                if mask is not None:
                    _keras3.set_mask(copy, mask)
                flat[index] = copy
                inputs.append(copy)
        call_args, call_kwargs = keras.tree.pack_sequence_as((args, kwargs), flat)
        held = {t.untyped_storage().data_ptr() for t in weights + inputs}
        kept = {}
        saved = []

        def pack(tensor):
            # NOTE [ a measured forward keeps nothing alive ]: the graph holds an index, the list the tensor,
            # until the measure is done. Returned from the hook, the tensor itself would be held by its own
            # grad_fn when it is an op's saved output (the softmax's): a cycle through autograd's C++ graph that
            # Python's gc cannot see and only a backward breaks. This forward has none, so its activations stayed
            # allocated for good: on a GPU, a BERT-base step planned at batch 153 then peaked at 22.1 GB against
            # 14.7 predicted. Held to the end, no two saved tensors share an address (as in a step).
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in held:
                kept[storage.data_ptr()] = storage.nbytes()
            saved.append(tensor)
            return len(saved) - 1

        def unpack(_):
            raise RuntimeError("keras_recompute: a measured forward has no backward")

        dots = []  # what "save_dots" keeps of the matmuls, kept as the policy keeps it
        keeping = _InMatmuls(_KeepingDots(dots)) if measure and policy == _policy.SAVE_DOTS else contextlib.nullcontext()
        masks = []  # the dropout masks a policy keeps (NOTE [ dropout masks under the policies ])
        _MEASURING.append(masks)
        try:
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if measure else contextlib.nullcontext()
            with _phase(FORWARD_MARK), hooks, keeping:
                outputs = layer(*call_args, **call_kwargs)
        finally:
            _MEASURING.remove(masks)
            del saved[:]
        if measure:  # no backward: what the forward keeps is known, and is freed with `outputs`
            sizes = list(kept.values()) + [t.untyped_storage().nbytes() for t in dots] + masks
            return sum(sizes), max(sizes, default=0)
        float_outputs = [o for o in keras.tree.flatten(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
        wanted = [t for t in inputs + weights if t.requires_grad]
        with _phase(BACKWARD_MARK):
            loss = sum(o.float().sum() for o in float_outputs)
            _autograd_grad(loss, wanted, allow_unused=True)
        _marked(None)
        return None

    def step():  # returns once the device has run it (NOTE [ timing a unit on a GPU ] in `_memory`)
        run(measure=False)
        synchronize()

    kept, largest = run(measure=True)
    return kept, largest, step if timed else None, kept


def synchronize():
    """Returns once the device has run what was queued on it: at once on the CPU; a GPU runs kernels after the host
    queues them (NOTE [ timing a unit on a GPU ] in `_memory`)."""
    if str(_device()).startswith("cuda"):
        torch.cuda.synchronize()

