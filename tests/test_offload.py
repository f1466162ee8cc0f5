"""`offload=True`: what a recomputed unit keeps goes to host memory and back (Keras 3, every backend).

On JAX and PyTorch every policy with offload gives the undecorated twin's
outputs and gradients, and the offload is proven to happen: JAX's step
program places the residuals in host memory and back; on PyTorch the inputs
the checkpoint saves pass through the offload hooks, which keep a host copy
and hand the recompute a tensor made from it. On a CPU host memory is the
device's, so nothing is saved there: the planner counts offloaded bytes on
the device unless the backend says the device is not a CPU (faked here to
check the counting). TensorFlow refuses it with a message.
"""

import collections
import re

import keras
import numpy as np
import pytest

from _keras3_twins import BACKEND, FAST_MODE, MODES, compare_with_twin, loss_and_gradients, recomputed_class, step_program
from keras_recompute import _budget, memory_report, recompute_grad, recompute_model, recompute_scope
from test_budget import AttentionBlock, blocks_model, pieces_model, train_call

X = np.random.RandomState(0).standard_normal((2, 6, 16)).astype("float32")
BATCH = np.random.RandomState(1).standard_normal((32, 64, 16)).astype("float32")  # activations outweigh the weights
POLICIES = ("full", "save_dots", "attention_core")
OFFLOADS = BACKEND in ("jax", "torch")


def built(policy=None, offload=True):
    keras.utils.set_random_seed(0)
    cls = AttentionBlock if policy is None else recomputed_class(AttentionBlock, policy=policy, offload=offload)
    layer = cls()
    with recompute_scope(False):
        train_call(layer, [X])
    return layer


@pytest.mark.skipif(not OFFLOADS, reason="offload is for JAX and PyTorch")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_offload_matches_the_twin(policy, mode):
    compare_with_twin(AttentionBlock, [X], mode, steps=2, policy=policy, offload=True)


@pytest.mark.skipif(not OFFLOADS, reason="offload is for JAX and PyTorch")
@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
def test_offload_with_masks_keywords_and_mixed_precision(dtype):
    """Keras masks on the arguments, keyword tensors, a boolean input, dropout and BatchNorm; bfloat16 too."""
    from test_keras3 import RNG, KeywordBlock, Noisy, normal

    RNG.seed(0)  # the data do not depend on which tests ran before
    options = {"rtol": 1e-2} if dtype != "float32" else {}

    def call(layer, xs):
        return layer(xs[0], bias=xs[1], keep=xs[2], scale=0.5, training=True)

    keras.config.set_dtype_policy(dtype)
    try:
        compare_with_twin(KeywordBlock, [normal(4, 8), normal(16), RNG.rand(4, 16) > 0.3], FAST_MODE, call=call,
                          offload=True, **options)
        compare_with_twin(Noisy, [normal(8, 16)], FAST_MODE, steps=2, offload=True, **options)
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.skipif(BACKEND != "jax", reason="the program of a JAX step")
@pytest.mark.parametrize("policy", POLICIES)
def test_the_jax_step_places_the_residuals_in_host_memory_and_back(policy):
    def placements(offload):
        with recompute_scope(True):
            program = step_program(built(policy, offload), [X], train_call)
        return collections.Counter(re.findall(r"MemorySpace\.(Host|Device)", program))

    without, with_offload = placements(False), placements(True)
    assert without == {}
    # Each residual goes to the host in the forward and comes back in the backward: full keeps the
    # block's input, attention_core the core's query, key and value; save_dots also its matmul outputs.
    expected = {"full": 1, "attention_core": 3}.get(policy)
    assert with_offload["Host"] == with_offload["Device"] == (expected or with_offload["Host"])
    assert with_offload["Host"] >= (1 if expected else 4)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's saved-tensor hooks")
@pytest.mark.parametrize("policy", POLICIES)
def test_torch_keeps_the_saved_inputs_as_host_copies(policy, monkeypatch):
    import torch

    from keras_recompute.backends import torch as torch_backend

    packed, unpacked = [], []
    original = torch_backend._offloaded

    def spied(name):
        hooks = original(name)

        def pack(tensor):
            result = hooks.pack_hook(tensor)
            packed.append((tensor, result[1]))
            return result

        def unpack(value):
            result = hooks.unpack_hook(value)
            unpacked.append(result)
            return result

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    monkeypatch.setattr(torch_backend, "_offloaded", spied)
    layer = built(policy)
    with recompute_scope(True):
        loss_and_gradients(layer, [X], "eager", train_call)
    # Torch before 2.12 also saves its checkpoint's own empty placeholder among the inputs.
    packed = [(tensor, host) for tensor, host in packed if tensor.numel()]
    shapes = [tuple(tensor.shape) for tensor, _ in packed]
    assert shapes == ([(2, 6, 16)] if policy != "attention_core" else [(2, 6, 2, 8)] * 3)
    for tensor, host in packed:
        assert host.device.type == "cpu" and host.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
        assert host.is_pinned() == (tensor.device.type == "cuda")
    assert len([tensor for tensor in unpacked if tensor.numel()]) == len(packed)  # each came back once, for the recompute


@pytest.mark.skipif(OFFLOADS, reason="TensorFlow's refusal")
def test_tensorflow_refuses_offload_with_a_message():
    layer = built("full", offload=True)
    with recompute_scope(True), pytest.raises(ValueError, match=r"offload=True.*'tensorflow'.*KERAS_BACKEND=jax or torch"):
        train_call(layer, [X])
    with pytest.raises(ValueError, match=r"recompute_model\(offload=True\).*'tensorflow'"):
        recompute_model(blocks_model(), offload=True)


def test_offload_takes_a_bool():
    with pytest.raises(TypeError, match=r"recompute_grad\(offload=\.\.\.\) takes True or False; received 'yes'"):
        recompute_grad(AttentionBlock.call, offload="yes")
    with pytest.raises(TypeError, match=r"recompute_model\(offload=\.\.\.\) takes True or False; received 1"):
        recompute_model(blocks_model(), offload=1)


def test_offloaded_costs_move_the_inputs_of_full_units_to_their_backward():
    unit = _budget.UnitCosts(
        "u",
        {
            "none": _budget.Option("none", 500, 80, 0.0),
            "full": _budget.Option("full", 100, 60, 1.0),
            "save_dots": _budget.Option("save_dots", 300, 70, 0.5),
        },
        gradient_bytes=10,
        input_bytes=100,
    )
    model = _budget.Model([unit, unit], resident=1000, outside=50, outside_gradient_bytes=5)
    moved = _budget.offloaded(model, ("full",))
    full = moved.units[0].options["full"]
    assert (full.kept, full.transient, full.seconds) == (0, 160, 1.0)
    assert moved.units[0].options["save_dots"].kept == 300 and moved.units[0].options["none"].kept == 500
    # Before: the second unit's backward holds both units' inputs (1050 fixed + 10 gradients + 200 + 60).
    # After: each unit's backward holds its own input alone; the first's has the most gradients (1050 + 20 + 160).
    assert (model.peak(["full", "full"]), moved.peak(["full", "full"])) == (1320, 1230)


@pytest.mark.skipif(not OFFLOADS, reason="offload is for JAX and PyTorch")
def test_the_planner_counts_offload_off_the_device_only_where_the_device_is_not_the_cpu(monkeypatch):
    from keras_recompute import _memory

    model = blocks_model(seq=64)
    backend = _memory._measuring_backend(model)
    plain = memory_report(model, BATCH)
    simulated = not backend.offload_frees_device_memory()
    if simulated:  # a CPU: nothing moves; then counted as on a GPU
        on_device = memory_report(model, BATCH, offload=True)
        assert "host memory is its own memory" in str(on_device)
        assert on_device.floor == plain.floor
        monkeypatch.setattr(backend, "offload_frees_device_memory", lambda: True)  # as on a GPU...
        # ...whose compiler's figures XLA's CPU cannot give: the units' sums, for the plain model too.
        monkeypatch.setattr(_memory, "compiled_peak", lambda *args, **kwargs: None)
        monkeypatch.setattr(_memory, "states_compiled_peak", lambda *args, **kwargs: False)
        plain = memory_report(model, BATCH)
    moved = memory_report(model, BATCH, offload=True)
    inputs = BATCH.nbytes  # every block takes a batch x seq x width float32 tensor
    assert "in host memory" in str(moved)
    for before, after in zip(plain.rows, moved.rows):
        assert after["kept_bytes"]["full"] == before["kept_bytes"]["full"] - inputs
        assert after["kept_bytes"]["save_dots"] == before["kept_bytes"]["save_dots"]
    if simulated:  # the units' sums: less by the inputs moved
        assert moved.floor < plain.floor
    if moved.floor < plain.floor:
        # A budget between the two floors: a plan only with offload, and its units run offloaded.
        budget = (moved.floor + plain.floor) // 2
        with pytest.raises(ValueError, match="below the least peak"):
            recompute_model(model, budget=budget, inputs=BATCH, enabled=True)
    else:
        # A GPU's compiled figures can say offload frees nothing at this size (JAX on the H200, 2026-11-27: the
        # floor 39.0 MB offloaded, 38.7 MB not; these inputs are 131 KB a block). Then its own floor.
        budget = moved.floor
    recompute_model(model, budget=budget, inputs=BATCH, offload=True, enabled=True)
    report = memory_report(model, BATCH)  # the plan's offload, by default
    assert report.predicted_peak <= budget and "in host memory" in str(report)
    recomputed = sum(row["policy"] != "none" for row in report.rows)
    assert recomputed and _offloads_in_a_step(model, monkeypatch) >= recomputed  # JAX: one placement a residual


@pytest.mark.skipif(BACKEND != "torch", reason="the units' sums (a compiler states JAX's peak); TensorFlow has no offload")
def test_offload_does_not_lower_a_peak_after_the_backward_and_the_report_says_so(monkeypatch):
    """Wide blocks at a small batch: the optimizer's update holds the step's peak, after the backward, when no
    offloaded input is on the device. Measured so on an H200 (docs/gpu.md, 2026-11-29: 96 blocks x 256 at batch 64,
    full and offload 2307 MiB to the byte). The report puts its peak there with offload or not, and says so."""
    from keras_recompute import _memory

    model = blocks_model(seq=4, width=128)
    batch = np.random.RandomState(2).standard_normal((2, 4, 128)).astype("float32")
    monkeypatch.setattr(_memory._measuring_backend(model), "offload_frees_device_memory", lambda: True)  # as a GPU
    recompute_model(model, policy="full", enabled=True)
    kept, moved = memory_report(model, batch), memory_report(model, batch, offload=True)
    assert kept.peak_at == moved.peak_at == "after the backward, at the optimizer's update"
    assert moved.predicted_peak == kept.predicted_peak
    assert "in host memory" in moved.offload and "offload does not lower it" in moved.offload
    deep = blocks_model(seq=64)  # activations outweigh the update: the peak is in a unit, where offload lowers it
    recompute_model(deep, policy="full", enabled=True)
    lowered = memory_report(deep, BATCH, offload=True)
    assert lowered.peak_at.startswith("in block_") and "does not lower" not in lowered.offload
    assert lowered.predicted_peak < memory_report(deep, BATCH).predicted_peak


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's saved-tensor hooks; JAX's program frees by liveness")
@pytest.mark.parametrize("build", [blocks_model, pieces_model], ids=["blocks", "pieces"])
def test_torch_offload_leaves_no_earlier_units_input_on_the_device(build, monkeypatch):
    """Each unit's input leaves the device when its host copy is made, as the planner counts it: Keras's
    functional graph kept every value until the forward ended, so each input stayed on the device beside its copy
    (an H200, docs/gpu.md 2026-12-04: offload's peak 9058 MiB against full's 9702, predicted 3971). At each
    unit's copy no earlier unit's input is alive, in a graph of blocks (Keras's runner) and of pieces (ours)."""
    import gc
    import weakref

    import torch

    from keras_recompute.backends import torch as torch_backend

    packed, alive_at_each = [], []
    original = torch_backend._offloaded

    def spied(name):
        hooks = original(name)

        def pack(tensor):
            gc.collect()
            alive_at_each.append(sum(ref() is not None for ref in packed))
            if tensor.numel():  # not torch's own placeholder
                packed.append(weakref.ref(tensor))
            return hooks.pack_hook(tensor)

        return torch.autograd.graph.saved_tensors_hooks(pack, hooks.unpack_hook)

    model = build()
    recompute_model(model, offload=True, enabled=True)
    monkeypatch.setattr(torch_backend, "_offloaded", spied)
    loss_and_gradients(model, [BATCH[:2, :8]], "eager", train_call)
    assert len(packed) >= 4 and alive_at_each == [0] * len(alive_at_each), alive_at_each


def _skips_and_a_shared_layer():
    inputs = keras.Input((8, 16))
    shared = keras.layers.Dense(16, name="shared")
    first = shared(inputs)
    second = keras.layers.Dense(16, activation="gelu")(first)
    joined = keras.layers.Add()([first, shared(second), inputs])
    return keras.Model(inputs, [keras.layers.Dense(3)(joined), second]), BATCH[:2, :8]


def _masks_dicts_and_a_nested_model():
    ids, side = keras.Input((6,), dtype="int32", name="ids"), keras.Input((6, 4), name="side")
    embedded = keras.layers.Embedding(20, 8, mask_zero=True)(ids)
    attended = keras.layers.MultiHeadAttention(2, 4)(embedded, embedded)  # its mask from the embedding's
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Concatenate()([attended, side]))
    inner = keras.Input((12,))
    head = keras.Model(inner, keras.layers.Dense(3)(inner))
    model = keras.Model({"ids": ids, "side": side}, {"out": head(pooled), "pooled": pooled})
    x = {"ids": np.array([[1, 2, 3, 0, 0, 0], [4, 5, 0, 0, 0, 0]], "int32"), "side": BATCH[:2, :6, :4]}
    return model, x


@pytest.mark.parametrize("build", [_skips_and_a_shared_layer, _masks_dicts_and_a_nested_model], ids=["skips", "masks"])
def test_a_graph_that_releases_its_values_computes_what_keras_computes(build, monkeypatch):
    """`_run_releasing`, the functional graph runner that drops each value after its last reader, against Keras's
    own, each model called whole in training: a value read again after others (a skip over two layers), a layer
    called twice, an intermediate that is also an output; masks carried from an embedding, dict inputs and outputs,
    a model inside the model."""
    from keras.src.ops.function import Function

    from keras_recompute.backends import _keras3

    keras_own = _keras3._RELEASING[0] if _keras3._RELEASING else Function._run_through_graph  # ours once offloaded
    releasing = _keras3.releasing_runner(keras_own)
    keras.utils.set_random_seed(0)
    model, x = build()
    outputs = {}
    for name, run in (("keras", keras_own), ("released", releasing)):
        monkeypatch.setattr(Function, "_run_through_graph", run)
        outputs[name] = keras.tree.map_structure(keras.ops.convert_to_numpy, model(x, training=True))
    keras.tree.map_structure(np.testing.assert_array_equal, outputs["released"], outputs["keras"])


def _offloads_in_a_step(model, monkeypatch):
    """How many recomputed calls of a training step of `model` offloaded what they keep."""
    x = BATCH[:2]
    if BACKEND == "jax":
        program = step_program(model, [x], train_call)
        return len(re.findall(r"MemorySpace\.Host", program))
    from keras_recompute.backends import torch as torch_backend

    calls = []
    original = torch_backend._offloaded
    monkeypatch.setattr(torch_backend, "_offloaded", lambda name: calls.append(1) or original(name))
    loss_and_gradients(model, [x], "eager", train_call)
    return len(calls)
