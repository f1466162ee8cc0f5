"""`recompute_model(budget=..., inputs=...)` and `memory_report` (Keras 3, every backend).

A plan, over layers or over the pieces of a graph, is exact (every gradient
equal to the plain model's, a different policy per unit included), recomputes
what it says (the planned blocks' `call`
runs twice in a step on TensorFlow and PyTorch; on JAX each recomputed gelu
adds an `erfc` to the step's program), predicts a peak within the budget, and
measuring leaves the model as it was. On TensorFlow a fresh process measures
the allocator's peak of a planned model against the budget.
"""

import contextlib
import functools
import json
import os
import re
import sys
import warnings

import keras
import numpy as np
import pytest
from keras import layers

import _fresh
from _keras3_twins import BACKEND, FAST_MODE, MODES, compare_on_and_off, loss_and_gradients, recomputed_class, step_program
from keras_recompute import _budget, _memory, _model, memory_report, recompute_grad, recompute_model, recompute_scope

# A batch whose activations outweigh the optimizer's update (on PyTorch three times the weights, at the end).
X = np.random.RandomState(0).standard_normal((64, 8, 16)).astype("float32")


class AttentionBlock(layers.Layer):
    """Attention with dropout, add & norm, a gelu FFN with dropout: every policy applies."""

    def __init__(self, hidden=16, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(2, hidden // 2, dropout=0.2, seed=1)
        self.norm = layers.LayerNormalization()
        self.up = layers.Dense(2 * hidden, activation="gelu")
        self.dropout = layers.Dropout(0.2, seed=2)
        self.down = layers.Dense(hidden)

    def call(self, inputs, training=None):
        hidden = self.norm(inputs + self.attention(inputs, inputs, training=training))
        return hidden + self.down(self.dropout(self.up(hidden), training=training))


def blocks_model(count=4, seq=8, width=16, batch_size=None, block=AttentionBlock):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((seq, width), batch_size=batch_size)
    hidden = layers.Dense(width, name="stem")(inputs)
    for i in range(count):
        hidden = block(width, name=f"block_{i}")(hidden)
    model = keras.Model(inputs, layers.Dense(3, name="head")(layers.GlobalAveragePooling1D()(hidden)))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train_call(model, xs):
    return model(xs[0], training=True)


def pieces_model(count=4, seq=8, width=16):
    """`blocks_model`'s blocks built from separate layers, as bert4keras builds a BERT: units are graph pieces."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((seq, width))
    hidden = layers.Dense(width, name="stem")(inputs)
    for i in range(count):
        attended = layers.MultiHeadAttention(2, width // 2, dropout=0.2, seed=1, name=f"attention_{i}")(hidden, hidden)
        hidden = layers.LayerNormalization(name=f"norm_{i}")(layers.Add(name=f"attention_add_{i}")([hidden, attended]))
        up = layers.Dense(2 * width, activation="gelu", name=f"up_{i}")(hidden)
        down = layers.Dense(width, name=f"down_{i}")(layers.Dropout(0.2, seed=2, name=f"dropout_{i}")(up))
        hidden = layers.Add(name=f"add_{i}")([hidden, down])
    pooled = layers.GlobalAveragePooling1D(name="pool")(hidden)
    model = keras.Model(inputs, layers.Dense(3, name="head")(pooled))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


PIECES = [f"attention_{i} .. add_{i}" for i in range(4)]


def calls_per_layer(make, cls):
    """How often each `cls` layer's `call` runs in one eager training step of `make()` (TensorFlow, PyTorch)."""
    counts = {}
    original = cls.__dict__["call"]

    @functools.wraps(original)
    def counted(self, *args, **kwargs):
        counts[self.name] = counts.get(self.name, 0) + 1
        return original(self, *args, **kwargs)

    cls.call = counted
    try:
        model = make()  # planned with the counting call, as the plan wraps the call it finds
        counts.clear()
        with recompute_scope(True):
            loss_and_gradients(model, [X], "eager", train_call)
    finally:
        cls.call = original
    return counts


def assert_recomputes_as_planned(make, policies, pieces=False):
    """In `make()`, units planned "full" or "save_dots" run again, others once.

    Counted as each block's `call` (each piece's LayerNormalization), which
    runs twice; on JAX, as the step's `erfc`s: one more per recomputed gelu.
    `make` must plan `policies` again: it fixes the solver's answer, since the
    measured times, and with them the fastest plan, vary from run to run.
    """
    again = [p in ("full", "save_dots") for p in policies]
    if BACKEND == "jax":
        plain = step_program((pieces_model if pieces else blocks_model)(len(policies)), [X], train_call).count(" erfc ")
        with recompute_scope(True):
            program = step_program(make(), [X], train_call)
        assert program.count(" erfc ") - plain == sum(again)
        return
    counts = calls_per_layer(make, layers.LayerNormalization if pieces else AttentionBlock)
    name = "norm_{}" if pieces else "block_{}"
    assert counts == {name.format(i): 2 if twice else 1 for i, twice in enumerate(again)}


@contextlib.contextmanager
def fixed_plan(policies):
    """Within it, a budget plans `policies` without measuring (the test is of applying a plan)."""
    options = {p: _budget.Option(p, 1, 0, 0) for p in ("none", "full", "save_dots", "attention_core")}
    units = [_budget.UnitCosts(f"block_{i}", options, 0) for i in range(len(policies))]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_budget, "solve", lambda costs, budget, quanta=2000: list(policies))
        patch.setattr(_memory, "costs", lambda *args, **kwargs: (_budget.Model(units, 0, 0, 0), 0.0))
        patch.setattr(_memory, "compiled_peak", lambda *args: None)  # JAX: nor compiles the step to check it
        yield


def planned(model):
    report = memory_report(model, X)
    return [row["policy"] for row in report.rows]


def test_a_budget_half_way_is_met_with_fewer_blocks_fully_recomputed():
    model = blocks_model()
    plain = memory_report(model, X)
    recompute_model(model, enabled=True)
    full = memory_report(model, X).predicted_peak
    assert full < plain.predicted_peak == plain.plain_peak
    budget = (full + plain.predicted_peak) // 2
    recompute_model(model, budget=budget, inputs=X, enabled=True)
    report = memory_report(model, X)
    assert report.measure_seconds == 0  # measured once per model and batch shape
    policies = [row["policy"] for row in report.rows]
    assert report.predicted_peak <= budget
    assert policies.count("full") < 4 and policies.count("none") < 4, policies
    assert _model.recomputed_units(model) == [f"block_{i}" for i, p in enumerate(policies) if p != "none"]

    def make():
        model = blocks_model()
        with fixed_plan(policies):
            recompute_model(model, budget=budget, inputs=X, enabled=True)
            assert planned(model) == policies
        return model

    assert_recomputes_as_planned(make, policies)


def test_a_budget_the_plans_are_predicted_under_but_their_steps_miss_says_so(monkeypatch):
    """Where every plan checked is predicted under the budget but its step, measured (compiled on JAX, run under
    TensorFlow's allocator for a CNN), peaks over it, the refusal names the least measured peak, not the predicted
    floor, which is under the budget (a CNN without oneDNN on TensorFlow: "budget=85612308 is below the least peak
    any plan reaches for this batch, 77.1 MB")."""
    model = blocks_model()
    plain = memory_report(model, X)
    budget = (plain.floor + plain.plain_peak) // 2
    measured = []

    def over(*args, **kwargs):
        measured.append(budget + 2_000_000 + len(measured))
        return measured[-1]

    def refused(costs, value, compiled, *args, **kwargs):  # as `_checked_plan` where each plan's step misses
        assert costs.floor() <= value
        for policy in ("full", "save_dots"):
            assert compiled([policy] * len(costs.units)) > value
        return None

    monkeypatch.setattr(_model, "_compiled_peak_of", over)
    monkeypatch.setattr(_model, "_checked_plan", refused)
    with pytest.raises(ValueError, match="below the least peak") as raised:
        recompute_model(model, budget=budget, inputs=X)
    least = _budget.format_bytes(min(measured))
    floor = _budget.format_bytes(plain.floor)
    expected = f"predicted at {floor}, but the steps of the {len(measured)} plans checked, measured, peaked at {least}"
    assert f"{expected} or more" in str(raised.value), str(raised.value)


def test_budget_one_recomputes_nothing():
    def make():
        model = blocks_model()
        recompute_model(model, budget=1.0, inputs=X, enabled=True)
        assert _model.recomputed_units(model) == [] and _memory._COSTS not in model.__dict__  # nor measures
        return model

    assert_recomputes_as_planned(make, ["none"] * 4)


def test_a_fraction_keeps_that_part_of_the_activations():
    """Judged by the planner's own costs: on JAX calibrated to XLA's compiled step, where the uncalibrated figures
    put a plan it may choose (which one, the measured times decide) 0.5% over (seen under load in CI)."""
    model = blocks_model()
    units = _model._choose_blocks(model, _model._framework(model), "auto")
    execution, _ = _memory.execution_of(model, None, "recompute_model")
    costs = _model._calibrated_costs(model, units, X, execution, offload=False)
    plain = ["none"] * 4
    recompute_model(model, budget=0.75, inputs=X, enabled=True)
    policies = planned(model)
    assert costs.peak(policies) <= costs.peak(plain) - 0.25 * costs.activation_bytes(plain)
    assert any(p != "none" for p in policies)


@pytest.mark.skipif(BACKEND != "jax", reason="a compiler's figure of the step: JAX's")
def test_a_compilers_fixed_scratch_is_held_once_not_scaled_with_the_units(monkeypatch):
    """NOTE [ the compiler's scratch ]: on an H200 every compiled step held a fixed workspace (these blocks' units keep
    1.9 MB; their steps were 35-36 MB), and the planner, scaling it into the units, refused `budget=0.75` and every
    budget between `memory_report`'s floor and plain peak as below any plan. On a CPU (no scratch) the steps hold
    32 MiB more here, and the probe says so; on a GPU, its own (the H200's probe: 32 MiB)."""
    from keras_recompute.backends import jax as backend

    scratch = backend.compiler_scratch_bytes()
    if not scratch:
        scratch = 32 * 2**20
        step_bytes = backend.step_bytes
        monkeypatch.setattr(backend, "step_bytes", lambda *args: step_bytes(*args) + scratch)
        monkeypatch.setattr(backend, "compiler_scratch_bytes", lambda: scratch)
    model = blocks_model()
    plain = memory_report(model, X)
    assert scratch < plain.floor < plain.plain_peak < scratch + 4 * 2**20, str(plain)
    recompute_model(model, budget=0.75, inputs=X, enabled=True)
    assert any(p != "none" for p in planned(model))
    budget = (plain.floor + plain.plain_peak) // 2
    recompute_model(model, budget=budget, inputs=X, enabled=True)
    report = memory_report(model, X)
    assert report.predicted_peak <= budget and 0 < len(_model.recomputed_units(model)) < 4, str(report)


def language_model(vocabulary=4000, count=2, seq=64, width=32):
    """`blocks_model` with a head over a vocabulary at every position: its step peaks at the loss, on the logits."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((seq, width))
    hidden = layers.Dense(width, name="stem")(inputs)
    for i in range(count):
        hidden = AttentionBlock(width, name=f"block_{i}")(hidden)
    model = keras.Model(inputs, layers.Dense(vocabulary, name="head")(hidden))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.skipif(BACKEND != "jax", reason="a compiler's figure of the step: JAX's")
def test_a_reports_other_plans_are_their_compiled_steps():
    """NOTE [ a report's other plans on JAX ]: with `full` applied, "with no recompute" is what the plain step
    compiles to, and "the least any plan reaches" a peak a plan meets. They were the units' sums, which miss what
    XLA holds at the loss (three buffers of the logits' size): here both read 3.5 MB, where the plain step compiles
    to 9.8 MB and the least plan (`full`, applied) to 8.5."""
    x = np.random.RandomState(0).standard_normal((2, 64, 32)).astype("float32")
    as_plain = memory_report(language_model(), x)  # compiled as it stands: no recompute
    model = language_model()
    recompute_model(model, policy="full", enabled=True)
    report = memory_report(model, x)
    assert report.plain_peak == pytest.approx(as_plain.predicted_peak, abs=1024), str(report)
    assert report.floor <= report.predicted_peak, str(report)  # `full` on every block is a plan
    twin = language_model()
    recompute_model(twin, budget=report.floor, inputs=x, enabled=True)  # a plan meets the floor
    assert memory_report(twin, x).predicted_peak <= report.floor


def _costs(model):
    units = _model._choose_blocks(model, _model._framework(model), "auto")
    return _memory.costs(model, units, X)


def _torch_cuda():
    import torch

    return torch.cuda.is_available()


MIXED = ["full", "save_dots", "attention_core", "none"]


@pytest.mark.parametrize("mode", MODES)
def test_a_plan_of_mixed_policies_is_exact(mode):
    """Each block with its own policy: outputs, every gradient and the state equal the plain model's."""
    if BACKEND == "jax" and mode == "eager":
        pytest.skip("JAX op by op: each policy's path is compared in eager mode in test_policy.py")
    model = blocks_model()
    with fixed_plan(MIXED):
        recompute_model(model, budget="1TB", inputs=X)
        assert planned(model) == ["none"] * 4  # RECOMPUTE is unset: the model runs plainly
        with recompute_scope(True):
            assert planned(model) == MIXED
    compare_on_and_off(model, [X], mode, train_call, steps=2)
    if mode == FAST_MODE:

        def make():
            model = blocks_model()
            with fixed_plan(MIXED):
                recompute_model(model, budget="1TB", inputs=X, enabled=True)
            return model

        assert_recomputes_as_planned(make, MIXED)


def test_a_budget_plans_a_graphs_pieces():
    """Blocks built from separate layers (bert4keras's way): the units are pieces of the graph."""
    model = pieces_model()
    plain = memory_report(model, X)
    assert [row["name"] for row in plain.rows] == PIECES
    assert all(set(row["kept_bytes"]) == {"none", "full", "save_dots", "attention_core"} for row in plain.rows)
    budget = (plain.floor + plain.plain_peak) // 2
    recompute_model(model, budget=budget, inputs=X, enabled=True)
    report = memory_report(model, X)
    policies = [row["policy"] for row in report.rows]
    assert report.measure_seconds == 0 and report.predicted_peak <= budget
    assert policies.count("full") < 4 and policies.count("none") < 4, policies
    assert _model.recomputed_units(model) == [name for name, p in zip(PIECES, policies) if p != "none"]
    # A plan that fails puts the earlier one back (with other pieces: the bad-budget table's segments row).
    with pytest.raises(ValueError, match="below the least peak"):
        recompute_model(model, budget=1000, inputs=X)
    assert _model.recomputed_units(model) == [name for name, p in zip(PIECES, policies) if p != "none"]


@pytest.mark.parametrize("mode", MODES)
def test_a_plan_of_mixed_policies_over_pieces_is_exact(mode):
    if BACKEND == "jax" and mode == "eager":
        pytest.skip("JAX op by op: each policy's path is compared in eager mode in test_policy.py")

    def make():
        model = pieces_model()
        with fixed_plan(MIXED):
            recompute_model(model, budget="1TB", inputs=X, enabled=True)
        assert _model.recomputed_units(model) == PIECES[:3]
        return model

    compare_on_and_off(make(), [X], mode, train_call, steps=2)
    if mode == FAST_MODE:
        assert_recomputes_as_planned(make, MIXED, pieces=True)


def test_fit_save_and_load_after_a_plan(tmp_path):
    x, labels = X[:4], np.array([0, 1, 2, 1])
    losses = {}
    for on in (False, True):
        model = blocks_model()
        with fixed_plan(MIXED):
            recompute_model(model, budget=0.5, inputs=x)
        keras.utils.set_random_seed(3)
        with recompute_scope(on):
            losses[on] = model.fit(x, labels, epochs=2, batch_size=4, verbose=0).history["loss"]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"AttentionBlock": AttentionBlock})
    assert _model.recomputed_units(loaded) == []
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)


def test_each_timed_step_waits_for_its_device(monkeypatch):
    """NOTE [ timing a unit on a GPU ] in `_memory`: each option's step is timed only once its device has run it
    (a GPU runs kernels after the host queues them: timed without the wait, the planner's seconds were the host's
    launch time). On the CPU the wait is at once; here every timed run of every unit's every option calls it."""
    model = blocks_model(2)
    backend = _memory._measuring_backend(model)
    waits = []
    if BACKEND == "jax":
        import jax

        block_until_ready = jax.block_until_ready
        monkeypatch.setattr(jax, "block_until_ready", lambda value: waits.append(1) or block_until_ready(value))
    else:
        synchronize = backend.synchronize
        monkeypatch.setattr(backend, "synchronize", lambda: waits.append(1) or synchronize())
    timed = []
    measure_options = _memory._measure_options

    def counting(unit, *args):
        measured = measure_options(unit, *args)
        timed.append(len(measured))
        return measured

    monkeypatch.setattr(_memory, "_measure_options", counting)
    memory_report(model, X)
    # (JAX measures two units alike once: `timed` counts the options of each unit measured.)
    assert timed and len(waits) >= _memory._REPEATS * sum(timed), (timed, len(waits))


def _work_of_jax_steps(layer, options):
    """XLA's count of the floating-point operations of each option's compiled timed step."""
    import jax

    from keras_recompute import _patch
    from keras_recompute.backends import jax as jax_backend

    jit, compiled, work = jax.jit, [], {}

    def recording(function, *args, **kwargs):
        jitted = jit(function, *args, **kwargs)

        def run(*arguments):
            compiled.append(jitted.lower(*arguments).compile())
            return jitted(*arguments)

        return run

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(jax, "jit", recording)
        for option in options:
            call = layer.call if option == "none" else recompute_grad(layer.call, enabled=True, policy=option)
            with _patch.instance_attribute(layer, "call", call):
                jax_backend.measure_unit(layer, (X,), {"training": True}, option)
            analysis = compiled[-1].cost_analysis()
            work[option] = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    return work


def _work_of_tensorflow_steps(layer, options):
    """How many matrix products and softmaxes each option's timed step ran, by TensorFlow's profiler (what ran
    after Grappler's rewrites, not what was traced); our recompute check's own products are not counted."""
    import glob
    import tempfile

    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from keras_recompute import _patch
    from keras_recompute.backends import tensorflow as tf_backend

    work = {}
    for option in options:
        call = layer.call if option == "none" else recompute_grad(layer.call, enabled=True, policy=option)
        with _patch.instance_attribute(layer, "call", call), tempfile.TemporaryDirectory() as directory:
            _, _, step, _ = tf_backend.measure_unit(layer, (X,), {"training": True}, option)
            tf.profiler.experimental.start(directory)
            step()
            tf.profiler.experimental.stop()
            (path,) = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
            space = xplane_pb2.XSpace()
            with open(path, "rb") as file:
                space.ParseFromString(file.read())
        names = [
            plane.event_metadata[event.metadata_id].name
            for plane in space.planes
            for line in plane.lines
            for event in line.events
        ]  # "scope/op_name:OpType"
        kinds = [name.rpartition(":")[2] for name in names if ":" in name and "keras_recompute_check" not in name]
        work[option] = sum(1 for kind in kinds if "MatMul" in kind or "Einsum" in kind or kind == "Softmax")
    return work


def _work_of_torch_steps(layer, options):
    """PyTorch's count of the floating-point operations each option's timed step ran."""
    from torch.utils.flop_counter import FlopCounterMode

    from keras_recompute import _patch
    from keras_recompute.backends import torch as torch_backend

    work = {}
    for option in options:
        call = layer.call if option == "none" else recompute_grad(layer.call, enabled=True, policy=option)
        with _patch.instance_attribute(layer, "call", call):  # the step runs the layer's call: timed under it
            _, _, step, _ = torch_backend.measure_unit(layer, (X,), {"training": True}, option)
            with FlopCounterMode(display=False) as counter:
                step()
        work[option] = counter.get_total_flops()
    return work


def test_each_options_timed_step_runs_its_recompute():
    """NOTE [ measuring a unit on JAX ], NOTE [ timing a unit on TensorFlow ]: the step timed for an option runs
    what the option recomputes. Timed on the gradient of the outputs' sum, a constant, XLA and Grappler folded the
    zero the recompute waits on and merged the recompute into the forward: on JAX "full" counted the flops of
    "none"; on TensorFlow its step ran the projections and the scores' product and softmax once, and "save_dots"
    ran the softmax once. PyTorch's eager step cannot merge: checked so that it stays so."""
    layer = AttentionBlock()
    layer(X[:1])
    work = globals()[f"_work_of_{BACKEND}_steps"](layer, ("none", "full", "save_dots", "attention_core"))
    # "full" runs the block's forward again (here 1.57x the plain step's flops on JAX, 1.38x on PyTorch, 29
    # products and softmaxes against 20 on TensorFlow), the policies a part of it. (The seconds timed from these
    # steps are not asserted: noise on a busy machine, and the report clamps them above 0.)
    assert work["full"] > 1.3 * work["none"], work
    assert work["full"] > work["save_dots"] > work["none"] and work["attention_core"] > work["none"], work


def test_measuring_changes_nothing_in_the_model():
    model = blocks_model()
    before = [np.array(keras.ops.convert_to_numpy(v.value)) for v in model.variables]
    memory_report(model, X)
    after = [np.array(keras.ops.convert_to_numpy(v.value)) for v in model.variables]
    assert len(before) == len(after)
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)


def test_a_large_batch_is_measured_at_a_quarter_and_a_half_of_it(monkeypatch):
    """NOTE [ measuring below the batch ]: where measuring runs the units on the device (TensorFlow, PyTorch), a
    batch of 64 is measured at 16 and 32 and extrapolated: the same figures, to 1%, as measured whole, and its plans
    fit as measured whole; JAX measures the batch itself (its plans are compiled there)."""
    seen, only = [], []
    call = AttentionBlock.call

    def spied(self, inputs, training=None):
        if self.name == "block_0" and isinstance(inputs.shape[0], int):  # not the call that builds the model
            seen.append(inputs.shape[0])
            if only and inputs.shape[0] not in only:
                raise ValueError(f"this model takes {only} rows")
        return call(self, inputs, training=training)

    monkeypatch.setattr(AttentionBlock, "call", spied)
    below = _costs(blocks_model())[0]
    cut = BACKEND in ("tensorflow", "torch")
    # (Keras on PyTorch infers a symbolic call's shapes by calling with batches of 83 and 89.)
    assert ({16, 32} <= set(seen) and 64 not in seen) if cut else 64 in seen, seen
    seen.clear()
    _costs(blocks_model(batch_size=64))  # a model that takes no other batch: measured at it
    assert 64 in seen and 16 not in seen, seen
    model = blocks_model()
    seen.clear()
    only.append(64)  # one that refuses a part of its batch (a `ValueError`): measured whole
    _costs(model)
    only.clear()
    assert 64 in seen, seen
    monkeypatch.setattr(_memory, "MEASURED_BELOW", 1 << 30)
    whole = _costs(blocks_model())[0]
    count = len(whole.units)
    # On the H200 (2026-11-28) the peaks extrapolated from 16 and 32 rows read 2.0% over those measured at 64 in this
    # 2 MB model (45 KB: the line from a quarter and a half triples a half's error), one policy's in each of two
    # processes; on the CPU they agree to the byte. Not CUDA's rounding of each block to 512 bytes (the CPU's records
    # so rounded moved them by 512 bytes). 3% on a GPU until one finds the cause: the units' figures say where.
    tolerance = 0.03 if BACKEND == "torch" and _torch_cuda() else 0.01
    differing = [
        (unit.name, name, option, other.options[name])
        for unit, other in zip(below.units, whole.units)
        for name, option in unit.options.items()
        if (option.kept, option.transient, option.forward) != (other.options[name].kept, other.options[name].transient, other.options[name].forward)
    ]
    for choice in (["none"] * count, ["full"] * count, MIXED, ["save_dots"] * count):
        assert abs(below.peak(choice) - whole.peak(choice)) <= tolerance * whole.peak(choice), (choice, below.peak(choice), whole.peak(choice), differing)
    for unit_below, unit_whole in zip(below.units, whole.units):
        for name, option in unit_whole.options.items():
            assert abs(unit_below.options[name].kept - option.kept) <= 0.01 * max(option.kept, 1 << 16), (name, unit_below.options[name], option)
    plain, least = whole.peak(["none"] * count), whole.floor()
    for fraction in (0.25, 0.5, 0.75):
        budget = int(least + fraction * (plain - least))
        plan = _budget.solve(below, budget)  # fits as measured whole (which plan is the fastest rests on timings)
        assert plan is not None and whole.peak(plan) <= 1.01 * budget, (fraction, plan)


_MEASURING_CHILD = r"""
import json, sys
import numpy as np, keras, tensorflow as tf
sys.path.insert(0, sys.argv[1])
from test_budget import blocks_model
from keras_recompute import _memory, memory_report, recompute_model

if sys.argv[2] == "whole":
    _memory.MEASURED_BELOW = 1 << 30
x = np.random.RandomState(0).standard_normal((64, 128, 64)).astype("float32")
labels = np.zeros(64, "int32")
model = blocks_model(4, seq=128, width=64)
recompute_model(model, enabled=True)
model.optimizer.build(model.trainable_variables)
tf.config.experimental.reset_memory_stats("CPU:0")
predicted = memory_report(model, x).predicted_peak
measuring = tf.config.experimental.get_memory_info("CPU:0")["peak"]
model.train_on_batch(x, labels)
tf.config.experimental.reset_memory_stats("CPU:0")
model.train_on_batch(x, labels)
step = tf.config.experimental.get_memory_info("CPU:0")["peak"]
print(json.dumps({"measuring": measuring, "step": step, "predicted": predicted}))
"""


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the allocator's peak: TensorFlow's BFC allocator on the CPU")
def test_measuring_a_large_batch_holds_less_than_the_step_it_plans():
    """NOTE [ measuring below the batch ]: a report (what `recompute_model(budget=)` measures) of 4 blocks at batch
    64 under `full` peaked above the step it predicts when measured whole (a device limited to that step's memory
    ran out while planning); at a quarter and a half of the batch, well under it, and predicting the same."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    here = os.path.dirname(os.path.abspath(__file__))
    records = {}
    for how in ("whole", "below"):
        done = _fresh.run(["-c", _MEASURING_CHILD, here, how], env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        records[how] = json.loads(done.stdout.strip().splitlines()[-1])
    whole, below = records["whole"], records["below"]
    # The allocator's peaks move by 10-20% from one process to the next: the step 69-93 MB, measuring below 47-62 MB
    # on three machines. Measuring whole peaked 98-102 MB against the 84.8 MB predicted until the TensorFlow unit
    # step's timing fix (2026-12-05); since, 84-103 MB (ten runs): at times under the prediction, so not asserted
    # (a CI run failed on `measuring > 1.1 * step` at 91.4 against 88.0 MB). What is asserted holds in every run:
    # measuring below is under the step (what a device sized to it needs) and well under measuring whole (0.48-0.59x).
    assert below["measuring"] < below["step"], records
    assert below["measuring"] < 0.75 * whole["measuring"], records
    assert abs(below["predicted"] - whole["predicted"]) <= 0.01 * whole["predicted"], records


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's autograd graph")
def test_measuring_leaves_no_activation_alive():
    """NOTE [ a measured forward keeps nothing alive ]: the first GPU plan of BERT-base at batch 153 peaked at
    22 GB against 14.7 predicted: each unit's measured forward, which runs no backward, left its activations
    allocated for good (a cycle through autograd's C++ graph), and the training step ran beside them."""
    import gc

    import torch

    def graphed():
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None]

    before = {id(t) for t in graphed()}  # what an earlier test of the process left (the order of files varies)
    model = blocks_model()
    memory_report(model, X)
    recompute_model(model, budget=0.75, inputs=X, enabled=True)
    left = [t for t in graphed() if id(t) not in before]
    assert left == [], [(tuple(t.shape), type(t.grad_fn).__name__) for t in left]


@pytest.mark.skipif(BACKEND != "torch", reason="Keras's tree on torch's pytree")
def test_a_recomputed_step_leaves_no_tensor_to_the_garbage_collector():
    """NOTE [ Keras's tree keeps a call's tensors in a cycle ]: each recomputed unit's input copies (and what its
    layers pass on) stayed allocated until Python's collector ran: the step's peak 59.2 MB with it off, 42.2 MB where
    it ran, for 40.6 MB freed as they go; a plan's measure read them or not from one process to the next."""
    import gc

    import torch

    model = blocks_model()
    recompute_model(model, policy="full", enabled=True)
    model.compile(optimizer="sgd", loss="mse")
    y = np.zeros(model.output_shape[1:], "float32")[None].repeat(len(X), 0)
    model.train_on_batch(X, y)
    gc.collect()
    # Held through the step: what earlier tests left alive. A torch.compile'd step of test_verify's leaves FX graphs
    # whose nodes hold its example tensors, and they fell into the garbage during this step (then it failed after
    # test_verify in one process, not in CI's file order).
    earlier = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        model.train_on_batch(X, y)
        gc.collect()
        left = [(tuple(o.shape), type(o.grad_fn).__name__) for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
        del earlier
    assert left == []


def test_the_report():
    model = blocks_model()
    report = memory_report(model, X)
    assert [row["name"] for row in report.rows] == [f"block_{i}" for i in range(4)]
    for row in report.rows:
        kept = row["kept_bytes"]
        assert set(kept) == {"none", "full", "save_dots", "attention_core"} and set(row["recompute_seconds"]) == set(kept) - {"none"}
        # A block keeps scores, softmax, dropout masks, activations: far more than its dots alone, or nothing.
        assert kept["none"] > kept["attention_core"] > kept["full"] and kept["none"] > kept["save_dots"] > kept["full"]
    assert report.floor < report.predicted_peak == report.plain_peak
    assert report.resident > 0 and report.predicted_peak > report.resident
    text = str(report)
    assert "block_3" in text and "predicted peak" in text and "attention_core" in text
    # Where the peak is: a unit's point here, where the activations outweigh the update (JAX: its compiler states
    # the peak, no point). The update's point: tests/test_budget_solver.py, tests/test_offload.py.
    if BACKEND != "jax":
        assert re.fullmatch(r"in block_\d's (forward|backward)", report.peak_at) and f", {report.peak_at} (" in text


def test_a_unit_whose_call_is_decorated_is_reported_under_its_policy():
    """`@recompute_grad(policy=...)` on a block class: the report counts that policy where the switch is on (it
    counted the blocks as plain until 2026-11-29), and plain where it is off, as a plan made by `recompute_model`."""
    decorated = blocks_model(block=recomputed_class(AttentionBlock, policy="save_dots"))
    planned = blocks_model()
    recompute_model(planned, policy="save_dots", enabled=True)
    with recompute_scope(True):
        on = memory_report(decorated, X)
    assert [row["policy"] for row in on.rows] == ["save_dots"] * 4
    assert on.predicted_peak == memory_report(planned, X).predicted_peak < on.plain_peak
    off = memory_report(decorated, X)  # RECOMPUTE unset: the decorated calls run plain
    assert [row["policy"] for row in off.rows] == ["none"] * 4 and off.predicted_peak == off.plain_peak


def test_the_report_of_a_plan_is_over_the_plans_units():
    """NOTE [ the units of a planned model ]: `blocks="auto"` in the report takes the plan's units, not its own."""
    model = blocks_model()
    recompute_model(model, blocks=["block_1", "block_3"], enabled=True)
    report = memory_report(model, X)
    assert [(row["name"], row["policy"]) for row in report.rows] == [("block_1", "full"), ("block_3", "full")]
    recompute_model(model, limit=1, policy="save_dots", enabled=True)  # every block a unit, the first recomputed
    report = memory_report(model, X)
    assert [row["policy"] for row in report.rows] == ["save_dots", "none", "none", "none"]


class FeedForward(layers.Layer):
    def __init__(self, hidden=16, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(4 * hidden, activation="gelu")
        self.down = layers.Dense(hidden)

    @recompute_grad
    def call(self, inputs):
        return self.down(self.up(inputs))


class HoldsDecorated(layers.Layer):
    """A block that is not decorated but holds a layer that is (a block built of ready layers)."""

    def __init__(self, hidden=16, **kwargs):
        super().__init__(**kwargs)
        self.feed_forward = FeedForward(hidden)
        self.norm = layers.LayerNormalization()

    def call(self, inputs):
        return self.norm(inputs + self.feed_forward(inputs))


def test_the_report_names_units_that_hold_decorated_layers():
    """A unit's 'none' is measured as it stands, its decorated layers recomputing where the switch is on: the
    report's peak is the model's as it runs, and a line says which units hold which decorated layers (NOTE [ units
    that hold decorated layers ])."""
    model = blocks_model(block=HoldsDecorated)
    with recompute_scope(True):
        on = memory_report(model, X)
    off = memory_report(model, X)  # RECOMPUTE unset: the FFNs run plain
    assert [row["policy"] for row in on.rows] == ["none"] * 4 == [row["policy"] for row in off.rows]
    assert on.rows[0]["kept_bytes"]["none"] < off.rows[0]["kept_bytes"]["none"]
    assert on.predicted_peak < off.predicted_peak
    assert "block_0, block_1, block_2 and 1 more hold layers" in on.inner and "FeedForward: full" in on.inner
    assert on.inner in str(on) and off.inner == ""


def test_a_model_changed_around_its_units_is_measured_again():
    """What was measured is kept on the model under what it depends on (`_memory.cache_key`). Until 2026-12-05 that
    left out the layers outside the units and the optimizer: a report over one block, after `recompute_model` set
    the other to recompute, kept the figures from before (on TensorFlow 1.54 MB where a model made so holds 0.96),
    and a model compiled again with SGD kept Adam's slots. Now each is measured again, as a model made so is."""
    x = X[:4]  # measured as it is (NOTE [ measuring below the batch ]): the suite's time
    model = blocks_model(2)
    before = memory_report(model, x, blocks=["block_0"])
    recompute_model(model, blocks=["block_1"], enabled=True)
    after = memory_report(model, x, blocks=["block_0"])
    made_so = blocks_model(2)
    recompute_model(made_so, blocks=["block_1"], enabled=True)
    expected = memory_report(made_so, x, blocks=["block_0"]).predicted_peak
    assert after.predicted_peak == pytest.approx(expected, rel=0.01)
    assert abs(before.predicted_peak - expected) > 0.02 * expected, (before.predicted_peak, expected)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    sgd = memory_report(model, x, blocks=["block_0"])
    assert sgd.resident == _memory.resident_bytes(model, x) < after.resident


@pytest.mark.skipif(BACKEND != "jax", reason="a compiler's figure of the step: JAX's")
def test_each_plans_step_is_compiled_once(monkeypatch):
    """NOTE [ each plan's step compiled once ]: a report compiles each plan's step once (the model as it stands,
    plain, is no recompute's step), and planning to the report's floor and reporting again compile nothing more:
    they compiled 6, 3 and 2 steps until 2026-12-05. The figures are the steps' own."""
    from keras_recompute._decorator import decorated_policy
    from keras_recompute.backends import jax as backend

    model = blocks_model(2)
    compiled, step_bytes = [], backend.step_bytes

    def counted(model, inputs):
        policies = tuple((decorated_policy(model.get_layer(f"block_{i}").call) or ("none",))[0] for i in range(2))
        compiled.append(policies)
        return step_bytes(model, inputs)

    monkeypatch.setattr(backend, "step_bytes", counted)
    report = memory_report(model, X)
    assert len(compiled) == len(set(compiled)) and ("none", "none") in compiled, compiled
    first = list(compiled)
    recompute_model(model, budget=report.floor, inputs=X, enabled=True)
    again = memory_report(model, X)
    assert compiled == first, compiled
    assert again.predicted_peak <= report.floor
    monkeypatch.setattr(backend, "step_bytes", step_bytes)
    as_it_stands = _memory.compiled_peak(model, X, None)  # compiled here, not kept
    assert again.predicted_peak == as_it_stands


def test_the_report_of_a_plan_the_switch_keeps_off_says_so():
    """RECOMPUTE unset: the rows are the plain model's, and a line names the plan and how to switch it on."""
    model = blocks_model()
    recompute_model(model, budget=0.75, inputs=X)  # enabled=None: follows the switch, off here
    with recompute_scope(True):
        planned_with_switch_on = memory_report(model, X)
    chosen = [row["policy"] for row in planned_with_switch_on.rows]
    assert any(policy != "none" for policy in chosen) and not planned_with_switch_on.switch
    report = memory_report(model, X)
    assert [row["policy"] for row in report.rows] == ["none"] * 4 and report.predicted_peak == report.plain_peak
    assert "recompute is off now" in report.switch and "recompute_scope(True)" in report.switch
    first = next(i for i, policy in enumerate(chosen) if policy != "none")
    assert f"block_{first}: {chosen[first]}" in str(report)
    assert report.floor <= report.plain_peak and planned_with_switch_on.floor <= planned_with_switch_on.plain_peak


def refuse_compiles(monkeypatch):
    """From here on in the test, any step compiled for its peak (JAX's check of a plan) fails it."""

    def compiled(*args):
        raise AssertionError("a step was compiled for its peak")

    monkeypatch.setattr(_model, "_compiled_peak_of", compiled)


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        ({"budget": "1GB"}, ValueError, "needs inputs="),
        ({"inputs": X}, ValueError, "pass budget= with it"),
        ({"budget": "1GB", "inputs": X, "limit": 2}, ValueError, "budget= or limit=, not both"),
        ({"budget": "1GB", "inputs": X, "policy": "save_dots"}, ValueError, "chooses each unit's policy"),
        ({"budget": "lots", "inputs": X}, ValueError, "could not read 'lots'"),
        ({"budget": -3, "inputs": X}, ValueError, "got -3 bytes"),
        ({"budget": 2.0, "inputs": X}, ValueError, "must lie in"),
        ({"budget": 1000, "inputs": X}, ValueError, r"below the least peak any plan reaches.*MB.*smaller batch"),
        ({"budget": 1000, "inputs": X, "segments": 2}, ValueError, "below the least peak"),
    ],
)
def test_bad_budgets_say_what_and_how(arguments, error, match, monkeypatch):
    model = blocks_model()
    recompute_model(model, limit=1)
    refuse_compiles(monkeypatch)  # a budget below what stays resident needs no step compiled to be refused (JAX)
    with pytest.raises(error, match=match):
        recompute_model(model, **arguments)
    assert _model.recomputed_units(model) == ["block_0"]  # the earlier plan stays


def test_the_update_counted_is_twice_the_largest_weight_once_compiled():
    model = blocks_model()  # compiled with Adam
    largest = max(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    total = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    # Keras's PyTorch optimizers update every weight at once: a multiple of them all (`TORCH_UPDATE`).
    assert _memory._update_bytes(model) == (3 * total if BACKEND == "torch" else 2 * largest) > 0
    assert _memory._update_bytes(model, model.trainable_variables[:2]) == 2 * max(
        int(np.prod(v.shape)) * 4 for v in model.trainable_variables[:2]
    )
    assert _memory._update_bytes(keras.Model(model.inputs, model.outputs)) == 0  # no optimizer: neither slots nor update


@pytest.mark.skipif(BACKEND != "torch", reason="Keras's PyTorch optimizers")
@pytest.mark.skipif(
    os.environ.get("KERAS_RECOMPUTE_TESTS_BACKWARD_THREAD") == "1",
    reason="the profiler records the allocations of the thread it runs in, and the backward runs in another",
)
@pytest.mark.parametrize("name", sorted(_memory.TORCH_UPDATE) + ["SGD_momentum"])
def test_the_torch_update_is_measured(name):
    """`_memory.TORCH_UPDATE`: what each of Keras's PyTorch optimizers allocates above the weights, slots and
    gradients, from the profiler's allocation records, or a GPU allocator's peak (a Keras whose optimizers
    allocate otherwise fails here)."""
    import torch

    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    hidden = inputs
    for _ in range(3):
        hidden = layers.Dense(256)(hidden)
    model = keras.Model(inputs, hidden)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9) if name == "SGD_momentum" else getattr(keras.optimizers, name)()
    model.compile(optimizer=optimizer, loss="mse")
    x = np.ones((1, 256), "float32")
    model.train_on_batch(x, x)
    held = [v.value for v in model.variables + model.optimizer.variables]
    if torch.cuda.is_available():  # the device allocator's peak over the step, above what it held before
        start = sum(t.numel() * t.element_size() for t in held + [t.grad for t in held if t.grad is not None])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model.train_on_batch(x, x)
        torch.cuda.synchronize()
        peak = start + torch.cuda.max_memory_allocated() - before
    else:
        import gc

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
        import _measure

        gc.collect()  # earlier tests' garbage, freed inside the step, would count against it
        gc.disable()
        try:
            peak = _measure.torch_cpu_peak(lambda: model.train_on_batch(x, x), held)
        finally:
            gc.enable()
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    predicted = _memory.resident_bytes(model, x) + weights + _memory._update_bytes(model)  # weights' gradients and update
    # A factor off by one is all of the weights. The CPU's records read every optimizer within 0.4% of them (SGD's
    # 3 KB); they read 0.66x of them low, or a third high, depending on the tests before, until the trace left out
    # the frees it misread (NOTE [ frees the profiler misreads ]). A GPU's allocator peak: a third, never measured
    # closer.
    tolerance = 0.34 if torch.cuda.is_available() else 0.02
    assert abs(peak - predicted) < tolerance * weights, (name, (peak - predicted) / weights)


def test_memory_report_takes_a_model():
    with pytest.raises(TypeError, match="memory_report takes a Keras 3 or tf_keras model"):
        memory_report(lambda x: x, X)


# A child's last lines: the peak of a second training step (the first traces it), under the BFC allocator.
_STEP_PEAK = r"""
model.optimizer.build(model.trainable_variables)  # not in the first traced step: traced once (tests/test_fit.py)
model.train_on_batch(x, labels)
tf.config.experimental.reset_memory_stats("CPU:0")
model.train_on_batch(x, labels)
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
"""

_CHILD = r"""
import json, sys
import numpy as np, keras, tensorflow as tf
sys.path.insert(0, sys.argv[1])
from test_budget import blocks_model
from keras_recompute import memory_report, recompute_model

x = np.random.RandomState(0).standard_normal((16, 128, 64)).astype("float32")
labels = np.zeros(16, "int32")
model = blocks_model(6, seq=128, width=64)
plain = memory_report(model, x).predicted_peak
recompute_model(model, enabled=True)
full = memory_report(model, x).predicted_peak
budget = (plain + full) // 2
recompute_model(model, budget=budget, inputs=x, enabled=True)
report = memory_report(model, x)
""" + _STEP_PEAK + r"""print(json.dumps({"budget": budget, "peak": peak, "predicted": report.predicted_peak,
                  "plan": [row["policy"] for row in report.rows]}))
"""


_WEIGHTS_CHILD = r"""
import json
import numpy as np, keras, tensorflow as tf
from keras_recompute import memory_report


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up, self.down = keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1024)

    def call(self, x):
        return x + self.down(self.up(x))


keras.utils.set_random_seed(0)
inputs = keras.Input((1024,))
hidden = inputs
for i in range(8):
    hidden = Block(name=f"block_{i}")(hidden)
model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              jit_compile=False)
x, labels = np.random.RandomState(0).standard_normal((4, 1024)).astype("float32"), np.zeros(4, "int32")
report = memory_report(model, x, blocks=Block, execution="compiled")
""" + _STEP_PEAK + r"""gradients = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
print(json.dumps({"peak": peak, "predicted": report.predicted_peak, "resident": report.resident, "gradients": gradients}))
"""


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the allocator's peak: TensorFlow's BFC allocator on the CPU")
def test_a_graph_step_of_large_weights_is_predicted_without_their_reads_and_gradients_all_alive():
    """NOTE [ the peak of a plan ]: a TensorFlow graph applies each gradient as it is made, and a
    weight's read is the variable's buffer: 64 MiB of weights at batch 4 peak 16 MiB above resident."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    done = _fresh.run(["-c", _WEIGHTS_CHILD], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["peak"] - record["resident"] < record["gradients"] / 2, record  # not every gradient at once
    assert abs(record["predicted"] - record["peak"]) <= 0.10 * record["peak"], record


# Blocks of two Dense layers of 32 -> 256 -> 32 with a residual, for the children below.
_DENSE_BLOCK = r"""
class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up, self.down = keras.layers.Dense(256, activation="tanh"), keras.layers.Dense(32)

    def call(self, x):
        return x + self.down(self.up(x) * 2.0)  # only the down-projection's kernel gradient reads the product
"""

_FROZEN_CHILD = r"""
import json, sys
import numpy as np, keras, tensorflow as tf
from keras_recompute import memory_report, recompute_model
""" + _DENSE_BLOCK + r"""


keras.utils.set_random_seed(0)
inputs = keras.Input((64, 32))
hidden = inputs
for i in range(4):
    block = Block(name=f"block_{i}")
    hidden = block(hidden)
    block.down.trainable = sys.argv[1] == "trainable"
model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(hidden)))
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
x, labels = np.random.RandomState(0).standard_normal((64, 64, 32)).astype("float32"), np.zeros(64, "int32")
if sys.argv[1] == "recomputed":  # each block's backward makes its forward again, the product too
    recompute_model(model, blocks=Block, enabled=True)
report = memory_report(model, x, blocks=Block, execution="compiled")
""" + _STEP_PEAK + r"""print(json.dumps({"peak": peak, "predicted": report.predicted_peak}))
"""


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the allocator's peak: TensorFlow's BFC allocator on the CPU")
def test_what_a_frozen_weights_gradient_would_read_is_not_counted_kept():
    """NOTE [ measuring a unit on TensorFlow ]: a gradient function makes every input's gradient, and the runtime
    prunes a frozen weight's (LoRA's case): each block's 4 MiB product, which only its frozen kernel's gradient
    would read, is held when the kernel trains and not when it is frozen, and the predictions differ as the steps do.
    Recomputed, each block's backward makes the product again, and its prediction counts it."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    records = {}
    for how in ("frozen", "trainable", "recomputed"):
        done = _fresh.run(["-c", _FROZEN_CHILD, how], env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        records[how] = json.loads(done.stdout.strip().splitlines()[-1])
    held = records["trainable"]["peak"] - records["frozen"]["peak"]
    predicted = records["trainable"]["predicted"] - records["frozen"]["predicted"]
    assert held > 3 * 2**22, records  # the four products
    assert abs(predicted - held) <= 0.25 * held, records
    assert records["frozen"]["predicted"] >= records["frozen"]["peak"], records
    # Recomputed (frozen too), the product is made again in each backward: counted in its transient.
    assert records["recomputed"]["predicted"] >= 0.95 * records["recomputed"]["peak"], records


def frozen_prefix_model(frozen, stem_frozen=True):
    """`blocks_model` with its stem (if `stem_frozen`) and its first `frozen` blocks frozen, compiled again."""
    model = blocks_model()
    model.get_layer("stem").trainable = not stem_frozen
    for i in range(frozen):
        model.get_layer(f"block_{i}").trainable = False
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


ALL_OPTIONS = {"none", "full", "save_dots", "attention_core"}


@pytest.fixture(scope="module")
def trained_report():
    """`memory_report` of `frozen_prefix_model(0)`: every block trained (measured once for the tests below)."""
    return memory_report(frozen_prefix_model(0), X)


@pytest.mark.parametrize("frozen", [2, 4])
def test_a_unit_no_gradient_reaches_keeps_nothing_and_stays_plain(frozen, trained_report):
    """NOTE [ a unit no gradient reaches ] in `_memory`: blocks called before any trained weight (a frozen stem and
    blocks) keep nothing in a compiled step, and a plan leaves them plain; the trained blocks after them are
    measured as ever. A frozen block after a trained stem is reached, its inputs carrying the stem's gradient.

    Each check that measures every block again runs for one of the two (the suite's time): with 2 frozen, the plan
    and unfreezing; with all 4 frozen, a batch given as a tensor, the trained stem and (TensorFlow) an eager step."""
    model = frozen_prefix_model(frozen)
    report = memory_report(model, X)
    for i, row in enumerate(report.rows):
        if i < frozen:  # every option alike: nothing kept, no recompute run
            assert row["kept_bytes"] == dict.fromkeys(ALL_OPTIONS, 0), (i, row)
            assert row["recompute_seconds"] == dict.fromkeys(ALL_OPTIONS - {"none"}, 0.0), (i, row)
        else:
            assert set(row["kept_bytes"]) == ALL_OPTIONS and row["kept_bytes"]["none"] > 0, (i, row)
    assert report.predicted_peak < trained_report.predicted_peak
    assert f"{frozen} units (" in str(report) and "no gradient reaches" in str(report) and not trained_report.unreached
    if frozen == 4:
        # A batch given as a tensor is not differentiated either: a step takes no gradient of it.
        assert memory_report(frozen_prefix_model(frozen), keras.ops.convert_to_tensor(X)).predicted_peak == report.predicted_peak
        # After a trained stem every frozen block is reached.
        for row in memory_report(frozen_prefix_model(frozen, stem_frozen=False), X).rows:
            assert set(row["kept_bytes"]) == ALL_OPTIONS and row["kept_bytes"]["none"] > 0, row
        if BACKEND == "tensorflow":  # an eager tape records the frozen blocks (their variables): they keep what they read
            for row in memory_report(frozen_prefix_model(frozen), X, execution="eager").rows:
                assert set(row["kept_bytes"]) == ALL_OPTIONS and row["kept_bytes"]["none"] > 0, row
        return
    # The least peak: every trained block fully recomputed, the frozen ones plain.
    recompute_model(model, budget=report.floor, inputs=X, enabled=True)
    assert [row["policy"] for row in memory_report(model, X).rows][:frozen] == ["none"] * frozen
    for layer in model.layers:  # unfrozen (fine-tuning's second phase): measured again, not read from what was kept
        layer.trainable = True
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    unfrozen = memory_report(model, X)
    assert not unfrozen.unreached and all(row["kept_bytes"]["none"] > 0 for row in unfrozen.rows), unfrozen.rows


def test_a_frozen_unit_called_again_after_a_trained_layer_is_reached():
    """A shared block, frozen, called first on the batch and again on a trained layer's output: its second call
    carries a gradient back through it, so it keeps what any block keeps (NOTE [ a unit no gradient reaches ])."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 16))
    shared = AttentionBlock(16, name="shared")
    hidden = layers.Dense(16, name="middle")(shared(inputs))
    outputs = layers.Dense(3)(layers.GlobalAveragePooling1D()(shared(hidden)))
    model = keras.Model(inputs, outputs)
    shared.trainable = False
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    (row,) = memory_report(model, X, blocks=AttentionBlock).rows
    assert set(row["kept_bytes"]) == ALL_OPTIONS and row["kept_bytes"]["none"] > 0, row


_FROZEN_PREFIX_CHILD = r"""
import json, sys
import numpy as np, keras, tensorflow as tf
from keras_recompute import memory_report
""" + _DENSE_BLOCK + r"""


keras.utils.set_random_seed(0)
inputs = keras.Input((64, 32))
hidden = keras.layers.Dense(32, name="stem")(inputs)
blocks = [Block(name=f"block_{i}") for i in range(6)]
for block in blocks:
    hidden = block(hidden)
model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(hidden)))
model.get_layer("stem").trainable = False
for block in blocks[: int(sys.argv[1])]:
    block.trainable = False
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
x, labels = np.random.RandomState(0).standard_normal((128, 64, 32)).astype("float32"), np.zeros(128, "int32")
report = memory_report(model, x, blocks=Block, execution="compiled")
""" + _STEP_PEAK + r"""print(json.dumps({"peak": peak, "predicted": report.predicted_peak}))
"""


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the allocator's peak: TensorFlow's BFC allocator on the CPU")
@pytest.mark.parametrize("frozen", [4, 6])
def test_a_frozen_prefix_is_predicted_as_its_step_peaks(frozen):
    """NOTE [ a unit no gradient reaches ]: 6 blocks under a trained head, the stem and the first 4 (or all 6)
    frozen. Counted as keeping their activations, the step was predicted at 2.0x (6.1x) its peak; now within
    -10%..+60% of it (all frozen, the step peaks in the forward: a block's input and its widest layer's call, where
    TensorFlow's executor orders the ops differently from run to run: 11.1 to 12.2 MiB, predicted 11.4). With 4
    frozen the prediction, 53.8 MiB, is above the peak by as much as the executor's order allows: 45.7-46.0 MiB
    with its two threads, 36.2-37.9 with one, as on a loaded machine (CI's run beside another: 36.3; 2026-12-02)."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    done = _fresh.run(["-c", _FROZEN_PREFIX_CHILD, str(frozen)], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.9 * record["peak"] <= record["predicted"] <= 1.6 * record["peak"], record


def conv_blocks_model(count=2, size=8, width=8):
    """Residual blocks of Conv2D, BatchNormalization and ReLU under a pooling head: a small CNN."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((size, size, width))
    hidden = inputs
    for i in range(count):
        branch = layers.Conv2D(width, 3, padding="same", use_bias=False, name=f"conv_{i}")(hidden)
        branch = layers.ReLU(name=f"relu_{i}")(layers.BatchNormalization(name=f"norm_{i}")(branch))
        hidden = layers.Add(name=f"add_{i}")([hidden, branch])
    model = keras.Model(inputs, layers.Dense(1, name="head")(layers.GlobalAveragePooling2D()(hidden)))
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_a_cnn_compiled_on_tensorflow_is_reported_with_its_allocator_line():
    """NOTE [ a CNN on TensorFlow's allocator ]: there a CNN's step peaked up to 1.36x its prediction (MobileNetV2
    under full); the report says so for a compiled step of a model with a convolution, on TensorFlow only."""
    x = np.random.RandomState(0).rand(4, 8, 8, 8).astype("float32")
    report = memory_report(conv_blocks_model(), x)
    tensorflow = BACKEND == "tensorflow"
    assert bool(report.allocator) == tensorflow and (report.allocator in str(report)), str(report)
    if tensorflow:
        assert "1.36x" in report.allocator and "70%" in report.allocator, report.allocator
        assert not memory_report(conv_blocks_model(), x, execution="eager").allocator  # measured with the allocator
        # A model with no convolution: its prediction held to a few percent, no line (off TensorFlow no model has
        # one, the CNN included).
        dense = memory_report(blocks_model(), np.random.RandomState(0).standard_normal((4, 8, 16)).astype("float32"))
        assert not dense.allocator and "convolutional" not in str(dense), str(dense)
    # Planning to a budget says it too, at the caller's line; a model with no convolution plans silently.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recompute_model(conv_blocks_model(), budget=10**9, inputs=x, enabled=True)
        if tensorflow:
            recompute_model(blocks_model(), budget=10**9, inputs=np.zeros((4, 8, 16), "float32"), enabled=True)
    said = [w for w in caught if "convolutional network" in str(w.message)]
    assert len(said) == tensorflow, [str(w.message) for w in caught]
    assert all(w.filename == __file__ and "recompute_model(budget=1000000000)" in str(w.message) for w in said), said
    if tensorflow:
        with pytest.warns(UserWarning, match="largest_fit: On TensorFlow a convolutional network") as fit_said:
            _model.largest_fit(
                conv_blocks_model(), 10**9, lambda n: np.zeros((n, 8, 8, 8), "float32"), options=["none"], plan=False
            )
        assert {w.filename for w in fit_said if "convolutional" in str(w.message)} == {__file__}


_CNN_CHILD = r"""
import json, sys
import numpy as np, tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)  # one order of ops: the peak does not vary with the load
if sys.argv[1] == "tf_keras":
    import tf_keras as keras
else:
    import keras
from keras_recompute import memory_report, recompute_model
from keras_recompute.backends import tensorflow as backend

runs = []
measure = backend._step_bytes_at
backend._step_bytes_at = lambda model, inputs: runs.append(len(inputs)) or measure(model, inputs)
keras.utils.set_random_seed(0)
inputs = keras.Input((32, 32, 32))
hidden = inputs
for i in range(8):  # conv_blocks_model's, of 8 blocks: plain's peak well over the budget (the test's NOTE)
    branch = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name=f"conv_{i}")(hidden)
    branch = keras.layers.ReLU(name=f"relu_{i}")(keras.layers.BatchNormalization(name=f"norm_{i}")(branch))
    hidden = keras.layers.Add(name=f"add_{i}")([hidden, branch])
model = keras.Model(inputs, keras.layers.Dense(1, name="head")(keras.layers.GlobalAveragePooling2D()(hidden)))
model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
x = np.random.RandomState(0).rand(32, 32, 32, 32).astype("float32")
labels = np.zeros((32, 1), "float32")
before = [w.numpy() for w in model.weights]
plain = memory_report(model, x)
changed = any(not np.array_equal(a, w.numpy()) for a, w in zip(before, model.weights))
changed = changed or int(model.optimizer.iterations.numpy()) != 0
changed = changed or any(np.any(v.numpy()) for v in model.optimizer.variables if len(v.shape))  # momentum slots
budget = (plain.predicted_peak + plain.floor) // 2
recompute_model(model, budget=budget, inputs=x, enabled=True)
report = memory_report(model, x)
""" + _STEP_PEAK + r"""print(json.dumps({"runs": runs, "changed": changed, "line": plain.allocator, "budget": budget,
                  "peak": peak, "predicted": report.predicted_peak, "plan": [row["policy"] for row in report.rows]}))
"""


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the allocator's peak: TensorFlow's BFC allocator on the CPU")
@pytest.mark.parametrize("framework", ["keras", "tf_keras"])
def test_a_cnn_is_planned_with_its_step_run_where_the_allocator_keeps_figures(framework):
    """NOTE [ calibrating a CNN to TensorFlow's allocator ]: under the BFC allocator a CNN's step is run at a quarter
    and a half of the batch (the model and its optimizer left as they were), no allocator line is shown, a plan for
    a budget meets it as its step runs, and the plan's prediction is not below its step's peak."""
    if framework == "tf_keras":
        pytest.importorskip("tf_keras")
    if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0":
        # Without oneDNN, TensorFlow's convolutions hold a scratch of a fixed size (the NOTE) that recompute does not
        # lower: this CNN under full predicted 88.6 MB against plain's 84.1 (2026-12-05), and no budget between them.
        pytest.skip("without oneDNN this CNN's recompute lowers no peak: nothing to plan")
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    done = _fresh.run(["-c", _CNN_CHILD, framework], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["runs"] and set(record["runs"]) == {8, 16}, record  # never the batch itself: it may not fit
    assert not record["changed"] and not record["line"], record
    # Not "none" everywhere: the budget, half-way between plain's peak and the floor, is under plain's peak by more
    # than the planner's own measure of plain varies. It extrapolates from 8 and 16 rows, and what 8 rows read varies
    # with the allocator's history in the process (likely BFC's free chunks; the NOTE in backends/tensorflow.py):
    # on 4 blocks 14.8-19.1 MB where 16 read 29.5-31.7 (2026-12-05, 64 runs, two at a time), and the budget was
    # 1.1-12.6 MB under the planner's measure of plain: all "none" came out once in CI and once in 23 local runs.
    # On 8 blocks it is 19-28 MB under it (12 runs, two at a time; plans of 3-6 of 7 units recomputed).
    assert any(p != "none" for p in record["plan"]), record
    # The allocator's spread, not a count's error: extrapolated from steps of 8 and 16 rows whose peaks vary from run
    # to run, trace to trace and with the load (2026-12-02): the plan's step peaked at 0.89-0.98x its budget alone or
    # beside another run, 0.99-1.00x in CI's TensorFlow run beside its JAX run; its prediction 0.95-1.06x the peak, in
    # CI 0.80-0.84x. Half the step's bytes peaked at 1.68x its budget. On 2026-12-04 (a slow evening, tf_keras) CI's
    # step peaked at 0.77x its budget and the plan's second report predicted 1.41x that peak (1.09x the budget), where
    # four local runs gave 0.91-1.20x: over the peak is the side a plan fits on, so the bound above allows 1.6x.
    assert record["peak"] <= 1.25 * record["budget"], record
    assert 0.7 * record["peak"] <= record["predicted"] <= 1.6 * record["peak"], record


_LOSS_CHILD = r"""
import json, sys
import numpy as np, tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)  # one order of ops: the peak does not vary with the load
if sys.argv[1] == "tf_keras":
    import tf_keras as keras
else:
    import keras
from keras_recompute import memory_report

VOCABULARY = 4000


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up, self.down = keras.layers.Dense(64, activation="gelu"), keras.layers.Dense(32)

    def call(self, x):
        return x + self.down(self.up(x))


keras.utils.set_random_seed(0)
inputs = keras.Input((64, 32))
hidden = inputs
for i in range(2):
    hidden = Block(name=f"block_{i}")(hidden)
model = keras.Model(inputs, keras.layers.Dense(VOCABULARY)(hidden))  # a language model's head: its logits
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"] if sys.argv[2] == "metrics" else None)
x = np.random.RandomState(0).standard_normal((8, 64, 32)).astype("float32")
labels = np.random.RandomState(1).randint(0, VOCABULARY, (8, 64)).astype("int32")
report = memory_report(model, x, blocks=Block)
""" + _STEP_PEAK + r"""print(json.dumps({"peak": peak, "predicted": report.predicted_peak, "resident": report.resident,
                  "logits": 8 * 64 * VOCABULARY * 4}))
"""


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the allocator's peak: TensorFlow's BFC allocator on the CPU")
@pytest.mark.parametrize("framework", ["keras", "tf_keras"])
@pytest.mark.parametrize("metrics", ["metrics", "none"])
def test_a_graph_step_that_peaks_at_its_loss_is_predicted_there(framework, metrics):
    """NOTE [ the loss's point on TensorFlow ]: a language model's logits and its loss's gradient on them, the
    step's peak, were counted nowhere (keras-hub Gemma's step predicted at 0.52-0.61 of its measured peak)."""
    if framework == "tf_keras":
        pytest.importorskip("tf_keras")
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    done = _fresh.run(["-c", _LOSS_CHILD, framework, metrics], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    print(record)
    assert record["peak"] - record["resident"] > record["logits"], record  # the logits dominate the step
    # Not under (what the prediction was without the loss's point); over by at most twice the logits, where the
    # step's kernels reused the logits' buffer (no metrics) or tf_keras's metric held less than Keras 3's.
    assert -0.10 * record["peak"] <= record["predicted"] - record["peak"] <= 2 * record["logits"] + 0.15 * record["peak"], record


_LOOP_CHILD = r"""
import json, os, sys
import numpy as np, keras
sys.path[:0] = [sys.argv[1], os.path.join(os.path.dirname(sys.argv[1]), "benchmarks")]
from test_budget import blocks_model
from eager_budget import planned_loop_peak

method, loop, budget = sys.argv[2], sys.argv[3], int(sys.argv[4])
x = np.random.RandomState(0).standard_normal((16, 128, 64)).astype("float32")
compiled = blocks_model(6, seq=128, width=64)
model = keras.Model(compiled.inputs, compiled.outputs)  # not compiled: trained in a loop of one's own
print(json.dumps(planned_loop_peak(model, x, np.zeros(16, "int32"), method, loop, budget)))
"""


def _loop_child(method, loop, budget=0):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    here = os.path.dirname(os.path.abspath(__file__))
    done = _fresh.run(["-c", _LOOP_CHILD, here, method, loop, str(budget)], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the allocator's peak: TensorFlow's BFC allocator on the CPU")
def test_a_plan_for_a_model_not_compiled_fits_an_eager_loop_and_a_compiled_plan_a_function():
    """NOTE [ which execution a plan is for ]: an eager `tf.GradientTape` loop keeps about twice what
    a `tf.function` step keeps. A model not compiled is planned for eager execution, and fits a
    half-way budget there; named `"compiled"`, the plan fits a `tf.function` loop and recomputes less.
    """
    plain, full = _loop_child("none", "eager")["peak"], _loop_child("full", "eager")["peak"]
    budget = (plain + full) // 2
    eager = _loop_child("inferred", "eager", budget)
    assert eager["execution"] == "eager", eager
    assert eager["peak"] <= 1.10 * budget, (budget, eager)
    assert any(p != "none" for p in eager["plan"]) and eager["plan"].count("full") < 6, eager
    compiled = _loop_child("compiled", "function", budget)
    assert compiled["execution"] == "compiled", compiled
    assert compiled["peak"] <= 1.10 * budget, (budget, compiled)
    order = {"none": 0, "attention_core": 1, "save_dots": 2, "full": 3}
    assert sum(order[p] for p in compiled["plan"]) < sum(order[p] for p in eager["plan"]), (eager, compiled)


def test_execution_is_checked_and_stated():
    model = blocks_model(2)
    with pytest.raises(ValueError, match=r"execution=\.\.\.\) got 'jit'; valid values are \['eager', 'compiled'\]"):
        recompute_model(model, budget=0.5, inputs=X, execution="jit")
    with pytest.raises(ValueError, match=r"recompute_model\(execution=\.\.\.\) is part of planning to a budget"):
        recompute_model(model, execution="eager")
    assert memory_report(model, X).execution == ("eager" if BACKEND == "torch" else "compiled")  # compiled, not run_eagerly
    uncompiled = keras.Model(model.inputs, model.outputs)
    report = memory_report(uncompiled, X)
    assert report.execution == "eager" and "not compiled" in str(report) or BACKEND == "torch", str(report)
    if BACKEND == "torch":
        with pytest.raises(ValueError, match="Keras runs PyTorch eagerly"):
            memory_report(model, X, execution="compiled")
    else:
        assert "run compiled" in str(memory_report(uncompiled, X, execution="compiled"))


@pytest.mark.skipif(BACKEND != "jax", reason="XLA states a compiled step's buffers")
@pytest.mark.parametrize("policy", ["none", "full"])
def test_the_compiled_step_is_measured_as_keras_runs_it(policy):
    """NOTE [ checking a plan on JAX ]: the step `compiled_peak` compiles holds what Keras's own donated `train_step`
    does, with its loss and Adam. The gradient alone was 23% under it plain and 12% over it recomputed."""
    import jax

    from keras_recompute.backends import jax as jax_backend

    model = blocks_model(4, seq=128, width=64)
    x = np.random.RandomState(1).standard_normal((16, 128, 64)).astype("float32")
    labels = np.zeros((16,), "int32")
    if policy != "none":
        recompute_model(model, policy=policy, enabled=True)
    model.train_on_batch(x, labels)
    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables, model.metrics_variables))
    lowered = jax.jit(model.train_step, donate_argnums=0).lower(state, (x, labels))
    expected = lowered.compile().memory_analysis().temp_size_in_bytes
    assert jax_backend.step_bytes(model, x) == pytest.approx(expected, rel=0.02)
    # Compiled for its memory alone (the code unoptimized), the same program states the same bytes, to the byte.
    unoptimized = lowered.compile(compiler_options=jax_backend.MEMORY_ONLY)  # the option is taken, not fallen back from
    assert unoptimized.memory_analysis().temp_size_in_bytes == expected


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's persistent compilation cache")
def test_a_program_from_the_runs_compile_cache_states_what_its_compile_did():
    """The JAX run shares one persistent compilation cache (`tests/conftest.py`): a step's bytes read from a
    cached program are those of its compile, so no figure of the suite changes with the cache."""
    import jax

    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not folder:
        pytest.skip("no persistent compilation cache in this run")
    from keras_recompute.backends import jax as jax_backend

    model = blocks_model(2, seq=24, width=40)
    recompute_model(model, policy="save_dots", enabled=True)
    x = np.ones((3 + os.getpid() % 61, 24, 40), "float32")  # this process's own batch: a miss, even in a kept folder
    # This process's own events: the folder is shared with the other workers, whose writes a count of its files saw
    # (the H200's 8 workers: "compiled again" where it was not).
    events = []

    def listen(event, **kwargs):
        events.append(event)

    jax.monitoring.register_event_listener(listen)
    try:
        compiled = jax_backend.step_bytes(model, x)
        assert "/jax/compilation_cache/cache_misses" in events, "the step's program was not written to the cache"
        jax.clear_caches()  # what a new process has: only the folder
        del events[:]
        assert jax_backend.step_bytes(model, x) == compiled > 0
    finally:
        jax.monitoring.unregister_event_listener(listen)
    assert "/jax/compilation_cache/cache_hits" in events, "the same program was compiled again, not read from the cache"
    assert "/jax/compilation_cache/cache_misses" not in events, "the same program was compiled again"


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the allocator's peak: TensorFlow's BFC allocator on the CPU")
def test_the_measured_peak_of_a_plan_meets_its_budget():
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    here = os.path.dirname(os.path.abspath(__file__))
    done = _fresh.run(["-c", _CHILD, here], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert any(p != "none" for p in record["plan"]) and record["plan"].count("full") < 6, record
    assert record["peak"] <= 1.05 * record["budget"], record
    assert abs(record["predicted"] - record["peak"]) <= 0.10 * record["peak"], record


class NotBuiltYet(keras.Model):
    """Built at its first call: no weights when `recompute_model(budget=)` is called."""

    def __init__(self):
        super().__init__()
        self.blocks = [FeedForwardBlock(name=f"block_{i}") for i in range(2)]
        self.head = layers.Dense(3)

    def call(self, inputs):
        for block in self.blocks:
            inputs = block(inputs)
        return self.head(inputs)


class FeedForwardBlock(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(64, activation="gelu")
        self.down = layers.Dense(16)

    def call(self, inputs):
        return inputs + self.down(self.up(inputs))


def test_a_model_not_built_yet_is_planned_and_then_trains():
    """Its weights are made by the measure; the optimizer is built after, with them (built first, with none, the
    first training step refuses every weight)."""
    model = NotBuiltYet()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.RandomState(0).standard_normal((8, 16)).astype("float32")
    with pytest.raises(ValueError, match="below the least peak"):
        recompute_model(model, budget="1KB", inputs=x, blocks=FeedForwardBlock)
    recompute_model(model, budget="1GB", inputs=x, blocks=FeedForwardBlock)
    model.train_on_batch(x, np.zeros((8,), "int32"))
    assert len(model.optimizer.variables) > 2 * len(model.trainable_variables)


class StemThenFrozenBlocks(NotBuiltYet):
    """A trained stem, then frozen blocks: the blocks are reached by the stem's gradient."""

    def __init__(self):
        super().__init__()
        self.stem = layers.Dense(16)
        for block in self.blocks:
            block.trainable = False

    def call(self, inputs):
        return super().call(self.stem(inputs))


def test_a_model_the_measuring_forward_builds_counts_every_unit_reached():
    """NOTE [ a unit no gradient reaches ]: before its first call the stem owns no weight, so a forward that builds
    the model cannot tell which layers own trained ones when they run; it counts every unit as reached (frozen
    blocks after a trained stem counted as keeping nothing would under-predict the step)."""
    model = StemThenFrozenBlocks()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.RandomState(0).standard_normal((8, 16)).astype("float32")
    report = memory_report(model, x, blocks=FeedForwardBlock)
    assert len(report.rows) == 2 and not report.unreached
    assert all(row["kept_bytes"]["none"] > row["kept_bytes"]["full"] for row in report.rows), report.rows


class DropoutBlock(layers.Layer):
    """Its `call` takes no `training`: its dropout reads the call context's, as Keras gives it."""

    def __init__(self, rate, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(64, activation="gelu")
        self.dropout = layers.Dropout(rate, seed=1)
        self.down = layers.Dense(16)

    def call(self, inputs):
        return inputs + self.down(self.dropout(self.up(inputs)))


class PassesTraining(DropoutBlock):
    def call(self, inputs, training=None):
        return inputs + self.down(self.dropout(self.up(inputs), training=training))


class TakesNoTraining(keras.Model):
    """`call(self, inputs)`: Keras's trainer calls it without `training`, and its blocks' dropout runs off."""

    def __init__(self, rate=0.5):
        super().__init__()
        self.blocks = [DropoutBlock(rate, name=f"block_{i}") for i in range(2)]
        self.head = layers.Dense(3)

    def call(self, inputs):
        for block in self.blocks:
            inputs = block(inputs)
        return self.head(inputs)


def dropout_blocks(block, rate):
    inputs = keras.Input(X.shape[1:])
    hidden = inputs
    for i in range(2):
        hidden = block(rate, name=f"block_{i}")(hidden)
    return keras.Model(inputs, layers.Dense(3)(hidden))


def test_a_block_whose_call_takes_no_training_is_measured_as_keras_trains_it():
    """Each unit is measured with the `training` its call runs with in Keras's training step. A block whose `call`
    takes none, in a model that is given it (a functional model), reads it from the call context: its dropout is
    on, and it keeps what a block that takes `training` and passes it on keeps, more than with no dropout (it was
    measured with its dropout off until 2026-11-27). A subclassed model whose `call` takes none is not given it
    by Keras's trainer, and its blocks' dropout runs off: measured so (on JAX such a model was refused with a
    TypeError: `training=` given to its `call`)."""
    models = {"no training": dropout_blocks(DropoutBlock, 0.5), "training": dropout_blocks(PassesTraining, 0.5),
              "no dropout": dropout_blocks(DropoutBlock, 0.0), "subclassed": TakesNoTraining()}
    kept = {}
    for name, model in models.items():
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model(X[:2])  # built
        blocks = PassesTraining if name == "training" else DropoutBlock
        kept[name] = [row["kept_bytes"]["none"] for row in memory_report(model, X, blocks=blocks).rows]
    assert kept["no training"] == kept["training"], kept
    assert all(a > b for a, b in zip(kept["no training"], kept["no dropout"])), kept
    assert kept["subclassed"] == kept["no dropout"], kept
