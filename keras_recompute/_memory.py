"""What each unit's options keep and cost, measured; `memory_report` shows it.

NOTE [ measuring a model's units ]
The costs are measured on the model itself, at the batch the user gives (a
large one at a quarter and a half of it, extrapolated: NOTE [ measuring below
the batch ]):
  1. one forward of the model in training mode records each unit's call
     (its arguments, masks attached, the `training` of the call context where
     its `call` takes none, and the size of its outputs; not the call by which
     Keras builds a model, which computes only shapes);
  2. each unit is then run alone on those arguments, once per option (no
     recompute, and each policy that applies to it), by its backend's
     `measure_unit`: the bytes its forward keeps for the backward (read from
     the autodiff itself: the graph's tensors the gradient reads on
     TensorFlow, the residuals of `jax.vjp` on JAX, saved-tensor hooks on
     PyTorch) and the seconds of its forward and backward;
  3. the whole model is measured the same way with every unit recomputed,
     which gives what is kept outside the units (embeddings, a head); where
     measuring runs the forward (PyTorch), it so holds no more than full
     recompute keeps, never the plain model's activations. Nothing measured
     runs the plain model's whole backward.
Units alike (class, weights, argument shapes) are measured once. Variables
the forward assigns (seed states, moving statistics) are put back after, so
measuring changes nothing in the model. The result is kept on the model per
input shape: planning again, or a report after a plan, measures nothing.
A unit's recompute time is its step's time with the option minus without.

NOTE [ which execution a plan is for ]
One model keeps more in a step run eagerly than in a compiled one (a
`tf.function` or XLA step, `jax.jit`): on TensorFlow an 8-block encoder
peaked at 1574 MB eager and 741 MB in a `tf.function`
(NOTE [ measuring for eager execution ] in `backends/tensorflow.py`). A plan is
made for one of the two, `execution=`:
  * `"compiled"`: a compiled model that does not `run_eagerly` (its `fit` and
    `train_on_batch` run a compiled step), or named by the user;
  * `"eager"`: a model compiled with `run_eagerly=True`, or a model not
    compiled at all, whose training loop is the user's and may run eagerly
    (the larger peak: a plan for it fits either way), or named by the user.
PyTorch runs eagerly: `"eager"` always. The report says which, and why.
"""

import contextlib
import re
import sys
import time

from keras_recompute import _budget, _context, _patch, _policy

EAGER = "eager"
COMPILED = "compiled"
EXECUTIONS = (EAGER, COMPILED)

_COSTS = "_keras_recompute_costs"
_REPEATS = 9


class MemoryReport:
    """The plan of a model at one batch: each unit's options, and the predicted peak of a step.

    Attributes:
        rows: one dict per unit: `"name"`, `"policy"` (applied now, `"none"`
            if it does not recompute), `"kept_bytes"` and `"recompute_seconds"`
            (each a dict by option).
        predicted_peak: the predicted peak of one training step as the model
            stands, in bytes (NOTE [ the peak of a plan ] in `_budget`).
        resident: the part of it that is weights, optimizer slots and the batch.
        floor: the least peak any plan over these units reaches.
        plain_peak: the predicted peak with no unit recomputed.
        measure_seconds: what measuring the units took (0 when it was cached).
        offload: a line on offload when the plan offloads (NOTE [ offload ]
            in `_policy`), else `""`.
        execution: the execution the prediction is for, `"eager"` or
            `"compiled"` (NOTE [ which execution a plan is for ]).
        execution_reason: why that one.
        peak_at: where in the step the predicted peak is, in words (a unit's
            forward or backward, the loss's backward, or after the backward,
            where the optimizer's update runs and neither recompute nor
            offload lowers it); `""` where a compiler states the peak (JAX).
        switch: a line when the model has a plan that the switch keeps off
            now (the rows and peak are then the plain model's), else `""`.
        inner: a line naming the units that hold layers whose own call is
            decorated and recomputes now (their "none" is the unit as it
            stands, those layers recomputed), else `""`.
        unreached: a line naming the units no gradient reaches in the step
            (frozen, with no trained weight before them: NOTE [ a unit no
            gradient reaches ]), which keep nothing and stay plain, else `""`.
        allocator: a line on a convolutional network's compiled step on
            TensorFlow, whose allocator holds more than the prediction counts
            (NOTE [ a CNN on TensorFlow's allocator ]), else `""`.
    """

    def __init__(self, title, rows, predicted_peak, resident, floor, plain_peak, measure_seconds, execution=COMPILED,
                 execution_reason=""):
        self.title = title
        self.execution = execution
        self.execution_reason = execution_reason
        self.rows = rows
        self.predicted_peak = predicted_peak
        self.resident = resident
        self.floor = floor
        self.plain_peak = plain_peak
        self.measure_seconds = measure_seconds
        self.peak_at = ""  # where in the step the predicted peak is, in words ("" where a compiler states it)
        self.offload = ""  # a line on offload (NOTE [ offload ] in `_policy`) when it was asked for
        self.switch = ""  # a line when the model has a plan that the switch keeps off now
        self.inner = ""  # a line when units hold decorated layers that recompute now
        self.unreached = ""  # a line when no gradient reaches some units
        self.allocator = ""  # a line on a convolutional network's compiled step on TensorFlow

    def __str__(self):
        options = []
        for row in self.rows:
            options += [o for o in row["kept_bytes"] if o not in options]
        header = ["unit", "policy"] + [f"keeps ({o})" for o in options] + [f"recompute s ({o})" for o in options[1:]]
        lines = [header]
        for row in self.rows:
            kept = [_budget.format_bytes(row["kept_bytes"][o]) if o in row["kept_bytes"] else "-" for o in options]
            seconds = [
                f"{row['recompute_seconds'][o]:.4f}" if o in row["recompute_seconds"] else "-" for o in options[1:]
            ]
            lines.append([row["name"], row["policy"]] + kept + seconds)
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = [self.title]
        for index, line in enumerate(lines):
            text.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
            if index == 0:
                text.append("  ".join("-" * width for width in widths))
        text.append(
            f"predicted peak of a training step run {'eagerly' if self.execution == EAGER else 'compiled'} "
            f"({self.execution_reason}): {_budget.format_bytes(self.predicted_peak)}"
            + (f", {self.peak_at}" if self.peak_at else "")
            + f" (weights, optimizer and batch {_budget.format_bytes(self.resident)}; with no recompute "
            f"{_budget.format_bytes(self.plain_peak)}; the least any plan reaches {_budget.format_bytes(self.floor)})"
        )
        if self.unreached:
            text.append(self.unreached)
        if self.allocator:
            text.append(self.allocator)
        if self.inner:
            text.append(self.inner)
        if self.offload:
            text.append(self.offload)
        if self.switch:
            text.append(self.switch)
        return "\n".join(text)

    def __repr__(self):
        return f"<MemoryReport {len(self.rows)} units, predicted peak {_budget.format_bytes(self.predicted_peak)}>"


def report(model, units, inputs, current, execution=None, offload=False, step_key=None):
    """The `MemoryReport` of `units` of `model` at `inputs`; `current[i]` is unit i's policy now.

    `execution`: `"eager"`, `"compiled"`, or None to infer it (`execution_of`).
    `offload`: whether the recomputed units keep their inputs in host memory.
    `step_key`: where the step as the model stands is a plan's, that plan's key (NOTE [ each plan's step compiled
    once ] in `_model`), else None.
    """
    execution, reason = execution_of(model, execution, "memory_report")
    measured, seconds = costs(model, units, inputs, execution)
    measured, offload_line = with_offload(model, measured, offload)
    measured = measured.like(measured.units, scratch=compiler_scratch(model, execution))  # in the compiler's figure too
    rows = []
    for unit, unit_costs, policy in zip(units, measured.units, current):
        options = unit_costs.options
        rows.append(
            {
                "name": unit_name(unit),
                "policy": policy,
                "kept_bytes": {o: option.kept for o, option in options.items()},
                "recompute_seconds": {o: option.seconds for o, option in options.items() if o != _budget.NONE},
            }
        )
    plain = measured.peak([_budget.NONE] * len(units))
    predicted, where = compiled_peak(model, inputs, measured, execution, step_key), ""
    if predicted is None:
        predicted, point = measured.peak_point(current)
        where = measured.point_text(point)
        if offload and point is None and offload_frees(model) and any(policy != _budget.NONE for policy in current):
            # Measured on an H200 (docs/gpu.md, 2026-11-29): Adam's update held the step's peak, the same to the
            # byte with offload.
            offload_line += "; the predicted peak is after the backward, where nothing offloaded is on the device: " \
                            "offload does not lower it"
    elif all(policy == _budget.NONE for policy in current):
        plain = predicted
    # No recompute is itself a plan: where the compiler's figure for it is below the units' sum
    # (NOTE [ checking a plan on JAX ]), the least peak is at most that figure.
    floor = min(measured.floor(), plain)
    title = f"keras_recompute memory report: {model.name!r}, {len(units)} units, {_backend_name(model)}"
    result = MemoryReport(title, rows, predicted, measured.resident, floor, plain, seconds, execution, reason)
    result.peak_at = where
    result.offload = offload_line
    result.unreached = _unreached_line([unit.name for unit in measured.units if not unit.reached])
    result.allocator = allocator_line(model, execution)
    return result


# NOTE [ a CNN on TensorFlow's allocator ]
# On TensorFlow the prediction counts the tensors a traced backward reads of
# its forward (NOTE [ measuring a unit on TensorFlow ] in
# `backends/tensorflow.py`): for a transformer's blocks, the BFC allocator's
# figure to a few percent. For a convolutional network it is not
# (benchmarks/tf_allocator_gap.py, docs/benchmarks.md, 2026-12-02; fit's
# compiled step, batch 32 at 128x128): at the end of the forward the
# allocator held 12-26% more than the count, varying from run to run of one
# graph, and Grappler kept an activation-sized constant between steps under
# recompute; MobileNetV2's step peaked 1.10x its prediction plain and 1.36x
# under "full" (1.26-1.36x at batch 8-32), ResNet50's 0.85x and 1.01x. A plan
# for a budget can then go over it (MobileNetV2's by 10.5%). Where the allocator
# keeps figures, the units are calibrated to them, as JAX's are to the
# compiler's (NOTE [ calibrating a CNN to TensorFlow's allocator ] in
# `backends/tensorflow.py`); where it keeps none (the CPU's default allocator)
# the report says so where it applies: TensorFlow, a compiled step, a layer
# whose class is a convolution's.
def allocator_line(model, execution):
    """The report's line on a convolutional network's compiled step on TensorFlow (NOTE [ a CNN on TensorFlow's
    allocator ]), or `""`."""
    if execution != COMPILED or _module_name(_measuring_backend(model)) != "tensorflow":
        return ""
    if not _has_convolution(model) or states_compiled_peak(model, execution):  # calibrated: its step was run
        return ""
    return (
        "On TensorFlow a convolutional network's step can peak above this prediction: its allocator held 12-26% more "
        "than the tensors the backward reads, and MobileNetV2's step under 'full' peaked 1.36x its prediction "
        "(docs/benchmarks.md, \"TensorFlow's allocator against the planner's count\"). Where the allocator keeps "
        "figures (a GPU; on a CPU, TF_CPU_ALLOCATOR_USE_BFC=1 set before TensorFlow starts) the planner runs the step "
        "and calibrates to them; here, give budget= about 70% of the memory."
    )


def _has_convolution(model):
    """Whether `model` or a layer in it is a convolution (`_is_convolution`)."""
    return any(_is_convolution(layer) for layer in [model] + _context.sublayers(model))


def _is_convolution(layer):
    """Whether `layer`'s class is a convolution's (Keras's `Conv2D`, `DepthwiseConv2D`, ...: a class named so in
    its bases)."""
    return any(re.fullmatch(r"(Base)?(Depthwise|Separable)?Conv(olution)?\d?D?(Transpose)?", base.__name__)
               for base in type(layer).__mro__)


def _unreached_line(names):
    """The report's line on the units no gradient reaches (NOTE [ a unit no gradient reaches ]), or `""`."""
    if not names:
        return ""
    shown = ", ".join(names) if len(names) <= 3 else f"{names[0]}, ..., {names[-1]}"  # a piece's name has a ".."
    return (
        f"{len(names)} unit{'s' if len(names) > 1 else ''} ({shown}) no gradient reaches in this step (frozen, with "
        "no trained weight before them): they keep nothing and stay plain. The plan is for the model as it stands: "
        "after unfreezing them, plan again."
    )


def with_offload(model, measured, offload):
    """`(measured, line)`: the costs with offload counted where it frees device memory, and the report's line on it.

    NOTE [ offload ] in `_policy`: on a CPU the host memory is the device's,
    and offloaded bytes stay counted.
    """
    if not offload:
        return measured, ""
    if not offload_frees(model):
        return measured, (
            "offload: on, but this device's host memory is its own memory (a CPU): the inputs stay counted"
        )
    moved = sum(unit.input_bytes for unit in measured.units)
    return _budget.offloaded(measured, (_policy.FULL,)), (
        f"offload: on; the inputs of units under 'full' are in host memory (up to {_budget.format_bytes(moved)}), "
        "back on the device for their backward"
    )


def offload_frees(model):
    """Whether offloaded bytes leave the device's memory where `model` runs (not on a CPU: NOTE [ offload ])."""
    return getattr(_measuring_backend(model), "offload_frees_device_memory", lambda: False)()


def execution_of(model, execution, where):
    """`(execution, reason)`: the execution a plan of `model` is for (NOTE [ which execution a plan is for ]).

    Raises:
        ValueError: for an `execution` that is not `"eager"`, `"compiled"` or
            None, and for `"compiled"` on PyTorch.
    """
    backend = _backend_name(model)
    if execution is not None:
        if not (isinstance(execution, str) and execution in EXECUTIONS):
            raise ValueError(
                f"keras_recompute: {where}(execution=...) got {execution!r}; valid values are {list(EXECUTIONS)}: "
                "'eager' for a training step that runs op by op (a `tf.GradientTape` loop not in `tf.function`, "
                "`run_eagerly=True`), 'compiled' for one in `tf.function`, XLA or `jax.jit` (a compiled model's "
                "`fit`). Leave it out to infer it from the model."
            )
        if execution == COMPILED and backend.endswith("torch"):
            raise ValueError(
                f"keras_recompute: {where}(execution='compiled') on PyTorch: Keras runs PyTorch eagerly, and the "
                "plan is made for that. Leave execution= out, or pass 'eager'."
            )
        return execution, f"execution={execution!r}"
    if backend.endswith("torch"):
        return EAGER, "PyTorch runs eagerly"
    compiled = getattr(model, "compiled", None)
    compiled = getattr(model, "_is_compiled", False) if compiled is None else compiled
    if not compiled:
        return EAGER, (
            "the model is not compiled, so its training loop may run eagerly; pass execution='compiled' "
            "for a step in tf.function or jax.jit"
        )
    if getattr(model, "run_eagerly", False):
        return EAGER, "compiled with run_eagerly=True"
    return COMPILED, "compiled: fit runs a compiled step"


def states_compiled_peak(model, execution=COMPILED):
    """Whether `compiled_peak` gives a figure for `model`'s step under `execution`: compiled, on JAX (the compiler
    states it), or a convolutional network on TensorFlow where the allocator keeps figures (NOTE [ calibrating a CNN
    to TensorFlow's allocator ] in `backends/tensorflow.py`)."""
    backend = _measuring_backend(model)
    if execution != COMPILED or not hasattr(backend, "step_bytes"):
        return False
    return backend.states_step_bytes(model) if hasattr(backend, "states_step_bytes") else True


def compiler_scratch(model, execution=COMPILED):
    """What `model`'s compiled step holds whatever its size (NOTE [ the compiler's scratch ] in `backends/jax.py`), or 0."""
    if not states_compiled_peak(model, execution):
        return 0
    return _measuring_backend(model).compiler_scratch_bytes()  # a backend with `step_bytes` states it


def resident_bytes(model, inputs):
    """What a step holds whatever it runs: the variables, the optimizer's slots and the batch."""
    return _variable_bytes(model.variables) + _optimizer_bytes(model) + _tensor_bytes(inputs)


def resident_unmeasured(model, inputs):
    """`resident_bytes` without running the model, or 0 for a model not built yet.

    The measure builds such a model; its optimizer is built after, on the weights it then has (built first, with
    none, it would refuse them in training)."""
    return resident_bytes(model, inputs) if getattr(model, "built", False) and model.variables else 0


def compiled_peak(model, inputs, measured, execution=COMPILED, key=None):
    """The peak of a step of `model` as it stands, where a compiler states it (JAX) or its step is run for the
    allocator's figures (a CNN on TensorFlow: `states_compiled_peak`), else None.

    NOTE [ checking a plan on JAX ] in `backends/jax.py`. None for an eager step. `key`: what the step's program
    depends on, its bytes kept on the model under it (NOTE [ each plan's step compiled once ] in `_model`).
    """
    if not states_compiled_peak(model, execution):
        return None
    resident = measured.resident if measured is not None else resident_bytes(model, inputs)
    step = remembered(model, key) if key is not None else None
    if step is None:
        step = _measuring_backend(model).step_bytes(model, inputs)  # the optimizer's update is in the step
        if key is not None:
            remember(model, key, step)
    return resident + step


def costs(model, units, inputs, execution=COMPILED, below=True):
    """The `_budget.Model` of `model` at `inputs` for `execution`, measured or cached, and the seconds measuring took.

    With `below`, a batch of `MEASURED_BELOW` rows or more is measured at a quarter and a half of itself where
    measuring runs the units on the device, and extrapolated (NOTE [ measuring below the batch ]); without, it is
    measured as it is (an extrapolation kept from before is not taken for a measurement).
    """
    key = cache_key(model, units, inputs, execution)
    keys = (key, key + ("extrapolated",)) if below else (key,)
    for cached in (remembered(model, k) for k in keys):
        if cached is not None:
            return cached, 0.0
    start = time.perf_counter()
    extrapolated = _extrapolated(model, units, inputs, execution) if below else None
    if extrapolated is not None:
        measured = remember(model, keys[-1], extrapolated)
    else:
        measured = remember(model, key, _measure(model, units, inputs, _measuring_backend(model), execution))
    return measured, time.perf_counter() - start


# NOTE [ measuring below the batch ]
# Measuring a unit runs its step without recompute at the batch measured,
# while the measure holds the weights, the optimizer's slots and every unit's
# inputs: more than a step that recomputes that unit holds. At the batch a
# budget is for, planning needed more memory than the plan's training
# (TensorFlow's BFC allocator on the CPU, 2026-11-28): bert4keras BERT-base at
# batch 41, `recompute_model(budget=2261 MiB)` peaked at 2499.8 MiB while
# planning and the plan's steps at 2257-2264; keras-hub BERT small at 66, at
# 683.3 against 544-545. In the allocator limited to the budget, as a
# device's is, planning ran out of memory where the plan it would have made
# trains (that plan set by hand ran every time: keras-hub BERT small at 66 to
# 74, bert4keras at 41). So where measuring runs the units on the device and
# reads what they held (TensorFlow's allocator, PyTorch's profiler), a batch
# of `MEASURED_BELOW` rows or more is measured at a quarter and at a half of
# itself, every input cut along its first axis, and each figure of the two
# `_budget.Model`s extrapolated to the batch along a line
# (`_fit.FittedModel`, as `largest_fit` extrapolates from small batches: every
# activation is a batch of rows, the weights and slots are the same at every
# batch), the seconds in proportion to the half's (`_in_proportion`). Planning
# then peaked at 1911.1 and 366.1 MiB, its plans predicted as measured whole
# to 0.01 MiB (`tests/test_budget.py`: within 1%), and both plans ran in the
# limited allocator. JAX is measured at the batch: its plans are checked by
# compiling the step there, which allocates nothing. Inputs not all cut along
# one first axis of one length, a model whose inputs name their batch size,
# and one whose measuring refuses a part of its batch (a `ValueError`,
# `TypeError` or `IndexError`), are measured as they are. `largest_fit`
# measures its sizes as they are: the fit is its own.
MEASURED_BELOW = 8


def _extrapolated(model, units, inputs, execution):
    """The costs at `inputs` from its quarter and half, or None where it is measured as it is."""
    from keras_recompute import _fit

    below = _measured_below(model, inputs)
    if below is None:
        return None
    batch, sizes, parts = below
    try:
        models = [costs(model, units, part, execution, below=False)[0] for part in parts]
    except (ValueError, TypeError, IndexError):  # a model that takes no part of its batch: measured whole
        return None
    return _in_proportion(_fit.FittedModel(sizes, models, 1).at(batch), models[-1], batch / sizes[-1])


def _measured_below(model, inputs):
    """`(batch, sizes, parts)`: `inputs` cut to a quarter and a half of its batch, or None to measure it as it is."""
    if _module_name(_measuring_backend(model)) not in ("tensorflow", "torch"):
        return None
    leaves = list(_context.leaves(inputs))
    shapes = [getattr(leaf, "shape", None) for leaf in leaves]
    if not leaves or any(shape is None or len(shape) == 0 or shape[0] is None for shape in shapes):
        return None
    batches = {int(shape[0]) for shape in shapes}
    batch = batches.pop()
    if batches or batch < MEASURED_BELOW or _fixed_batch(model):
        return None
    sizes = (batch // 4, batch // 2)
    try:
        parts = [_context.rebuild(inputs, iter([leaf[:size] for leaf in leaves])) for size in sizes]
    except (TypeError, ValueError, IndexError):  # a leaf that cannot be cut (a sparse tensor): measured whole
        return None
    return batch, sizes, parts


def _fixed_batch(model):
    """Whether `model`'s inputs name their batch size (`keras.Input(batch_size=...)`): it takes no other."""
    for tensor in getattr(model, "inputs", None) or ():
        shape = getattr(tensor, "shape", None)
        if shape is not None and len(shape) > 0 and shape[0] is not None:
            return True
    return False


def _in_proportion(fitted, half, scale):
    """`fitted` with each option's seconds those of `half` times `scale`.

    A line through two timings a few milliseconds apart, extrapolated to twice
    the larger batch, can fall to nothing (keras-hub BERT small at 66:
    `save_dots` 0 s where measured whole it took 0.06-0.31 s); a step's time grows
    with its rows, and the larger batch's timing is the steadier.
    """
    units = []
    for unit, measured in zip(fitted.units, half.units):
        units.append(unit.like({
            name: _budget.Option(name, option.kept, option.transient, measured.options[name].seconds * scale, option.forward)
            for name, option in unit.options.items()
        }))
    return fitted.like(units)


def cache_key(model, units, inputs, execution):
    """What the costs of `units` depend on besides the model's values: the units, the inputs' shapes, the
    execution, which layers inside the units recompute now by their own decorators (a unit's "none" is measured
    with them, NOTE [ units that hold decorated layers ] in `_model`), which weights train (a unit no gradient
    reaches keeps nothing: NOTE [ a unit no gradient reaches ]; unfrozen, it is measured again), the optimizer
    (its slots and update: `optimizer_key`), and which other layers recompute now (`recomputing_elsewhere`)."""
    from keras_recompute._decorator import decorated_inside

    inside = tuple(tuple(decorated_inside(unit)) for unit in units)
    trained = tuple(id(variable) for variable in model.trainable_variables)
    return (
        tuple(id(unit) for unit in units), _signature(inputs), execution, inside, trained, optimizer_key(model),
        recomputing_elsewhere(model, units),
    )


def recomputing_elsewhere(model, units):
    """`((position, (policy, offload)), ...)`: the layers of `model` other than `units` that recompute now (a plan's
    or a decorator's), by their position among its layers. The units' own calls are each option's as it is measured;
    another layer's recompute is in what the step holds outside them (and in a unit's "none", inside it). Until
    2026-12-05 it was not part of the key: a report over `blocks=["block_0"]` of two blocks, after `recompute_model`
    set `block_1` to recompute, kept the report's figures from before (1.54 MB on TensorFlow, where a model made so
    holds 0.96)."""
    from keras_recompute._decorator import decorated_policy

    own = {id(unit) for unit in units}
    found = [(position, decorated_policy(getattr(layer, "call", None)))
             for position, layer in enumerate(_context.sublayers(model)) if id(layer) not in own]
    return tuple((position, options) for position, options in found if options is not None)


def optimizer_key(model):
    """What the resident bytes and the update depend on in `model`'s optimizer: its class and configuration, and
    which it is. A model compiled again with another optimizer is measured again: until 2026-12-05 a report after
    `compile(optimizer="sgd")` on a model reported with Adam kept Adam's slots (142.0 kB resident, where SGD's model
    holds 69.3), and the other way a plan would have left out the slots it needed."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    try:
        config = repr(sorted(optimizer.get_config().items()))
    except Exception:  # noqa: BLE001 - an optimizer whose configuration cannot be read: its class and identity
        config = None
    return (type(optimizer).__module__, type(optimizer).__qualname__, id(optimizer), config)


def remembered(model, key):
    """What `remember` kept on `model` under `key`, or None."""
    cache = model.__dict__.get(_COSTS)
    return cache.entries.get(key) if cache is not None else None


def remember(model, key, value):
    """Keeps `value` on `model` under `key` (the last `_Cached.KEPT` of them: `largest_fit` measures several sizes,
    and each plan's step compiled is kept: NOTE [ each plan's step compiled once ] in `_model`)."""
    cache = model.__dict__.get(_COSTS)
    if cache is None:
        cache = _Cached()
        object.__setattr__(model, _COSTS, cache)
    cache.entries.pop(key, None)
    cache.entries[key] = value
    while len(cache.entries) > _Cached.KEPT:
        cache.entries.pop(next(iter(cache.entries)))
    return value


def unit_name(unit):
    """A unit's name in plans and reports: its layer's name, or a graph piece's first and last layers'."""
    return getattr(unit, "_keras_recompute_label", None) or unit.name


def _measuring_backend(model):
    """The backend module whose `measure_unit` measures `model`: Keras 3's backend, or TensorFlow."""
    import importlib

    from keras_recompute.backends import _keras3

    name = _keras3.backend_name() if _keras3.is_layer(model) else "tensorflow"
    return importlib.import_module(f"keras_recompute.backends.{name}")


def _backend_name(model):
    from keras_recompute.backends import _keras3

    return f"Keras 3 on {_keras3.backend_name()}" if _keras3.is_layer(model) else "tf_keras"


class _Cached:
    """Not a dict or list: Keras's saving walks a model's attributes (see `_model._Plan`)."""

    KEPT = 64

    def __init__(self):
        self.entries = {}


def options_of(unit):
    """The policies that apply to `unit`, `"none"` first."""
    options = [_budget.NONE, _policy.FULL, _policy.SAVE_DOTS]
    if _policy.attention_layers(unit):
        options.append(_policy.ATTENTION_CORE)
    return options


def _measure(model, units, inputs, backend, execution):
    from keras_recompute._decorator import _undecorated, recompute_grad

    state = [v for v in model.variables if not _trainable(v)]
    saved = [_numpy(v) for v in state]
    try:
        records, loss, output_bytes, (reached, unreached_forward) = _record(model, units, inputs, backend)
        # Where the step differentiates only what a trained weight reaches, a unit no gradient reaches keeps
        # nothing and is not recomputed (NOTE [ a unit no gradient reaches ]).
        pruned = execution == COMPILED or _module_name(backend) != "tensorflow"
        costs_by_kind, unit_costs = {}, []
        for unit in units:
            args, kwargs, sizes = records[id(unit)]
            if pruned and id(unit) not in reached:
                unit_costs.append(_unreached_costs(unit, sizes[0], unreached_forward))
                continue
            kind = _unit_kind(unit, args, kwargs)
            if kind not in costs_by_kind:
                costs_by_kind[kind] = _measure_options(
                    unit, args, kwargs, backend, _undecorated(unit.call), recompute_grad, execution
                )
            unit_costs.append(_unit_costs(unit, costs_by_kind[kind], *sizes, _recompute_largest(backend, unit), model))
        whole = _whole_model_kept(model, units, inputs, backend, _undecorated, recompute_grad, execution, not pruned)
        outside = max(0, whole - sum(u.options[_policy.FULL].kept for u in unit_costs))
        resident = resident_bytes(model, inputs)
        unit_gradients = sum(u.gradient_bytes for u in unit_costs)
        outside_gradients = max(0, _variable_bytes(model.trainable_variables) - unit_gradients)
        # A TensorFlow graph applies each gradient as it is made (NOTE [ the peak of a plan ]).
        applied_as_made = execution == COMPILED and _module_name(backend) == "tensorflow"
        # Keras's PyTorch trainer frees the last step's gradients after the forward (`zero_grad`), not before it.
        torch = _module_name(backend) == "torch"
        forward_held = unit_gradients + outside_gradients if torch else 0
        # And keeps the outputs for its metrics, computed after the update (NOTE [ the peak of a plan ]).
        return _budget.Model(
            unit_costs, resident, outside, outside_gradients, _update_bytes(model), applied_as_made, loss,
            forward_held, outputs_held=output_bytes if torch else 0,
        )
    finally:
        for variable, value in zip(state, saved):
            variable.assign(value)


def _measure_options(unit, args, kwargs, backend, base, recompute_grad, execution):
    """`{option: (kept, largest, seconds, peaks, read)}` for one unit (`read`: what its recompute makes again);
    the options' steps are timed in turns."""
    measured, reads, steps = {}, {}, {}
    for option in options_of(unit):
        call = base if option == _budget.NONE else recompute_grad(base, enabled=True, policy=option)
        with _patch.instance_attribute(unit, "call", call):
            kept, largest, step, reads[option] = backend.measure_unit(unit, args, kwargs, option, execution=execution)
        measured[option] = (kept, largest)
        steps[option] = _patched(unit, call, step)
    # In turns, so that a slower spell of the machine falls on every option alike; the fastest counts.
    #
    # NOTE [ timing a unit on a GPU ]
    # A GPU runs kernels after the host has queued them, and a call returns once
    # they are queued: a step timed without waiting for the device times the
    # queueing, about the same for every option, where a GPU's matmuls make
    # `"full"` cost more than `"save_dots"`, and the planner chose by the host's
    # launch time. So each backend's timed step returns once its device has run
    # it: JAX's `block_until_ready`, PyTorch's `torch.cuda.synchronize`,
    # TensorFlow's `sync_devices` (`synchronize` in their files). Until
    # 2026-12-03 PyTorch's and TensorFlow's steps did not wait (found reading
    # the code; not yet timed on a GPU). On the CPU the ops have run when the
    # call returns, and the wait costs nothing.
    seconds = {option: float("inf") for option in steps}
    for _ in range(_REPEATS):
        for option, step in steps.items():
            start = time.perf_counter()
            step()
            seconds[option] = min(seconds[option], time.perf_counter() - start)
    # Where a step's allocations can be read (PyTorch), what it holds is measured, not modelled.
    peaks = {option: backend.step_peaks(step) if hasattr(backend, "step_peaks") else None for option, step in steps.items()}
    return {option: measured[option] + (seconds[option], peaks[option], reads[option]) for option in measured}


def _patched(unit, call, step):
    def run():
        with _patch.instance_attribute(unit, "call", call):
            step()

    return run


def _recompute_largest(backend, unit):
    """How many largest tensors a recomputed unit's backward holds on top of what it makes again.

    Measured (NOTE [ the peak of a plan ] in `_budget`): 1, except where the
    unit draws dropout on TensorFlow (2: its executor's order of a graph's ops
    varies from run to run). Not used on PyTorch, whose units' transients are
    measured (NOTE [ measuring a unit on PyTorch ]).
    """
    if _module_name(backend) == "tensorflow" and _dropouts(unit):
        return 2.0
    return 1.0


def _module_name(backend):
    """A backend module's short name: `"tensorflow"`, `"jax"` or `"torch"`."""
    return backend.__name__.rsplit(".", 1)[-1]


def _dropouts(unit):
    """The layers of `unit` that drop out (a `rate` above 0)."""
    layers = unit._flatten_layers() if hasattr(unit, "_flatten_layers") else [unit]
    return [layer for layer in layers if isinstance(getattr(layer, "rate", None), float) and layer.rate > 0]


def _unit_costs(unit, measured, input_bytes, output_bytes, recompute_largest=1.0, model=None):
    """A unit's options from its measurements (NOTE [ the peak of a plan ] in `_budget`)."""
    kept_none, largest, seconds_none, _, read_none = measured[_budget.NONE]
    gradient_bytes = _variable_bytes(unit.trainable_variables)
    options = {}
    for option, (kept, _, seconds, peaks, read) in measured.items():
        forward = 0
        if peaks is not None:  # measured (NOTE [ measuring a unit on PyTorch ])
            forward, _, backward = peaks
            # The step's backward held what the unit keeps and its weights' gradients (counted apart, NOTE [ the
            # peak of a plan ]) beside its own; and its output, held by the measure (freed in a model's step by
            # then), in the place of the gradient flowing in (a sum's, made there without allocating).
            transient = max(0, backward - kept - gradient_bytes)
        elif option == _budget.NONE:
            transient = 2 * output_bytes + 2 * largest
        else:  # what its recompute makes again, too: all the forward its backward's ops read (`read`)
            transient = 2 * output_bytes + recompute_largest * largest + max(0, read_none - read)
        extra = 0.0 if option == _budget.NONE else max(seconds - seconds_none, 1e-6)
        # Every option holds the unit's inputs: its first layers save them, or the recompute needs them.
        options[option] = _budget.Option(option, input_bytes + kept, transient, extra, forward)
    update = _update_bytes(model, unit.trainable_variables) if model is not None else 0
    return _budget.UnitCosts(unit_name(unit), options, gradient_bytes, input_bytes, update, largest)


def _record(model, units, inputs, backend):
    """`({id(unit): (args, kwargs, (input_bytes, output_bytes))}, loss, outputs, reached)` from one training-mode
    forward of `model`.

    `loss`: what a loss's backward holds on its outputs (PyTorch, TensorFlow; else 0); `outputs`: their bytes;
    `reached`: `(ids, forward)`, the ids of the units a gradient may reach and the most bytes one layer's call
    held (its arguments and outputs) before any trained weight was used (NOTE [ a unit no gradient reaches ]).
    """
    from keras_recompute.backends import _keras3

    records, reached, trained, unreached_forward = {}, set(), [], [0]
    layers = [model] + _context.sublayers(model)
    owners = _trained_owners(layers)
    with contextlib.ExitStack() as stack:
        for layer in layers:
            leaf = not _context.children(layer)
            if id(layer) in owners or leaf:
                marker = _marker(layer, layer.call, trained, id(layer) in owners, unreached_forward if leaf else None)
                stack.enter_context(_patch.instance_attribute(layer, "call", marker))
        for unit in units:
            recorder = _recorder(unit, unit.call, records, reached, trained)
            stack.enter_context(_patch.instance_attribute(unit, "call", recorder))
        with _no_gradient(backend):
            outputs = model(inputs, **_keras3.training_kwargs(model))  # as Keras's trainer calls it
    missing = [unit_name(unit) for unit in units if id(unit) not in records]
    if missing:
        raise ValueError(
            f"keras_recompute: a forward of {model.name!r} on `inputs` did not call the units {missing}: "
            "pass inputs= as the model takes them in training."
        )
    after = [model] + _context.sublayers(model)
    if [id(layer) for layer in after] != [id(layer) for layer in layers] or _trained_owners(after) != owners or not owners:
        # Layers made or built by this first call were not watched, or nothing trains (no step to plan: its units
        # are measured as a gradient would reach them): every unit counts as reached, as before.
        reached, unreached_forward = {id(unit) for unit in units}, [0]
    # What the loss's backward holds on the outputs: measured on PyTorch, counted on TensorFlow's graph.
    loss = backend.loss_peak(outputs, model) if hasattr(backend, "loss_peak") else 0
    return records, loss, _tensor_bytes(outputs), (reached, unreached_forward[0])


# NOTE [ a unit no gradient reaches ]
# A training step differentiates the loss with respect to the trained weights,
# never the batch. A unit called before any trained weight is used, with none
# of its own (a frozen backbone under a trained head: Keras's transfer
# learning guide's first phase; the frozen lower half of a model fine-tuned),
# is reached by no gradient: a compiled step (a `tf.function`, XLA, `jax.jit`)
# prunes its backward and keeps nothing of its forward, PyTorch's autograd
# records none of it, and a recompute of it is pruned too (NOTE [ a check the
# runtime may prune ] in `backends/tensorflow.py`). Measured as a unit is,
# inputs differentiated, it was counted as keeping its activations:
# keras.applications ResNet50 frozen under a Dense head, batch 32 at 128x128,
# was predicted to peak at 669 MB (the least plan at 369 MB) where its `fit`
# step peaks at 189 MB (TensorFlow's BFC allocator), and with its lower half
# frozen at 810 MB (417) where it peaks at 363. So the forward that records
# the units' calls (`_record`) also notes, in call order, whether a layer that
# owns a trained weight has been called yet (`_trained_owners`, `_marker`); a
# unit called before that, with no trained weight of its own, is not reached:
# every option keeps nothing, has no backward and costs no time (a plan leaves
# it plain, "none" winning the tie), and the whole model is measured with its
# inputs not differentiated, as the step has them. (Where that forward builds
# layers, or makes new ones, which were not watched, and where nothing in the
# model trains (no step to plan; a report then says what each unit would
# keep), every unit counts as reached.) Such a step may peak in its forward, which the units' measures do
# not see: there, what a leaf layer's call held before any trained weight ran
# (its arguments and outputs; the most of any), beside a unit's inputs (held
# for a residual's sum). ResNet50 is now predicted at 235 MB (24% over; its
# peak is at a sum in the stem's block, where three tensors of 33.5 MB are
# alive), with its lower half frozen at 445 MB (22% over, as the trained
# model's 1255 MB is 17% over its 1073); 6 dense blocks, all frozen, at 11.4
# MiB where three runs of the step peaked at 11.1, 12.0 and 12.2 MiB
# (TensorFlow's executor orders a graph's ops differently from run to run;
# `tests/test_budget.py`). The order is the calls', not the graph's: a trained
# layer on another branch called earlier counts as reaching every unit after
# it, which can only over-predict, as before. An eager TensorFlow step is
# measured as it was: Keras 3's frozen variables are still trainable
# `tf.Variable`s, so its tape records the frozen units and keeps what they
# read (NOTE [ measuring for eager execution ] in `backends/tensorflow.py`). A
# plan is for the model as it stands: unfreezing its layers (the guide's
# second phase) needs a plan made again.


def _trained_owners(layers):
    """The ids of `layers` that own a trained weight none of their sub-layers holds."""
    owners = set()
    for layer in layers:
        own = {id(v) for v in layer.trainable_variables}
        for child in _context.children(layer):
            own -= {id(v) for v in child.trainable_variables}
        if own:
            owners.add(id(layer))
    return owners


def _marker(layer, call, trained, owner, held):
    """`call`, which notes in `trained` that a layer owning a trained weight ran (`owner`), and in `held[0]` the
    most bytes a leaf layer's call held before one did (`held` not None); not a shape-only call."""
    from keras_recompute.backends import _keras3

    keras3 = _keras3.is_layer(layer)

    def mark(*args, **kwargs):
        symbolic = keras3 and _keras3.in_symbolic_scope()
        if owner and not symbolic:
            trained.append(layer)
        outputs = call(*args, **kwargs)
        if held is not None and not trained and not symbolic:
            held[0] = max(held[0], _float_bytes((args, kwargs)) + _float_bytes(outputs))
        return outputs

    return mark


def _unreached_costs(unit, input_bytes, held):
    """A unit no gradient reaches: under every option it keeps nothing, has no backward and costs no time (its
    recompute is pruned: NOTE [ a unit no gradient reaches ]); its forward holds its inputs and `held`, the most a
    layer's call held before a trained weight was used (the block's input, held for a residual's sum, beside its
    layers' arguments and outputs)."""
    options = {option: _budget.Option(option, 0, 0, 0.0, held) for option in options_of(unit)}
    return _budget.UnitCosts(unit_name(unit), options, 0, input_bytes, 0, 0, reached=False)


def _recorder(unit, call, records, reached, trained):
    from keras_recompute.backends import _keras3

    keras3 = _keras3.is_layer(unit)

    def record(*args, **kwargs):
        # Every call counts: a unit called again after a trained layer (a shared block) is reached by a gradient.
        if not (keras3 and _keras3.in_symbolic_scope()) and (trained or unit.trainable_variables):
            reached.add(id(unit))
        outputs = call(*args, **kwargs)
        # A model not built yet is built by Keras at its first call, by a call that computes only shapes (on JAX
        # its values are tracers of that trace): that call is not the one measured, the call that follows is.
        if id(unit) in records or (keras3 and _keras3.in_symbolic_scope()):
            return outputs
        # A `call` that takes no `training` runs with the call context's (its dropout reads it there): measured
        # with it, given as `training=` (which `__call__` puts back in the context).
        training = _keras3.context_training(unit) if keras3 else _tf_keras_context_training(unit)
        recorded = kwargs if training is None else dict(kwargs, training=training)
        records[id(unit)] = (args, recorded, (_float_bytes((args, kwargs)), _float_bytes(outputs)))
        return outputs

    return record


def _tf_keras_context_training(unit):
    if "tf_keras" not in sys.modules:  # no tf_keras loaded: not a tf_keras layer
        return None
    from keras_recompute.backends import _tf_keras

    return _tf_keras.context_training(unit)


def _no_gradient(backend):
    if backend.__name__.endswith(".torch"):
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def _whole_model_kept(model, units, inputs, backend, undecorated, recompute_grad, execution, differentiated=True):
    """What the whole model keeps with every unit recomputed ("full"): its units' inputs, and the rest.

    `differentiated`: whether the model's floating inputs are differentiated (not where the step prunes what no
    gradient reaches: NOTE [ a unit no gradient reaches ]).

    Measured with the units recomputed, not plain: where the measurement runs
    the forward (PyTorch), it then holds no more than full recompute keeps,
    not the plain model's activations, which may be what does not fit.
    """
    from keras_recompute.backends import _keras3

    with contextlib.ExitStack() as stack:
        for unit in units:
            full = recompute_grad(undecorated(unit.call), enabled=True, policy=_policy.FULL)
            stack.enter_context(_patch.instance_attribute(unit, "call", full))
        training = _keras3.training_kwargs(model)  # as Keras's trainer calls it
        return backend.measure_unit(
            model, (inputs,), training, _policy.FULL, timed=False, execution=execution, differentiated=differentiated
        )[0]


def _unit_kind(unit, args, kwargs):
    """Units of one kind keep and cost the same: one class, weights and arguments alike."""
    leaves = []
    for leaf in _context.leaves((args, kwargs)):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            leaves.append((tuple(leaf.shape), str(leaf.dtype), _context.get_mask(leaf) is not None))
        else:
            leaves.append(repr(leaf))
    weights = tuple((tuple(v.shape), str(v.dtype), bool(v.trainable)) for v in unit.weights)
    # A graph's pieces are all one class: theirs are the classes of the layers in them.
    layers = tuple(type(layer) for layer in getattr(unit, "segment_layers", ()))
    return (type(unit), layers, weights, tuple(leaves), tuple(sorted(kwargs)), tuple(options_of(unit)))


def _signature(inputs):
    return tuple(
        (tuple(leaf.shape), str(leaf.dtype)) if hasattr(leaf, "shape") else repr(leaf)
        for leaf in _context.leaves(inputs)
    )


def _trainable(variable):
    return bool(getattr(variable, "trainable", False))


def _numpy(variable):
    import numpy

    return numpy.array(variable.numpy() if hasattr(variable, "numpy") else variable)


def _itemsize(dtype):
    name = getattr(dtype, "name", None) or str(dtype)
    if name.startswith("torch."):
        name = name[len("torch.") :]
    if name in ("bool", "int8", "uint8", "float8_e4m3fn", "float8_e5m2"):
        return 1
    digits = re.findall(r"\d+", name)
    return max(1, int(digits[-1]) // 8) if digits else 4


def _shape_bytes(shape, dtype):
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * _itemsize(dtype)


def _variable_bytes(variables):
    seen, total = set(), 0
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            total += _shape_bytes(variable.shape, variable.dtype)
    return total


def _float_bytes(tree):
    return _tensor_bytes([leaf for leaf in _context.leaves(tree) if "float" in str(getattr(leaf, "dtype", ""))])


def _tensor_bytes(tree):
    total = 0
    for leaf in _context.leaves(tree):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype") and not isinstance(leaf, type):
            total += _shape_bytes(leaf.shape, leaf.dtype)
    return total


# What Keras's PyTorch optimizers allocate in their update, in multiples of all the trainable weights' bytes:
# they update every weight at once (`torch._foreach_*`, `TorchParallelOptimizer`), each operation making a
# list of new tensors as large as all the weights. Measured with the profiler's allocation records, above the
# weights, the slots and the gradients (Keras 3.15, `tests/test_budget.py::test_the_torch_update_is_measured`;
# one more each until 2026-11-26, when the measure counted the last step's gradients, which the trainer frees
# after the forward, beside the new ones; SGD's update, with momentum or without, runs in place).
TORCH_UPDATE = {
    "SGD": 0, "Lion": 2, "Adam": 3, "AdamW": 3, "Adamax": 3, "Adagrad": 3, "Adadelta": 3, "RMSprop": 3, "Nadam": 5,
}


def _update_bytes(model, variables=None):
    """What the optimizer's update of `variables` (default: all) allocates at once (NOTE [ the peak of a plan ]).

    Twice the largest, but for a whole model on PyTorch under one of Keras's
    optimizers that update all the weights at once (`TORCH_UPDATE`).
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return 0
    trainable = [v for v in (model.trainable_variables if variables is None else variables) if _trainable(v)]
    factor = _torch_update_factor(optimizer) if variables is None else None
    if factor is not None:
        return factor * _variable_bytes(trainable)
    return 2 * max((_variable_bytes([v]) for v in trainable), default=0)


def _torch_update_factor(optimizer):
    """`TORCH_UPDATE`'s factor for one of Keras's PyTorch optimizers (or a subclass), else None."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("keras.src.backend.torch.optimizers") and cls.__name__ in TORCH_UPDATE:
            return TORCH_UPDATE[cls.__name__]
    return None


def _optimizer_bytes(model):
    """The optimizer's variables, built as the first training step would build them (Adam: two per weight)."""
    return _variable_bytes(optimizer_variables(model))


def optimizer_variables(model):
    """`model`'s optimizer's variables (none without one), the optimizer built first as the first training step
    would build it."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return []
    weights = model.trainable_variables
    built = getattr(optimizer, "built", None)
    built = getattr(optimizer, "_built", False) if built is None else built  # tf_keras's: `_built`, set by build
    try:
        if hasattr(optimizer, "_create_all_weights"):  # a legacy tf_keras optimizer: slots made on its first step
            optimizer._create_all_weights(weights)
        elif not built and hasattr(optimizer, "build"):
            optimizer.build(weights)
    except Exception:  # e.g. outside the distribution strategy it was made in: counted as it stands
        pass
    variables = getattr(optimizer, "variables", [])
    return list(variables() if callable(variables) else variables)
