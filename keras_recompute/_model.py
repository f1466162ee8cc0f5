"""`recompute_model`: choose what to recompute in a model, and hand it to `recompute_grad`.

NOTE [ units of a model ]
A unit is what one `recompute_grad` call recomputes. It is either a layer
of the model (a transformer block, found by class, name, predicate, or as the
model's repeated blocks), whose instance's `call` is decorated; or a piece of
a functional model's graph between two tensors that separate it, run as one
call of a small holder layer (NOTE [ a functional graph's pieces ] in
`backends/_keras3.py`); a holder is planned and measured as a layer is, by its
instance's `call`. Either way the model's classes, config and weights are
untouched: another model built from the same classes does not recompute, and
`model.save` writes the plain model. The plan lives in one attribute of the
model; applying another first takes the earlier one off, so nothing is ever
wrapped twice, and a plan that fails (a budget measured too low) puts the
earlier one back.

A tensor separates the graph when every path from the inputs to the outputs
goes through it, as the residual stream between two blocks does: cut there,
the pieces before and after share that one tensor and the model's inputs.
We look for it in Keras's execution order: between two consecutive nodes,
the float tensors made before and used after, the model's inputs aside (they
are kept by the caller anyway). Where exactly one crosses, the graph may be
cut. Integer and boolean tensors (ids, masks) may cross too: they are
constants of a recompute and take no gradient.
"""

import contextlib
import functools
import math
import sys
import warnings

from keras_recompute import _budget, _config, _context, _fit, _memory, _patch, _policy
from keras_recompute._decorator import _undecorated, decorated_inside, decorated_policy, recompute_grad
from keras_recompute._errors import RecomputeError

# Attributes of keras-hub backbones that list their repeated blocks.
_BLOCK_LISTS = ("transformer_layers", "encoder_transformer_layers", "decoder_transformer_layers")

_PLAN = "_keras_recompute_plan"
_PIECES = "_keras_recompute_pieces"


def recompute_model(
    model,
    blocks="auto",
    *,
    segments=None,
    limit=None,
    policy="full",
    enabled=None,
    budget=None,
    inputs=None,
    execution=None,
    offload=False,
):
    """Recomputes units of an existing model in the backward pass, without editing its classes.

    The model is changed in place: each chosen unit runs as one
    `recompute_grad` call, with every guarantee of it (dropout masks,
    BatchNorm updated once, mixed precision, masks, every gradient equal to
    the plain model's). Calling it again replaces the earlier choice.

    Args:
        model: a Keras 3 or tf_keras model (or layer).
        blocks: which units recompute. `"auto"`: the model's repeated blocks,
            every run of them (a keras-hub backbone's `transformer_layers`,
            chains of blocks of one class in a model's graph, runs of them in a
            layer's list (keras-hub's ViT): an encoder-decoder's both sides,
            both towers; outer runs first); else the longest chain of layers of
            one class with weights in a graph; else, in a functional model,
            the pieces between tensors that separate its graph. Or a layer
            class or tuple of classes, a list of layer names, or a predicate
            `layer -> bool`; nested layers are found too, and a layer inside a
            chosen one is not chosen again.
        segments: instead of `blocks`, cut a functional or Sequential model's
            graph into this many pieces at tensors that separate it, each
            recomputed as one unit; `"sqrt"` for about the square root of the
            number of layers (Chen et al. 2016).
        limit: only the first `limit` units recompute; the rest keep their
            activations (the least recompute that fits, as Megatron's
            "block" method).
        policy: what a unit keeps (NOTE [ policies ] in `_policy`).
            `"full"` (default): only its inputs. `"save_dots"`: also the
            outputs of its weight matmuls. `"attention_core"`: everything
            but the core of its attention layers (scores, softmax, attention
            dropout, weighted sum), which alone recomputes.
        enabled: `None` follows `RECOMPUTE` and `recompute_scope` when the
            model runs; `True` or `False` fixes the choice.
        budget: instead of `limit` and `policy`, the peak memory one training
            step on `inputs` may use: bytes (an int), a size (`"512MB"`,
            `"12GiB"`), or a float in (0, 1], the fraction of the plain
            model's activation memory to keep (`1.0` recomputes nothing).
            Each unit gets no recompute or the policy that fits the budget
            with the least recompute time, from costs measured on `inputs`
            (NOTE [ measuring a model's units ] in `_memory`, NOTE [ the
            solver ] in `_budget`). `memory_report` shows the plan.
        inputs: with `budget`, a batch of the size training will use, as the
            model takes it.
        execution: with `budget`, how the training step will run, which
            decides what it keeps (NOTE [ which execution a plan is for ] in
            `_memory`): `"eager"` (a `tf.GradientTape` loop not wrapped in
            `tf.function`, `run_eagerly=True`, PyTorch) or `"compiled"`
            (`tf.function`, XLA, `jax.jit`, a compiled model's `fit`). `None`
            infers it: a compiled model's own setting, else `"eager"`, the
            larger peak. `memory_report` states which one a plan is for.
        offload: `True` keeps what each recomputed unit saves for its
            recompute in host memory (`recompute_grad(offload=True)`, NOTE
            [ offload ] in `_policy`): Keras 3 on JAX and PyTorch. With
            `budget`, the plan counts the inputs of units under `"full"` off
            the device, where the device is not a CPU.

    Returns:
        `model` itself.

    Raises:
        ValueError: for an unknown policy or layer name, a `segments` or
            `limit` that is not a valid count, `segments` on a model without
            a graph to cut, a model where `"auto"` finds no units,
            `"attention_core"` on units without an attention layer (with
            `blocks="auto"`: where no unit has one; the others are left
            out, with a warning), a budget
            that cannot be read, `budget` without `inputs` or with `limit`,
            `inputs` or `execution` without `budget`, an unknown
            `execution`, a budget below the least peak any plan reaches, or
            `offload=True` on TensorFlow or tf_keras.
        TypeError: if `model` is not a Keras layer, or `enabled` or
            `offload` not a bool.

    Example:

    ```python
    backbone = keras_hub.models.GemmaBackbone.from_preset("gemma_2b_en")
    keras_recompute.recompute_model(backbone)               # each decoder block
    keras_recompute.recompute_model(model, segments="sqrt")  # a functional model's graph
    keras_recompute.recompute_model(model, budget="12GiB", inputs=batch)  # the least recompute that fits
    ```
    """
    _refuse_keras2(model, "recompute_model")
    _check_options(model, blocks, segments, limit, policy, enabled)
    _check_budget_options(budget, inputs, limit, policy, execution)
    framework = _framework(model)
    _check_offload(model, framework, offload)
    # Everything that can fail before measuring comes first; a failed plan puts the earlier one back.
    getattr(framework, "check_plannable", lambda model: None)(model)
    pieces = None
    units = None if segments is not None else _choose_blocks(model, framework, blocks)
    if units is None:
        count = _segment_count(model, framework, segments) if segments is not None else None
        pieces = _Pieces.of(model, framework, count)
        units = pieces.units
        if count is not None and len(units) < count:
            warnings.warn(
                f"keras_recompute: recompute_model(segments={segments!r}) cut {model.name!r} into {len(units)} "
                f"pieces, not {count}: a piece ends at a tensor that every path from the model's inputs to its "
                "outputs goes through, and its graph has no more such tensors to cut at.",
                stacklevel=2,
            )
    chosen = tuple(units)  # the units a report of this plan is over (NOTE [ the units of a planned model ])
    if budget is None:
        if policy == _policy.ATTENTION_CORE and segments is None and isinstance(blocks, str) and blocks == "auto":
            units = _auto_units_with_cores(units)
        units = units[:limit]
        if policy == _policy.ATTENTION_CORE:
            _check_attention(units)
    _remove_bert4keras_recompute()
    earlier = model.__dict__.get(_PLAN)
    unrecompute_model(model)
    try:
        if budget is None:
            policies = [policy] * len(units)
        else:
            with pieces.measuring() if pieces is not None else contextlib.nullcontext():
                policies = _planned_policies(model, units, budget, inputs, execution, offload)
    except BaseException:
        if earlier is not None:
            earlier.redo()
            object.__setattr__(model, _PLAN, earlier)
        raise
    plan = _Plan(enabled, pieces, execution if budget is not None else None, offload)
    plan.units = chosen
    on = lambda: _config.is_enabled() if enabled is None else enabled  # noqa: E731
    if pieces is not None:
        plan.add(functools.partial(pieces.install, on))
    for unit, unit_policy in zip(units, policies):
        if unit_policy != _budget.NONE:
            plan.add(
                functools.partial(_patch_call, unit, enabled, unit_policy, offload),
                _memory.unit_name(unit),
                unit_policy,
                unit,
            )
    plan.add(functools.partial(getattr(framework, "rebuild_graph_outputs", lambda model: None), model))
    object.__setattr__(model, _PLAN, plan)
    return model


def memory_report(model, inputs, *, blocks="auto", execution=None, offload=None):
    """What each unit of `model` keeps and costs under each policy, and the peak of a training step.

    The costs are measured on `inputs` (NOTE [ measuring a model's units ] in
    `_memory`) and kept on the model: after `recompute_model(budget=...)` on
    the same batch shape, nothing is measured again. Where a compiler states
    a step's peak (JAX, compiled), the peaks are its: the model's step as it
    stands, and no recompute and the least plan compiled too (NOTE [ a
    report's other plans on JAX ]).

    Args:
        model: a Keras 3 or tf_keras model, in eager mode.
        inputs: a batch of the size training will use, as the model takes it.
        blocks: the units, as in `recompute_model` (`"auto"`, a class, names
            or a predicate). With `"auto"`, a model that runs as pieces of its
            graph (a `segments=` plan) is reported over those pieces, and one
            whose blocks are not layers (bert4keras) over its blocks' pieces.
        execution: `"eager"`, `"compiled"` or None, as in `recompute_model`:
            the execution the predicted peak is for; the report states it.
        offload: whether the recomputed units keep their inputs in host
            memory (NOTE [ offload ] in `_policy`); None: as the model's
            plan does (False without one). The report says how it counted it.

    Returns:
        A `MemoryReport`: `print(report)` shows the table; `report.rows` (one
        dict per unit, with `"name"` and `"policy"` applied now) and
        `report.predicted_peak` (bytes) hold it.

    Example:

    ```python
    keras_recompute.recompute_model(model, budget="2GB", inputs=batch)
    print(keras_recompute.memory_report(model, batch))
    ```
    """
    framework = _checked_model(model, "memory_report")
    plan, units, pieces = _units_of(model, framework, blocks)
    applied = plan.applied() if plan is not None else {}
    # A unit whose own call is decorated (`recompute_grad` on its class's or its instance's `call`) recomputes
    # under its decorator's policy where no plan names it (until 2026-11-29 the report counted it as plain).
    decorated, inner = {}, {}
    for unit in units if pieces is None else ():
        found = decorated_policy(unit.call)
        if found is not None:
            decorated[_memory.unit_name(unit)] = found
        else:
            inside = decorated_inside(unit)
            if inside:
                inner[_memory.unit_name(unit)] = inside
    if execution is None and plan is not None:
        execution = plan.execution  # a plan's report is for the execution it was made for
    if offload is None:
        offload = plan.offload if plan is not None else any(moved for _, moved in decorated.values())
    _check_offload(model, framework, offload, "memory_report")
    with pieces.measuring() if pieces is not None else contextlib.nullcontext():
        current = [
            applied.get(_memory.unit_name(u)) or decorated.get(_memory.unit_name(u), (_budget.NONE,))[0] for u in units
        ]
        step_key = None  # the step as it stands, where it is the plan `current` (see _compiled_key)
        if pieces is None and all(_runs_as_planned(unit, applied) for unit in units):
            resolved, _ = _memory.execution_of(model, execution, "memory_report")
            step_key = _compiled_key(model, units, current, inputs, resolved, plan.offload if applied else offload)
        result = _memory.report(model, units, inputs, current, execution, offload, step_key)
        if _memory.states_compiled_peak(model, result.execution):
            result.plain_peak, result.floor = _compiled_bounds(model, units, inputs, result, offload)
    result.inner = _inner_line(inner)
    if plan is not None and plan.names and not applied:
        result.switch = (
            f"recompute is off now ({'enabled=False' if plan.enabled is False else 'RECOMPUTE is not on, no recompute_scope(True)'}): "
            f"the policies and peak above are the plain model's; recompute_model chose "
            f"{', '.join(f'{name}: {policy}' for name, policy in zip(plan.names, plan.policies))}, which runs "
            f"{'with enabled=True' if plan.enabled is False else 'with RECOMPUTE=1 or inside recompute_scope(True)'}"
        )
    return result


def _runs_as_planned(unit, applied):
    """Whether layer `unit` runs its own call, or a plan's wrapper (`applied`) of a call that does not recompute
    itself: as `_compiled_peak_of` runs it under the unit's policy."""
    if decorated_policy(unit.call) is None:
        return True  # its own call, or a wrapper that is off now
    if _memory.unit_name(unit) not in applied:
        return False  # a decorator's, under its own options
    return decorated_policy(getattr(unit.call, "__wrapped__", None)) is None


def _inner_line(inner):
    """The report's line on units that hold decorated layers (NOTE [ units that hold decorated layers ])."""
    if not inner:
        return ""
    names = list(inner)
    layers = []
    for found in inner.values():
        layers += [f"{name}: {policy}" for name, policy in found if f"{name}: {policy}" not in layers]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"{shown} hold layers whose own call is decorated and recomputes now ({', '.join(layers)})"
        + ": 'none' above is such a unit as it stands, those layers recomputed, and so is 'with no recompute'"
    )


# NOTE [ units that hold decorated layers ]
# A unit (a block the report or a plan works with) may hold layers whose own
# call is decorated: `TransformerBlock`s built of this library's ready
# `MultiHeadAttention`, or a user's FFN class with `@recompute_grad`. With the
# switch on, those layers recompute whatever the unit's policy; a unit's
# "none" is measured running its call as it stands, so it includes them: a
# block whose FFN is decorated (`full`) kept 2.1 MB under "none" on PyTorch
# where the same block undecorated kept 10.5 (4 blocks of 128, 2026-11-29). The
# prediction is right for the model as it runs (the report's peak 27.6 MB
# against 51.7 with the switch off), and a plan may leave such a unit as it
# stands; only the names "none" and "with no recompute" would mislead, so the
# report says which units hold decorated layers, and which those are. Which
# of them recompute now is part of what the measurement is cached under
# (`_memory.cache_key`): a report made with the switch on and then one made
# with it off took the first's measurement for both (the blocks above "kept"
# 2.1 MB each with the switch off too) until 2026-11-29.


def _compiled_bounds(model, units, inputs, report, offload):
    """`(plain, floor)` of `report` where a compiler states a step's peak (JAX): what the steps under those plans hold.

    NOTE [ a report's other plans on JAX ]
    The step as the model stands is compiled and its peak read. The other
    plans' peaks were the units' sums, which miss what XLA's program holds
    besides the residuals: a language model's loss on its logits above all.
    keras-hub Gemma with LoRA (4 blocks of 256, vocabulary 32000, sequence
    256; 2026-11-27, CPU), `full` applied: "with no recompute" read 128.6 MB
    where that step compiles to 164.2, "the least any plan reaches" 97.2
    where `full`, a plan, compiles to 141.9. XLA's buffer assignment there
    holds three buffers of the logits' size at the loss (the logits, their
    exponentials, the gradient: 98.3 MB) above the weights and slots (42.2)
    and what it keeps of the blocks (1.4 MB under `full`, 23.6 with none,
    where their residuals are 10.2 and 50.7). Now no recompute is its
    compiled step (calibrated: NOTE [ calibrating the units to the compiler ],
    every uniform plan compiled), and the least is the least of the uniform
    plans' compiled peaks and of the solver's least plan, compiled too: the
    calibrated units interpolate a mixed plan, and there read 128.5 MB for a
    plan whose step compiles to 149.8. A budget at that floor is met by a
    plan `recompute_model(budget=)` finds (it tries the uniform plans).
    """
    costs = _calibrated_costs(model, units, inputs, report.execution, offload)
    count = len(units)
    uniform = _uniform_options(costs)
    as_it_stands = all(row["policy"] == _budget.NONE for row in report.rows)  # no recompute: its step was compiled
    plain = report.predicted_peak if as_it_stands else costs.peak([_budget.NONE] * count)
    peaks = [plain] + [costs.peak([option] * count) for option in uniform]
    least = _budget.solve(costs, costs.floor())
    if least is not None and len(set(least)) > 1:  # a mixed plan: its step compiled
        peaks.append(_compiled_peak_of(model, units, least, inputs, costs, report.execution, offload))
    return plain, min(peak for peak in peaks if peak is not None)


def _checked_model(model, where):
    """The framework module of `model`, a Keras 3 or tf_keras model; else a clear error naming `where`."""
    _refuse_keras2(model, where)
    if not _context.is_layer(model):
        raise TypeError(
            f"keras_recompute: {where} takes a Keras 3 or tf_keras model; received {model!r} "
            f"of type {type(model).__name__}."
        )
    return _framework(model)


def _units_of(model, framework, blocks):
    """`(plan, units, pieces)`: the model's plan (or None), the units a report or fit is over, their graph pieces (or None)."""
    plan = model.__dict__.get(_PLAN)
    pieces = units = None
    if plan is not None and isinstance(blocks, str) and blocks == "auto":
        if plan.pieces is not None:
            pieces = plan.pieces  # the pieces the model runs as
        elif plan.units:
            units = list(plan.units)  # the units the plan chose (NOTE [ the units of a planned model ])
    if units is None and pieces is None:
        units = _choose_blocks(model, framework, blocks)
    if units is None:
        pieces = pieces or _Pieces.of(model, framework, None)
        units = pieces.units
    return plan, units, pieces


# NOTE [ the units of a planned model ]
# A report, a fit or verify's prediction of a model that `recompute_model`
# planned is over the units the plan was made over, unless `blocks=` names
# others: the plan's own `blocks=` choice (or its budget's units), not what
# `blocks="auto"` would find. Until 2026-11-29 it chose again with "auto": a
# keras-hub ViT with a head, planned with `blocks=ViTEncoderBlock` (its blocks
# sit in a layer's list, where "auto" finds no run), was reported as two graph
# pieces, the whole backbone one of them, the planned blocks inside it
# measured as a part of it; the report's rows then named no planned unit, and
# `verify` said "nothing saved". Graph pieces were already taken from the plan.


def measured_costs(model, inputs, *, blocks="auto", execution=None, offload=False, where="largest_fit"):
    """`(units, costs, execution, reason)`: the `_budget.Model` of `model`'s units at `inputs`, offload counted.

    What `memory_report` measures, without the report, calibrated to the
    compiler's figures where one states them (NOTE [ calibrating the units to
    the compiler ]): for callers that plan over several batch shapes.
    """
    units, pieces, execution, reason = _measuring_setup(model, blocks, execution, offload, where)
    with pieces.measuring() if pieces is not None else contextlib.nullcontext():
        return units, _calibrated_costs(model, units, inputs, execution, offload), execution, reason


def _measuring_setup(model, blocks, execution, offload, where):
    """`(units, pieces, execution, reason)` for measuring `model` (`pieces` None where the units are layers)."""
    framework = _checked_model(model, where)
    plan, units, pieces = _units_of(model, framework, blocks)
    if execution is None and plan is not None:
        execution = plan.execution
    _check_offload(model, framework, offload, where)
    execution, reason = _memory.execution_of(model, execution, where)
    return units, pieces, execution, reason


def _calibrated_costs(model, units, inputs, execution, offload, below=True):
    """The costs: measured (or cached), offload counted, calibrated; inside the pieces' `measuring()`.

    `below`: a large batch may be measured at a quarter and a half of it (NOTE [ measuring below the batch ] in
    `_memory`); `largest_fit` measures each of its sizes as it is, its fit being its own.
    """
    costs, _ = _memory.costs(model, units, inputs, execution, below=below)
    costs, _ = _memory.with_offload(model, costs, offload)
    return _calibrated(model, units, inputs, costs, execution, offload)


def largest_fit(
    model,
    budget,
    make_inputs,
    *,
    axis="batch",
    sizes=None,
    options=None,
    plan=True,
    offload=False,
    execution=None,
    blocks="auto",
    multiple_of=1,
    limit=1 << 20,
    headroom=None,
):
    """The largest batch (or sequence length) whose training step fits `budget`, per option, predicted.

    Measures what each unit keeps under each option at a few small sizes,
    fits each figure by a polynomial in the size (degree 1 along the batch, 2
    along the sequence: attention's scores), and reads off, for no recompute,
    each policy applied to every unit, and the budget planner's plan, the
    largest size whose predicted peak fits; along the sequence, where the
    shortest answer lies past twice the sizes measured, the units are
    measured there once more and every answer fitted again (NOTE [ measuring
    nearer the answers ]). Nothing runs at the sizes
    predicted (NOTE [ predicting the largest fit ] in `_fit`); where the
    model's memory does not follow the fit at the sizes measured, that row
    says so instead of answering.

    Args:
        model: a Keras 3 or tf_keras model (compile it with its optimizer
            first: its slots and update are counted).
        budget: the peak a training step may use: bytes, or a size with a
            unit (`"8GiB"`, `"2500MiB"`).
        make_inputs: `size -> inputs`: a batch as the model takes it, with
            `size` rows (`axis="batch"`) or `size` positions
            (`axis="sequence"`).
        axis: `"batch"` or `"sequence"`.
        sizes: the sizes to measure at (default: batch 2, 4, 8; sequence
            64, 128, 192, 256); at least 3 for the batch, 4 for the sequence.
        options: the options to answer for (default: `"none"`, `"full"`,
            `"save_dots"`, `"attention_core"`; each applied to every unit it
            applies to).
        plan: also answer for `recompute_model(budget=...)`'s plan.
        offload: count the recomputed units' inputs in host memory, as
            `recompute_model(offload=True)` does.
        execution: `"eager"`, `"compiled"` or None, as in `recompute_model`.
        blocks: the units, as in `recompute_model`.
        multiple_of: answer in multiples of this (a sequence length your
            model needs to be a multiple of 8, say).
        limit: the largest size searched.
        headroom: the fraction kept free for the prediction's error of the
            room the size can take, the budget above what the step holds at
            size 0 (its weights, optimizer slots and gradients): sizes are
            answered whose predicted peak fits `budget - headroom * (budget -
            fixed)`. None: 0.1 (NOTE [ the headroom ] in `_fit`). 0 answers
            against the whole budget. On TensorFlow each peak also counts
            the step's largest tensor once more, as its allocator may hold a
            tensor in a block of up to twice its size (NOTE [ the
            allocator's blocks ]).

    Returns:
        A `FitReport`: `print(report)` shows the table; `report.largest("full")`
        is one answer; `report.rows` holds them all, with the predicted peak
        at the answer and at the next size.

    Raises:
        ValueError: for a budget below what any plan needs at the smallest
            size, a `make_inputs` that ignores its size, inputs with no
            sequence axis under `axis="sequence"`, or bad arguments.

    Example:

    ```python
    make = lambda n: {"token_ids": np.ones((n, 512), "int32"), "padding_mask": np.ones((n, 512), "int32")}
    report = keras_recompute.largest_fit(model, "16GiB", make)
    print(report)
    recompute_model(model, policy="full")   # then train at report.largest("full")
    ```
    """
    if headroom is None:
        headroom = _fit.HEADROOM
    budget_bytes, sizes = _fit.check_arguments(axis, sizes, budget, multiple_of, headroom)
    options = _fit.default_options() if options is None else list(options)
    for option in options:
        if option != _budget.NONE:
            _policy.check(option, "largest_fit")
    batches = _fit.checked_inputs(make_inputs, sizes, axis, _flatten)
    units, pieces, execution, reason = _measuring_setup(model, blocks, execution, offload, "largest_fit")
    _warn_allocator(model, execution, "largest_fit", stacklevel=3)
    with pieces.measuring() if pieces is not None else contextlib.nullcontext():
        # Below what stays resident at the smallest size, no plan fits: said before anything is measured or compiled
        # (a model not built yet is measured first: the fit below says it).
        resident = [_memory.resident_unmeasured(model, inputs) for inputs in batches]
        least = _fit._evaluate(_fit.polynomial(sizes, resident, _fit.DEGREES[axis]), multiple_of)
        if budget_bytes < least:
            raise ValueError(
                f"keras_recompute: largest_fit(budget={budget!r}) is below the least peak any plan reaches at {axis} "
                f"{multiple_of}: the weights, optimizer and inputs alone take {_budget.format_bytes(least)}. Allow "
                f"more memory, or use a smaller model."
            )
        # TensorFlow's allocator may hold a tensor in a block of up to twice its size (NOTE [ the allocator's blocks ]).
        rounding = _memory._module_name(_memory._measuring_backend(model)) == "tensorflow"

        def answered(sizes, measured):  # the fit through the sizes measured, its usable budget and its answers
            fitted = _fit.FittedModel(sizes, measured, _fit.DEGREES[axis])
            fixed = fitted.at(0).peak([_budget.NONE] * len(fitted.names))
            usable = _fit.usable(budget_bytes, fixed, headroom)
            return fitted, fixed, usable, _fit.fit_rows(fitted, usable, options, plan, limit, multiple_of, rounding)

        measured = [_calibrated_costs(model, units, inputs, execution, offload, below=False) for inputs in batches]
        fitted, fixed, usable, rows = answered(sizes, measured)
        compiled_peak = _memory.states_compiled_peak(model, execution)
        nearer = None if compiled_peak else _fit.nearer_size(rows, sizes, axis, multiple_of)
        if nearer is not None:  # NOTE [ measuring nearer the answers ]
            (inputs,) = _fit.checked_inputs(make_inputs, [nearer], axis, _flatten)
            measured.append(_calibrated_costs(model, units, inputs, execution, offload, below=False))
            sizes = sizes + [nearer]
            fitted, fixed, usable, rows = answered(sizes, measured)
        if compiled_peak:  # each answer checked by compiling the step there
            compiled = {}

            def peak_at(choice, size):
                key = (tuple(choice), size)
                if key not in compiled:
                    compiled[key] = _compiled_peak_of(model, units, choice, make_inputs(size), None, execution, offload)
                return compiled[key]

            def plan_at(size, ruled_out):  # as recompute_model(budget=) plans at that size
                costs = fitted.at(size)
                fallback = [option for option in _uniform_options(costs) if option not in ruled_out]
                return _checked_plan(costs, usable, lambda policies: peak_at(policies, size), fallback, calibrated_here=False)

            _fit.checked_rows(rows, len(units), plan_at, peak_at, usable, limit, multiple_of)
    answered = [row for row in rows if row["largest"]]
    if not answered and all((row["residual"] or 0.0) <= _fit.RESIDUAL_LIMIT for row in rows):
        floor = fitted.at(multiple_of).floor()
        raise ValueError(
            f"keras_recompute: largest_fit(budget={budget!r})"
            + (f", less its headroom ({headroom:.0%} of the room above the {_budget.format_bytes(fixed)} held at "
               f"{axis} 0: {_budget.format_bytes(usable)})," if headroom else "")
            + f" is below the least peak any plan reaches at "
            f"{axis} {multiple_of}: {_budget.format_bytes(floor)} (weights, optimizer and inputs alone: "
            f"{_budget.format_bytes(fitted.at(multiple_of).resident)}). Allow more memory, or use a smaller model."
        )
    title = f"keras_recompute largest fit: {model.name!r}, {len(fitted.names)} units, {_memory._backend_name(model)}"
    return _fit.FitReport(title, axis, budget_bytes, sizes, rows, execution, reason, multiple_of, headroom, fixed, rounding)


def _flatten(structure):
    if isinstance(structure, dict):
        return [leaf for key in sorted(structure, key=str) for leaf in _flatten(structure[key])]
    if isinstance(structure, (list, tuple)):
        return [leaf for item in structure for leaf in _flatten(item)]
    return [structure]


def unrecompute_model(model):
    """Takes off what `recompute_model` put on `model`; the model runs as before it."""
    plan = model.__dict__.get(_PLAN)
    if plan is not None:
        plan.undo()
        del model.__dict__[_PLAN]
    return model


def recomputed_units(model):
    """The names of the units `recompute_model` chose for `model`, in order (empty if none)."""
    plan = model.__dict__.get(_PLAN)
    return list(plan.names) if plan is not None else []


def recomputed_unit_layers(model):
    """`(name, layer)` of each unit `recompute_model` chose for `model` (a graph piece's holder layer for a piece)."""
    plan = model.__dict__.get(_PLAN)
    return list(zip(plan.names, plan.layers)) if plan is not None else []


class _Plan:
    """What `recompute_model` did to one model, and how to undo and redo it.

    Each step is a function that does it and returns how to undo it (or
    None). Deliberately not a list: Keras's saving walks a model's attributes
    and would save the weights of layers found in a list a second time.
    """

    def __init__(self, enabled=None, pieces=None, execution=None, offload=False):
        self._steps = []  # (do, undo)
        self.offload = offload
        self.names = ()
        self.policies = ()
        self.layers = ()
        self.units = ()  # every unit the plan was made over, recomputed or not
        self.enabled = enabled
        self.pieces = pieces
        self.execution = execution  # what a budget's plan was made for (None: no budget, or inferred)

    def add(self, do, name=None, policy=None, layer=None):
        """Does `do()` now; `name`, `policy` and its `layer` when it makes a unit recompute."""
        self._steps.append((do, do()))
        if name is not None:
            self.names += (name,)
            self.policies += (policy,)
            self.layers += (layer,)

    def applied(self):
        """`{unit name: policy}` for the units that recompute as the model runs now."""
        on = _config.is_enabled() if self.enabled is None else self.enabled
        return dict(zip(self.names, self.policies)) if on else {}

    def undo(self):
        for _, undo in reversed(self._steps):
            if undo is not None:
                undo()
        self._steps = [(do, None) for do, _ in self._steps]

    def redo(self):
        """Does every step again, after `undo` (a later plan failed and this one comes back)."""
        self._steps = [(do, do()) for do, _ in self._steps]


def _remove_bert4keras_recompute():
    """bert4keras's own recompute, on when `RECOMPUTE` was set at its import, gives wrong
    gradients (NOTE [ bert4keras's own recompute ] in integrations/bert4keras.py): it goes."""
    if "bert4keras.layers" not in sys.modules:
        return
    from keras_recompute.integrations import bert4keras

    removed = bert4keras.remove_theirs()
    if removed:
        warnings.warn(
            "keras_recompute: bert4keras's own recompute was on (RECOMPUTE was set when bert4keras was "
            f"imported) and is now taken off {removed}: it doubles the gradient of a tensor passed twice "
            "(self-attention), and inside recompute_model's units it would recompute twice.",
            stacklevel=3,
        )


def _refuse_keras2(model, what):
    """A `RecomputeError` for a model of standalone Keras 2 or of TensorFlow's own tf.keras before 2.4, where the
    model-level functions do not run (TensorFlow 2.0-2.1 raised an `AttributeError` from deep inside until
    2026-12-05): decorating the blocks' call does."""
    if _context._keras2_layer(model):  # imports TensorFlow only where it is loaded already
        raise RecomputeError(
            f"keras_recompute: {what} takes a Keras 3 or tf_keras model, not a standalone Keras 2 one "
            f"({type(model).__name__}). On Keras 2.3 decorate the blocks' call with recompute_grad, "
            "or call keras_recompute.integrations.bert4keras.enable() before building a bert4keras model."
        )
    if _context._builtin_layer(model):
        from keras_recompute.backends._tf_private import require_modern

        require_modern(
            f"{what} (on a tf.keras model)",
            "Decorate the blocks' call with recompute_grad and set RECOMPUTE=1, or call "
            "keras_recompute.integrations.bert4keras.enable() before building a bert4keras model.",
        )


def _check_options(model, blocks, segments, limit, policy, enabled):
    _policy.check(policy, "recompute_model")
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(
            "keras_recompute: recompute_model(enabled=...) takes True, False or None; "
            f"received {enabled!r} of type {type(enabled).__name__}."
        )
    if segments is not None:
        if segments != "sqrt" and (not isinstance(segments, int) or isinstance(segments, bool) or segments < 1):
            raise ValueError(
                f"keras_recompute: recompute_model(segments=...) takes a positive int or 'sqrt'; received {segments!r}."
            )
        if not (isinstance(blocks, str) and blocks == "auto"):
            raise ValueError(
                "keras_recompute: recompute_model takes blocks= or segments=, not both: blocks chooses "
                "layers as units, segments cuts the graph into pieces."
            )
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ValueError(f"keras_recompute: recompute_model(limit=...) takes an int >= 0 or None; received {limit!r}.")
    if not _context.is_layer(model):
        raise TypeError(
            f"keras_recompute: recompute_model takes a Keras 3 or tf_keras model; received {model!r} "
            f"of type {type(model).__name__}."
        )


def _check_offload(model, framework, offload, where="recompute_model"):
    if not isinstance(offload, bool):
        raise TypeError(
            f"keras_recompute: {where}(offload=...) takes True or False; received {offload!r} of type "
            f"{type(offload).__name__}."
        )
    if not offload:
        return
    from keras_recompute.backends import _keras3

    backend = _keras3.backend_name() if framework is _keras3 else "tf_keras"
    if backend not in ("jax", "torch"):
        raise ValueError(
            f"keras_recompute: {where}(offload=True) keeps what recomputed units save in host memory on Keras 3's "
            f"JAX and PyTorch backends; {model.name!r} runs on {backend!r}, which has no offload path. Drop "
            "offload=True, or run it with KERAS_BACKEND=jax or torch."
        )


def _check_budget_options(budget, inputs, limit, policy, execution):
    if budget is None:
        for name, value in (("inputs", inputs), ("execution", execution)):
            if value is not None:
                raise ValueError(
                    f"keras_recompute: recompute_model({name}=...) is part of planning to a budget; pass "
                    f"budget= with it, or leave {name}= out."
                )
        return
    _budget.parse_budget(budget)
    if inputs is None:
        raise ValueError(
            "keras_recompute: recompute_model(budget=...) needs inputs=: a batch of the size training will "
            "use (as the model takes it), on which the units' memory and time are measured."
        )
    if limit is not None:
        raise ValueError(
            "keras_recompute: recompute_model takes budget= or limit=, not both: the budget decides how many "
            "units recompute, and with which policy."
        )
    if policy != _policy.FULL:
        raise ValueError(
            f"keras_recompute: recompute_model(budget=...) chooses each unit's policy itself; policy={policy!r} "
            "cannot be kept. Leave policy= out, or drop budget= and choose by hand."
        )


def _planned_policies(model, units, budget, inputs, execution, offload=False):
    """Each unit's policy (or `"none"`) from the solver, under `budget` (NOTE [ the solver ])."""
    kind, value = _budget.parse_budget(budget)
    execution, _ = _memory.execution_of(model, execution, "recompute_model")
    plain = [_budget.NONE] * len(units)
    if kind == "fraction" and value >= 1.0:
        return plain  # all the activations may stay: nothing to measure
    if kind == "bytes":
        resident = _memory.resident_unmeasured(model, inputs)
        if value < resident:  # no plan fits: said before anything is measured or compiled
            raise ValueError(
                f"keras_recompute: recompute_model(budget={budget!r}) is below the least peak any plan reaches "
                f"for this batch: the weights, optimizer and batch alone take {_budget.format_bytes(resident)}. "
                "Train with a smaller batch, or allow more memory."
            )
    _warn_allocator(model, execution, f"recompute_model(budget={budget!r})", stacklevel=4)
    costs = _calibrated_costs(model, units, inputs, execution, offload)
    if kind == "fraction":
        value = costs.peak(plain) - (1.0 - value) * costs.activation_bytes(plain)
    checked = []  # the peaks of the plans' steps, where a compiler states them or the allocator measured them

    def compiled(policies):
        peak = _compiled_peak_of(model, units, policies, inputs, costs, execution, offload)
        if peak is not None:
            checked.append(peak)
        return peak

    policies = _checked_plan(costs, value, compiled)
    if policies is None:
        asked = f"{budget!r}" if kind == "bytes" else f"{budget!r}, a peak of {_budget.format_bytes(value)}"
        floor = _budget.format_bytes(costs.floor())
        reached = f", {floor}"
        if checked and costs.floor() <= value:  # predicted to fit, but no plan's step did
            plans = f"{len(checked)} plans" if len(checked) > 1 else "plan"
            reached = (f": predicted at {floor}, but the steps of the {plans} checked, measured, peaked at "
                       f"{_budget.format_bytes(min(checked))} or more")
        raise ValueError(
            f"keras_recompute: recompute_model(budget={asked}) is below the least peak any plan reaches "
            f"for this batch{reached} (weights, optimizer and batch alone: "
            f"{_budget.format_bytes(costs.resident)}). Train with a smaller batch, or allow more memory."
        )
    return policies


def _warn_allocator(model, execution, where, stacklevel):
    """Warns, at the caller's line (`stacklevel`), where `model`'s step may peak above what planning predicts (NOTE
    [ a CNN on TensorFlow's allocator ] in `_memory`): the line `memory_report` shows."""
    line = _memory.allocator_line(model, execution)
    if line:
        warnings.warn(f"keras_recompute: {where}: {line}", stacklevel=stacklevel)


def _checked_plan(costs, value, compiled, fallback=None, calibrated_here=True):
    """The solver's plan under `value`, checked by `compiled(policies)` where a compiler states the peak, else None.

    Over the budget by the compiler's figure, the plan is solved again for a
    target lower by that much (three tries). Where no plan is predicted to
    fit, the plan of the least peak is checked, and it with each other option
    on the last unit (where nothing states a compiled peak, no plan fits). A
    mixed plan's peak is
    interpolated (NOTE [ calibrating the units to the compiler ]) and can miss
    where one policy on every unit fits: then the fastest of those whose
    compiled step fits (the planner then never refuses a budget that `full`
    meets). `fallback`: the options tried so (default: every option that
    applies to every unit). `calibrated_here`: `costs` were calibrated at
    these inputs, so each of those plans' predicted peak is the compiler's,
    and none is compiled again.
    """
    policies = _budget.solve(costs, value)
    target = value
    for _ in range(3):
        if policies is None:
            break
        actual = compiled(policies)
        if actual is None or actual <= value:  # nothing states the peak: the prediction stands
            return policies
        target -= actual - value
        policies = _budget.solve(costs, target)
    # A mixed plan's interpolated peak can lie over its compiled one (keras-hub BERT small at batch 59: full on
    # three blocks and attention_core on the last, 576.3 MB predicted, 563.8 compiled, under a budget of 566.2
    # that full on all four, 571.6, misses). The step peaks in the last unit's backward (NOTE [ the peak of a
    # plan ] in `_budget`): the plan of the least peak, then it with each other option on the last unit.
    least = _budget.solve(costs, costs.floor())
    candidates = [] if not least else [least] + sorted(
        (least[:-1] + [option] for option in costs.units[-1].options if option != least[-1]), key=costs.peak
    )
    for candidate in candidates:
        actual = compiled(candidate)
        if actual is None:
            return None  # nothing states the peak: no plan is predicted to fit
        if actual <= value:
            return candidate
    count = len(costs.units)
    uniform = _uniform_options(costs)
    uniform = uniform if fallback is None else [o for o in uniform if o in fallback]
    for option in sorted(uniform, key=lambda o: costs.seconds([o] * count)):
        if calibrated_here:
            if costs.peak([option] * count) <= value:
                return [option] * count
            continue
        actual = compiled([option] * count)
        if actual is None:
            break
        if actual <= value:
            return [option] * count
    return None


def _uniform_options(costs):
    """The options that apply to every unit of `costs` (each a plan on its own), in the first unit's order."""
    if not costs.units:
        return []
    return [o for o in costs.units[0].options if all(o in unit.options for unit in costs.units)]


def _compiled_peak_of(model, units, policies, inputs, costs, execution, offload=False):
    """The compiler's peak of a step with `policies[i]` applied to unit i (`_memory.compiled_peak`), or None.

    Each unit runs its own call under `policies[i]`, whatever the model has applied now: `"none"` is the plain
    call, not the plan in place (until 2026-11-27 a model with `full` applied answered `largest_fit`'s "none" with
    full's batch: three of tests/test_fit.py's blocks in 200 MiB, 121 where 47 fits;
    tests/test_fit.py::test_a_planned_model_is_answered_as_a_plain_one).
    """
    if not _memory.states_compiled_peak(model, execution):
        return None
    key = _compiled_key(model, units, policies, inputs, execution, offload)
    with contextlib.ExitStack() as stack:
        if _memory.remembered(model, key) is None:  # else its step's bytes are known: nothing is compiled
            for unit, policy in zip(units, policies):
                base = _undecorated(unit.call)
                call = base if policy == _budget.NONE else recompute_grad(base, enabled=True, policy=policy, offload=offload)
                stack.enter_context(_patch.instance_attribute(unit, "call", call))
        return _memory.compiled_peak(model, inputs, costs, execution, key)


# NOTE [ each plan's step compiled once ]
# Where a compiler states a step's peak (JAX), planning and reporting compile
# whole steps: each uniform plan to calibrate the units, the solver's plan to
# check it, the step as the model stands for the report. Compiling was most of
# their time (`memory_report` of tests/test_budget.py's four blocks on a 2-core
# CPU: 13.4 of 20.6 s in 11 XLA compiles, 2026-12-05), and the same step was
# compiled again: the report compiled the model as it stood and then the same
# plan among the uniform ones; a report after `recompute_model(budget=)`
# compiled the plan the planner had compiled. So a step's peak is kept on the
# model (`_memory.remember`) under what its program depends on: the costs'
# key (`_memory.cache_key`: the units, the inputs' shapes, the execution, which
# weights train, the optimizer, which other layers recompute now and how),
# each unit's policy, and offload; and the report's step as the model stands
# is taken as that plan's where it is one (`_runs_as_planned`).
def _compiled_key(model, units, policies, inputs, execution, offload):
    """What a step compiled with `policies[i]` on unit i holds depends on (NOTE [ each plan's step compiled once ])."""
    moved = bool(offload) and any(policy != _budget.NONE for policy in policies)
    return ("compiled peak", _memory.cache_key(model, units, inputs, execution), tuple(policies), moved)


def _calibrated(model, units, inputs, costs, execution, offload=False):
    """`costs` moved to the compiler's figures, where a compiler states a step's peak (JAX) or the allocator's figures
    stand in for it (a CNN on TensorFlow: NOTE [ calibrating a CNN to TensorFlow's allocator ]); else `costs`.

    NOTE [ calibrating the units to the compiler ]
    The units' residuals are what the autodiff keeps; XLA's program keeps
    less (it fuses elementwise work: keras-hub BERT small's step held 0.75-0.84x
    the residuals' sum) or more (NOTE [ checking a plan on JAX ] in
    `backends/jax.py`). A planner that believed the sum refused budgets that
    the compiled step meets, and `largest_fit` answered 0.55-0.84x of what
    fits. So the step is compiled once per option that applies to every unit
    (no recompute, each policy, in turn on all units; compiled, not run), and
    each unit's kept and transient bytes under that option are scaled by the
    one factor that makes the plan's predicted peak the compiler's (XLA keeps
    that fraction of what the autodiff says, for that option). A scale, not
    a shift: it stays smooth in the size, where a shift clamped at 0 bent the
    fitted curves along the sequence. What every compiled step holds whatever
    its size (a GPU's matrix-product workspace: NOTE [ the compiler's scratch ]
    in `backends/jax.py`) is no unit's: it is counted once, outside the scale;
    nor is the optimizer's update, which is the compiler's before anything is
    scaled (NOTE [ the compiler's update ] in `backends/jax.py`: counted as
    Keras runs it op by op, it was above the whole compiled step at small
    batches, and the units were scaled to nothing there).
    Every uniform plan's predicted peak is then the compiler's; a mixed plan's is
    interpolated between them, and checked by compiling it
    (`_planned_policies`, `largest_fit`).
    """
    if not units or not _memory.states_compiled_peak(model, execution):
        return costs
    key = ("calibrated", _memory.cache_key(model, units, inputs, execution), offload)
    cached = _memory.remembered(model, key)
    if cached is not None:
        return cached
    count = len(units)
    backend = _memory._measuring_backend(model)
    if hasattr(backend, "update_bytes") and costs.update:  # XLA fuses the update (NOTE [ the compiler's update ])
        # The same at every size: compiled once per trained set (about 1 s for BERT-base), not once per size.
        update_key = ("compiled update", tuple(id(v) for v in model.trainable_variables), _memory.optimizer_key(model))
        update = _memory.remembered(model, update_key)
        if update is None:
            update = _memory.remember(model, update_key, backend.update_bytes(model))
        costs = costs.like(costs.units, update=update)
    uniform = _uniform_options(costs)
    actuals = {}
    for option in uniform:
        actuals[option] = _compiled_peak_of(model, units, [option] * count, inputs, costs, execution, offload)
        if actuals[option] is None:
            return costs
    # The scratch is held once, not scaled; never more than a uniform step holds above its units' least bytes.
    room = min(actual - _scaled(costs, {option: 0.0}).peak([option] * count) for option, actual in actuals.items())
    costs = costs.like(costs.units, scratch=max(0, min(_memory.compiler_scratch(model, execution), room)))
    scales = {}
    for option, actual in actuals.items():
        choice = [option] * count
        peak = lambda scale, option=option, choice=choice: _scaled(costs, {option: scale}).peak(choice)  # noqa: E731
        low, high = 0.0, 1.0
        while peak(high) < actual and high < 1e6:
            low, high = high, 2 * high
        for _ in range(50):  # the peak grows with the scale: bisection
            middle = (low + high) / 2
            low, high = (middle, high) if peak(middle) < actual else (low, middle)
        scales[option] = high
    return _memory.remember(model, key, _scaled(costs, scales))


def _scaled(costs, scales):
    """`costs` with the kept and transient bytes of each unit's option `o` times `scales[o]` (else as they are)."""
    units = []
    for unit in costs.units:
        options = {
            name: _budget.Option(name, o.kept * scales.get(name, 1.0), o.transient * scales.get(name, 1.0), o.seconds, o.forward)
            for name, o in unit.options.items()
        }
        units.append(unit.like(options))
    return costs.like(units)


def _framework(model):
    from keras_recompute.backends import _keras3

    if _keras3.is_layer(model):
        return _keras3
    from keras_recompute.backends import _tf_keras

    return _tf_keras


# Choosing layers as units.


def _choose_blocks(model, framework, blocks):
    """The layers that recompute, in order; None for "auto" on a graph with no repeated layers."""
    if isinstance(blocks, str) and blocks == "auto":
        return _auto_blocks(model, framework)
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and blocks and all(isinstance(b, type) for b in blocks)):
        return _outermost(model, lambda layer: isinstance(layer, blocks), f"instances of {_names_of(blocks)}")
    if isinstance(blocks, (list, tuple)) and blocks and all(isinstance(b, str) for b in blocks):
        return _by_names(model, list(blocks))
    if callable(blocks):
        return _outermost(model, lambda layer: bool(blocks(layer)), "layers the predicate accepts")
    raise ValueError(
        "keras_recompute: recompute_model(blocks=...) takes 'auto', a layer class or tuple of classes, "
        f"a list of layer names, or a predicate layer -> bool; received {blocks!r}."
    )


def _outermost(model, accept, description):
    """The accepted layers that are not inside another accepted one."""
    chosen, inside = [], set()
    for layer in _context.sublayers(model):
        if id(layer) in inside:
            continue
        if accept(layer):
            chosen.append(layer)
            inside.update(id(sub) for sub in _context.sublayers(layer))
    if not chosen:
        raise ValueError(
            f"keras_recompute: recompute_model found no {description} in {model.name!r}. Pass blocks= "
            "with a class, layer names or a predicate that matches its blocks."
        )
    return chosen


def _by_names(model, names):
    by_name = {}
    for layer in _context.sublayers(model):
        by_name.setdefault(layer.name, layer)
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ValueError(
            f"keras_recompute: recompute_model(blocks=...) names layers {unknown} that {model.name!r} does not "
            f"have. Its layers include {sorted(by_name)[:20]}."
        )
    return [by_name[name] for name in names]


def _auto_blocks(model, framework):
    """The repeated blocks of `model` (NOTE [ every run of blocks ]); else the longest run of one class of layers
    with weights in a graph; else None (a graph's pieces)."""
    listed = []
    for layer in [model] + _context.sublayers(model):
        listed = [x for attribute in _BLOCK_LISTS for x in _listed_blocks(layer, attribute)]
        if listed:
            break
    graphs = [(framework.children(p), _feeds(p, framework)) for p in _models_in(model)]
    lists = [(_context.children(p), None) for p in _context.sublayers(model) if not _is_model(p)]
    runs = ([listed] if listed else []) + _runs(graphs, _is_block) + _runs(lists, _is_block)
    chosen = _disjoint(runs, model) if runs else max(_runs(graphs, lambda layer: bool(layer.weights)), key=len, default=None)
    if chosen and not _graph_blocks_hold_more(model, framework, chosen):
        return chosen
    if _graph_to_cut(model, framework) is not None:
        return None
    unbuilt = (
        f" {model.name!r} is not built yet, and its layers have no weights until it runs: call it on a batch "
        "(model(batch)) or model.build(input_shape) first, then recompute_model; or"
        if not model.weights
        else ""
    )
    raise ValueError(
        f"keras_recompute: recompute_model(blocks='auto') found no repeated blocks in {model.name!r} "
        f"({type(model).__name__}): no keras-hub `transformer_layers`, no two or more blocks of one class "
        f"(layers that hold layers with weights) in a chain or in a layer's list, no chain of layers of one class "
        f"with weights, and no functional graph to cut.{unbuilt} Pass blocks= "
        "(a layer class, layer names or a predicate), or segments= for a functional model."
    )


# NOTE [ blocks that are pieces of a graph ]
# A CNN's blocks are seldom layers: keras.applications builds them as pieces
# of one graph. "auto" took a run of layers first, where one was found, and
# found small ones there: EfficientNetB0's two squeeze-and-excite convolutions
# (a Conv2D feeding a Conv2D), VGG16's three convolutions of one stage,
# ConvNeXt's stem and downsampling layers (Sequentials), each a sliver of the
# model, its blocks left as they were. Where the runs found hold less than
# half of the model's weights (by size) and the repeated pieces of its graph
# (`_repeated_blocks`, in the model it nests: NOTE [ a model inside a model ])
# hold more, the pieces are the units. A transformer's blocks, layers that
# hold most of its weights, are chosen as before.


def _graph_blocks_hold_more(model, framework, chosen):
    """Whether the repeated pieces of `model`'s graph hold more weights than the layers `chosen`, these less than
    half of the model's (NOTE [ blocks that are pieces of a graph ])."""
    held = sum(_weights_size(layer) for layer in {id(layer): layer for layer in chosen}.values())
    functional = _graph_to_cut(model, framework)
    if functional is None or 2 * held >= _weights_size(model):
        return False
    nodes = framework.graph_nodes(functional)
    ranges = _repeated_blocks(nodes, _separating_cuts(nodes, *framework.graph_ends(functional)))
    if not ranges:
        return False
    pieces = {id(node[0]): node[0] for start, end in ranges for node in nodes[start:end]}
    return sum(_weights_size(layer) for layer in pieces.values()) > held


def _listed_blocks(layer, attribute):
    listed = getattr(layer, attribute, None)
    if isinstance(listed, (list, tuple)) and listed and all(_context.is_layer(x) for x in listed):
        return list(listed)
    return []


def _models_in(model):
    """`model` and the models in it: the parents whose children are chains of a graph."""
    return [model] + [layer for layer in _context.sublayers(model) if _is_model(layer)]


# NOTE [ every run of blocks ]
# "auto" took the longest run of blocks and stopped there: an encoder-decoder
# (keras-hub's EdRec, Moonshine, T5Gemma) recomputed its decoder's blocks and
# not its encoder's, a two-tower model (CLIP, SigLIP, PaliGemma) one tower, a
# model whose stages hold blocks of one class (MiT, SegFormer) its first
# stage. It now takes every run of two or more blocks (layers that hold layers
# with weights, not attention layers: `_is_block`) of one class: chains in a
# model's graph (NOTE [ a chain of blocks ]), runs in a layer's list (NOTE
# [ blocks held by a layer ]) and keras-hub's `transformer_layers` lists, the
# outer runs first and, at one depth, the longest, each run kept unless one of
# its layers is, holds or is held by a layer already kept (a stage and the
# blocks in it are not both units: the stages are, as "auto" chose before;
# Gemma 4's vision blocks and not the projections in them). Where no block repeats, the
# longest run of leaf layers with weights in a graph (a Sequential's Dense
# layers) is the units, as before.


def _runs(groups, qualifies):
    """Every run of two or more layers of one class, each `qualifies`, over `(children, feeds)` groups.

    `feeds`: the `(id(a), id(b))` pairs of a graph (`_feeds`); a run is then a chain in it, whatever lies between
    its layers in the children's order (a shared Dropout called between blocks: NOTE [ a chain of blocks ]).
    None: no graph; a run is then consecutive children.
    """
    found = []
    for children, feeds in groups:
        chains = []
        for layer in children:
            if feeds is None:  # the chain the previous child ended, if this one is of its class
                open_ = chains[-1:] if chains and type(chains[-1][-1]) is type(layer) else []
            else:  # any chain of this class whose last layer feeds this one (two towers' blocks interleave)
                open_ = [c for c in chains if type(c[-1]) is type(layer) and (id(c[-1]), id(layer)) in feeds][:1]
            if open_:
                open_[0].append(layer)
            else:
                chains.append([layer])
        for chain in chains:  # split where a layer does not qualify
            part = []
            for layer in chain + [None]:
                if layer is not None and qualifies(layer):
                    part.append(layer)
                    continue
                if len(part) >= 2:
                    found.append(part)
                part = []
    return found


def _disjoint(runs, model):
    """The layers of `runs`, outer runs first and, at one depth, the longest: a run is dropped where a layer of it
    is, holds or is held by a layer of a run taken. In the order the runs were found."""
    depth = {id(model): 0}
    for layer in [model] + _context.sublayers(model):  # parents first
        for child in _context.children(layer):
            depth.setdefault(id(child), depth.get(id(layer), 0) + 1)
    taken, covered = [], set()
    for index in sorted(range(len(runs)), key=lambda i: (depth.get(id(runs[i][0]), 0), -len(runs[i]))):
        inside = {id(x) for layer in runs[index] for x in [layer] + _context.sublayers(layer)}
        if inside & covered:
            continue
        taken.append(index)
        covered |= inside
    return [layer for index in sorted(taken) for layer in runs[index]]


def _is_block(layer):
    """Whether `layer` may be a block: it holds two or more layers with weights (a layer's own weights count as
    one), and is not an attention layer. A wrapper of one projection (keras-hub Gemma 4's clippable Q, K and V)
    is not a block: recomputing it alone would keep what plain keeps."""
    if _policy.core_method(layer) is not None:
        return False
    children = _context.children(layer)
    if not children:
        return False
    held = {id(w) for child in children for w in child.weights}
    own = any(id(w) not in held for w in layer.weights)
    leaves = [x for x in _context.sublayers(layer) if x.weights and not _context.children(x)]
    return len(leaves) + own >= 2


# NOTE [ blocks held by a layer ]
# keras-hub's ViT keeps its blocks in a list of its `ViTEncoder` layer
# (`encoder_layers`), DINOv2 and DINOv3 in their encoders' `layers`: blocks of
# a layer, not of a model, so "auto" found no run and cut the graph instead. A
# ViT with a head then had two pieces, the whole backbone one of them, and its
# recompute saved nothing: "with no recompute" 136.6 MB, the plan 136.2 (6
# blocks of 128, 64 x 64 images, batch 32, PyTorch, 2026-11-29); measured,
# TensorFlow's compiled step peaked at 205.6 MiB against plain's 216.5, and at
# 65.3 with the blocks as units (benchmarks/auto_blocks_vit.py). Runs among
# a layer's children count as runs among a model's (NOTE [ every run of
# blocks ]) when each layer in them is a block (`_is_block`): the query, key
# and value projections in an attention layer are not blocks, nor are a
# decoder block's self- and cross-attention layers.


def _is_model(layer):
    return all(hasattr(layer, attribute) for attribute in ("compile", "fit", "layers"))


def _feeds(parent, framework):
    """`{(id(a), id(b))}` where layer a's output is an input of layer b; or, where both are blocks (`_is_block`),
    reaches it through calls of layers without weights (a Dropout, an activation, an op: NOTE [ a chain of
    blocks ]); None without a graph."""
    functional = framework.functional_of(parent) if parent is not None else None
    if functional is None:
        return None
    producer = {}  # a tensor -> the layer whose call made it
    reaching = {}  # a tensor -> {id: layer}: the layers with weights whose outputs reach it through calls without weights
    pairs = set()
    for layer, input_ids, output_ids, _ in framework.graph_nodes(functional):
        pairs.update((id(producer[tensor]), id(layer)) for tensor in input_ids if tensor in producer)
        sources = {}
        for tensor in input_ids:
            sources.update(reaching.get(tensor, {}))
        if sources and _context.is_layer(layer) and _is_block(layer):
            pairs.update((key, id(layer)) for key, source in sources.items() if _is_block(source))
        passes_on = {id(layer): layer} if getattr(layer, "weights", None) else sources
        for tensor in output_ids:
            producer[tensor] = layer
            reaching[tensor] = passes_on
    return pairs


# NOTE [ a chain of blocks ]
# keras-hub's RWKV-7 calls one Dropout layer between its blocks, on the
# stream a block hands the next (`x = dropout(block(x, v_first))`): in its
# graph the blocks were not consecutive layers, nor one's output the next
# one's input, so "auto" found no run (3 blocks: the last two, by the value
# stream they also pass on; 2 blocks: none) and cut the graph into two pieces,
# the whole backbone one of them. A run in a graph is now a chain of layers of
# one class, whatever other layers lie between them in the model's list (two
# towers' blocks interleave there, tower by tower at each depth), each
# one's output the next one's input or, for blocks (layers that hold layers
# with weights), reaching it through calls of layers without weights. Leaf
# layers chain directly only: a Sequential's Conv2D, ReLU, Conv2D are not a
# run of blocks (each Conv2D a unit would keep what plain keeps), and are cut
# into pieces as before.


# NOTE [ "auto" under attention_core ]
# "auto" takes every run of blocks (NOTE [ every run of blocks ]), and a model's
# runs need not all hold an attention layer whose core keras_recompute can
# recompute alone: PaliGemma's and Gemma 3's vision encoders compute their
# cores inside their attention layers' `call` (PaliGemmaVitAttention,
# Gemma3VisionAttention), Qwen3.5's linear-attention layers have no softmax
# core. Under `policy="attention_core"` "auto" keeps the units that hold one
# and leaves the others as they are, with a warning that names them and what
# else would recompute them; only where no unit holds one does it raise. Until
# 2026-11-30 it raised there: "auto" had taken only the longest run (the
# language model's decoder) until the day before, and the change to every run
# turned `recompute_model(paligemma, policy="attention_core")`, which worked,
# into an error. A report of the plan is over every unit "auto" found, the
# ones left out shown as not recomputed (as `limit=` leaves units out).


def _auto_units_with_cores(units):
    """Of the units "auto" chose, those that hold an attention layer we know; warns of the others (NOTE [ "auto"
    under attention_core ]). All of them when none holds one: `_check_attention` then raises."""
    held = [bool(_policy.attention_layers(unit)) for unit in units]
    if all(held) or not any(held):
        return units
    kept = [unit for unit, has in zip(units, held) if has]
    left = [unit for unit, has in zip(units, held) if not has]
    inline = _policy.inline_attention(left)
    warnings.warn(
        f"keras_recompute: recompute_model(policy='attention_core'): 'auto' found {len(units)} units, and "
        f"{', '.join(repr(_memory.unit_name(unit)) for unit in left)} hold no attention layer whose core "
        "keras_recompute can recompute alone"
        + (f" ({', '.join(inline)} {'computes its' if len(inline) == 1 else 'compute their'} core inside `call`)"
           if inline else "")
        + (f": the other {len(kept)} recompute their cores" if len(kept) > 1 else ": the other one recomputes its cores")
        + ", these are left as they are. To recompute them too, "
        "use policy='full' or 'save_dots', or budget=, whose plan gives each unit a policy it can take.",
        stacklevel=3,
    )
    return kept


def _check_attention(units):
    held = [bool(_policy.attention_layers(unit)) for unit in units]
    if not all(held):
        without = [unit for unit, has in zip(units, held) if not has]
        raise ValueError(_policy.no_attention_message(
            [_memory.unit_name(unit) for unit in without],
            without,
            [unit.name for unit, has in zip(units, held) if has and not hasattr(unit, "_keras_recompute_label")],
        ))


def _patch_call(layer, enabled, policy, offload=False):
    """Decorates one instance's `call`; returns how to undo it."""
    had_own = "call" in layer.__dict__
    previous = layer.__dict__.get("call")
    wrapped = recompute_grad(layer.call, enabled=enabled, policy=policy, offload=offload)
    object.__setattr__(layer, "call", wrapped)

    def undo():
        if layer.__dict__.get("call") is wrapped:
            if had_own:
                object.__setattr__(layer, "call", previous)
            else:
                del layer.__dict__["call"]

    return undo


def _names_of(classes):
    classes = classes if isinstance(classes, tuple) else (classes,)
    return ", ".join(cls.__name__ for cls in classes)


# Cutting a graph into pieces.


def _segment_count(model, framework, segments):
    functional = _graph_to_cut(model, framework)
    if functional is None:
        raise ValueError(
            f"keras_recompute: recompute_model(segments=...) cuts the graph of a functional or Sequential "
            f"model; {model.name!r} ({type(model).__name__}) has no graph to cut (a subclassed model, or a "
            "Sequential model not built yet). Pass blocks= (a layer class, layer names or a predicate) to "
            "choose its units."
        )
    if segments == "sqrt":
        return max(1, round(math.sqrt(len(framework.graph_nodes(functional)))))
    return segments


# NOTE [ a model inside a model ]
# Transfer learning nests a whole model in another: `x = backbone(inputs)`,
# a pooling and a Dense on it (keras.applications, keras-cv's backbones). The
# outer graph then has the backbone as one node, and its pieces were the
# backbone and the head: the backbone, one unit, kept only its input and ran
# again whole in the backward, its activations all live again at the peak. A
# ResNet50 so planned (batch 8, 128x128, TensorFlow) peaked at 360 MiB against
# plain's 359 at 1.36x the time: recompute for nothing. Pieces are now cut in
# the graph of the model inside where the outer graph calls one model once and
# it holds more than half of the weights (by size), and so on inward; the
# outer graph runs as Keras runs it. A model called twice (a Siamese tower)
# is not cut into: its pieces would run once per call, and a budget or a
# report counts each piece once. A subclassed model that holds one model
# with a graph and most of the weights (`self.backbone = ResNet50(...)`) is
# cut in that model's graph too: its own calls cannot be seen before it runs.


def _graph_to_cut(model, framework):
    """The functional graph whose pieces recompute: `model`'s own, or that of the model it nests (NOTE [ a model
    inside a model ]); None where `model` has no graph."""
    functional = framework.functional_of(model)
    if functional is None:  # a subclassed model: the one model with a graph among its layers, if most weights
        inner = [layer for layer in _context.children(model) if _is_model(layer) and framework.functional_of(layer) is not None]
        if len(inner) == 1 and 2 * _weights_size(inner[0]) > _weights_size(model):
            functional = framework.functional_of(inner[0])
    while functional is not None:
        nodes = framework.graph_nodes(functional)
        inner = [node[0] for node in nodes if _is_model(node[0]) and framework.functional_of(node[0]) is not None]
        if len(inner) != 1 or 2 * _weights_size(inner[0]) <= _weights_size(functional):
            return functional
        functional = framework.functional_of(inner[0])
    return functional


def _weights_size(layer):
    """The elements of `layer`'s weights (none for a Keras 3 op in a graph)."""
    return sum(math.prod(int(d) for d in weight.shape) for weight in getattr(layer, "weights", None) or [])


class _Pieces:
    """A functional model's graph cut into pieces, each held by a layer (`framework.segment`).

    `units` are the holders of the pieces that recompute (or that a budget
    may choose); the pieces between them run plainly. Calling a holder runs
    its `call` as the instance has it, so a unit is planned as a layer is: by
    setting its `call` (`_patch_call`). Installed, the model runs its graph as
    the pieces while `active()` holds, else as Keras runs it.
    """

    def __init__(self, model, framework, count):
        functional = _graph_to_cut(model, framework)
        nodes = framework.graph_nodes(functional)
        input_ids, output_ids, floats = framework.graph_ends(functional)
        cuts = _separating_cuts(nodes, input_ids, output_ids, floats)
        if count is None:
            ranges = _repeated_blocks(nodes, cuts) or _between_weights(nodes, cuts)
        else:
            bounds = [0] + _even_cuts(cuts, len(nodes), count) + [len(nodes)]
            ranges = [(start, end) for start, end in zip(bounds, bounds[1:]) if end > start]
        starts = {start for start, _ in ranges}
        bounds = sorted({0, len(nodes)} | {b for unit in ranges for b in unit})
        self._functional, self._framework = functional, framework
        self._pieces, self.units = [], []
        for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
            piece_nodes = nodes[start:end]
            piece_inputs, piece_outputs = _piece_ends(nodes, start, end, input_ids, output_ids)
            holder = framework.segment(functional, piece_nodes, piece_inputs, piece_outputs, f"{model.name}_piece_{index}")
            holder._keras_recompute_label = f"{piece_nodes[0][0].name} .. {piece_nodes[-1][0].name}"
            self._pieces.append((holder, piece_inputs, piece_outputs))
            if start in starts:
                self.units.append(holder)
        self._forced = False
        self._uninstall = None

    @classmethod
    def of(cls, model, framework, count):
        """The pieces of `model` for `count` (None: its repeated blocks), cut once and kept on it.

        Kept, so that a report and a plan share one set of holders, and with
        them the costs measured for those holders (`_memory.costs`).
        """
        kept = model.__dict__.get(_PIECES)
        if kept is None or kept.count != count:
            kept = cls(model, framework, count)
            kept.count = count
            object.__setattr__(model, _PIECES, kept)
        return kept

    def install(self, active):
        """Makes the model run as the pieces while `active()` holds; returns how to undo it."""
        uninstall = self._framework.install_pieces(self._functional, self._pieces, lambda: self._forced or active())

        def undo():
            uninstall()
            self._uninstall = None

        self._uninstall = undo
        return undo

    @contextlib.contextmanager
    def measuring(self):
        """Within it, the model runs as the pieces whatever the switch says (installed for the while if not)."""
        temporary = self.install(lambda: False) if self._uninstall is None else None
        self._forced = True
        try:
            yield
        finally:
            self._forced = False
            if temporary is not None:
                temporary()


def _separating_cuts(nodes, input_ids, output_ids, floats):
    """Positions `b` (cut before node `b`) where exactly one float tensor, not an input, crosses."""
    made_at = {}
    last_use = {}
    for position, (_, node_inputs, node_outputs, _) in enumerate(nodes):
        for tensor in node_outputs:
            made_at.setdefault(tensor, position)
        for tensor in node_inputs:
            last_use[tensor] = position
    for tensor in output_ids:
        last_use[tensor] = len(nodes)
    inputs = set(input_ids)
    # Each float tensor made by a node crosses the boundaries after its maker, up to its last use.
    crossing = [0] * (len(nodes) + 1)
    for tensor, made in made_at.items():
        if tensor in floats and tensor not in inputs and tensor in last_use:
            for boundary in range(made + 1, last_use[tensor] + 1):
                crossing[boundary] += 1
    return [b for b in range(1, len(nodes)) if crossing[b] <= 1]


def _repeated_blocks(nodes, cuts):
    """The repeated blocks of a graph, as node ranges: None if nothing repeats.

    The graph is cut at every separating tensor; each piece is described by
    the classes of its layers. A transformer's pieces repeat with a period
    (attention part, norm, feed-forward part, norm in a post-norm BERT built
    from separate layers, as bert4keras builds it): the period repeated most
    often is the block, and each repetition is one unit. Layers before and
    after the repeated region (embeddings, a head) are not units. Every
    repetition of the block is a unit, not only those of its longest run, and
    the pieces between two of them are units too (NOTE [ a CNN's stages ]).
    A piece of one leaf layer repeated is not a block: VGG16's convolutions,
    each its own unit, kept their inputs, which were their predecessors'
    outputs, and saved nothing (0.96x plain's peak at 1.45x its time); its
    stages are. A block layer called again and again is (ALBERT's one shared
    transformer layer).
    """
    bounds = [0] + cuts + [len(nodes)]
    pieces = list(zip(bounds, bounds[1:]))
    kinds = [tuple(type(layer).__name__ for layer, _, _, _ in nodes[start:end]) for start, end in pieces]
    best = None  # (repeats, -period, first piece)
    for period in range(1, len(pieces) // 2 + 1):
        first = 0
        while first + period < len(pieces):
            last = first
            while last + period < len(pieces) and kinds[last] == kinds[last + period]:
                last += 1
            repeats = (last - first) // period + 1
            start, end = pieces[first]
            lone = period == 1 and end - start == 1 and not _is_block_node(nodes[start][0])  # one leaf is no block
            if repeats >= 2 and not lone and (best is None or (repeats, -period) > best[:2]):
                best = (repeats, -period, first)
            first = max(last, first + 1)
    if best is None:
        return None
    period, first = -best[1], best[2]
    block = kinds[first : first + period]
    blocks, index = [], 0
    while index + period <= len(pieces):
        if kinds[index : index + period] != block:
            index += 1
            continue
        if blocks and blocks[-1][1] < pieces[index][0]:  # what lies between two of the block's repetitions
            between = (blocks[-1][1], pieces[index][0])
            if any(_has_weights(layer) for layer, _, _, _ in nodes[between[0] : between[1]]):
                blocks.append(between)
        blocks.append((pieces[index][0], pieces[index + period - 1][1]))
        index += period
    if not all(any(_has_weights(layer) for layer, _, _, _ in nodes[start:end]) for start, end in blocks):
        return None
    return blocks


# NOTE [ a CNN's stages ]
# A ResNet's stages each open with a block that changes the shape (a strided
# convolution on its shortcut) and go on with blocks of one kind; the blocks
# of all four stages are of one kind. "auto" took the longest run of
# repetitions only: ResNet50's third stage, 5 of its 16 blocks, and not the
# first stages, whose activations are the largest: at batch 32, 128x128, its
# peak fell 7% (1030 to 959 MiB, TensorFlow), where 13 even pieces
# (`segments="sqrt"`) took it 41% lower. Every repetition is now a unit, and
# each stretch between two repetitions that holds weights (the stages' first
# blocks) is one too: ResNet50's 15 blocks after its first. A transformer's
# blocks repeat without a gap, as before.


def _is_block_node(operation):
    """`_is_block` for a graph node's operation: a Keras 3 op in a graph (`keras.ops.relu`) is no layer, and
    asking for its sub-layers raised on TensorFlow (keras-cv's MobileNetV3)."""
    return _context.is_layer(operation) and _is_block(operation)


def _between_weights(nodes, cuts):
    """Pieces that each start at a layer with weights and take the weightless layers after it."""
    kept, start = [], 0
    for cut in cuts:
        if _has_weights(nodes[cut][0]) and any(_has_weights(layer) for layer, _, _, _ in nodes[start:cut]):
            kept.append(cut)
            start = cut
    bounds = [0] + kept + [len(nodes)]
    return [(start, end) for start, end in zip(bounds, bounds[1:]) if end > start]


def _has_weights(operation):
    """Whether a graph node's operation holds weights: a layer's, or none for a Keras 3 op (`keras.ops.mean`
    in a functional model is an `Operation`, not a layer, and has no `weights`)."""
    return bool(getattr(operation, "weights", None))


def _even_cuts(cuts, count_nodes, count):
    """`count - 1` of the separating cuts, as near as they can be to even spacing."""
    chosen = []
    for index in range(1, count):
        target = index * count_nodes / count
        candidates = [c for c in cuts if c not in chosen and (not chosen or c > chosen[-1])]
        if not candidates:
            break
        chosen.append(min(candidates, key=lambda c: abs(c - target)))
    return sorted(set(chosen))


def _piece_ends(nodes, start, end, input_ids, output_ids):
    """The tensors a piece takes from before it, and those it hands on (or the model outputs)."""
    made_inside = {t for _, _, node_outputs, _ in nodes[start:end] for t in node_outputs}
    made_before = set(input_ids) | {t for _, _, node_outputs, _ in nodes[:start] for t in node_outputs}
    used_after = set(output_ids) | {t for _, node_inputs, _, _ in nodes[end:] for t in node_inputs}
    piece_inputs, piece_outputs = [], []
    for _, node_inputs, node_outputs, _ in nodes[start:end]:
        for tensor in node_inputs:
            if tensor in made_before and tensor not in piece_inputs:
                piece_inputs.append(tensor)
        for tensor in node_outputs:
            if tensor in used_after and tensor not in piece_outputs:
                piece_outputs.append(tensor)
    assert all(t in made_inside for t in piece_outputs)
    return piece_inputs, piece_outputs
