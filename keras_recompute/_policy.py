"""Policies: how much of a unit its forward keeps. The names and their checks live here;
each backend's mechanism for `"save_dots"` lives in that backend's file.

NOTE [ policies ]
`"full"` keeps a unit's inputs and recomputes all of it. The other two keep
more and recompute less; each costs memory where it saves time:
  * `"save_dots"` keeps the outputs of the unit's weight matmuls (Dense,
    EinsumDense, attention projections: a matmul or einsum with a weight and
    no batch dimension, as JAX's `dots_with_no_batch_dims_saveable`) and
    recomputes what lies between them: attention scores, softmax, dropout,
    activations, norms, adds. The matmuls are most of the time of a
    transformer block and a few of its activations; what lies between them is
    the opposite.
  * `"attention_core"` recomputes only the core of each attention layer in the
    unit: scores, mask, softmax, attention dropout and the weighted sum
    (Korthikanti et al. 2022, Megatron-LM's selective recompute). It is a
    choice of *what* to recompute, not a mechanism: the unit runs as the plain
    call, and each attention layer's core method is recomputed as a unit of
    its own with `"full"`, on every backend's usual path.
An attention layer is a layer with a `_compute_attention` method (Keras's and
tf_keras's `MultiHeadAttention` and their subclasses, most of keras-hub's
attention layers, a user's own layer whose core is a method of that name) or
with `pay_attention_to` (bert4keras). Some keras-hub families (Bloom, Falcon,
T5, ESM, SAM, Swin, the vision encoders of PaliGemma and Gemma 3, ...) compute
the core inside their attention layer's `call`, which no method patch can
separate: units of theirs have no core to recompute, and `inline_attention`
names those layers in the error (NOTE [ "auto" under attention_core ] in
`_model`).
"""

import contextlib
import inspect
import threading
import types

from keras_recompute import _context, _patch

FULL = "full"
SAVE_DOTS = "save_dots"
ATTENTION_CORE = "attention_core"
POLICIES = (FULL, SAVE_DOTS, ATTENTION_CORE)

# The method that computes an attention layer's core, by the library that names it so.
_CORE_METHODS = ("_compute_attention", "pay_attention_to")


_STATE = threading.local()


def keeps_dropout_masks(policy):
    """Whether a recomputed call keeps its dropout masks rather than drawing them again.

    The two policies trade memory for time, and keep them where drawing them
    again costs: Keras 3 on PyTorch's CPU, a bit an element (NOTE [ dropout
    masks under the policies ] in `backends/torch.py`), and on TensorFlow, a
    byte an element (NOTE [ dropout masks on TensorFlow under the policies ]
    in `backends/tensorflow.py`), and on JAX, a bit an element (NOTE [ dropout
    masks under the policies on JAX ] in `backends/jax.py`: drawing them again
    was most of the bytes these policies' recompute moved, and on an H200 as
    much time as `"full"`'s). `"full"` keeps the least and draws them again.
    An attention core recomputed under `"attention_core"` is a `"full"` call
    made inside `cores_recomputed`, which keeps them too.
    """
    return policy == SAVE_DOTS or getattr(_STATE, "cores", 0) > 0


# NOTE [ offload ]
# `offload=True` keeps what a recomputed unit's forward keeps for its
# recompute in host memory, and copies it back for the recompute, as
# DeepSpeed's `cpu_checkpointing`, JAX's offloading checkpoint policies and
# torch's `save_on_cpu` do for theirs. Under "full" that is the unit's
# floating-point inputs, which with every unit recomputed are most of what a
# deep model keeps (blocks x batch x seq x hidden). What moves, per backend:
#   * JAX: the custom VJP's residuals that are the call's floating-point
#     inputs (and under "save_dots" every floating-point residual that is not
#     a closed-over value, such as a weight) are placed in host memory
#     (`jax.memory.Space.Host`) by the forward, and placed back on the device
#     by the backward before it waits for the incoming gradient. XLA does the
#     copies, and schedules them.
#   * PyTorch: the inputs torch's checkpoint saves for the recompute go
#     through saved-tensor hooks that copy them to (pinned, when CUDA is
#     there) host memory, and back when the recompute needs them; the copies
#     are asynchronous on the current stream, which orders them with the
#     kernels that make and use the tensors, and the copy back waits for an
#     event recorded after the copy out (the backward may run on another
#     stream). Copies on the compute stream do not overlap its kernels: a
#     side stream and a prefetch of the previous unit's inputs would, and are
#     not done (unmeasured without a GPU). What "save_dots" keeps and the
#     packed dropout masks stay on the device.
#   * TensorFlow: not offered (`ValueError`).
# On a CPU host memory is the device's memory: the same code runs (PyTorch
# copies into another CPU tensor; XLA's CPU compiler drops the placement),
# and nothing is saved, so the planner counts offloaded bytes as device bytes
# there (`offload_frees_device_memory` in each backend). Values never change:
# a copy there and back is the same tensor.


def offload_refused_message(name, backend):
    return (
        f"keras_recompute: {name} was decorated with offload=True, which keeps what a recomputed call saves in "
        f"host memory on Keras 3's JAX and PyTorch backends; it runs on {backend!r}, which has no offload path. "
        "Drop offload=True, or run it with KERAS_BACKEND=jax or torch."
    )


def check(policy, where):
    """Raises ValueError unless `policy` names a policy; `where` names the function it was passed to."""
    if not (isinstance(policy, str) and policy in POLICIES):
        raise ValueError(
            f"keras_recompute: {where}(policy=...) got {policy!r}; valid policies are {list(POLICIES)}."
        )


def core_method(layer):
    """The name of `layer`'s attention-core method, or None if it is not an attention layer we know."""
    for name in _CORE_METHODS:
        if callable(getattr(type(layer), name, None)):
            return name
    return None


def attention_layers(root):
    """`root` and every layer under it that has an attention core, parents first."""
    return [layer for layer in [root] + _context.sublayers(root) if core_method(layer) is not None]


def inline_attention(roots):
    """The class names of the layers in `roots` (and under them) that are named as attention layers but have no
    core method we know: their core runs inside their `call` (keras-hub's Falcon, T5, ...), or they are not
    attention at all (a mask layer, excluded by name)."""
    names = []
    for root in roots:
        if not _context.is_layer(root):
            continue
        for layer in [root] + _context.sublayers(root):
            name = type(layer).__name__
            inline = "attention" in name.lower() and "mask" not in name.lower() and core_method(layer) is None
            if inline and name not in names:
                names.append(name)
    return names


def no_attention_message(names, layers=(), others=()):
    """The error of `"attention_core"` on units without an attention layer we know.

    Args:
        names: how to name those units.
        layers: the units themselves (layers, or a call's owner), to name the attention-like layers in them.
        others: the names of the chosen units that do hold an attention layer we know, if any.
    """
    inline = inline_attention(layers)
    held = (
        f" They hold {', '.join(inline)}, which {'computes its' if len(inline) == 1 else 'compute their'} core "
        "inside `call`, not in a method of its own: that core cannot be recomputed alone."
        if inline else ""
    )
    only = (
        f" blocks={list(others)!r} recomputes the cores of the units that hold one, and those units alone;"
        if others else ""
    )
    return (
        "keras_recompute: policy='attention_core' recomputes the core of the attention layers inside a unit, and "
        f"{', '.join(repr(n) for n in names)} {'contain' if len(names) > 1 else 'contains'} none that "
        "keras_recompute knows: a layer with a `_compute_attention` method (Keras's MultiHeadAttention and its "
        f"subclasses, most of keras-hub's attention layers) or bert4keras's `pay_attention_to`.{held} Use "
        "policy='full' or 'save_dots' for these units, or budget=, whose plan gives each unit a policy it can "
        f"take;{only} or, in an attention layer of your own, compute its core (scores, softmax, dropout, weighted "
        "sum) in a method named `_compute_attention`."
    )


@contextlib.contextmanager
def cores_recomputed(layers, recompute, check, offload=False):
    """Within it, each layer's attention core is recomputed: its instance's method is decorated.

    Args:
        layers: attention layers (see `attention_layers`).
        recompute: the `recompute_grad` decorator (passed in: the decorator imports this module).
        check: the `check` option of the unit.
        offload: the `offload` option of the unit: each core's inputs go to host memory.
    """
    with contextlib.ExitStack() as stack:
        patched = []
        for layer in layers:
            name = core_method(layer)
            before = layer.__dict__.get(name, _ABSENT)  # the instance's own method, if it had one
            core = _recomputed_core(layer, name, recompute, check, offload)
            stack.enter_context(_patch.instance_attribute(layer, name, core))
            patched.append((layer, name, before, core))
        active = _active_cores()
        _STATE.cores = getattr(_STATE, "cores", 0) + 1
        active += patched
        try:
            yield
        finally:
            del active[len(active) - len(patched):]
            _STATE.cores -= 1


_ABSENT = object()


def _active_cores():
    """`[(layer, name, before, core)]`: the cores `cores_recomputed` patched in this thread, now."""
    if not hasattr(_STATE, "active"):
        _STATE.active = []
    return _STATE.active


# NOTE [ a recomputed call inside an attention_core unit ]
# `cores_recomputed` patches the attention layers' cores for the length of a
# unit's forward. A layer inside the unit whose own call recomputes (a
# decorated TransformerBlock in a graph piece that `recompute_model(segments=
# 2, policy="attention_core")` chose, or a block `recompute_model` planned
# `full` measured under `attention_core` by `memory_report`) ran its forward
# with the cores patched, and its recompute, in the backward, after the unit's
# forward, with them as they are: PyTorch's checkpoint saw its recompute save
# more tensors than its forward ("trying to save more tensors during
# recomputation than during the original forward pass") and the step raised
# (4 such blocks, 2 pieces; 2026-11-29; TensorFlow and JAX gave the plain
# model's update, a recompute there need not save what its forward did). So a
# recomputed call runs outside the cores' patches (`outside_cores`): inside
# it, the cores it holds are as they were before the unit patched them, in its
# forward as in its recompute, and calls nested in it see no unit's cores
# patched. Its policy recomputes what it holds anyway: `full` all of it, and
# `save_dots` keeps no batched matmul of a core. (A call decides whether it
# keeps its dropout masks, `keeps_dropout_masks`, when it is entered, before
# this takes effect: a `full` block inside the unit keeps them, as before.)
# The cores' own recomputed calls go through it too, harmlessly: such a call
# runs the core's original method, bound, which reads no patch.


def cores_patched():
    """Whether a unit's forward under `"attention_core"` is running in this thread (its cores patched)."""
    return getattr(_STATE, "cores", 0) > 0


def outside_cores(fn, owner):
    """`fn`, run outside the cores' patches that are active inside `owner` when it runs (NOTE [ a recomputed call
    inside an attention_core unit ])."""

    def run(*args, **kwargs):
        if not getattr(_STATE, "cores", 0):
            return fn(*args, **kwargs)
        inside = {id(layer) for layer in [owner] + _context.sublayers(owner)} if _context.is_layer(owner) else set()
        mine = [p for p in _active_cores() if id(p[0]) in inside and p[0].__dict__.get(p[1]) is p[3]]
        saved_cores, saved_active = _STATE.cores, _active_cores()
        _STATE.cores, _STATE.active = 0, []
        for layer, name, before, _ in mine:
            if before is _ABSENT:
                del layer.__dict__[name]
            else:
                object.__setattr__(layer, name, before)
        try:
            return fn(*args, **kwargs)
        finally:
            for layer, name, _, core in mine:
                object.__setattr__(layer, name, core)
            _STATE.cores, _STATE.active = saved_cores, saved_active

    return run


def _recomputed_core(layer, name, recompute, check, offload=False):
    """`layer`'s core method, recomputed; when its caller drops the scores, they are not returned.

    A core returns `(output, scores)` (Keras's `_compute_attention`,
    bert4keras's `pay_attention_to`), and `MultiHeadAttention` drops the
    scores unless it was asked for them. Returned from the recomputed call,
    they would be one more B x H x S x S output per layer, and its backward
    would take a zero gradient for them through the softmax. So when the
    scores go unused, the recomputed call is one that returns the output only.
    """
    original = getattr(layer, name)
    whole = recompute(original, enabled=True, check=check, offload=offload)

    def attention_output(self, *args, **kwargs):
        return original(*args, **kwargs)[0]

    attention_output.__qualname__ = f"{type(layer).__name__}.{name}"
    output_only = recompute(types.MethodType(attention_output, layer), enabled=True, check=check, offload=offload)

    scores_unused = _scores_unused_test(layer, name, original)

    def core(*args, **kwargs):
        if scores_unused(args, kwargs):
            return output_only(*args, **kwargs), None
        return whole(*args, **kwargs)

    return core


def _scores_unused_test(layer, name, method):
    """`(args, kwargs) -> bool`: whether a call of `layer`'s core drops the scores it returns."""
    if name == "pay_attention_to":  # bert4keras: the layer's flag asks for the scores
        return lambda args, kwargs: not getattr(layer, "return_attention_scores", False)
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        signature = None
    if signature is None or "return_attention_scores" not in signature.parameters:
        return lambda args, kwargs: False  # a core that returns the output alone (keras-hub's)

    def unused(args, kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return False
        bound.apply_defaults()
        return not bound.arguments["return_attention_scores"]

    return unused
