"""`verify`: a user proves on their own model, backend and device that recompute trains as without it.

NOTE [ what verify compares ]
Every silent wrong update found so far was in a setup the tests did not run,
and a training run does not show one: the loss goes down either way. So
`verify` runs the model's own compiled training step (as `compile` set it:
eager, `tf.function`, XLA, JAX's jit, PyTorch) on two copies of the model,
one plain and one recomputed by `recompute_model` with the options given,
from the model's current variables and one seed, with SGD at lr 1.0, where
the update of each weight is its gradient (and a non-trainable weight's, a
BatchNorm statistic's, is what the step wrote). It compares:
  * the plain step against itself, `plain_trials` times: its own spread from
    run to run (0 on a CPU; on a GPU autotuned kernels and unordered
    reductions may move it);
  * the recomputed step, `trials` times, the variables set back before each,
    so that a race with the optimizer (a read overtaken by a write, which
    showed in 2-5 steps of 40) has the chances to show;
  * each weight's update against the plain one's: a weight passes when its
    largest difference over the trials is within twice the plain spread, or
    within what reassociating float sums moves (1e-5 of the largest update,
    `tests/_compare.py`'s bound, plus one float32 spacing of the weight where
    the optimizer rounds `w - g`);
  * where a compiled step's comparison fails, both steps again op by op, to
    tell the compiler's rounding from a defect (NOTE [ what compiling moves ]).
  * where a tf.function's comparison fails though op by op the steps match,
    both compiled again with Grappler's arithmetic optimizer off, to tell
    its rewrite from a defect (NOTE [ a graph optimizer's rewrite ]); on JAX
    in a 16-bit float, with XLA's excess precision off (NOTE [ XLA's excess
    precision ]).
Each weight belongs to the unit whose layer holds it (or to no unit). A
unit whose gradient is wrong passes the error on, through its input
gradient, to every weight before it, so a failure names the last unit (in
the forward's order) with a weight that differs, and its worst weight, and
suggests what to change. A
`RecomputeError` raised by the recomputed step is a failure too, with its
text, and so is an error of the plain step (the model is wrong without
recompute too). Both steps run on the model itself, compiled for the time
with SGD and then compiled again with its own optimizer object and compile
arguments, its variables and recompute plan put back: a clone
(`clone_model`) would be another model, rebuilt from its config without
what was done to the instance (keras-hub's `enable_lora` adds variables the
config does not ask for). It also times both steps and, where the device's
allocator keeps figures, measures their peaks.
"""

# NOTE [ a plain step that is wrong too ]
# The plain step is the reference, so verify first checks that it is one.
# An update that is not finite (nan, inf) leaves nothing to compare. And the
# plain step run again from the same variables and seed must give the same
# update: on PyTorch, Keras registers a model's variables as torch parameters
# in a dict keyed by path, so of two weights that share a path (keras-hub's
# T5, BLIP-2 and SmolLM3 have such: a weight made outside its layer's name
# scope) one is not a parameter; `zero_grad` before each step misses it and
# its gradient adds up from step to step (T5's relative attention bias: its
# update was 1x, 2x, 3x the gradient in three runs). Plain training is wrong
# there, with or without recompute; verify names the weights and the cause
# instead of blaming the first recomputed unit the difference reaches. Any
# other update that grows by the same amount each run is named the same way.

import contextlib
import functools
import importlib
import os
import statistics
import sys
import time

import numpy as np

from keras_recompute import _budget, _context, _memory, _model, _policy

_REASSOCIATION = 1e-5  # of the largest update: what reordering float sums moves (tests/_compare.py)

# NOTE [ what compiling moves ]
# A compiler (XLA: JAX's jit, TensorFlow's jit_compile) makes the recomputed
# step another program than the plain one: it fuses and orders the recomputed
# forward's ops otherwise, and the float rounding differs. Most models keep
# that within the reassociation bound; one that amplifies rounding does not.
# keras-hub's DenseNet on random images, JAX on a CPU: the compiled steps
# differ by 5.3e-5 (normwise), run op by op they are bitwise equal, and the
# plain step compiled moves 9.9e-6 from the same step run op by op (on its
# test's constant images, BatchNorm over a variance near 0: 0.25 and 1.0). So
# when a compiled comparison fails, verify runs both steps op by op
# (run_eagerly=True), where each op is the same kernel in both. If they match
# there, the recompute's logic is exact, and a compiled difference within 10x
# what compiling moves the plain step is the compiler's rounding: the largest
# ratio measured over keras-hub's convnets on random images (JAX, CPU) was
# 5.4 (DenseNet; ResNet 0.24, EfficientNet 0.58, CSPNet, Xception, VGG,
# HGNetV2 0; benchmarks/results/verify_compiled_rounding.json). An allowance
# of 0.01 or more is no yardstick (the smallest silent wrong updates found
# were 0.02 and 0.047): the difference is then held to a fixed bound, 1e-3
# (a tenth of that; less than compiling alone moves the plain step there),
# and verify says it cannot tell on that batch only beyond it. Measured
# (2026-12-03, JAX, CPU, benchmarks/cnn_verify_all.py): keras.applications'
# ResNet50V2 on two random images, the first conv's kernel 5.3e-5 off, all
# else within reassociation, op by op bitwise equal, and compiling moves the
# plain step 1.7e-3 (BatchNorm over the 2x2 maps of a batch of 2): verify
# said "cannot tell" of a step 30x closer to the plain one than compiling
# alone moves it. A race with the optimizer shows only in a compiled step
# (by 0.02 and more where measured), but a tf.function moves the plain step
# by (nearly) nothing from op by op, and the allowance with it.
# And where the compiled recomputed step is the plain step run op by op
# (within reassociation, in every trial), it is exact against the reference
# itself, and it is compiling the plain step that moved: JAX's jit under
# mixed_bfloat16, save_dots (benchmarks/layer_setups.py, 2026-12-03, CPU):
# the kept dot outputs are bfloat16 tensors, rounded as op by op, where the
# plain step's fusions keep float32 between ops; the plain compiled update
# moved 4.0e-3 to 1.2e-2 from op by op, the recomputed compiled one 0, and
# verify said "cannot tell" on 15 rows of 15. 14 pass now, as the plain step
# op by op (a frozen BatchNorm's block is 7.0e-3 from it: still cannot tell).
#
# NOTE [ XLA's excess precision ]
# On JAX in a 16-bit float XLA keeps float32 between the ops it fuses where
# op by op rounds each result, and it fuses the recomputed step otherwise
# than the plain one. keras-hub's Qwen2, Mixtral, Phi-3, Falcon and OPT with
# LoRA in mixed_bfloat16 (2 layers of 16, 2026-12-05, CPU): the compiled steps
# differed by 3.3e-3 to 7.4e-3 (normwise) where compiling moved the plain step
# 7.2e-3 to 1.8e-2, op by op exact: no yardstick, and verify could not tell.
# With XLA_FLAGS=--xla_allow_excess_precision=false the compiler rounds as the
# program says, and all five passed; but XLA_FLAGS is read once, when JAX
# starts, and the first fix (that morning) was a hint to restart with it. XLA
# takes the same switch per compile (`jax.jit(compiler_options=...)`, as
# `backends/jax.py` compiles what it only measures). So where such a
# comparison fails, op by op the steps match and every recomputed trial is
# the same, verify compiles both steps again with it off, for its own
# compiles only (Keras's JAX trainer's `jit`, put back after), as it does
# with Grappler's arithmetic optimizer on TensorFlow (NOTE [ a graph
# optimizer's rewrite ]), and the same rule holds: matching then, the
# difference below `_NO_YARDSTICK` is XLA's excess precision (ok, saying so);
# above it, the failure says training with the flag is exact. Qwen2's: 3.3e-3
# with it on, 0 with it off: ok (tests/test_verify.py). Where Flax NNX
# compiles the step (its `jit`, not `jax.jit`) verify compiles nothing again.
_EXCESS_PRECISION_OPTION = "xla_allow_excess_precision"
_EXCESS_PRECISION_OFF = f"--{_EXCESS_PRECISION_OPTION}=false"
_COMPILER_FACTOR = 10
_NO_YARDSTICK = 0.01  # normwise: an allowance this large would pass a wrong update
_BELOW_COMPILING = _NO_YARDSTICK / _COMPILER_FACTOR  # where there is none: less than compiling moves the plain step
# What verify compiles both steps again without (`_without_rewrites`).
_ARITHMETIC_OPTIMIZER = "arithmetic optimizer"  # TensorFlow's Grappler (NOTE [ a graph optimizer's rewrite ])
_EXCESS_PRECISION = "excess precision"  # XLA's, under JAX's jit (NOTE [ XLA's excess precision ])
_REWRITES_OFF = {
    _ARITHMETIC_OPTIMIZER: "TensorFlow's arithmetic optimizer off", _EXCESS_PRECISION: "XLA's excess precision off",
}


# NOTE [ torch.compile's random numbers ]
# On PyTorch, `jit_compile=True` compiles the step with torch.compile, whose
# backend (inductor) draws random numbers with its own generator: a compiled
# dropout keeps other elements than the same dropout run op by op. The
# recomputed units run op by op inside the compiled step (dynamo does not
# trace through torch's checkpoint and our hooks and modes around it: it
# breaks the graph there), so they draw PyTorch's own masks, and the
# recomputed step trains with other masks than the plain compiled one: each
# step's gradient is that of its own masks, but the two steps are no longer
# the same function. Measured (Keras 3.15, torch 2.x, CPU; two blocks of
# attention with dropout 0.2 and a Dropout 0.3, SGD at lr 1.0): the plain
# compiled update 0.44 from the op-by-op one (normwise), the recomputed
# compiled update 4.8e-8 from the op-by-op plain one; verify said "cannot
# tell". So verify compiles its steps with inductor's `fallback_random`,
# which draws as PyTorch does op by op (what PyTorch's own accuracy checks of
# compiled models set): the plain compiled update is then 2.9e-7 from the
# op-by-op one and the recomputed one 2.5e-7 from it (ok).

# NOTE [ a graph optimizer's rewrite ]
# TensorFlow's tf.function hands each traced step to Grappler, whose
# arithmetic optimizer rewrites the graph, and it may rewrite the recomputed
# step's graph where it leaves the plain one's alone. Measured (2026-12-03,
# TensorFlow 2.21, CPU, benchmarks/layer_setups.py): a block ending
# `y = x + d2(h) + 0.1 * matmul(h, transpose(d1.kernel))` (a tied kernel),
# save_dots, under mixed_bfloat16: `AddOpsRewrite` collapses the recomputed
# forward's chain of adds into one AddN, rounding once where the plain step
# rounds at each add, and the updates differ by 8.5e-3 (normwise; 5.5e-4
# under mixed_float16), while op by op the steps are bitwise equal and
# compiling moves the plain step by nothing, so the compiler's yardstick
# (NOTE [ what compiling moves ]) is 0: verify said DIFFERS of a step that
# trains right. It also made TensorFlow's bfloat16 "cannot tell" rows there.
# So where a tf.function comparison fails, op by op the steps match, and the
# recomputed trials are bitwise equal to one another (the same program each
# step, unlike a race with the optimizer, which shows in some steps of many),
# verify runs both steps compiled again with the arithmetic optimizer off
# (`tf.config.optimizer.set_experimental_options`, put back after), from the
# model's own compile arguments (read before verify compiled anything: its
# first try compiled them from the arguments then current, the op-by-op
# ones, ran op by op, and matched with the optimizer on as well). If they
# then match, and the difference is below `_NO_YARDSTICK`, it is the
# optimizer's rounding (ok); where it is larger the failure says that the
# steps match with the optimizer off (training with it off is then exact).


def verify(
    model,
    x,
    y=None,
    *,
    blocks="auto",
    segments=None,
    policy="full",
    budget=None,
    offload=False,
    trials=20,
    plain_trials=3,
    seed=0,
    memory=True,
):
    """Checks, on your model, backend and device, that recompute trains exactly as without it.

    Runs the model's compiled training step on a plain copy and on a copy
    recomputed by `recompute_model` with the options given (NOTE [ what
    verify compares ]), and compares the first update of every weight, the
    recomputed step repeated `trials` times, against the plain step's own
    spread (where a compiled comparison fails, both steps run again op by op,
    to tell the compiler's rounding from a defect). Run it once on a new
    model, backend or device before training.

    Args:
        model: a compiled Keras 3 or tf_keras model (TF2 behaviour). Its
            loss and its compile settings (`jit_compile`, `run_eagerly`) are
            the step's; its weights, optimizer and any recompute plan are
            left as they are.
        x: a batch of inputs, as `train_on_batch` takes it.
        y: its targets, as `train_on_batch` takes them (None for a model
            whose loss needs none).
        blocks, segments, policy, budget, offload: what to recompute, as
            `recompute_model` takes them (`budget` is planned on `x`).
        trials: how many times the recomputed step runs (a race shows in
            some steps of many).
        plain_trials: how many times the plain step runs, for its spread (at
            least 2).
        seed: the random seed set before every step (dropout draws the same
            masks in every trial, plain and recomputed).
        memory: where the device's allocator keeps no figures (a CPU under
            JAX or PyTorch, TensorFlow's default CPU allocator), predict the
            steps' peaks with `memory_report` (it measures each unit: seconds
            on a large model; on JAX the compiler states both steps' peaks,
            and nothing is measured); False leaves them out.

    Returns:
        A `VerifyReport`: `report.ok`, `print(report)` for the table (each
        unit's largest difference, the plain spread, the verdict, and the
        steps' times and peaks), `report.failure` naming the first unit and
        weight that differ and what to change.

    Raises:
        TypeError: if `model` is not a Keras 3 or tf_keras model, or
            `trials`, `plain_trials` or `seed` is not an int.
        ValueError: if the model is not compiled, `trials < 1` or
            `plain_trials < 2`, it runs in a TF1-style graph, or an option is
            one `recompute_model` refuses.

    Example:

    ```python
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    report = keras_recompute.verify(model, x, y, policy="save_dots")
    print(report)
    assert report.ok, report.failure
    ```
    """
    keras_module = _check(model, trials, plain_trials, seed)
    _policy.check(policy, "verify")
    state = [np.array(v) for v in _state_variables(model, keras_module)]
    with _Restored(model, keras_module, state) as restored, _random_as_op_by_op(model, keras_module):
        arguments = restored.arguments  # the model's own: each step below is compiled from them
        _model.unrecompute_model(model)
        plain_run = _Runs(_compiled_with_sgd(model, keras_module, arguments), keras_module, state, x, y, seed)
        initial = [np.asarray(w, np.float64) for w in model.get_weights()]
        error, plain_updates = plain_run.updates(plain_trials, initial)
        names = [getattr(w, "path", None) or w.name for w in model.weights]
        plain_problem = None if error is not None else _plain_problem(model, names, plain_updates)
        plain_figure = None  # the compiler's peak of the plain step, where one states it (JAX): as the recomputed one's
        execution = _memory.execution_of(model, None, "verify")[0]
        if memory and plain_run.peak is None:
            plain_figure = _memory.compiled_peak(model, x, None, execution)

        def plan():  # recompute_model with verify's options (again for the op-by-op steps)
            _model.recompute_model(
                model,
                blocks,
                segments=segments,
                policy=policy,
                budget=budget,
                inputs=x if budget is not None else None,
                offload=offload,
                enabled=True,
            )

        plan()
        units = _model.recomputed_unit_layers(model)
        predicted = recomputed_figure = None
        if plain_figure is not None:  # the compiler states the recomputed step's too: nothing to measure
            recomputed_figure = _memory.compiled_peak(model, x, None, execution)
        elif memory and plain_run.peak is None:
            predicted = _model.memory_report(model, x)
        recomputed_run = _Runs(
            _compiled_with_sgd(model, keras_module, arguments), keras_module, state, x, y, seed,
            plain_run.optimizer_state,
        )
        if error is not None:
            error = f"the plain step raised, so the model is wrong without recompute too: {error}"
            if y is None:
                error += (
                    ". verify was given no y: a model compiled with a loss that takes targets needs them, "
                    "verify(model, x, y)"
                )
            updates = []
        else:
            error, updates = recomputed_run.updates(trials, initial)
            if error is not None:
                error = f"the recomputed step raised: {error}"
        op_by_op = None
        graph_optimized = _graph_optimized(model, keras_module)  # as compiled for the step (op by op changes it)
        excess_precision = _excess_precision(model, keras_module)  # likewise (NOTE [ XLA's excess precision ])
        if (
            error is None and plain_problem is None and _step_is_compiled(model, keras_module)
            and not all(_compare(initial, plain_updates, updates)[3])
        ):
            op_by_op = _op_by_op(
                model, keras_module, arguments, state, x, y, seed, initial, plain_updates, updates, min(trials, 2),
                plan, plain_run.optimizer_state,
            )
        found = (
            model.name, names, _owners(model, units), [name for name, _ in units], initial, plain_updates, updates,
            error, plain_run, recomputed_run, plain_problem, op_by_op,
        )
        report = VerifyReport(*found)
        if (
            not report.ok and op_by_op is not None and op_by_op["error"] is None and op_by_op["exact"]
            and (graph_optimized or excess_precision) and _same_in_every_trial(updates)
        ):  # NOTE [ a graph optimizer's rewrite ], NOTE [ XLA's excess precision ]
            rewrites = _without_rewrites(
                model, keras_module, arguments, state, x, y, seed, initial, min(trials, 2), plan,
                plain_run.optimizer_state, _ARITHMETIC_OPTIMIZER if graph_optimized else _EXCESS_PRECISION,
            )
            report = VerifyReport(*found, rewrites)
        if recomputed_figure is not None and report.plain_peak is None:
            report.plain_peak, report.recomputed_peak = plain_figure, recomputed_figure
            report.peak_source = "XLA's figures for the compiled steps"
        elif predicted is not None and report.plain_peak is None:
            report.plain_peak, report.recomputed_peak = predicted.plain_peak, predicted.predicted_peak
            report.peak_source = "predicted by memory_report"
        return report


class VerifyReport:
    """What `verify` found: each unit's verdict, the first difference, and the steps' costs.

    Attributes:
        ok: True when every weight's update matched the plain one in every
            trial (or differed only by the compiler's rounding, `op_by_op`)
            and the recomputed step raised nothing.
        rows: one dict per unit (and one for the weights of no unit):
            `"unit"`, `"weight"` (its worst), `"difference"` and `"spread"`
            (normwise: over the largest plain update), `"ok"`, and
            `"rounding"`: ok only as the compiler's rounding (NOTE [ what
            compiling moves ]) or the graph optimizer's (NOTE [ a graph
            optimizer's rewrite ]).
        op_by_op: where a compiled comparison failed, both steps run op by op
            (`run_eagerly=True`): a dict of `compile_spread` (the compiled
            plain update against the op-by-op one, normwise), `exact`
            (whether op by op the recomputed step matched), `difference`,
            `as_op_by_op` (whether the compiled recomputed step matched the
            plain one run op by op) with `as_op_by_op_difference`, and
            `error`; None where it was not needed.
        rewrites: where a tf.function comparison failed though op by op the
            steps match, both steps compiled again with TensorFlow's
            arithmetic optimizer off (NOTE [ a graph optimizer's rewrite ]):
            a dict of `exact`, `difference` and `error`; else None.
        cannot_tell: True when compiling alone moves the plain step so far
            that a compiled difference (here beyond 1e-3) tells nothing
            (then `ok` is False).
        failure: a message naming the first unit and weight that differ and
            what to change, or the recompute's error; None when `ok`.
        units: the recomputed units' names.
        trials: how many recomputed steps were compared.
        plain_seconds, recomputed_seconds: the median time of a step.
        plain_peak, recomputed_peak: the peak bytes of a step, measured where
            the device's allocator reports them, else predicted by
            `memory_report` (with `memory=True`), else None.
        peak_source: how the peaks were had.
    """

    def __init__(self, model_name, names, owners, unit_names, initial, plain_updates, updates, error, plain_run,
                 recomputed_run, plain_problem=None, op_by_op=None, rewrites=None):
        self.model_name = model_name
        self.units = list(unit_names)
        self.trials = len(updates)
        self.plain_seconds = plain_run.seconds()
        self.recomputed_seconds = recomputed_run.seconds()
        self.plain_peak = plain_run.peak
        self.recomputed_peak = recomputed_run.peak
        self.peak_source = "measured by the device's allocator" if self.plain_peak is not None else None
        scale, spreads, differences, exact = _compare(initial, plain_updates, updates)
        self.plain_spread = max(spreads, default=0.0) / scale
        # NOTE [ what compiling moves ]: op_by_op is measured only where a compiled comparison failed
        self.op_by_op = op_by_op
        allowance = 0.0
        as_op_by_op = False  # the compiled recomputed step is plain's run op by op (NOTE [ what compiling moves ])
        if op_by_op is not None and op_by_op["error"] is None and op_by_op["exact"]:
            allowance = _COMPILER_FACTOR * op_by_op["compile_spread"] * scale
            as_op_by_op = bool(op_by_op.get("as_op_by_op"))
        # NOTE [ a graph optimizer's rewrite ]: measured only where op by op the steps match
        self.rewrites = rewrites
        rewritten = rewrites is not None and rewrites["error"] is None and rewrites["exact"]
        no_yardstick = allowance >= _NO_YARDSTICK * scale and not rewritten and not as_op_by_op
        if no_yardstick:  # NOTE [ what compiling moves ]: a fixed bound, below what compiling moves the plain step
            allowance = _BELOW_COMPILING * scale
        passed = [
            e or as_op_by_op or d <= allowance or (rewritten and d < _NO_YARDSTICK * scale)
            for e, d in zip(exact, differences)
        ]
        self.cannot_tell = cannot_tell = no_yardstick and not all(passed)
        # What a weight that passes but not bitwise is put down to (its verdict and the report's line say it).
        self._rounding = (
            "plain op by op" if as_op_by_op
            else ("graph optimizer" if rewrites["kind"] == _ARITHMETIC_OPTIMIZER else "excess precision") if rewritten
            else "fixed bound" if no_yardstick else "compiler"
        )
        groups = {}
        for index, owner in enumerate(owners):
            groups.setdefault(owner, []).append(index)
        self.rows = []
        for owner in unit_names + [None]:
            if owner not in groups:
                continue
            worst = max(groups[owner], key=lambda i: (not passed[i], differences[i]))
            self.rows.append(
                {
                    "unit": owner if owner is not None else "(not recomputed)",
                    "weight": names[worst],
                    "difference": differences[worst] / scale,
                    "spread": spreads[worst] / scale,
                    "ok": all(passed[i] for i in groups[owner]) and error is None,
                    "rounding": not all(exact[i] for i in groups[owner]) and all(passed[i] for i in groups[owner]),
                }
            )
        self.ok = error is None and plain_problem is None and all(passed)
        self.failure = None
        if error is not None:
            self.failure = f"keras_recompute.verify: {error}"
        elif plain_problem is not None:
            self.failure = plain_problem
        elif not self.ok and cannot_tell:  # only where op by op the steps match
            self.failure = (
                f"keras_recompute.verify: cannot tell on this batch: the compiled steps differ by up to "
                f"{max(differences) / scale:.3g} (normwise), more than {_BELOW_COMPILING:g}, and compiling alone "
                f"moves the plain step's update {op_by_op['compile_spread']:.3g} from the same step run op by op, so "
                "a difference of that size says nothing; run op by op (run_eagerly=True), the recomputed step "
                "matches the plain one. Verify with a batch like your training data (constant inputs under "
                "BatchNorm make a step this ill-conditioned), or compile the model with run_eagerly=True for verify."
            )
            if rewrites is not None and rewrites["kind"] == _EXCESS_PRECISION:
                self.failure += (
                    " Compiled again with XLA's excess precision off (xla_allow_excess_precision=false), "
                    + (f"a step raised: {rewrites['error']}." if rewrites["error"] is not None else
                       f"the steps still differ ({rewrites['difference']:.3g}).")
                )
        elif not self.ok:
            # A unit whose gradient is wrong passes it on to every weight before it: the unit to
            # name is the last one (in the forward's order) with a weight that differs.
            failing = [row for row in self.rows if not row["ok"] and row["unit"] in unit_names]
            row = failing[-1] if failing else next(row for row in self.rows if not row["ok"])
            self.failure = _failure_message(
                row["weight"], row["unit"] if failing else None, row["difference"], row["spread"], self.units
            )
            if op_by_op is not None and op_by_op["error"] is not None:
                self.failure += (
                    " (Run op by op, to tell it from the compiler's rounding, a step raised: "
                    f"{op_by_op['error']}.)"
                )
            elif rewritten and rewrites["kind"] == _EXCESS_PRECISION:
                self.failure += (
                    " Compiled with XLA's excess precision off, and op by op, the steps match: XLA keeps float32 "
                    "between the ops it fuses, fuses the recomputed step otherwise than the plain one, and this "
                    f"model's update moves by more than a rounding. Train with XLA_FLAGS={_EXCESS_PRECISION_OFF}."
                )
            elif rewritten:
                self.failure += (
                    " Compiled with TensorFlow's arithmetic optimizer off, and op by op, the steps match: the "
                    "optimizer (Grappler) rewrote the recomputed step's graph, and the rewrite moves this model's "
                    "update by more than a rounding. Train with it off: "
                    "tf.config.optimizer.set_experimental_options({'arithmetic_optimization': False})."
                )
            elif op_by_op is not None and op_by_op["exact"]:
                self.failure += (
                    f" Run op by op (run_eagerly=True) the steps match ({op_by_op['difference']:.3g}): the difference "
                    "comes with compiling the recomputed step, beyond what compiling moves the plain one "
                    f"({op_by_op['compile_spread']:.3g})"
                    + (
                        f", and compiled with {_REWRITES_OFF[rewrites['kind']]} it remains "
                        f"({rewrites['difference']:.3g})." if rewrites is not None and rewrites["error"] is None
                        else "."
                    )
                )
            elif op_by_op is not None:
                self.failure += (
                    f" Run op by op (run_eagerly=True) the steps differ too ({op_by_op['difference']:.3g}): "
                    "it is not the compiler's rounding."
                )

    def __str__(self):
        header = ["unit", "worst weight", "difference", "plain spread", "verdict"]
        ran = self.trials > 0  # no recomputed step was compared where a step raised
        lines = [header] + [
            [
                row["unit"], row["weight"], f"{row['difference']:.2e}" if ran else "-",
                f"{row['spread']:.2e}" if ran else "-",
                _verdict(row, self.cannot_tell, self._rounding) if ran else "not compared",
            ]
            for row in self.rows
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = [
            f"keras_recompute.verify: {self.model_name!r}, {len(self.units)} units recomputed, "
            f"{self.trials} recomputed steps against the plain step (differences over the largest update)"
        ]
        for index, line in enumerate(lines):
            text.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
            if index == 0:
                text.append("  ".join("-" * width for width in widths))
        rounding = self.ok and any(row["rounding"] for row in self.rows)
        worst = max((row["difference"] for row in self.rows), default=0.0)
        if rounding and self._rounding == "plain op by op":
            text.append(
                f"plain step's compiler rounding: the compiled steps differ by up to {worst:.2e}, but the compiled "
                "recomputed step is the plain step run op by op "
                f"({self.op_by_op['as_op_by_op_difference']:.2e}): it is compiling the plain step that moves it "
                f"({self.op_by_op['compile_spread']:.2e} from op by op), not the recompute"
            )
        elif rounding and self._rounding == "graph optimizer":
            text.append(
                f"graph optimizer's rounding: the tf.function steps differ by up to {worst:.2e}; compiled with "
                "TensorFlow's arithmetic optimizer off they match "
                f"({self.rewrites['difference']:.2e}), and op by op too: the optimizer (Grappler) rewrote the "
                "recomputed step's graph (a chain of adds into one AddN rounds once) where it left the plain one's. "
                "Training is exact with tf.config.optimizer.set_experimental_options({'arithmetic_optimization': "
                "False})"
            )
        elif rounding and self._rounding == "excess precision":
            text.append(
                f"XLA's excess precision: the compiled steps differ by up to {worst:.2e}; compiled with XLA's excess "
                f"precision off they match ({self.rewrites['difference']:.2e}), and op by op too: in a 16-bit float "
                "XLA keeps float32 between the ops it fuses, and it fuses the recomputed step's ops otherwise than "
                f"the plain step's. Training is exact with XLA_FLAGS={_EXCESS_PRECISION_OFF}"
            )
        elif rounding:
            fixed = self._rounding == "fixed bound"
            bound = f"below {_BELOW_COMPILING:g} and" if fixed else f"within {_COMPILER_FACTOR}x"
            text.append(
                f"compiler's rounding: the compiled steps differ by up to {worst:.2e}, {bound} what compiling alone "
                f"moves the plain step ({self.op_by_op['compile_spread']:.2e} from the same step run op by op), and "
                f"run op by op the recomputed step matches the plain one ({self.op_by_op['difference']:.2e}): the "
                "compiler makes the recomputed step another program, whose float rounding this model amplifies"
            )
        if self.plain_seconds and self.recomputed_seconds:
            text.append(
                f"step time: plain {self.plain_seconds * 1e3:.1f} ms, recomputed {self.recomputed_seconds * 1e3:.1f} "
                f"ms ({self.recomputed_seconds / self.plain_seconds:.2f}x)"
            )
        else:
            text.append("step time: not measured (a step raised)")
        if self.plain_peak is not None and self.recomputed_peak is not None:
            if self.recomputed_peak < self.plain_peak:
                saved = f"{self.plain_peak / max(self.recomputed_peak, 1):.2f}x lower"
            else:  # e.g. a small model on a GPU, whose step peaks at its weights and the matmuls' workspaces
                saved = (
                    f"{self.recomputed_peak / max(self.plain_peak, 1):.2f}x higher: nothing saved, the step's peak is "
                    "not in what these units keep"
                )
            text.append(
                f"step peak ({self.peak_source}): plain {_budget.format_bytes(self.plain_peak)}, recomputed "
                f"{_budget.format_bytes(self.recomputed_peak)} ({saved})"
            )
        else:
            text.append("step peak: not measured (this device's allocator keeps no figures; memory=True predicts it)")
        text.append("verdict: OK, recompute trains as the plain model" if self.ok else self.failure)
        return "\n".join(text)

    def __repr__(self):
        return f"<VerifyReport ok={self.ok}, {len(self.units)} units, {self.trials} trials>"


def _plain_problem(model, names, updates):
    """Why the plain step is no reference, or None (NOTE [ a plain step that is wrong too ])."""
    if updates and not any(np.any(values) for values in updates[0]):  # NOTE [ a loss-scaled step ]
        return (
            "keras_recompute.verify: the plain step moved no weight, so there is nothing to compare: no gradient "
            "reaches the trainable weights, or (mixed_float16) the loss-scaled gradients overflowed at every scale "
            f"down to 2**-{_SETTLING_STEPS - 15} and each step was skipped. Check the loss and the inputs on the "
            "plain model."
        )
    for update in updates:
        for name, values in zip(names, update):
            if not np.all(np.isfinite(values)):
                return (
                    f"keras_recompute.verify: the plain step's update of {name!r} is not finite (nan or inf): the "
                    "model is wrong without recompute too, and there is nothing to compare with. Check the inputs, "
                    "targets and loss on the plain model (verify trains with SGD at lr 1.0: the update is the "
                    "gradient)."
                )
    if len(updates) < 2:
        return None
    changing = [  # (index, name, how far each later run's update is from the first's)
        (i, name, [float(np.max(np.abs(u[i] - updates[0][i]), initial=0.0)) for u in updates[1:]])
        for i, name in enumerate(names)
        if any(np.any(u[i] != updates[0][i]) for u in updates[1:])
    ]
    untracked = _untracked_torch_weights(model)
    accumulating = [(name, moves) for _, name, moves in changing if name in untracked]
    if accumulating:
        shown = ", ".join(
            f"{name!r} (its update moved {', '.join(f'{m:.3g}' for m in moves)})" for name, moves in accumulating[:3]
        )
        shared = ", ".join(repr(name) for name in sorted(set(untracked))[:3])
        return (
            "keras_recompute.verify: the plain step is wrong without recompute: trainable weights are not "
            f"registered as torch parameters of the model ({len(untracked)} of them), so Keras's `zero_grad` "
            f"before each step leaves their gradients, and each step adds its gradient to the last: {shown}. "
            f"Keras registers a model's variables by path, and these share theirs with other weights ({shared}): "
            "a Keras bug on PyTorch, not recompute's. Until it is fixed, clear their gradients before each step, "
            "e.g. with a callback given to fit: `on_train_batch_begin`: `for v in self.model.trainable_variables: "
            "v.value.grad = None`."
        )
    if len(updates) >= 3 and changing:
        # Updates that grow by the same step each run: something carried from one step to the next.
        i, name, _ = max(changing, key=lambda item: item[2][-1])
        first, last = updates[1][i] - updates[0][i], updates[-1][i] - updates[0][i]
        runs = len(updates) - 1
        if np.max(np.abs(first)) > 0 and np.max(np.abs(last - runs * first)) <= 0.01 * np.max(np.abs(last)):
            return (
                "keras_recompute.verify: the plain step is wrong without recompute: run again from the same "
                f"variables and seed, it updates {name!r} by more each time, by the same amount (something, a "
                "gradient that accumulates, is carried from one step to the next). There is nothing to compare "
                "with until the plain step gives the same update from the same start."
            )
    return None


def _verdict(row, cannot_tell, rounding):
    if not row["ok"]:
        return "cannot tell" if cannot_tell else "DIFFERS"
    if not row["rounding"]:
        return "ok"
    return _ROUNDING_VERDICTS.get(rounding, "ok (compiler's rounding)")


_ROUNDING_VERDICTS = {
    "plain op by op": "ok (as the plain step op by op)", "graph optimizer": "ok (graph optimizer's rounding)",
    "excess precision": "ok (XLA's excess precision)",
}


def _compare(initial, plain_updates, updates):
    """`(scale, spreads, differences, exact)`: the largest plain update, and for each weight the plain step's own
    spread, the recomputed updates' largest difference from the first plain one (beyond one float32 spacing of the
    weight, where the optimizer rounds `w - g`), and whether that is within the spread or reassociation."""
    reference = plain_updates[0] if plain_updates else [np.zeros_like(w) for w in initial]
    scale = max((float(np.max(np.abs(u))) for u in reference if u.size), default=0.0) or 1.0
    spreads = [
        max((float(np.max(np.abs(t[i] - reference[i]), initial=0.0)) for t in plain_updates), default=0.0)
        for i in range(len(reference))
    ]
    differences = []
    for index, (w0, expected) in enumerate(zip(initial, reference)):
        spacing = np.spacing((np.abs(w0) + np.abs(expected)).astype(np.float32)).astype(np.float64)
        worst = 0.0
        for update in updates:
            beyond = np.maximum(np.abs(update[index] - expected) - spacing, 0.0)
            worst = max(worst, float(np.max(beyond, initial=0.0)))
        differences.append(worst)
    exact = [d <= max(2 * s, _REASSOCIATION * scale) for d, s in zip(differences, spreads)]
    return scale, spreads, differences, exact


def _step_is_compiled(model, keras_module):
    """Whether the model's training step is compiled (and a compiler may round it otherwise than op by op)."""
    if model.run_eagerly:
        return False
    if keras_module.__name__ != "keras":
        return True  # tf_keras: a tf.function
    backend = _backend_of(model)
    return backend == "tensorflow" or bool(model.jit_compile)  # JAX: jit; PyTorch: torch.compile


def _random_as_op_by_op(model, keras_module):
    """On PyTorch with torch.compile: compiled steps draw random numbers as op by op (NOTE [ torch.compile's random
    numbers ]); elsewhere nothing."""
    if keras_module.__name__ != "keras" or _backend_of(model) != "torch" or not _step_is_compiled(model, keras_module):
        return contextlib.nullcontext()
    from torch._inductor import config

    return config.patch(fallback_random=True)


def _both_steps(model, keras_module, arguments, state, x, y, seed, initial, trials, plan, optimizer_state,
                op_by_op=False):
    """`(error, plain, recomputed)`: the plain step's updates twice, then (the model planned again by `plan`) the
    recomputed step's `trials` times, each compiled anew from `arguments` and started from `optimizer_state`."""
    _model.unrecompute_model(model)
    error, plain = _Runs(_compiled_with_sgd(model, keras_module, arguments, op_by_op), keras_module, state, x, y,
                         seed, optimizer_state).updates(2, initial)
    plan()
    recomputed = []
    if error is None:
        error, recomputed = _Runs(_compiled_with_sgd(model, keras_module, arguments, op_by_op), keras_module, state,
                                  x, y, seed, optimizer_state).updates(trials, initial)
    return error, plain, recomputed


def _op_by_op(model, keras_module, arguments, state, x, y, seed, initial, plain_updates, updates, trials, plan,
              optimizer_state):
    """Both steps again, run op by op (NOTE [ what compiling moves ]): a dict of `compile_spread` (how far the
    compiled plain update is from the op-by-op one, normwise), `exact` (whether op by op the recomputed updates
    match the plain ones), their largest `difference` (normwise), `as_op_by_op` (whether the compiled recomputed
    `updates` match the plain op-by-op ones, every trial) and `as_op_by_op_difference`, and the `error` a step
    raised, or None."""
    error, eager_plain, eager_updates = _both_steps(
        model, keras_module, arguments, state, x, y, seed, initial, trials, plan, optimizer_state, op_by_op=True
    )
    if error is not None:
        return {"error": error, "compile_spread": None, "exact": False, "difference": None, "as_op_by_op": False,
                "as_op_by_op_difference": None}
    scale, _, differences, exact = _compare(initial, eager_plain, eager_updates)
    _, _, compiled_differences, compiled_exact = _compare(initial, eager_plain, updates)
    compiled_scale = _compare(initial, plain_updates, [])[0]
    compile_spread = max(
        (float(np.max(np.abs(e - c), initial=0.0)) for e, c in zip(eager_plain[0], plain_updates[0])), default=0.0
    ) / compiled_scale
    return {
        "error": None,
        "compile_spread": compile_spread,
        "exact": all(exact),
        "difference": max(differences, default=0.0) / scale,
        "as_op_by_op": all(compiled_exact),
        "as_op_by_op_difference": max(compiled_differences, default=0.0) / scale,
    }


def _graph_optimized(model, keras_module):
    """Whether the training step is a TensorFlow graph Grappler optimizes (a tf.function, not XLA)."""
    return (
        _backend_of(model) == "tensorflow" and _step_is_compiled(model, keras_module)
        and not (model.jit_compile if keras_module.__name__ == "keras" else model._jit_compile)
    )


def _same_in_every_trial(updates):
    """Whether every trial's update equals the first's bitwise (the same program each step: no race showed)."""
    return all(all(np.array_equal(a, b) for a, b in zip(update, updates[0])) for update in updates[1:])


@contextlib.contextmanager
def _arithmetic_optimizer_off():
    """Within it, tf.functions traced are optimized without Grappler's arithmetic optimizer; the user's options
    come back after."""
    from tensorflow.python.eager import context

    options = context.context()._optimizer_experimental_options
    saved = dict(options)
    context.context().set_optimizer_experimental_options({"arithmetic_optimization": False})
    try:
        yield
    finally:
        options.clear()
        context.context().set_optimizer_experimental_options(saved)


def _without_rewrites(model, keras_module, arguments, state, x, y, seed, initial, trials, plan, optimizer_state,
                      kind=_ARITHMETIC_OPTIMIZER):
    """Both steps compiled again with Grappler's arithmetic optimizer off (NOTE [ a graph optimizer's rewrite ]), or
    with `kind=_EXCESS_PRECISION` with XLA's excess precision off (NOTE [ XLA's excess precision ]): a dict of
    `exact` (whether the recomputed updates then match the plain ones), their largest `difference` (normwise), the
    `error` a step raised, or None, and the `kind`."""
    with _arithmetic_optimizer_off() if kind == _ARITHMETIC_OPTIMIZER else _excess_precision_off():
        error, plain, recomputed = _both_steps(
            model, keras_module, arguments, state, x, y, seed, initial, trials, plan, optimizer_state
        )
    if error is not None:
        return {"error": error, "exact": False, "difference": None, "kind": kind}
    scale, _, differences, exact = _compare(initial, plain, recomputed)
    return {"error": None, "exact": all(exact), "difference": max(differences, default=0.0) / scale, "kind": kind}


def _excess_precision(model, keras_module):
    """Whether the step is compiled by JAX's jit over a 16-bit float with XLA's excess precision on (XLA_FLAGS
    without the switch), which verify turns off for compiles of its own (NOTE [ XLA's excess precision ])."""
    if keras_module.__name__ != "keras" or _backend_of(model) != "jax" or not _step_is_compiled(model, keras_module):
        return False
    if _EXCESS_PRECISION_OFF in os.environ.get("XLA_FLAGS", ""):
        return False
    layers = model._flatten_layers() if hasattr(model, "_flatten_layers") else [model]  # the model itself first
    policies = {getattr(getattr(layer, "dtype_policy", None), "compute_dtype", None) for layer in layers}
    return bool(policies & {"bfloat16", "float16"}) and _jax_trainer() is not None


def _jax_trainer():
    """Keras's JAX trainer module, where it compiles the steps with `jax.jit` (not Flax NNX's `jit`), else None."""
    try:
        import jax
        from keras.src.backend.jax import trainer
    except ImportError:
        return None
    return trainer if getattr(trainer, "jit", None) is jax.jit else None


@contextlib.contextmanager
def _excess_precision_off():
    """Within it, Keras's JAX trainer compiles each step with XLA's excess precision off, by a compiler option of
    that compile (`jax.jit(compiler_options=...)`: XLA_FLAGS is read once, when JAX starts); its `jit` comes back
    after."""
    import jax

    trainer = _jax_trainer()
    trainer.jit = functools.partial(jax.jit, compiler_options={_EXCESS_PRECISION_OPTION: False})
    try:
        yield
    finally:
        trainer.jit = jax.jit


def _untracked_torch_weights(model):
    """The paths of the trainable weights that PyTorch's `model.parameters()` does not list (empty off PyTorch)."""
    from keras_recompute.backends import _keras3

    if not _keras3.is_layer(model) or _keras3.backend_name() != "torch":
        return []
    registered = {id(parameter) for parameter in model.parameters()}
    return [v.path for v in model.trainable_variables if id(v.value) not in registered]


def _failure_message(weight, unit, difference, spread, units):
    if unit is None:
        where = f"weight {weight!r}, outside every recomputed unit,"
        fix = "no recomputed unit's own weights differ: check what feeds this weight's gradient"
    else:
        others = [u for u in units if u != unit]
        where = f"unit {unit!r} (weight {weight!r}; the weights before it differ through its input gradient)"
        fix = (
            f"recompute without it (recompute_model(model, blocks={others!r})), or try another policy "
            "(policy='full' recomputes the most and keeps no activation of its own)"
        )
    return (
        f"keras_recompute.verify: {where} updated {difference:.3g} off the plain model's update (normwise), "
        f"where the plain step's own spread is {spread:.3g}. To fix: {fix}. Please report it with the "
        "model, backend and device."
    )


def _check(model, trials, plain_trials, seed):
    _model._refuse_keras2(model, "verify")
    if not _context.is_layer(model):
        raise TypeError(
            f"keras_recompute: verify takes a compiled Keras 3 or tf_keras model; received {model!r} of type "
            f"{type(model).__name__}."
        )
    for name, value in (("trials", trials), ("plain_trials", plain_trials), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"keras_recompute: verify({name}=...) takes an int; received {value!r}.")
    if trials < 1 or plain_trials < 2:
        raise ValueError(
            f"keras_recompute: verify needs trials >= 1 and plain_trials >= 2 (the plain spread is measured "
            f"between runs); received trials={trials}, plain_trials={plain_trials}."
        )
    if getattr(model, "optimizer", None) is None or getattr(model, "loss", None) is None:
        raise ValueError(
            f"keras_recompute: verify runs {model.name!r}'s own compiled training step, and it is not compiled "
            "with a loss: call model.compile(optimizer=..., loss=...) first (the optimizer is not used: "
            "verify trains copies with SGD at lr 1.0)."
        )
    keras_module = _keras_module(model)
    if keras_module.__name__ == "tf_keras":
        import tensorflow as tf

        if not tf.compat.v1.executing_eagerly_outside_functions():
            raise ValueError(
                "keras_recompute: verify runs in TF2 behaviour; in a TF1-style graph "
                "(disable_eager_execution) it cannot copy the model's variables between steps."
            )
    return keras_module


def _keras_module(model):
    from keras_recompute.backends import _keras3

    if _keras3.is_layer(model):
        return sys.modules["keras"]
    return sys.modules["tf_keras"]


def _compiled_with_sgd(model, keras_module, arguments, op_by_op=False):
    """`model` compiled with `arguments` (the model's own, `_compile_arguments`, read before verify compiled it: a
    step compiled from the current ones after an op-by-op step ran op by op too), but with SGD at lr 1.0 (a new
    training step, traced anew); run op by op if asked."""
    options = dict(arguments, optimizer=keras_module.optimizers.SGD(learning_rate=1.0))
    options["steps_per_execution"] = 1  # `train_on_batch` runs one step (tf_keras raises on more); restored after
    if op_by_op:
        options.update(run_eagerly=True, jit_compile=False)
    options.pop("metrics", None)
    options.pop("weighted_metrics", None)
    model.compile(**options)
    return model


def _compile_arguments(model, keras_module):
    """The arguments `model` was compiled with, its optimizer as the object it holds."""
    if keras_module.__name__ == "keras":
        arguments = dict(model._compile_config.config)
    else:
        # tf_keras's own list leaves out how the step runs: without these, the step verified would be a
        # tf.function whatever `compile` set, and the model would come back without its `jit_compile`.
        arguments = dict(model._get_compile_args(), run_eagerly=model._run_eagerly, jit_compile=model._jit_compile)
        if getattr(model, "_autotune_steps_per_execution", False):
            arguments["steps_per_execution"] = "auto"
        elif getattr(model, "_steps_per_execution", None) is not None:
            arguments["steps_per_execution"] = int(model._steps_per_execution.numpy())
    arguments["optimizer"] = model.optimizer
    return arguments


class _Restored:
    """Within it, `model` may be compiled and planned otherwise: on exit its variables, compile and plan are back."""

    def __init__(self, model, keras_module, state):
        self._model, self._keras, self._state = model, keras_module, state

    def __enter__(self):
        self.arguments = _compile_arguments(self._model, self._keras)
        self._plan = self._model.__dict__.get(_model._PLAN)
        return self

    def __exit__(self, *exc_info):
        model = self._model
        _model.unrecompute_model(model)
        if self._plan is not None:
            self._plan.redo()
            object.__setattr__(model, _model._PLAN, self._plan)
        for variable, value in zip(_state_variables(model, self._keras), self._state):
            variable.assign(value)
        model.compile(**self.arguments)
        return False


def _state_variables(model, keras_module):
    """What a step starts from: every variable (Keras 3: seed states too), in a fixed order."""
    return list(model.variables) if keras_module.__name__ == "keras" else list(model.weights)


def _owners(model, units):
    """For each of `model.weights`, the name of the recomputed unit that holds it, or None."""
    by_id = {}
    for name, layer in units:
        for variable in layer.weights:
            by_id.setdefault(id(variable), name)
    return [by_id.get(id(w)) for w in model.weights]


# NOTE [ a loss-scaled step ]
# Under mixed_float16 Keras wraps the optimizer in a LossScaleOptimizer, whose
# dynamic scale starts at 32768 and halves at each step whose scaled gradient
# overflows; that step updates nothing. verify compiled its SGD copies afresh
# and set back only the model's variables between steps, so the scale went on
# halving from trial to trial, and a trial that no longer overflowed was
# compared with a plain one that did: a "DIFFERS" of the whole update (found
# 2026-12-03, PyTorch, attention over `Embedding(mask_zero=True)`: 1.09
# normwise, every policy, where the two steps were the same function). So
# every step of both copies starts from the same optimizer state too (the
# scale, its step counter, the iteration), and that state is the one the plain
# step first updates weights from: the plain copy's first steps run until one
# does (the scale settles as in training), at most `_SETTLING_STEPS`. A plain
# step that moves no weight at all leaves nothing to compare, and says so.
_SETTLING_STEPS = 24  # halvings: 32768 down to below 0.002


def _optimizer_variables(model):
    """The variables a training step of `model` reads from its optimizer (NOTE [ a loss-scaled step ])."""
    optimizer = model.optimizer
    if getattr(optimizer, "built", True) is False and hasattr(optimizer, "build"):  # Keras 3: else at the first step
        optimizer.build(model.trainable_variables)
    variables = optimizer.variables
    variables = list(variables() if callable(variables) else variables)
    scale = getattr(optimizer, "_loss_scale", None)  # tf_keras: its dynamic scale is no variable of the optimizer's
    scale_variables = (getattr(scale, name, None) for name in ("_current_loss_scale", "_counter"))
    return variables + [v for v in scale_variables if v is not None]


class _Runs:
    """Steps of one copy from the same variables, optimizer state and seed: their updates, times and peak.

    `optimizer_state`: what each step's optimizer starts from (another copy's `optimizer_state`, NOTE [ a
    loss-scaled step ]); None: this copy's own, the state its first steps settle to.
    """

    def __init__(self, model, keras_module, state, x, y, seed, optimizer_state=None):
        self._model = model
        self._keras = keras_module
        self._state = state
        self._x, self._y, self._seed = x, y, seed
        self._times = []
        self.peak = None
        self.optimizer_state = optimizer_state

    def _reset(self, optimizer=True):
        for variable, value in zip(_state_variables(self._model, self._keras), self._state):
            variable.assign(value)
        if optimizer:
            for variable, value in zip(_optimizer_variables(self._model), self.optimizer_state):
                variable.assign(value)
        self._keras.utils.set_random_seed(self._seed)

    def _step(self):
        started = time.perf_counter()
        self._model.train_on_batch(self._x, self._y)
        return time.perf_counter() - started

    def _settle(self):
        """The first steps, traced and compiled, not timed; then the optimizer state each step starts from."""
        loss_scaled = "LossScale" in type(self._model.optimizer).__name__
        for _ in range(_SETTLING_STEPS if loss_scaled and self.optimizer_state is None else 1):
            before = [np.array(v) for v in _optimizer_variables(self._model)]
            self._reset(optimizer=False)
            self._step()
            if self._moved():
                break
        variables = _optimizer_variables(self._model)
        if self.optimizer_state is None:
            self.optimizer_state = before if len(before) == len(variables) else [np.array(v) for v in variables]
        elif [np.shape(v) for v in self.optimizer_state] != [tuple(v.shape) for v in variables]:
            raise ValueError(
                "keras_recompute.verify: the recomputed copy's optimizer has other variables than the plain copy's "
                f"({len(variables)} against {len(self.optimizer_state)}): please report it with the model."
            )

    def _moved(self):
        """Whether the last step moved a trainable weight from where the steps start."""
        start = {id(v): value for v, value in zip(_state_variables(self._model, self._keras), self._state)}
        return any(np.any(np.asarray(w) != start[id(w)]) for w in self._model.trainable_weights if id(w) in start)

    def updates(self, trials, initial):
        """`(error, updates)`: the first update of each weight in each trial, or the error a step raised."""
        updates = []
        try:
            self._settle()
            for _ in range(trials):
                self._reset()
                with _Peak(self._model) as peak:
                    self._times.append(self._step())
                if peak.bytes is not None:
                    self.peak = max(self.peak or 0, peak.bytes)
                updates.append([np.asarray(w, np.float64) - w0 for w, w0 in zip(self._model.get_weights(), initial)])
        except Exception as error:  # noqa: BLE001 - reported: RecomputeError, an in-place error, a failed assert
            return f"{type(error).__name__}: {error}", updates
        return None, updates

    def seconds(self):
        return statistics.median(self._times) if self._times else 0.0


class _Peak:
    """The peak bytes the device's allocator held during a block (`allocator_peak` of the backend), or None."""

    def __init__(self, model):
        from keras_recompute import _decorator

        self._peak = importlib.import_module(_decorator._PATHS[_backend_of(model)]).allocator_peak
        self.bytes = None

    def __enter__(self):
        self._kept = self._peak(reset=True) is not None
        return self

    def __exit__(self, *exc_info):
        if self._kept and exc_info[0] is None:
            self.bytes = self._peak()
        return False


def _backend_of(model):
    from keras_recompute.backends import _keras3

    return _keras3.backend_name() if _keras3.is_layer(model) else "tensorflow"
