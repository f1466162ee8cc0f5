"""Selective recompute: `policy="save_dots"` and `"attention_core"` (Keras 3, every backend).

Each policy is compared with the undecorated twin on a transformer block with
attention dropout, dropout and BatchNorm (outputs, every gradient, moving
statistics after two steps), and proven to recompute what it says and no more:
  * `attention_core`: the block's `call` runs once and the attention core
    twice (TensorFlow, PyTorch: counted calls); on JAX, which traces once,
    the step's program has one more softmax (`exp`) and no more gelu (`erf`).
  * `save_dots`: no weight matmul runs in the recompute: the step runs as many
    unbatched matmuls as the plain step (PyTorch: `aten.mm`; JAX: the
    program's `dot_general`s; TensorFlow: XLA's optimized `dot`s), and only
    attention's two batched matmuls more.
The memory each policy keeps is ordered as it should be in `test_policy_memory`.
"""

import collections
import contextlib
import functools
import json
import os
import re
import sys

import keras
import numpy as np
import pytest
from keras import layers

import _fresh
from _keras3_twins import BACKEND, MODES, compare_on_and_off, compare_with_twin, loss_and_gradients, recomputed_class, step_program
from keras_recompute import recompute_grad, recompute_model, recompute_scope

X = np.random.RandomState(0).standard_normal((2, 6, 16)).astype("float32")
POLICIES = ("full", "save_dots", "attention_core")


class AttentionBlock(layers.Layer):
    """Post-norm transformer block: attention with dropout, FFN with gelu and dropout, BatchNorm."""

    def __init__(self, return_scores=False, **kwargs):
        super().__init__(**kwargs)
        self.return_scores = return_scores
        self.attention = layers.MultiHeadAttention(2, 8, dropout=0.2, seed=3)
        self.norm = layers.LayerNormalization()
        self.up = layers.Dense(32, activation="gelu")
        self.dropout = layers.Dropout(0.3, seed=1)
        self.down = layers.Dense(16)
        self.batch_norm = layers.BatchNormalization()

    def call(self, inputs, training=None):
        attended = self.attention(inputs, inputs, training=training, return_attention_scores=self.return_scores)
        scores = None
        if self.return_scores:
            attended, scores = attended
        hidden = self.norm(inputs + attended)
        output = self.batch_norm(hidden + self.down(self.dropout(self.up(hidden), training=training)), training=training)
        return output if scores is None else (output, scores)


class ScoresBlock(AttentionBlock):
    def __init__(self, **kwargs):
        super().__init__(return_scores=True, **kwargs)


def train_call(layer, xs):
    return layer(xs[0], training=True)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_every_policy_matches_the_twin(policy, mode):
    compare_with_twin(AttentionBlock, [X], mode, steps=2, policy=policy)


@pytest.mark.parametrize("policy", ["save_dots", "attention_core"])
def test_attention_scores_asked_for_are_returned_and_exact(policy):
    """MultiHeadAttention(return_attention_scores=True): the scores leave the recomputed core too."""
    compare_with_twin(ScoresBlock, [X], MODES[-1], policy=policy)


@contextlib.contextmanager
def counted(*methods):
    """Counts the calls of `(class, method name)` pairs, by class name."""
    counts = collections.Counter()
    originals = [(cls, name, cls.__dict__[name]) for cls, name in methods]
    for cls, name, original in originals:

        @functools.wraps(original)
        def counting(self, *args, _original=original, _key=f"{cls.__name__}.{name}", **kwargs):
            counts[_key] += 1
            return _original(self, *args, **kwargs)

        setattr(cls, name, counting)
    try:
        yield counts
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)


def block(policy=None, offload=False, cls=None):
    keras.utils.set_random_seed(0)
    cls = cls or AttentionBlock
    options = {"offload": True} if offload else {}
    layer = (cls if policy is None else recomputed_class(cls, policy=policy, **options))()
    with recompute_scope(False):
        train_call(layer, [X])
    return layer


@pytest.mark.skipif(BACKEND == "jax", reason="JAX traces a call once: counted in its program below")
def test_attention_core_recomputes_the_core_alone():
    with counted((AttentionBlock, "call"), (layers.MultiHeadAttention, "_compute_attention")) as counts:
        layer = block("attention_core")
        counts.clear()
        with recompute_scope(True):
            loss_and_gradients(layer, [X], "eager", train_call)
    assert counts == {"AttentionBlock.call": 1, "MultiHeadAttention._compute_attention": 2}


def _program_counts(policy, cls=None):
    with recompute_scope(True):
        program = step_program(block(policy, cls=cls), [X], train_call)
    patterns = {"dot_general": r"= dot_general\b", "exp": r"= exp\b", "erf": r"= erfc?\b"}
    return {op: len(re.findall(pattern, program)) for op, pattern in patterns.items()}


@pytest.mark.skipif(BACKEND != "jax", reason="the program of a JAX step")
def test_what_each_policy_recomputes_in_the_jax_program():
    plain = _program_counts(None)
    extra = {policy: {op: n - plain[op] for op, n in _program_counts(policy).items()} for policy in POLICIES}
    # The forward has 8 matmuls: 6 with a weight (query, key, value, output, up, down), 2 batched (attention).
    assert extra["full"] == {"dot_general": 8, "exp": 1, "erf": 1}
    assert extra["save_dots"] == {"dot_general": 2, "exp": 1, "erf": 1}
    # The core keeps its dropout mask, so JAX's own partial evaluation makes its recompute, and leaves out the
    # weighted sum, whose value no gradient reads (XLA pruned it before: COMPILED_EXTRA below).
    assert extra["attention_core"] == {"dot_general": 1, "exp": 1, "erf": 0}


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's dispatched ops")
def test_save_dots_runs_no_weight_matmul_again_on_torch():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                batched = func is torch.ops.aten.bmm.default and args[0].shape[0] > 1
                self.counts["batched" if batched else "weight"] += 1
            return func(*args, **(kwargs or {}))

    def matmuls(policy):
        layer = block(policy)
        with recompute_scope(True), Count() as mode:
            loss_and_gradients(layer, [X], "eager", train_call)
        return mode.counts

    plain, full, save_dots = matmuls(None), matmuls("full"), matmuls("save_dots")
    assert full["weight"] == plain["weight"] + 6
    assert save_dots["weight"] == plain["weight"]
    assert save_dots["batched"] == plain["batched"] + 2


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's dispatch modes")
def test_save_dots_modes_see_only_the_weight_matmuls_on_torch(monkeypatch):
    """The save_dots modes cost host time on each op they see: they see the weight matmuls' calls, no other op."""
    import torch

    from keras_recompute.backends import torch as torch_backend

    seen = collections.Counter()
    for mode in (torch_backend._KeepingDots, torch_backend._KeptDots):
        original = mode.__torch_dispatch__

        def spy(self, func, types, args=(), kwargs=None, _original=original, _mode=mode.__name__):
            batched = func is torch.ops.aten.bmm.default and args[0].shape[0] > 1
            seen[(_mode, "batched bmm" if batched else func.__name__.split(".")[0])] += 1
            return _original(self, func, types, args, kwargs)

        monkeypatch.setattr(mode, "__torch_dispatch__", spy)
    layer = block("save_dots")
    with recompute_scope(True):
        loss_and_gradients(layer, [X], "eager", train_call)
    ops = {op for _, op in seen}
    # Three projections' einsums (query, key, value), the output projection's and two Dense matmuls: kept, then handed back.
    kept = sum(n for (mode, op), n in seen.items() if mode == "_KeepingDots" and op in ("mm", "addmm", "bmm"))
    assert kept == 6, seen
    assert not ops & {"batched bmm", "_softmax", "bernoulli_", "native_dropout", "gelu", "native_layer_norm", "add"}, ops


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's autograd graph")
def test_save_dots_checks_a_matmuls_inputs_but_not_a_weight_or_a_cast_of_one_on_torch():
    """NOTE [ the recompute check under save_dots ]: the recompute fingerprints each kept matmul's operands but a
    weight as stored, which it reads as the forward read it; under `mixed_bfloat16` Keras reads each kernel as a cast
    of it, made again from the same weight, and its fingerprint was half the check's cost."""
    import torch

    from keras_recompute.backends import torch as torch_backend

    weight = torch.nn.Parameter(torch.randn(4, 3))
    frozen = torch.nn.Parameter(torch.randn(4, 3), requires_grad=False)
    x = torch.randn(2, 4, requires_grad=True)
    stored = [weight, weight.t(), weight.to(torch.bfloat16), weight.to(torch.bfloat16).t().reshape(3, 4)]
    computed = [
        x, x.to(torch.bfloat16).reshape(8),  # an input, and a cast of it: a leaf, not a weight
        weight * 2.0, (weight + weight[:, :1]).to(torch.bfloat16),  # computed from a weight (a LoRA's sum)
        frozen.to(torch.bfloat16),  # a frozen weight's cast leaves no graph: checked, as before
    ]
    assert [torch_backend._a_stored_weight(t) for t in stored] == [True] * len(stored)
    assert [torch_backend._a_stored_weight(t) for t in computed] == [False] * len(computed)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's recompute check")
def test_save_dots_raises_on_other_inputs_of_a_kept_matmul_in_mixed_bfloat16_on_torch():
    """The drift before a kept matmul (`tests/test_semantics_keras3.py`) is caught where each kernel is a cast."""
    from keras_recompute import RecomputeError
    from test_semantics_keras3 import DriftingBeforeAKeptMatmul, _drifting_gradients

    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        layer = DriftingBeforeAKeptMatmul(name="drifting")
        layer(X)
        with pytest.raises(RecomputeError, match="weight matmul 1 .*differ from its forward"):
            _drifting_gradients(layer, True)
    finally:
        keras.config.set_dtype_policy(before)


class InPlaceBlock(layers.Layer):
    """Writes in place to a weight matmul's output (as keras-hub's Gemma scales its query: `q *= c`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.project = layers.Dense(16, use_bias=False)
        self.up = layers.Dense(32, activation="gelu")

    def call(self, inputs, training=None):
        projected = self.project(inputs)
        projected *= 0.5  # in place on PyTorch
        return self.up(projected)


@pytest.mark.skipif(BACKEND != "torch", reason="an in-place write is PyTorch's")
def test_save_dots_runs_a_call_that_writes_a_matmul_output_in_place():
    """What is kept is what the matmul gave, not what the call wrote to it after; no matmul runs again.

    With torch's selective checkpoint the kernel gradient of `up` was 0.38 off, silently.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    compare_with_twin(InPlaceBlock, [X], "eager", steps=2, policy="save_dots")

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.matmuls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.matmuls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
            return func(*args, **(kwargs or {}))

    def matmuls(policy):
        layer = recomputed_class(InPlaceBlock, policy=policy)() if policy else InPlaceBlock()
        with recompute_scope(False):
            train_call(layer, [X])
        with recompute_scope(True), Count() as mode:
            loss_and_gradients(layer, [X], "eager", train_call)
        return mode.matmuls

    assert matmuls("save_dots") == matmuls(None)  # both kept and handed back, the written one too


class UnseededBlock(AttentionBlock):
    """Dropouts without a seed: on torch they draw from torch's global generator (Keras's fast path)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(2, 8, dropout=0.2)
        self.dropout = layers.Dropout(0.3)


class TorchRandBlock(UnseededBlock):
    """Also draws from torch's global generator outside Keras's dropout: a save_dots unit draws its masks again."""

    def call(self, inputs, training=None):
        import torch

        return super().call(inputs + 0.01 * torch.rand(inputs.shape, device=inputs.device), training=training)


def _torch_device_type():
    from keras.src.backend.torch.core import get_device

    return str(get_device()).split(":")[0]


def _bernoulli_draws(layer_class, policy):
    """The elements drawn for dropout (`bernoulli`, or on an accelerator the fused `native_dropout`)
    in one eager training step of a `layer_class` block under `policy`."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            drawing = (torch.ops.aten.bernoulli, torch.ops.aten.bernoulli_, torch.ops.aten.native_dropout)
            if func._overloadpacket in drawing:
                self.elements += args[0].numel()
            return func(*args, **(kwargs or {}))

    keras.utils.set_random_seed(0)
    layer = layer_class() if policy is None else recomputed_class(layer_class, policy=policy)()
    with recompute_scope(False):
        train_call(layer, [X])
    with recompute_scope(True), Count() as mode:
        loss_and_gradients(layer, [X], "eager", train_call)
    return mode.elements


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's dispatched ops")
@pytest.mark.parametrize("layer_class", [AttentionBlock, UnseededBlock, TorchRandBlock])
@pytest.mark.parametrize("policy", POLICIES)
def test_the_policies_keep_dropout_masks_on_torch(policy, layer_class):
    """NOTE [ dropout masks under the policies ]: no mask is drawn twice, and every gradient is the twin's."""
    compare_with_twin(layer_class, [X], "eager", steps=2, policy=policy)
    plain, recomputed = _bernoulli_draws(layer_class, None), _bernoulli_draws(layer_class, policy)
    # The block's dropouts: 2 x 2 x 6 x 6 attention probabilities, 2 x 6 x 32 in the FFN.
    assert plain == 2 * 2 * 6 * 6 + 2 * 6 * 32
    # On an accelerator, unseeded dropout is F.dropout's fused kernel: drawn again, from the restored generator.
    fused = layer_class is not AttentionBlock and _torch_device_type() != "cpu"
    if policy == "attention_core" and fused:  # (the GPU run's expectation was 2 * plain: it failed there)
        assert recomputed == plain + 2 * 2 * 6 * 6  # the core's dropout drawn again; the FFN's runs outside the core
    elif policy == "full" or fused or (policy == "save_dots" and layer_class is TorchRandBlock):
        assert recomputed == 2 * plain  # drawn again: full keeps no mask; torch.rand in the unit
    else:
        assert recomputed == plain  # under attention_core, torch.rand runs outside the recomputed core


class DropoutThenNoiseBlock(layers.Layer):
    """One seed generator drawn twice in a call: a dropout (its mask kept under save_dots), then noise after it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(32, activation="gelu")
        self.seeds = keras.random.SeedGenerator(3)

    def call(self, inputs, training=None):
        hidden = keras.random.dropout(self.dense(inputs), 0.3, seed=self.seeds)
        return hidden + keras.random.normal(keras.ops.shape(hidden), seed=self.seeds)


@pytest.mark.parametrize("mode", MODES)
def test_a_replayed_mask_advances_its_seed_generator_as_the_forward_did(mode):
    """A recompute that hands back a kept mask instead of drawing must still move the mask's seed generator, or
    what draws from it next (here noise) draws other numbers than the forward did: the recompute check raises
    (check=False: another function's gradient). Two steps: the state after the first is the plain model's."""
    compare_with_twin(DropoutThenNoiseBlock, [X], mode, steps=2, policy="save_dots")


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's dispatched ops")
def test_kept_dropout_masks_under_bfloat16_on_torch():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        compare_with_twin(UnseededBlock, [X], "eager", rtol=1e-2, policy="save_dots")
        drawn_again = 2 if _torch_device_type() != "cpu" else 1  # F.dropout's fused kernel on an accelerator
        assert _bernoulli_draws(UnseededBlock, "save_dots") == drawn_again * _bernoulli_draws(UnseededBlock, None)
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.skipif(BACKEND != "torch", reason="torch's global generators")
@pytest.mark.parametrize("policy", POLICIES)
def test_no_policy_seeds_or_moves_a_generator_of_torch(policy, monkeypatch):
    """NOTE [ the one-time check touches no generator ]: a recomputed step leaves every torch generator
    (CPU, and each accelerator's) where the plain step leaves it, and seeds none, its one-time check included.

    The first GPU run found the policies' check calling `torch.manual_seed`: on the CPU its state was
    restored, while CUDA's generator was reset, and every dropout after it drew another mask.
    """
    import torch

    from keras_recompute.backends import torch as torch_backend

    def states():
        cpu = [torch.get_rng_state()]
        return cpu + (list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [])

    def step(policy):
        layer = block(policy)
        torch.manual_seed(11)
        seeded.clear()
        with recompute_scope(True):
            loss_and_gradients(layer, [X], "eager", train_call)
        return states(), list(seeded)

    seeded = []
    for module, name in ((torch, "manual_seed"), (torch.random, "manual_seed"), (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _original=original, _name=name, **k: (seeded.append(_name), _original(*a, **k))[1])
    monkeypatch.delattr(torch_backend._dropout_replayable, "result", raising=False)  # the check runs again, in this step
    (plain, _), (recomputed, seeded_in_step) = step(None), step(policy)
    assert seeded_in_step == [], f"the {policy} step seeded torch: {seeded_in_step}"
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed)), "a generator moved otherwise than in the plain step"
    if policy != "full":  # the check ran in this step, and passed
        assert torch_backend._dropout_replayable.result


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's dispatched ops")
def test_the_kept_dropout_masks_are_a_bit_an_element():
    from keras_recompute import _patch
    from keras_recompute.backends import torch as torch_backend

    layer = block()
    kept = {}
    for policy in ("full", "save_dots"):
        call = recompute_grad(layer.call, enabled=True, policy=policy)
        with _patch.instance_attribute(layer, "call", call):
            kept[policy] = torch_backend.measure_unit(layer, (X,), {"training": True}, policy, timed=False)[0]
    # save_dots keeps the outputs of the six weight matmuls (query, key, value: 2 x 6 x 2 x 8; output,
    # down: 2 x 6 x 16; up: 2 x 6 x 32) and the two dropout masks (144 and 384 elements), packed.
    matmuls = (5 * 2 * 6 * 16 + 2 * 6 * 32) * 4
    assert kept["save_dots"] - kept["full"] == matmuls + (144 + 384) // 8


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's stateless draws")
@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
@pytest.mark.parametrize("policy", POLICIES)
def test_the_policies_keep_dropout_masks_on_tensorflow(policy, mode):
    """The policies draw each dropout mask once (a graph: once in the traced step), full twice."""
    from tensorflow.python.ops import stateless_random_ops

    original = stateless_random_ops.stateless_random_uniform
    shapes = []

    def counting(*args, **kwargs):
        drawn = original(*args, **kwargs)
        shapes.append(tuple(drawn.shape))
        return drawn

    def draws(policy):
        layer = block(policy)
        del shapes[:]
        stateless_random_ops.stateless_random_uniform = counting
        try:
            with recompute_scope(True):
                loss_and_gradients(layer, [X], mode, train_call)
        finally:
            stateless_random_ops.stateless_random_uniform = original
        return sorted(s for s in shapes if len(s) >= 3)  # the recompute check's own draws are matrices

    masks = [(2, 2, 6, 6), (2, 6, 32)]  # attention probabilities, FFN
    assert draws(None) == masks
    assert draws(policy) == (sorted(masks * 2) if policy == "full" else masks)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's lowered program")
@pytest.mark.parametrize("policy", POLICIES)
def test_the_policies_keep_dropout_masks_on_jax(policy):
    """NOTE [ dropout masks under the policies on JAX ]: the policies draw each mask once in the step's program,
    full twice; every gradient is the twin's."""
    import jax

    from _keras3_twins import _jax_step

    compare_with_twin(AttentionBlock, [X], "jit", steps=2, policy=policy)

    def draws(policy):
        layer = block(policy)
        with recompute_scope(True):
            grad_fn, arguments = _jax_step(layer, [X], [0], train_call)
            program = jax.jit(grad_fn).lower(*arguments).as_text()
        return len(re.findall(r"call @_bernoulli", program)), len(re.findall(r"call @packbits", program))

    plain = draws(None)
    assert plain == (2, 0)  # the block's two dropouts: attention probabilities and FFN
    if policy == "full":
        assert draws(policy) == (4, 0)
    elif policy == "save_dots":
        assert draws(policy) == (2, 2)
    else:  # the core's mask kept; the FFN's dropout runs outside the recomputed core
        assert draws(policy) == (2, 1)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's lowered program")
@pytest.mark.parametrize("policy", POLICIES)
def test_a_recompute_that_waits_at_a_barrier_keeps_every_gradient_on_jax(policy, monkeypatch):
    """NOTE [ how the recompute waits on JAX ]: waiting at one optimization barrier gives the twin's gradients, and
    the backward then waits at the barrier instead of adding zeros; on a GPU the saving policies' backward does."""
    import jax

    from _keras3_twins import _jax_step
    from keras_recompute.backends import jax as jax_backend

    def lowered():
        layer = block(policy)
        with recompute_scope(True):
            grad_fn, arguments = _jax_step(layer, [X], [0], train_call)
            program = jax.jit(grad_fn).lower(*arguments).as_text(debug_info=True)
        return [len(re.findall(rf'keras_recompute_wait/{op}"', program)) for op in ("optimization_barrier", "add")]

    monkeypatch.setattr(jax_backend, "_on_gpu", lambda: False)  # the CPU's way, on any device
    barriers, adds = lowered()
    assert barriers == 0 and adds > 0
    monkeypatch.setattr(jax_backend, "_WAIT_BY", "barrier")
    compare_with_twin(AttentionBlock, [X], "jit", steps=2, policy=policy)
    assert lowered() == [2, 0]  # the forward's seeds wait for its inputs, the backward's inputs for the gradient

    # A GPU's way, on any device: the backward of the policies that keep matmul outputs (and here the
    # dropout masks) waits at the barrier, which copies nothing into cuBLAS's matmuls; `full`'s adds
    # (at a barrier the GPU's compiler ran its recompute early) and the seeds' adds stay.
    monkeypatch.setattr(jax_backend, "_WAIT_BY", None)
    monkeypatch.setattr(jax_backend, "_on_gpu", lambda: True)
    compare_with_twin(AttentionBlock, [X], "jit", steps=2, policy=policy)
    barriers, gpu_adds = lowered()
    if policy == "full":
        assert (barriers, gpu_adds) == (0, adds)
    else:
        assert barriers == 1 and 0 < gpu_adds < adds


@functools.lru_cache(maxsize=None)
def _compiled_counts(policy, offload=False):
    """`(dot, exponential)` ops in XLA's optimized program of a training step (TensorFlow or JAX)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        layer = block(policy)
        variables = layer.trainable_variables

        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.sin(layer(x, training=True)))
            return tape.gradient(loss, variables)

        with recompute_scope(True):
            hlo = tf.function(step, jit_compile=True).experimental_get_compiler_ir(tf.constant(X))(stage="optimized_hlo")
    else:
        import jax

        from _keras3_twins import _jax_step

        # XLA's CPU pipeline on every machine: a GPU's calls cuBLAS for most dots and copies
        # elementwise ops into each fusion that reads them, so its counts are of other things.
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            layer = block(policy, offload)
            with recompute_scope(True):
                grad_fn, arguments = _jax_step(layer, [X], [0], train_call)
                hlo = jax.jit(grad_fn).lower(*jax.device_put(arguments, cpu)).compile().as_text()
    return len(re.findall(r" dot\(", hlo)), len(re.findall(r" exponential\(", hlo))


# What XLA compiles, over the plain step's (dot, exponential): a recompute XLA
# merged away, or ran where it should not, shows here. The block's forward has
# 8 matmuls, 6 with a weight; its softmax and gelu each make an exponential.
# `full` runs all 8 again; `save_dots` attention's 2 batched ones; the core
# of `attention_core` needs its scores again (the score matmul and softmax),
# and XLA prunes the weighted sum, whose value no gradient reads. Offloaded
# residuals come back as the same values: the same ops.
COMPILED_EXTRA = {
    ("full", False): (8, 2),
    ("save_dots", False): (2, 2),
    ("attention_core", False): (1, 1),
    ("full", True): (8, 2),
    ("save_dots", True): (2, 2),
    ("attention_core", True): (1, 1),
}


@pytest.mark.skipif(BACKEND == "torch", reason="XLA's compiled program of a TensorFlow or JAX step")
@pytest.mark.parametrize("policy,offload", [key for key in COMPILED_EXTRA if BACKEND == "jax" or not key[1]])
def test_what_xla_compiles_for_each_policy(policy, offload):
    plain = _compiled_counts(None)
    counts = _compiled_counts(policy, offload)
    extra = tuple(n - p for n, p in zip(counts, plain))
    assert extra == COMPILED_EXTRA[policy, offload], f"extra (dot, exponential) {extra}, plain {plain}"


def functional_attention(count=2):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 16))
    hidden = inputs
    for i in range(count):
        hidden = AttentionBlock(name=f"block_{i}")(hidden)
    return keras.Model(inputs, layers.Dense(3, name="head")(hidden))


@pytest.mark.parametrize("policy", ["save_dots", "attention_core"])
def test_recompute_model_takes_a_policy(policy):
    model = recompute_model(functional_attention(), policy=policy)
    compare_on_and_off(model, [X], MODES[-1], train_call, steps=2)


def test_recompute_model_attention_core_on_units_without_attention_names_them():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = inputs
    for i in range(3):
        hidden = layers.Dense(16, activation="gelu", name=f"dense_{i}")(hidden)
    model = keras.Model(inputs, hidden)
    with pytest.raises(ValueError, match=r"attention_core.*'dense_0', 'dense_1', 'dense_2'.*policy='full'"):
        recompute_model(model, blocks=layers.Dense, policy="attention_core")


def test_attention_core_on_a_call_without_attention_says_so():
    class NoAttention(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = layers.Dense(4)

        @recompute_grad(enabled=True, policy="attention_core")
        def call(self, inputs):
            return self.dense(inputs)

    with pytest.raises(ValueError, match=r"attention_core.*NoAttention\.call.*contains none"):
        NoAttention()(X)


class OwnAttention(layers.Layer):
    """A user's attention layer, not Keras's: its core is a method named `_compute_attention`, of its own
    signature, returning the output alone; its dropout is a Keras `Dropout` of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.query, self.key, self.value, self.out = (layers.Dense(16, name=name) for name in "qkvo")
        self.dropout = layers.Dropout(0.2, seed=5)

    def _compute_attention(self, query, key, value, training=None):
        scores = keras.ops.softmax(keras.ops.einsum("bqd,bkd->bqk", query, key) * 0.25, axis=-1)
        return keras.ops.einsum("bqk,bkd->bqd", self.dropout(scores, training=training), value)

    def call(self, inputs, training=None):
        query, key, value = self.query(inputs), self.key(inputs), self.value(inputs)
        return self.out(self._compute_attention(query, key, value, training=training))


class SelfAttention(OwnAttention):
    """The same attention, its core inline in `call` (as keras-hub's Falcon, T5, ...): no core method."""

    _compute_attention = None

    def call(self, inputs, training=None):
        scores = keras.ops.softmax(keras.ops.einsum("bqd,bkd->bqk", self.query(inputs), self.key(inputs)) * 0.25)
        return self.out(keras.ops.einsum("bqk,bkd->bqd", self.dropout(scores, training=training), self.value(inputs)))


class OwnBlock(layers.Layer):
    attention_class = OwnAttention

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = self.attention_class()
        self.norm = layers.LayerNormalization()
        self.up = layers.Dense(32, activation="gelu")
        self.down = layers.Dense(16)

    def call(self, inputs, training=None):
        hidden = self.norm(inputs + self.attention(inputs, training=training))
        return hidden + self.down(self.up(hidden))


class InlineBlock(OwnBlock):
    attention_class = SelfAttention


@pytest.mark.parametrize("mode", MODES)
def test_attention_core_recomputes_the_core_method_of_a_users_own_attention(mode):
    """The extension point the docs and the error name: any layer's `_compute_attention` is its core. Exact (dropout
    inside the core included), and the core alone recomputes: counted calls, or on JAX one more softmax and no
    more gelu in the step's program."""
    compare_with_twin(OwnBlock, [X], mode, steps=2, policy="attention_core")
    if BACKEND == "jax":
        plain, recomputed = _program_counts(None, OwnBlock), _program_counts("attention_core", OwnBlock)
        assert {op: recomputed[op] - plain[op] for op in ("exp", "erf")} == {"exp": 1, "erf": 0}
        return
    with counted((OwnBlock, "call"), (OwnAttention, "_compute_attention")) as counts:
        layer = block("attention_core", cls=OwnBlock)
        counts.clear()
        with recompute_scope(True):
            loss_and_gradients(layer, [X], mode, train_call)
    assert counts == {"OwnBlock.call": 1, "OwnAttention._compute_attention": 2}


def test_attention_core_names_an_attention_layer_whose_core_is_inline():
    with pytest.raises(ValueError, match=r"recomputed_inline_block.*They hold SelfAttention, which computes its core inside "
                                         r"`call`.*method named `_compute_attention`"):
        layer = block("attention_core", cls=InlineBlock)
        with recompute_scope(True):
            train_call(layer, [X])
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 16))
    hidden = InlineBlock(name="inline")(OwnBlock(name="own")(inputs))
    model = keras.Model(inputs, hidden)
    with pytest.raises(ValueError, match=r"'inline' contains none.*SelfAttention.*blocks=\['own'\] recomputes the "
                                         r"cores of the units that hold one"):
        recompute_model(model, blocks=lambda layer: layer.name in ("own", "inline"), policy="attention_core")


def two_towers(first, second):
    """A model of two runs of blocks, two of class `first`, then two of class `second`."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 16))
    hidden = inputs
    for i, cls in enumerate([first, first, second, second]):
        hidden = cls(name=f"{cls.__name__.lower()}_{i}")(hidden)
    return keras.Model(inputs, hidden)


def test_auto_under_attention_core_leaves_out_the_blocks_whose_core_is_inline():
    """NOTE [ "auto" under attention_core ]: as PaliGemma's vision encoder beside its decoder, "auto" finds two runs,
    one without a core it can recompute alone: the other run's cores recompute, exact, with a warning naming the
    blocks left as they are; a model where no block has one still raises."""
    model = two_towers(OwnBlock, InlineBlock)
    with pytest.warns(UserWarning, match=r"found 4 units, and 'inlineblock_2', 'inlineblock_3' hold no attention "
                                         r"layer.*\(SelfAttention computes its core inside `call`\): the other 2 "
                                         r"recompute their cores.*policy='full'"):
        recompute_model(model, policy="attention_core")
    with counted((OwnBlock, "call"), (OwnAttention, "_compute_attention")) as counts:
        compare_on_and_off(model, [X], MODES[-1], train_call)
    if BACKEND == "jax":  # traced once: the step's program has two more softmaxes, and no more gelu
        programs = {}
        for on in (False, True):
            with recompute_scope(on):
                programs[on] = step_program(model, [X], train_call)
        extra = {op: len(re.findall(rf"= {op}\b", programs[True])) - len(re.findall(rf"= {op}\b", programs[False]))
                 for op in ("exp", "erf")}
        assert extra == {"exp": 2, "erf": 0}
    else:
        assert counts == {"OwnBlock.call": 4, "OwnAttention._compute_attention": 6}  # off, then on: cores twice
    with pytest.raises(ValueError, match=r"'inlineblock_0', 'inlineblock_1', 'inlineblock_2', 'inlineblock_3' "
                                         r"contain none.*SelfAttention"):
        recompute_model(two_towers(InlineBlock, InlineBlock), policy="attention_core")


@pytest.mark.parametrize("bad", ["selective", "FULL", None, 3])
def test_unknown_policies_name_the_valid_ones(bad):
    expected = r"got .*; valid policies are \['full', 'save_dots', 'attention_core'\]"
    with pytest.raises(ValueError, match=r"recompute_grad\(policy=\.\.\.\) " + expected):
        recompute_grad(lambda x: x, policy=bad)
    with pytest.raises(ValueError, match=r"recompute_model\(policy=\.\.\.\) " + expected):
        recompute_model(functional_attention(1), policy=bad)


CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_policy_memory_child.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's allocator, in fresh processes")
@pytest.mark.parametrize("framework", ["keras", "tf_keras"])
def test_policy_memory(framework):
    """The BFC peak of a `tf.function` step: none > attention_core, and none > save_dots > full."""
    root = os.path.dirname(os.path.dirname(CHILD))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    peaks = {}
    for policy in ("none", "full", "save_dots", "attention_core"):
        done = _fresh.run([CHILD, framework, policy], env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        peaks[policy] = int(done.stdout.strip().splitlines()[-1])
    print({policy: f"{peak / 2**20:.1f} MB" for policy, peak in peaks.items()})
    assert peaks["none"] > 1.3 * peaks["attention_core"]
    assert peaks["none"] > 1.3 * peaks["save_dots"] > 1.3 * peaks["full"]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf_keras runs on TensorFlow")
@pytest.mark.parametrize("policy", ["save_dots", "attention_core"])
@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_tf_keras_policies_match_the_plain_model(policy, mode):
    import tensorflow as tf
    import tf_keras as K

    from _twins import on_and_off

    class Attention(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = K.layers.MultiHeadAttention(2, 8)
            self.norm = K.layers.LayerNormalization()
            self.up = K.layers.Dense(32, activation="gelu")
            self.dropout = K.layers.Dropout(0.2, seed=3)
            self.down = K.layers.Dense(16)

        def call(self, inputs, training=None):
            hidden = self.norm(inputs + self.attention(inputs, inputs, training=training))
            return hidden + self.down(self.dropout(self.up(hidden), training=training))

    def build():
        K.utils.set_random_seed(0)
        inputs = K.Input((6, 16))
        hidden = inputs
        for _ in range(2):
            hidden = Attention()(hidden)
        return recompute_model(K.Model(inputs, K.layers.Dense(3)(hidden)), policy=policy)

    if mode != "jit":
        on_and_off(K, build, tf.constant(X), mode)
        return
    # Under XLA, tf_keras's default dropout (TF's stateful random ops) draws other numbers in
    # every compiled program, the plain model's included; its `tf.random.Generator` does not.
    K.backend.experimental.enable_tf_random_generator()
    try:
        on_and_off(K, build, tf.constant(X), mode)
    finally:
        K.backend.experimental.disable_tf_random_generator()


@pytest.mark.parametrize("family, policy", [("Gemma", "attention_core"), ("GPT2", "save_dots")])
def test_keras_hub_lora_backbones_under_each_policy(policy, family):
    """keras-hub attention of its own classes, LoRA on, each policy on one backbone. Gemma's core
    scales its query in place (`q *= c`): on PyTorch the recompute of the core must see the query
    as it was (NOTE [ inputs written in place ]). Both backbones under `"full"`: `test_model.py`."""
    from test_model import _keras_hub_backbone

    backbone = recompute_model(_keras_hub_backbone(family, lora=True), policy=policy)
    ids = np.random.RandomState(0).randint(1, 100, size=(2, 16)).astype("int32")
    padding = np.ones((2, 16), "int32")
    padding[1, 10:] = 0
    call = lambda m, xs: m({"token_ids": xs[0], "padding_mask": xs[1]}, training=True)  # noqa: E731
    compare_on_and_off(backbone, [ids, padding], MODES[-1], call, steps=2)


_BIT_FOR_BIT = r"""
import json, os, sys, tempfile
import numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import first_step

sizes = ["--backend", "jax", "--dtype", "mixed_bfloat16", "--blocks", "2", "--batch", "4"]
updates = {}
with tempfile.TemporaryDirectory() as folder:
    for method in ("none", "ours", "save_dots", "attention_core", "offload"):
        path = os.path.join(folder, method + ".npz")
        first_step.child(first_step.parse_args(sizes + ["--child", method, path]))
        with np.load(path) as saved:
            updates[method] = [saved[f"arr_{i}"] for i in range(len(saved.files))]
print(json.dumps({m: [int(np.sum(u != p)) for u, p in zip(us, updates["none"])] for m, us in updates.items()}))
"""


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's rounding switches")
def test_bfloat16_updates_are_plains_bit_for_bit_where_xla_rounds_as_the_program_says():
    """NOTE in `benchmarks/first_step.py`: in mixed_bfloat16, with no excess precision and nothing fused into a
    matmul's kernel, every policy's and offload's first SGD update (lr 1, dropout 0.1, the compiled step, two
    BERT-shaped blocks) is plain's to the bit. Where XLA rounds otherwise (its defaults), a recompute, another
    program, rounds elsewhere: the suite's other twins in bfloat16 allow 1e-2."""
    import jax

    if jax.devices()[0].platform != "cpu":
        pytest.skip("on a GPU: benchmarks/first_step.py --excess-precision off --matmul-fusions off (docs/gpu.md)")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import first_step

    flags = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_allow_excess_precision=false", first_step.MATMUL_FUSIONS_OFF["cpu"]])
    env = dict(os.environ, XLA_FLAGS=flags.strip(), PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = _fresh.run(["-c", _BIT_FOR_BIT], env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    differing = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(differing) == 5 and all(len(counts) == len(differing["none"]) > 10 for counts in differing.values())
    assert all(not any(counts) for counts in differing.values()), differing
