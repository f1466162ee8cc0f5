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
tf_keras's `MultiHeadAttention` and their subclasses, keras-hub's attention
layers of every family) or with `pay_attention_to` (bert4keras).
"""

import contextlib
import inspect
import threading
import types

from keras_recompute import _context

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


def no_attention_message(names):
    return (
        f"keras_recompute: policy='attention_core' recomputes the core of the attention layers inside a "
        f"unit, and {', '.join(repr(n) for n in names)} contain none that keras_recompute knows (a layer "
        "with `_compute_attention`: Keras's MultiHeadAttention and keras-hub's attention layers; or "
        "bert4keras's MultiHeadAttention). Use policy='full' or 'save_dots' for these units."
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
        for layer in layers:
            name = core_method(layer)
            core = _recomputed_core(layer, name, recompute, check, offload)
            stack.enter_context(_context.instance_attribute(layer, name, core))
        _STATE.cores = getattr(_STATE, "cores", 0) + 1
        try:
            yield
        finally:
            _STATE.cores -= 1


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
