"""`keras_recompute.verify`: passes on clean models, and names each defect built into a model (issue 43).

Clean: the attention model of `_updates.py` (every policy), a model with
dropout and BatchNorm, and a keras-hub backbone with LoRA on; on each Keras 3
backend, and tf_keras. Defects, each of which verify must name by unit and
weight: a layer whose call changes with a Python counter (PyTorch and
TensorFlow: the recompute check raises; JAX replays its trace and is exact),
an in-place write the plain model refuses (PyTorch), a raw random op the
recompute draws again (TensorFlow), and a backend whose recompute doubles its
weight gradients (a mutation of ours, every backend). And verify's own
yardsticks: the step it runs is the model's as compiled (eager, tf.function,
XLA), a plain step that is wrong is named as such, a compiled difference
passes as the compiler's rounding only where op by op the steps match
(NOTE [ what compiling moves ]), and under torch.compile the steps draw the
same dropout masks (NOTE [ torch.compile's random numbers ]).
"""

import json
import os

import keras
import numpy as np
import pytest
from keras import layers, ops

from _keras3_twins import BACKEND
from _mutations import double_gradients
from _updates import attention_model, data

from keras_recompute import verify

X, Y = data()


def on_a_gpu():
    if BACKEND == "jax":
        import jax

        return jax.devices()[0].platform != "cpu"
    if BACKEND == "torch":
        import torch

        return torch.cuda.is_available()
    return False


def compiled(model, **options):
    model.compile(optimizer="adam", loss="mse", **options)
    return model


@pytest.mark.parametrize("policy", ["full", "save_dots", "attention_core"])
def test_a_clean_model_passes_under_each_policy(policy):
    model = compiled(attention_model(keras))
    before = [np.array(w) for w in model.get_weights()]
    report = verify(model, X, Y, policy=policy, trials=8)
    assert report.ok, str(report)
    assert len(report.units) == 2 and report.trials == 8
    if policy != "full" and on_a_gpu():
        # At this size a GPU step's peak is the weights and the matmuls' workspaces, and what save_dots and
        # attention_core free is lost in them. The H200: PyTorch's allocator, plain 69.9 MB and attention_core 33 KB
        # more; XLA's figures, plain 35.6 MB, save_dots 36.1 and attention_core 36.0.
        assert 0 < report.recomputed_peak <= 1.02 * report.plain_peak, str(report)
    else:
        assert report.plain_peak > report.recomputed_peak > 0, str(report)  # measured, or predicted on a CPU
        assert "x lower)" in str(report)
        report.recomputed_peak = report.plain_peak + 1  # as on a GPU: the report says nothing was saved
        assert "1.00x higher: nothing saved" in str(report)
    assert [row["unit"] for row in report.rows][:2] == report.units
    assert report.plain_seconds > 0 and report.recomputed_seconds > 0
    assert "verdict: OK" in str(report)
    # The model itself is left as it was: weights, optimizer, no plan.
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    assert model.optimizer.__class__.__name__ == "Adam"
    from keras_recompute import _model

    assert _model.recomputed_units(model) == []


class NoisyBlock(layers.Layer):
    """Dropout and BatchNorm inside the unit: verify must set the same seeds for both copies."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(32, activation="gelu")
        self.dropout = layers.Dropout(0.3, seed=1)
        self.norm = layers.BatchNormalization()
        self.down = layers.Dense(16)

    def call(self, inputs, training=None):
        return inputs + self.down(self.norm(self.dropout(self.up(inputs), training=training), training=training))

    def get_config(self):
        return super().get_config()


def blocks_model(block_class, count=3):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = inputs
    for _ in range(count):
        hidden = block_class()(hidden)
    return compiled(keras.Model(inputs, layers.Dense(1)(hidden)))


def test_dropout_and_batch_norm_pass():
    x = np.random.RandomState(1).normal(size=(8, 16)).astype("float32")
    y = np.random.RandomState(2).normal(size=(8, 1)).astype("float32")
    report = verify(blocks_model(NoisyBlock), x, y, trials=4, memory=False)
    assert report.ok, str(report)


class Drifting(layers.Layer):
    """Branches on a counter it changes itself: the recompute computes another function."""

    calls = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(16)

    def call(self, inputs):
        Drifting.calls += 1
        return inputs + self.dense(inputs) * (2.0 if Drifting.calls % 2 else 3.0)


@pytest.mark.skipif(BACKEND == "jax", reason="JAX traces the call once: its recompute is the forward's function")
def test_a_call_that_changes_with_a_counter_fails_with_the_recompute_error():
    x = np.random.RandomState(1).normal(size=(8, 16)).astype("float32")
    y = np.zeros((8, 1), "float32")
    report = verify(blocks_model(Drifting), x, y, trials=2, memory=False)
    assert not report.ok
    assert "differ from its forward" in report.failure and "drifting" in report.failure, report.failure


def test_a_doubled_gradient_is_named_by_unit_and_weight(monkeypatch):
    """A mutation of ours: each recomputed unit's output carries twice its gradient."""
    model = compiled(attention_model(keras))
    double_gradients(monkeypatch)
    report = verify(model, X, Y, trials=2, memory=False)
    assert not report.ok
    last = report.units[-1]  # the units before it differ through its input gradient
    assert f"unit {last!r} (weight '{last}/" in report.failure, report.failure
    assert f"recompute_model(model, blocks={report.units[:-1]!r})" in report.failure
    verdicts = {row["unit"]: row["ok"] for row in report.rows}
    assert verdicts[last] is False
    if BACKEND != "torch":  # a compiled step: run op by op, the steps differ too (NOTE [ what compiling moves ])
        assert "Run op by op (run_eagerly=True) the steps differ too" in report.failure, report.failure
        assert report.op_by_op["compile_spread"] < 1e-5 and not report.op_by_op["exact"]


@pytest.mark.skipif(BACKEND != "torch", reason="in-place writes to tensors are PyTorch's")
def test_an_in_place_write_is_named():
    from test_inplace_torch import IDS, TARGETS, stages_model

    model = stages_model(in_place=True)
    report = verify(model, IDS, TARGETS, trials=2, memory=False)
    assert not report.ok and "modified by an inplace operation" in report.failure, report.failure


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a raw TensorFlow random op")
def test_a_raw_random_op_is_named():
    import tensorflow as tf

    class RawNoise(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = layers.Dense(16)

        def call(self, inputs):
            return inputs + self.dense(inputs * tf.random.uniform(tf.shape(inputs)))

    x = np.random.RandomState(1).normal(size=(8, 16)).astype("float32")
    report = verify(blocks_model(RawNoise), x, np.zeros((8, 1), "float32"), trials=2, memory=False)
    assert not report.ok and "differ from its forward" in report.failure, report.failure


class SharedPath(layers.Layer):
    """A weight made outside the layer's name scope: its path ('scale') is every instance's (as keras-hub's T5,
    BLIP-2 and SmolLM3 make some of theirs)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(16)
        self.scale = keras.Variable(np.linspace(0.5, 1.5, 16).astype("float32"), name="scale")

    def call(self, inputs):
        return inputs + self.dense(inputs) * self.scale


@pytest.mark.skipif(BACKEND != "torch", reason="Keras registers torch parameters by path on PyTorch only")
def test_a_plain_step_that_accumulates_a_gradient_is_named():
    """Keras on PyTorch registers a model's variables as torch parameters by path: of two weights with one path,
    one is left out, `zero_grad` misses it and its gradient adds up step after step (plain training is wrong).
    verify says so, and does not blame a recomputed unit."""
    x = np.random.RandomState(1).normal(size=(8, 16)).astype("float32")
    report = verify(blocks_model(SharedPath, count=2), x, np.zeros((8, 1), "float32"), trials=2, memory=False)
    assert not report.ok
    assert "plain step is wrong without recompute" in report.failure and "'scale'" in report.failure, report.failure
    assert "v.value.grad = None" in report.failure


def test_a_plain_step_that_is_not_finite_is_named():
    x = np.random.RandomState(1).normal(size=(8, 16)).astype("float32")
    x[0, 0] = np.nan
    report = verify(blocks_model(NoisyBlock), x, np.zeros((8, 1), "float32"), trials=2, memory=False)
    assert not report.ok and "plain step's update of" in report.failure and "not finite" in report.failure, report.failure


def dense_block_class(K):
    """A residual Dense block's class, built with `K` (`keras` or `tf_keras`)."""

    class DenseBlock(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.up = K.layers.Dense(32, activation="gelu")
            self.down = K.layers.Dense(16)

        def call(self, inputs):
            return inputs + self.down(self.up(inputs))

    return DenseBlock


DenseBlock = dense_block_class(keras)


@pytest.fixture
def mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.config.set_dtype_policy("float32")


def test_a_loss_scaled_model_is_compared_at_the_scale_it_settles_to(mixed_float16):
    """NOTE [ a loss-scaled step ]: targets of 100 overflow the float16 gradients at the first loss scales (32768
    down to 512; it settles at 256 on PyTorch), and each copy's optimizer halved its scale from step to step, so the recomputed trials that no
    longer overflowed were compared with plain steps that did: DIFFERS, with the whole update (1.09 normwise found
    on attention over a mask_zero Embedding, PyTorch)."""
    x = np.random.RandomState(1).normal(size=(8, 16)).astype("float32")
    y = np.full((8, 1), 100.0, "float32")
    model = blocks_model(DenseBlock)
    assert "LossScale" in type(model.optimizer).__name__
    report = verify(model, x, y, trials=8, plain_trials=2, memory=False)
    assert report.ok, str(report)
    assert max(row["difference"] for row in report.rows) == 0.0 or BACKEND != "torch", str(report)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf_keras runs on TensorFlow")
def test_a_loss_scaled_tf_keras_model_is_compared_at_the_scale_it_settles_to():
    """The same on tf_keras, whose dynamic loss scale is no variable of its optimizer's (`_loss_scale`)."""
    import tf_keras

    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        Block = dense_block_class(tf_keras)
        tf_keras.utils.set_random_seed(0)
        inputs = tf_keras.Input((16,))
        hidden = inputs
        for _ in range(3):
            hidden = Block()(hidden)
        model = tf_keras.Model(inputs, tf_keras.layers.Dense(1)(hidden))
        model.compile(optimizer="adam", loss="mse")
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    x = np.random.RandomState(1).normal(size=(8, 16)).astype("float32")
    report = verify(model, x, np.full((8, 1), 100.0, "float32"), blocks=Block, trials=8, plain_trials=2, memory=False)
    assert report.ok, str(report)


def test_a_plain_step_that_moves_no_weight_is_named(mixed_float16):
    """Targets past float16's range: every loss-scaled step overflows, at every scale, and is skipped."""
    x = np.random.RandomState(1).normal(size=(8, 16)).astype("float32")
    report = verify(blocks_model(DenseBlock), x, np.full((8, 1), 1e9, "float32"), trials=2, memory=False)
    assert not report.ok and "the plain step moved no weight" in report.failure, report.failure


def test_bad_arguments_say_what_to_do():
    model = attention_model(keras)
    with pytest.raises(ValueError, match="not compiled"):
        verify(model, X, Y)
    compiled(model)
    with pytest.raises(ValueError, match="plain_trials >= 2"):
        verify(model, X, Y, plain_trials=1)
    with pytest.raises(TypeError, match="trials"):
        verify(model, X, Y, trials=2.5)
    with pytest.raises(TypeError, match="compiled Keras 3 or tf_keras model"):
        verify(object(), X, Y)
    with pytest.raises(ValueError, match=r"verify\(policy=...\) got 'some'; valid policies"):
        verify(model, X, Y, policy="some")


def test_a_step_that_raises_compares_nothing_and_says_so():
    """verify(model, x) of a model whose loss takes targets: the plain step raises. The report says so, names the
    missing y, and its table and times show nothing compared (its table read DIFFERS at a difference of 0, its time
    'nanx')."""
    report = verify(compiled(attention_model(keras)), X, trials=2, memory=False)
    assert not report.ok and report.trials == 0
    assert "the plain step raised" in report.failure and "verify was given no y" in report.failure, report.failure
    text = str(report)
    assert "not compared" in text and "DIFFERS" not in text and "step time: not measured (a step raised)" in text, text


def test_a_keras_hub_backbone_with_lora_passes():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=8,
        dropout=0.1,
    )
    backbone.enable_lora(4)
    ids = keras.Input((8,), dtype="int32", name="token_ids")
    padding = keras.Input((8,), dtype="int32", name="padding_mask")
    outputs = layers.Dense(1)(backbone({"token_ids": ids, "padding_mask": padding}))
    model = compiled(keras.Model({"token_ids": ids, "padding_mask": padding}, outputs))
    rng = np.random.RandomState(0)
    batch = {"token_ids": rng.randint(1, 64, size=(2, 8)).astype("int32"), "padding_mask": np.ones((2, 8), "int32")}
    batch["padding_mask"][1, 6:] = 0
    targets = rng.normal(size=(2, 8, 1)).astype("float32")
    report = verify(model, batch, targets, blocks=keras_hub.layers.TransformerDecoder, trials=2, memory=False)
    assert report.ok, str(report)
    assert len(report.units) == 2


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf_keras runs on TensorFlow")
def test_a_tf_keras_model_passes_and_a_doubled_gradient_is_named(monkeypatch):
    K = pytest.importorskip("tf_keras")
    model = attention_model(K)
    model.compile(optimizer="adam", loss="mse")
    report = verify(model, X, Y, policy="save_dots", trials=8, memory=False)
    assert report.ok, str(report)
    double_gradients(monkeypatch)
    report = verify(model, X, Y, trials=2, memory=False)
    assert not report.ok and f"unit {report.units[-1]!r}" in report.failure, report.failure


def test_the_models_own_plan_and_optimizer_come_back():
    from keras_recompute import _model, recompute_model

    model = compiled(recompute_model(attention_model(keras), policy="save_dots", limit=1))
    optimizer, plan = model.optimizer, _model.recomputed_units(model)
    report = verify(model, X, Y, policy="full", trials=2, memory=False)
    assert report.ok and len(report.units) == 2, str(report)  # verify's own plan: both blocks, full
    assert _model.recomputed_units(model) == plan and model.optimizer is optimizer
    assert model._keras_recompute_plan.policies == ("save_dots",)


SEEN = []  # how each call of a `how_called_layer` ran: ("eager" or "traced", under XLA or not)


def how_called_layer(K):
    class HowCalled(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = K.layers.Dense(16)

        def call(self, inputs):
            if not isinstance(inputs, keras.KerasTensor):  # a call building the model is neither
                SEEN.append(_how_called(inputs))
            return inputs + self.dense(inputs)

    return HowCalled()


def _how_called(inputs):
    if BACKEND == "jax":
        import jax

        return ("traced" if isinstance(inputs, jax.core.Tracer) else "eager", None)
    if BACKEND == "tensorflow":
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util

        xla = control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
        return ("eager" if tf.executing_eagerly() else "traced", xla)
    return ("eager", None)  # PyTorch: op by op but with jit_compile (torch.compile: its own test, below)


def _how_called_model(K, settings):
    inputs = K.Input((16,))
    model = K.Model(inputs, K.layers.Dense(1)(how_called_layer(K)(how_called_layer(K)(inputs))))
    model.compile(optimizer="adam", loss="mse", **settings)
    return model


@pytest.mark.skipif(BACKEND == "torch", reason="torch.compile: test_a_torch_compiled_step_with_dropout_is_verified_...")
@pytest.mark.parametrize(
    "settings", [{"run_eagerly": True}, {"jit_compile": True}, {"jit_compile": False, "steps_per_execution": 2}]
)
@pytest.mark.parametrize("module", ["keras", "tf_keras"])
def test_the_step_verified_runs_as_the_model_is_compiled(module, settings):
    """verify checks the user's own step: `run_eagerly` and `jit_compile` reach it (tf_keras's compile arguments
    leave them out: verify ran a tf.function whatever was set, and the model came back without them), and the
    model comes back with them and its `steps_per_execution` (verify's `train_on_batch` steps run one at a time)."""
    if module == "tf_keras" and BACKEND != "tensorflow":
        pytest.skip("tf_keras runs on TensorFlow")
    K = keras if module == "keras" else pytest.importorskip("tf_keras")
    model = _how_called_model(K, settings)
    before = _compile_settings(model, module)
    x = np.random.RandomState(1).normal(size=(8, 16)).astype("float32")
    SEEN.clear()
    report = verify(model, x, np.zeros((8, 1), "float32"), trials=2, memory=False)
    assert report.ok, str(report)
    # JAX: a step without jit_compile is op by op (TensorFlow's is a tf.function without XLA)
    eager = settings.get("run_eagerly") or (BACKEND == "jax" and not settings.get("jit_compile"))
    expected = "eager" if eager else "traced"
    xla = bool(settings.get("jit_compile")) if BACKEND == "tensorflow" else None
    if BACKEND == "jax" and expected == "eager":  # JAX's checkpoint traces the unit's call even in an eager step
        assert (expected, xla) in SEEN, SEEN
    else:
        assert set(SEEN) == {(expected, xla)}, SEEN
    assert _compile_settings(model, module) == before


def _compile_settings(model, module):
    if module == "keras":
        return model.run_eagerly, model.jit_compile, model.steps_per_execution
    return model.run_eagerly, model._jit_compile, int(model._steps_per_execution.numpy())


class _Timed:
    """What a report reads of a copy's steps."""

    peak = None

    def seconds(self):
        return 0.01


def _report_of(difference, op_by_op, rewrites=None):
    """A report on one weight whose compiled recomputed update is `difference` off the plain one's (normwise)."""
    from keras_recompute._verify import VerifyReport

    plain = [np.array([1.0, 0.5, 0.25, 0.0])]
    recomputed = [plain[0] + np.array([difference, 0.0, 0.0, 0.0])]
    return VerifyReport(
        "m", ["unit/kernel"], ["unit"], ["unit"], [np.zeros(4)], [plain, plain], [recomputed], None, _Timed(),
        _Timed(), None, op_by_op, rewrites,
    )


def _op_by_op(compile_spread, difference=0.0, error=None, as_op_by_op=None):
    """What `_verify._op_by_op` measures; `as_op_by_op`: the compiled recomputed update's difference from the plain
    op-by-op one (None: not measured)."""
    return {
        "error": error, "compile_spread": compile_spread, "exact": difference <= 1e-6, "difference": difference,
        "as_op_by_op": as_op_by_op is not None and as_op_by_op <= 1e-6, "as_op_by_op_difference": as_op_by_op,
    }


def test_a_compiled_difference_is_the_compilers_only_within_its_yardstick():
    """NOTE [ what compiling moves ]: a compiled difference beyond reassociation passes as the compiler's rounding
    only when run op by op the steps match, and within 10x what compiling moves the plain step (below 0.01)."""
    rounding = _report_of(5e-5, _op_by_op(1e-5))  # keras-hub's DenseNet on random images, JAX on a CPU
    assert rounding.ok and rounding.rows[0]["rounding"], str(rounding)
    assert "ok (compiler's rounding)" in str(rounding) and "compiler's rounding: the compiled steps" in str(rounding)
    for report in (_report_of(5e-5, None), _report_of(2e-4, _op_by_op(1e-5))):  # not measured; beyond 10x
        assert not report.ok and "updated" in report.failure and "DIFFERS" in str(report), str(report)
    wrong = _report_of(5e-5, _op_by_op(1e-5, difference=5e-5))  # op by op they differ too: the logic is wrong
    assert not wrong.ok and "it is not the compiler's rounding" in wrong.failure, wrong.failure
    raised = _report_of(5e-5, _op_by_op(None, error="ValueError: no"))
    assert not raised.ok and "a step raised: ValueError: no" in raised.failure, raised.failure
    # Compiling moves the plain step as much as a wrong update would: no yardstick (DenseNet on constant images).
    unknown = _report_of(0.25, _op_by_op(1.0))
    assert not unknown.ok and "cannot tell on this batch" in unknown.failure, unknown.failure
    assert "cannot tell" in str(unknown) and "DIFFERS" not in str(unknown)
    assert not _report_of(5e-3, _op_by_op(1e-3)).ok  # an allowance of 0.01 is already none
    assert _report_of(5e-3, _op_by_op(9e-4)).ok


def test_where_compiling_moves_the_plain_step_too_far_a_difference_below_a_fixed_bound_passes():
    """NOTE [ what compiling moves ]: with no yardstick (compiling moves the plain step 1e-3 or more), a compiled
    difference up to 1e-3 passes as the compiler's rounding, where op by op the steps match; beyond it, or where op
    by op they differ, it does not. keras.applications' ResNet50V2 on two random images, JAX on a CPU: 5.3e-5, with
    compiling moving the plain step 1.7e-3."""
    resnet = _report_of(5.3e-5, _op_by_op(1.7e-3))
    assert resnet.ok and not resnet.cannot_tell and resnet.rows[0]["rounding"], str(resnet)
    assert "ok (compiler's rounding)" in str(resnet) and "below 0.001 and what compiling alone moves" in str(resnet)
    assert _report_of(1e-3, _op_by_op(0.25)).ok
    for beyond in (_report_of(1.1e-3, _op_by_op(1.7e-3)), _report_of(0.25, _op_by_op(1.0))):
        assert not beyond.ok and beyond.cannot_tell and "more than 0.001" in beyond.failure, beyond.failure
    wrong = _report_of(5.3e-5, _op_by_op(1.7e-3, difference=5.3e-5))  # op by op they differ: no allowance
    assert not wrong.ok and not wrong.cannot_tell and "DIFFERS" in str(wrong), str(wrong)


def test_a_plain_step_that_compiling_moves_passes_where_the_recomputed_one_is_plains_op_by_op():
    """NOTE [ what compiling moves ]: where compiling moves the plain step as far as the difference (no yardstick:
    "cannot tell"), a compiled recomputed step that is the plain step run op by op passes; one that is not does
    not, and neither does one whose op-by-op step differs."""
    moved = _report_of(7e-3, _op_by_op(7e-3, as_op_by_op=0.0))  # JAX's jit, mixed_bfloat16, save_dots
    assert moved.ok and not moved.cannot_tell and "ok (as the plain step op by op)" in str(moved), str(moved)
    assert "it is compiling the plain step that moves it" in str(moved)
    for report in (_report_of(7e-3, _op_by_op(7e-3, as_op_by_op=5e-3)), _report_of(7e-3, _op_by_op(7e-3))):
        assert not report.ok and report.cannot_tell and "cannot tell on this batch" in report.failure, str(report)
    wrong = _report_of(5e-2, {**_op_by_op(7e-3, difference=5e-2), "as_op_by_op": True})  # op by op it differs
    assert not wrong.ok and "it is not the compiler's rounding" in wrong.failure, wrong.failure


class TiedBlock(layers.Layer):
    """`y = x + d2(h) + 0.1 * h @ d1.kernel^T`: a chain of adds, one a tied (transposed) kernel."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = layers.Dense(32, activation="tanh")
        self.d2 = layers.Dense(16)

    def call(self, inputs):
        hidden = self.d1(inputs)
        return inputs + self.d2(hidden) + 0.1 * ops.matmul(hidden, ops.transpose(self.d1.kernel))[..., :16]


def tied_model(dtype_policy):
    """`(model, x, y)`: two TiedBlocks and a head, built under `dtype_policy`, and a batch of 8 x 10 steps."""
    keras.config.set_dtype_policy(dtype_policy)
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((10, 16))
        hidden = TiedBlock()(TiedBlock()(inputs))
        model = compiled(keras.Model(inputs, layers.Dense(1)(hidden)))
    finally:
        keras.config.set_dtype_policy("float32")
    x = np.random.RandomState(0).rand(8, 10, 16).astype("float32") - 0.5
    return model, x, np.random.RandomState(1).rand(8, 10, 1).astype("float32")


@pytest.mark.skipif(BACKEND != "jax", reason="measured on JAX's jit (XLA) on a CPU")
def test_a_recomputed_step_that_rounds_as_op_by_op_passes_where_compiling_moves_the_plain_one():
    """The tied block under mixed_bfloat16, save_dots, JAX's jit on a CPU: the kept dot outputs are bfloat16, rounded
    as op by op, where the plain step's fusions keep float32; the plain compiled update moves 1.1e-2 (normwise) from
    op by op, the recomputed compiled one 0, and verify said "cannot tell". It is plain's op by op: OK."""
    if on_a_gpu():
        pytest.skip("measured on a CPU (a GPU's fusions round otherwise)")
    model, x, y = tied_model("mixed_bfloat16")
    report = verify(model, x, y, blocks=TiedBlock, policy="save_dots", trials=4, memory=False)
    assert report.ok, str(report)
    assert report.op_by_op is not None, "the compiled steps matched: compiling did not move the plain step"
    assert report.op_by_op["as_op_by_op"] and "ok (as the plain step op by op)" in str(report), str(report)


@pytest.mark.parametrize("kind", ["arithmetic optimizer", "excess precision"])
def test_a_graph_optimizers_rewrite_passes_only_where_the_steps_match_without_it(kind):
    """NOTE [ a graph optimizer's rewrite ], NOTE [ XLA's excess precision ]: a compiled difference that op by op is
    none passes as the graph optimizer's (TensorFlow) or XLA's excess precision (JAX) rounding only where, compiled
    with it off, the steps match, and below 0.01; each message names what it compiled without and how to train so."""
    exact = {"error": None, "exact": True, "difference": 0.0, "kind": kind}
    remains = {"error": None, "exact": False, "difference": 5e-3, "kind": kind}
    grappler = kind == "arithmetic optimizer"
    verdict, off = ("graph optimizer's rounding", "arithmetic optimizer off") if grappler else (
        "XLA's excess precision", "excess precision off")
    fix = "'arithmetic_optimization': False" if grappler else "XLA_FLAGS=--xla_allow_excess_precision=false"
    rewritten = _report_of(5e-3, _op_by_op(0.0), exact)
    assert rewritten.ok and rewritten.rows[0]["rounding"] and not rewritten.cannot_tell, str(rewritten)
    assert f"ok ({verdict})" in str(rewritten) and off in str(rewritten) and fix in str(rewritten), str(rewritten)
    large = _report_of(0.02, _op_by_op(0.0), exact)  # more than a rounding: named, with what makes it exact
    assert not large.ok and fix in large.failure, large.failure
    for report in (_report_of(5e-3, _op_by_op(0.0), remains), _report_of(5e-3, _op_by_op(0.0))):
        assert not report.ok and "DIFFERS" in str(report), str(report)
        assert "Run op by op (run_eagerly=True) the steps match" in report.failure, report.failure  # read "differ too"
    assert f"{off} it remains (0.005)" in _report_of(5e-3, _op_by_op(0.0), remains).failure
    # Under a compiler's yardstick that is none (cannot tell), the rewrite's check still tells; where it does not
    # match either, the report cannot tell, and says what it compiled without.
    assert _report_of(5e-3, _op_by_op(1.0), exact).ok
    unmatched = _report_of(5e-3, _op_by_op(1.0), remains)
    assert unmatched.cannot_tell and not unmatched.ok, str(unmatched)
    assert ("still differ (0.005)" in unmatched.failure) == (not grappler), unmatched.failure


@pytest.mark.skipif(BACKEND != "tensorflow", reason="Grappler optimizes TensorFlow's tf.function")
def test_a_step_that_changes_from_trial_to_trial_is_not_put_down_to_a_rewrite(monkeypatch):
    """A race with the optimizer shows in some compiled steps of many (2-5 of 40 before it was fixed), and may not in
    the 2 steps the rewrite's check runs again: that check runs only where every recomputed trial gave the same
    update bitwise. Here the third compiled recomputed trial is moved 1e-3 (as a race moves one), op by op the steps
    match, and the check, were it run, would say the steps match without the rewrite: DIFFERS all the same."""
    from keras_recompute import _verify

    updates, runs = _verify._Runs.updates, []

    def raced(self, trials, initial):
        runs.append(self)
        error, result = updates(self, trials, initial)
        if len(runs) == 2:  # the compiled recomputed copy (plain first; then op by op)
            result[2][-1] = result[2][-1] + 1e-3 * float(np.max(np.abs(result[2][-1])))
        return error, result

    monkeypatch.setattr(_verify._Runs, "updates", raced)
    monkeypatch.setattr(_verify, "_without_rewrites", lambda *a, **k: {"error": None, "exact": True, "difference": 0.0})
    x = np.random.RandomState(1).normal(size=(8, 16)).astype("float32")
    report = verify(blocks_model(DenseBlock), x, np.ones((8, 1), "float32"), trials=4, memory=False)
    assert report.op_by_op is not None and report.op_by_op["exact"], str(report)
    assert not report.ok and report.rewrites is None and "DIFFERS" in str(report), str(report)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="Grappler optimizes TensorFlow's tf.function")
def test_a_recomputed_step_the_graph_optimizer_rewrites_passes_as_its_rounding():
    """The tied block under mixed_float16, save_dots: Grappler's AddOpsRewrite collapses the recomputed forward's
    chain of adds into one AddN and leaves the plain one's, and the tf.function updates differ (here 6.2e-4
    normwise, float16 roundings; 9.9e-3 under mixed_bfloat16, too near verify's 0.01 for a test) where op by op
    they are bitwise equal: verify said DIFFERS. With the optimizer off they match: OK, as the graph optimizer's
    rounding; the user's optimizer options come back."""
    import tensorflow as tf

    model, x, y = tied_model("mixed_float16")
    tf.config.optimizer.set_experimental_options({"constant_folding": True})
    try:
        before = tf.config.optimizer.get_experimental_options()
        report = verify(model, x, y, blocks=TiedBlock, policy="save_dots", trials=4, memory=False)
        assert tf.config.optimizer.get_experimental_options() == before
    finally:
        tf.config.optimizer.set_experimental_options({"constant_folding": None})
    assert report.ok, str(report)
    assert report.rewrites is not None, "the tf.function comparison passed: the rewrite was not tried"
    assert report.rewrites["exact"] and "ok (graph optimizer's rounding)" in str(report), str(report)


@pytest.mark.skipif(BACKEND != "jax", reason="measured on JAX's jit (XLA) on a CPU")
def test_a_model_that_amplifies_the_compilers_rounding_passes():
    """keras-hub's DenseNet (BatchNorm in every block) on random images: JAX's jitted recomputed step is another
    program, and its update is 5.3e-5 off the plain one's on the CPU this was measured on (more than reassociation);
    run op by op they are bitwise equal. verify says OK, and why, where the compiled comparison alone fails."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.DenseNetBackbone(
        stackwise_num_repeats=[2, 4, 6, 4], compression_ratio=0.5, growth_rate=2, image_shape=(32, 32, 3)
    )
    head = layers.Dense(1)(backbone(backbone.input))  # the backbone one unit, as keras_hub_verify_all.py builds it
    model = compiled(keras.Model(backbone.input, ops.mean(head, axis=[1, 2, 3])))
    x = np.random.RandomState(0).rand(2, 32, 32, 3).astype("float32")
    report = verify(model, x, np.zeros((2,), "float32"), trials=2, memory=False)
    assert report.ok, str(report)
    if report.op_by_op is not None:  # the compiled comparison failed (on other CPUs XLA may round alike)
        assert report.op_by_op["exact"] and report.op_by_op["compile_spread"] > 0
        assert any(row["rounding"] for row in report.rows) and "compiler's rounding" in str(report)


class CountedDropoutBlock(layers.Layer):
    """Attention with dropout and a Dropout: its calls counted (a recompute runs it once more a step)."""

    calls = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(4, 16, dropout=0.2)
        self.norm = layers.LayerNormalization()
        self.up = layers.Dense(128, activation="gelu")
        self.down = layers.Dense(64)
        self.dropout = layers.Dropout(0.3)

    def call(self, inputs, training=None):
        CountedDropoutBlock.calls += 1
        hidden = self.norm(inputs + self.attention(inputs, inputs, training=training))
        return hidden + self.dropout(self.down(self.up(hidden)), training=training)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile is PyTorch's jit_compile")
def test_a_torch_compiled_step_with_dropout_is_verified_mask_for_mask():
    """`jit_compile=True` on PyTorch: torch.compile draws dropout's masks with its own generator, the recomputed
    units (run op by op inside the compiled step) with PyTorch's, so the compiled steps drew other masks and verify
    said "cannot tell" (NOTE [ torch.compile's random numbers ]). verify compiles with `fallback_random`: OK. The
    step is compiled (dynamo made graphs) and the unit recomputes in it (its call runs twice a step)."""
    torch = pytest.importorskip("torch")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 32))
    hidden = layers.Dense(64)(inputs)
    hidden = CountedDropoutBlock()(hidden)
    model = compiled(keras.Model(inputs, layers.Dense(1)(hidden)), jit_compile=True)
    report = verify(model, X, Y, trials=2, memory=False)
    assert report.ok and report.op_by_op is None, str(report)  # mask for mask: no op-by-op run was needed
    assert not torch._inductor.config.fallback_random  # the user's setting is back

    from keras_recompute import recompute_model

    torch._dynamo.utils.counters.clear()
    recompute_model(model, enabled=True)
    model.train_on_batch(X, Y)  # compiles
    CountedDropoutBlock.calls = 0
    model.train_on_batch(X, Y)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "the step was not compiled"
    assert CountedDropoutBlock.calls == 2, f"{CountedDropoutBlock.calls} calls in a step: it did not recompute"


_QWEN2_LORA_BFLOAT16 = r"""
import json
import keras, keras_hub, numpy as np
from keras_recompute import verify

keras.mixed_precision.set_global_policy("mixed_bfloat16")
keras.utils.set_random_seed(0)
backbone = keras_hub.models.Qwen2Backbone(vocabulary_size=64, num_layers=2, num_query_heads=2, num_key_value_heads=1,
                                          hidden_dim=16, intermediate_dim=32, dropout=0.1)
backbone.enable_lora(4)
inputs = {name: keras.Input((8,), dtype="int32", name=name) for name in ("token_ids", "padding_mask")}
model = keras.Model(inputs, keras.layers.Dense(1)(backbone(inputs)))
model.compile(optimizer="sgd", loss="mse")
rng = np.random.RandomState(0)
batch = {"token_ids": rng.randint(1, 64, size=(2, 8)).astype("int32"), "padding_mask": np.ones((2, 8), "int32")}
batch["padding_mask"][1, 6:] = 0
report = verify(model, batch, rng.normal(size=(2, 8, 1)).astype("float32"), trials=3, memory=False)
from keras.src.backend.jax import trainer
import jax
print(json.dumps({"ok": report.ok, "cannot_tell": report.cannot_tell, "failure": report.failure, "text": str(report),
                  "rewrites": report.rewrites, "differences": [row["difference"] for row in report.rows],
                  "jit_back": trainer.jit is jax.jit}))
"""


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's excess precision under JAX's jit")
def test_a_bfloat16_step_on_jax_is_compared_again_with_xlas_excess_precision_off():
    """NOTE [ XLA's excess precision ]: keras-hub's Qwen2 with LoRA in mixed_bfloat16: compiling keeps float32 between
    fused ops, so the compiled steps differ by more than verify can tell from rounding (3.3e-3: it said "cannot tell"
    until 2026-12-05); verify compiles both steps again with the excess precision off, for those compiles only, where
    they match: ok, saying why, and naming the flag to train so; Keras's jit is back after. With
    XLA_FLAGS=--xla_allow_excess_precision=false set, the first compiled steps match: nothing is compiled again."""
    pytest.importorskip("keras_hub")
    import _fresh
    import jax

    if jax.devices()[0].platform != "cpu":  # measured on the CPU only; a GPU's fusions (docs/gpu.md) untried
        pytest.skip("measured on the CPU (AVX-512, AVX2, AVX); on a GPU, XLA fuses matmuls otherwise")
    env = dict(os.environ, KERAS_BACKEND="jax")
    flags = os.environ.get("XLA_FLAGS", "")
    runs = {}
    for strict in (False, True):
        env["XLA_FLAGS"] = f"{flags} --xla_allow_excess_precision=false".strip() if strict else flags
        done = _fresh.run(["-c", _QWEN2_LORA_BFLOAT16], env=dict(env))
        assert done.returncode == 0, done.stderr[-3000:]
        runs[strict] = json.loads(done.stdout.strip().splitlines()[-1])
    default, strict = runs[False], runs[True]
    assert default["ok"] and not default["cannot_tell"] and default["jit_back"], default["text"]
    assert default["rewrites"]["kind"] == "excess precision" and default["rewrites"]["exact"], default["rewrites"]
    assert max(default["differences"]) > 1e-3, default["text"]  # beyond what verify tells from rounding without it
    assert "ok (XLA's excess precision)" in default["text"], default["text"]
    assert "XLA_FLAGS=--xla_allow_excess_precision=false" in default["text"], default["text"]
    assert strict["ok"] and strict["rewrites"] is None and max(strict["differences"]) <= 1e-3, strict["text"]


def test_verify_compiles_again_without_excess_precision_only_a_16_bit_step_jaxs_jit_compiles(monkeypatch):
    """NOTE [ XLA's excess precision ]: only on JAX, a compiled step, some layer computing in a 16-bit float, and
    XLA_FLAGS without the switch (with it the first compile already rounds as the program says)."""
    from keras_recompute import _verify

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    plain = compiled(attention_model(keras))
    half = compiled(keras.Sequential([keras.Input((4,)), layers.Dense(2, dtype="mixed_bfloat16")]))
    assert not _verify._excess_precision(plain, keras)
    assert _verify._excess_precision(half, keras) == (BACKEND == "jax")
    half.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    assert not _verify._excess_precision(half, keras)
    half.compile(optimizer="sgd", loss="mse")
    monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=false")
    assert not _verify._excess_precision(half, keras)