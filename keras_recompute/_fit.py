"""The largest batch or sequence length that fits a memory budget, predicted, not found by running out of memory.

NOTE [ predicting the largest fit ]
Lightning's `scale_batch_size` and Accelerate's `find_executable_batch_size`
answer "what fits?" by running steps until one runs out of memory: minutes
on a GPU, and on a CPU an out-of-memory run can take the machine down. Here
the answer is predicted from the same numbers a budget plan uses
(NOTE [ the peak of a plan ] in `_budget`): what each unit keeps and
holds under each option, what lies outside the units, what stays resident.
They are measured at a few small sizes (`sizes`), and each is fitted, as a
function of the size, by a polynomial: of degree 1 along the batch (every
activation is a batch of rows), of degree 2 along the sequence (attention's
scores, softmax and dropout mask are sequence x sequence; the rest is linear
in it). The fitted `_budget.Model` at any size then gives each option's peak,
and the solver's plan, without running the model there; the largest size
whose peak fits is found by doubling, then bisection, over the fitted model.

A model whose memory does not follow the fitted curve would be extrapolated
wrongly: the residual of each option's peak at the measured sizes (the
fitted peak against the measured one) is reported, and where it exceeds
`RESIDUAL_LIMIT` that option has no answer, with the residual named. With
only degree + 1 sizes the fit is exact and has no residual: at least one
size more is needed, so the defaults measure three batch sizes and four
sequence lengths.

The prediction is that of a plan's peak, and it errs both ways against a
measured one: on the CPU, steps run at the answers measured 0.82-1.08x the
prediction, one policy on every unit (docs/benchmarks.md, "The largest
fit"). On TensorFlow the fit of a unit's largest tensor, a maximum, is not a
polynomial where the largest changes between the sizes measured (an FFN's at
sequence 64, the scores' from 128 on), and each unit's kept bytes are the
graph's tensors its gradient reads, where the run kept less (read in order:
`benchmarks/tf_memory_timeline.py`): the attention mask each block makes
from the same padding mask once for all, and Grappler's other rewrites
(keras-hub Gemma with LoRA's `attention_core`, 0.82x; 0.77x before the
frozen weights' gradients were left out, NOTE [ measuring a unit on
TensorFlow ]). PyTorch's units are measured whole,
forward and backward (NOTE [ measuring a unit on PyTorch ]): its steps
measured 1.02-1.08x their prediction. An answer that runs out of memory
costs more than one a little smaller, so a headroom is kept for the
prediction's error (NOTE [ the headroom ]), and on TensorFlow each peak
counts what its allocator rounds up (NOTE [ the allocator's blocks ]).

NOTE [ the headroom ]
The error is in what the size adds: the weights, the optimizer's slots and
the gradients are counted from the variables, while the activations and the
transients are extrapolated from small sizes. So `headroom` is a fraction
of the room the size can take, the budget above what the step holds at
size 0 (`fixed`, the fitted model there), not of the whole budget: a peak
is answered if it fits `usable(budget, fixed, headroom)`. Where the weights
and Adam's slots take most of the budget (bert4keras BERT-base in 2500 MiB:
1543 MiB at batch 0), a tenth of the whole budget kept 26% of the
activations' room free; where they take 80% of a GPU (a large model
fine-tuned), it would keep half of it. On JAX (each answer compiled) and
PyTorch the steps run at the answers measured 8% of that room under their
prediction to 5% over (docs/benchmarks.md, "The largest fit"): the default
keeps 10% (`HEADROOM`), on TensorFlow too, where each peak also counts the
allocator's rounding. Checked against a bisection of the same step
(2026-11-28), keras-hub's Gemma with LoRA and BERT small on TensorFlow and
PyTorch: without a headroom the answers were within a step (64 along the
sequence) or 7% of the bisected size either way (TensorFlow's Gemma plan
a step over `full`'s unlimited runs' size; a TensorFlow step's peak moved 6%
from one process to the next; JAX's answers are compiled, the headroom
their only gap), with it every step run at an answer peaked within its
budget. The tenth stays: along the batch it costs about a tenth of the
batch where the prediction is exact or cautious (PyTorch's keras-hub BERT
small `full` 97 against 110, TensorFlow's `attention_core` 23 against 26),
less than an out-of-memory step costs, and no GPU's allocator has been
checked against it yet.

NOTE [ the allocator's blocks ]
TensorFlow's BFC allocator (a GPU's; the CPU's under
`TF_CPU_ALLOCATOR_USE_BFC=1`) gives a request a free block of its memory and
splits the block only where it is at least twice the request: otherwise the
whole block is the tensor's until it is freed, counted as in use and against
the allocator's limit. On a CPU a 100 MiB tensor held 128 MiB, and a 60 MiB
one made after it was freed held 68. Which block a request meets depends on
what was made and freed before it, so one step's peak moves from process
to process by about its largest tensors: keras-hub Gemma with LoRA under
`full` at sequence 1408 peaked at 172 and 255 MiB in two processes (scores
of 30 MiB); bert4keras BERT-base under `save_dots` at batch 18 ran in two
children limited to 2500 MiB and ran out of memory in the third. An error
of the size of the largest tensor, not of a fraction of the room: the
quarter of the room kept on TensorFlow until 2026-11-28 answered bert4keras
5, 41 and 16 (none, `full`, `save_dots`) where 7, 43 and 17 ran three times
in three in the limited allocator (45 for `full` since). So on TensorFlow
each peak `largest_fit` answers against counts the step's largest tensor
once more (`_budget.Model.largest_tensor`: the largest a unit makes, again
when it recomputes, or a unit's weight's gradient), with the tenth of the
room kept as elsewhere: bert4keras then answers 6, 44 and 17 against 7, 45
and 17 bisected in the limited allocator with three runs a batch
(`benchmarks/max_batch.py --repeats 3`); none's and `save_dots`' ran there,
`full`'s in four runs of five (an answer one under the edge is at it), and
keras-hub Gemma's and BERT small's all ran (docs/benchmarks.md, "The
largest fit").

Where a compiler states a step's peak (JAX, compiled), the answers are its:
the measured models are calibrated to it at each size (NOTE [ calibrating
the units to the compiler ] in `_model`), and `checked_rows` then compiles
the step around each fitted answer (`refine`: a few compiles) until the
answer fits and the size one on does not. A step run there measured 1.00x
its prediction (docs/benchmarks.md, "The largest fit").

NOTE [ measuring nearer the answers ]
Along the sequence the fit is a quadratic through 64 to 256, and the
answers lie at four to seven times that: a small error in the curvature
there is a large one at the answer. keras-hub Gemma with LoRA in 256 MiB on
PyTorch under `attention_core` was predicted 214 MiB at 1152 and measured
184; its units measured at 1152 itself predicted 179. So where the
compiler does not check the answers (TensorFlow, PyTorch, eager JAX) and
the least answer lies beyond twice the largest size measured, the units are
measured once more at that answer (`nearer_size`: no recompute's, where
asked; the plan's, asked alone) and every answer is fitted again through
all the sizes. The step there is predicted to fit the budget, and measuring
a unit holds less than the step does (one unit's activations, not all of
them), so the measurement fits too. Measured again at 960, PyTorch's
`attention_core` answered 1280 where 1408 was bisected (1152 before; two
steps of 64 under it, the headroom's), and TensorFlow's `full` 1600 where
1664 was (1408). Asked alone, the plan was answered from 64-256 until
2026-12-05: TensorFlow's Gemma 1472; measured again there, 1600.
Along the batch the fit is a line, and the answers measured 0.91-1.03x
their prediction without it.
"""

from keras_recompute import _budget, _policy

AXES = {"batch": 0, "sequence": 1}
DEGREES = {"batch": 1, "sequence": 2}
DEFAULT_SIZES = {"batch": (2, 4, 8), "sequence": (64, 128, 192, 256)}
RESIDUAL_LIMIT = 0.05
HEADROOM = 0.10
PLAN = "plan"


class FitReport:
    """The largest size that fits a budget, per option, predicted (NOTE [ predicting the largest fit ]).

    Attributes:
        axis: `"batch"` or `"sequence"`.
        budget: the budget, in bytes.
        fixed: the predicted peak at size 0 (weights, optimizer slots,
            gradients, the update), in bytes.
        headroom: the fraction of the room above `fixed` kept free for the
            prediction's error (NOTE [ the headroom ]); sizes are answered
            against `usable`, `budget - headroom * (budget - fixed)`.
        sizes: the sizes measured.
        rows: one dict per option (`"none"`, each policy, `"plan"`):
            `"option"`, `"largest"` (the largest size whose predicted peak
            fits, or None), `"predicted_peak"` there and `"next_peak"` at the
            next size (bytes), `"residual"` (the fit's largest relative error
            at the measured sizes), `"policies"` (for `"plan"`: each unit's
            policy at the largest size), `"note"` (why there is no answer)
            and, on TensorFlow, `"largest_tensor"` (counted in the predicted
            peak once more: NOTE [ the allocator's blocks ]).
        rounding: whether each peak counts the step's largest tensor once
            more (TensorFlow's allocator).
        execution: the execution the prediction is for (`"eager"` or
            `"compiled"`), and `execution_reason` why.
    """

    def __init__(
        self, title, axis, budget, sizes, rows, execution, execution_reason, multiple_of=1, headroom=0.0, fixed=0.0,
        rounding=False,
    ):
        self.title = title
        self.rounding = rounding
        self.axis = axis
        self.budget = budget
        self.headroom = headroom
        self.fixed = fixed
        self.usable = usable(budget, fixed, headroom)
        self.sizes = list(sizes)
        self.rows = rows
        self.execution = execution
        self.execution_reason = execution_reason
        self.multiple_of = multiple_of

    def largest(self, option):
        """The largest size for `option` (`"none"`, a policy, or `"plan"`), or None."""
        return next(row["largest"] for row in self.rows if row["option"] == option)

    def __str__(self):
        unit = "batch" if self.axis == "batch" else "sequence length"
        header = ["option", f"largest {unit}", "predicted peak", f"at the next {unit}", "fit residual", "plan or note"]
        lines = [header]
        for row in self.rows:
            plan = row.get("policies")
            detail = "; ".join(text for text in (_plan_text(plan) if plan else "", row.get("note")) if text)
            lines.append([
                row["option"],
                "-" if row["largest"] is None else str(row["largest"]),
                "-" if row.get("predicted_peak") is None else _budget.format_bytes(row["predicted_peak"]),
                "-" if row.get("next_peak") is None else _budget.format_bytes(row["next_peak"]),
                f"{100 * row['residual']:.1f}%" if row.get("residual") is not None else "-",
                detail,
            ])
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = [
            self.title,
            f"budget {_budget.format_bytes(self.budget)} for a training step run "
            f"{'eagerly' if self.execution == 'eager' else 'compiled'} ({self.execution_reason})"
            + (f", {100 * self.headroom:.0f}% of the room above the {_budget.format_bytes(self.fixed)} it holds at "
               f"{unit} 0 kept for the prediction's error: peaks predicted within "
               f"{_budget.format_bytes(self.usable)}; " if self.headroom else "; ")
            + ("each peak counting the step's largest tensor once more (the allocator may hold a tensor in a block of "
               "up to twice its size); " if self.rounding else "")
            + f"measured at {unit} {', '.join(map(str, self.sizes))} and fitted by a polynomial of degree "
            f"{DEGREES[self.axis]} in it",
        ]
        for index, line in enumerate(lines):
            text.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
            if index == 0:
                text.append("  ".join("-" * width for width in widths))
        return "\n".join(text)

    def __repr__(self):
        found = ", ".join(f"{row['option']}: {row['largest']}" for row in self.rows)
        return f"<FitReport {self.axis} in {_budget.format_bytes(self.budget)}: {found}>"


def _plan_text(policies):
    runs, previous, count = [], None, 0
    for policy in list(policies) + [None]:
        if policy == previous:
            count += 1
            continue
        if previous is not None:
            name = "-" if previous == _budget.NONE else previous
            runs.append(name if count == 1 else f"{name} x{count}")
        previous, count = policy, 1
    return " ".join(runs)


def usable(budget, fixed, headroom):
    """What a predicted peak must fit: `budget` less `headroom` of the room above `fixed` (NOTE [ the headroom ])."""
    return budget - headroom * max(0.0, budget - fixed)


# Fitting a measured `_budget.Model` as a function of the size.


def polynomial(xs, ys, degree):
    """Least-squares coefficients `c[0] + c[1] x + ...` of `degree`, through the points (plain Python)."""
    n = degree + 1
    scale = max(abs(x) for x in xs) or 1.0  # columns of similar size: a well-conditioned system
    rows = [[(x / scale) ** k for k in range(n)] for x in xs]
    normal = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))] for i in range(n)]
    for column in range(n):  # Gaussian elimination with partial pivoting
        pivot = max(range(column, n), key=lambda row: abs(normal[row][column]))
        normal[column], normal[pivot] = normal[pivot], normal[column]
        if normal[column][column] == 0:
            raise ValueError("keras_recompute: the sizes measured must differ")
        for row in range(n):
            if row != column:
                factor = normal[row][column] / normal[column][column]
                normal[row] = [a - factor * b for a, b in zip(normal[row], normal[column])]
    return [normal[k][n] / normal[k][k] / scale**k for k in range(n)]


def _evaluate(coefficients, x):
    return sum(c * x**k for k, c in enumerate(coefficients))


class FittedModel:
    """`_budget.Model`s measured at several sizes, fitted field by field; `at(size)` is the model there."""

    def __init__(self, sizes, models, degree):
        self.sizes = list(sizes)
        self.models = list(models)
        self.degree = degree
        first = models[0]
        self.names = [unit.name for unit in first.units]
        self.options = [list(unit.options) for unit in first.units]
        for model in models[1:]:
            if [unit.name for unit in model.units] != self.names or [list(u.options) for u in model.units] != self.options:
                raise ValueError("keras_recompute: the model's units or their options differ between the sizes measured")
        fit = lambda values: polynomial(self.sizes, values, degree)  # noqa: E731
        self._fixed = {name: fit([getattr(m, name) for m in models]) for name in ("resident", "outside", "outside_gradient_bytes", "update", "loss", "forward_held", "scratch", "outputs_held")}
        self._applied_as_made = first.applied_as_made
        self._units = []
        for index in range(len(self.names)):
            unit_models = [m.units[index] for m in models]
            options = {}
            for option in self.options[index]:
                picked = [u.options[option] for u in unit_models]
                options[option] = tuple(fit([getattr(o, field) for o in picked]) for field in ("kept", "transient", "seconds", "forward"))
            self._units.append((
                fit([u.gradient_bytes for u in unit_models]), fit([u.input_bytes for u in unit_models]),
                fit([u.update_bytes for u in unit_models]), fit([u.largest for u in unit_models]), options,
                unit_models[0].reached,
            ))

    def at(self, size):
        """The `_budget.Model` the fit predicts at `size` (no field below 0)."""
        value = lambda coefficients: max(0.0, _evaluate(coefficients, size))  # noqa: E731
        units = []
        for name, (gradients, inputs, update, largest, options, reached) in zip(self.names, self._units):
            built = {
                option: _budget.Option(option, value(kept), value(transient), value(seconds), value(forward))
                for option, (kept, transient, seconds, forward) in options.items()
            }
            units.append(_budget.UnitCosts(name, built, value(gradients), value(inputs), value(update), value(largest), reached))
        fixed = {name: value(coefficients) for name, coefficients in self._fixed.items()}
        return _budget.Model(
            units, fixed["resident"], fixed["outside"], fixed["outside_gradient_bytes"], fixed["update"], self._applied_as_made,
            fixed["loss"], fixed["forward_held"], fixed["scratch"], fixed["outputs_held"],
        )

    def residual(self, peak):
        """The largest relative error of `peak(model)` between the fit and the measurement, at the sizes measured."""
        worst = 0.0
        for size, measured in zip(self.sizes, self.models):
            actual = peak(measured)
            if actual:
                worst = max(worst, abs(peak(self.at(size)) - actual) / actual)
        return worst


def largest(fits, start, limit, multiple_of=1):
    """The largest multiple of `multiple_of` in [multiple_of, limit] for which `fits(size)` holds, or 0.

    `fits` is taken to hold up to some size and not after it: doubling from
    `start`, then bisection.
    """
    step = multiple_of
    size = max(step, (start // step) * step)
    if not fits(step):
        return 0
    low = step
    while size <= limit and fits(size):
        low, size = size, size * 2
    high = min(size, limit + step)
    while high - low > step:
        middle = ((low + high) // 2 // step) * step
        if middle <= low:
            break
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def refine(peak, usable, found, step=1, limit=1 << 20, known=0, slope=None):
    """The largest multiple of `step` up to `limit` whose `peak(size)` fits `usable`, searched from the prediction `found`; or 0.

    Each call of `peak` compiles a step, so the search takes secant steps on
    the peaks it has (the peak is smooth in the size), kept inside the
    bracket of sizes known to fit and not to; it bisects where a secant
    cannot be drawn or would not narrow the bracket. A prediction off by a
    step costs two calls. `known`: a size known to fit (0: none), not called.
    """
    low, high = known, None  # the largest size known to fit; the smallest known not to
    points = []  # (size, peak) called, newest last
    size = max(step, (max(found, known) // step) * step)
    for _ in range(64):
        if size <= low:
            size = low + step
        if high is not None and size >= high:
            size = high - step
        if size <= low or size > limit:
            break
        value = peak(size)
        points.append((size, value))
        if value <= usable:
            low = size
        else:
            high = size
        if high is not None and high - low <= step:
            break
        if len(points) == 1 and known and high is not None:
            size = known + step  # does anything beyond the known size fit at all?
        elif len(points) == 1 and slope:
            size = _secant(size, value, slope, usable, step)
        elif len(points) == 1:  # no slope: the neighbour across the boundary, if the prediction is right
            size = size + step if value <= usable else size - step
        else:
            size = _next_size(points, usable, low, high, step, limit)
    return low


def _secant(size, value, slope, usable, step):
    """The size where a line through `(size, value)` of `slope` meets `usable`, in steps, on the far side of it."""
    guess = size + (usable - value) / slope
    rounded = int(guess // step) * step
    return rounded + step if value <= usable and rounded <= size else rounded


def _next_size(points, usable, low, high, step, limit):
    """The next size to call: a secant step through the two newest finite peaks, else doubling or bisection."""
    finite = [(s, v) for s, v in points if v != float("inf")]
    guess = None
    if len(finite) >= 2 and finite[-1][0] != finite[-2][0]:
        (s0, v0), (s1, v1) = finite[-2], finite[-1]
        slope = (v1 - v0) / (s1 - s0)
        if slope > 0:
            guess = _secant(s1, v1, slope, usable, step)
    if guess is None or guess <= low or (high is not None and guess >= high) or guess > limit:
        if high is None:
            return min(max(low * 2, low + step), limit)
        guess = ((low + high) // 2 // step) * step
    if high is not None and low and guess - low > 2 * (high - guess) and len(points) % 3 == 0:
        guess = ((low + high) // 2 // step) * step  # every third call, a bisection keeps the bracket shrinking
    return max(guess, low + step)


def checked_rows(rows, count, plan_at, peak_at, usable, limit=1 << 20, multiple_of=1):
    """Each answer of `rows` made exact against `peak_at(choice, size)`, a step's peak as its compiler states it.

    NOTE [ calibrating the units to the compiler ] in `_model`: the fit
    answers near the compiler's figure; here the sizes around each answer are
    compiled (not run) until the largest one whose compiled peak fits is found.
    `peak_at` returns None where no compiler states the peak: the rows are
    then left as fitted. `count` units; for the plan, the choice at a size is
    `plan_at(size, ruled_out)` (the planner's, or None), `ruled_out` the
    options whose rows were checked here and do not fit at that size: one
    policy on every unit is a plan, and the planner falls back on the others
    (those not asked for too: a plan answered alone once stopped at 1536
    where `full` on every unit fits 1728, NOTE [ calibrating the units to
    the compiler ] in `_model`).
    """
    answers = {}  # each option's checked answer: past it, the option is ruled out of the plan's fallback
    for row in rows:
        if not row["largest"]:
            continue
        known = 0
        if row["option"] == PLAN:
            known = max(answers.values(), default=0)  # one policy on every unit is a plan

            def choice_at(size):
                return plan_at(size, [option for option, answer in answers.items() if not answer or answer < size])
        else:
            def choice_at(size, option=row["option"]):
                return [option] * count
        peaks = {}

        def peak(size, choice_at=choice_at, peaks=peaks):
            if size not in peaks:
                choice = choice_at(size)
                peaks[size] = float("inf") if choice is None else peak_at(choice, size)
            return peaks[size]

        if peak(row["largest"]) is None:
            return rows
        slope = None
        if row.get("next_peak") and row.get("predicted_peak") is not None:
            slope = (row["next_peak"] - row["predicted_peak"]) / multiple_of or None
        found = refine(peak, usable, row["largest"], multiple_of, limit, known, slope)
        if row["option"] != PLAN:
            answers[row["option"]] = found
        row["fitted_largest"] = row["largest"]
        row["checked"] = "compiled"
        if not found:
            row.update(largest=None, predicted_peak=None, next_peak=None, policies=None,
                       note=f"the compiled step at {multiple_of} does not fit: {_budget.format_bytes(peak(multiple_of))}")
            continue
        row["largest"], row["predicted_peak"] = found, peak(found)
        if found + multiple_of <= limit:
            following = peak(found + multiple_of)
            row["next_peak"] = following if following != float("inf") else None
            row["note"] = None if following != float("inf") else f"no plan fits at {found + multiple_of}"
        if row["option"] == PLAN:
            row["policies"] = choice_at(found)
    return rows


def fit_rows(fitted, budget, options, plan=True, limit=1 << 20, multiple_of=1, rounding=False):
    """One row per option (and the plan): the largest size whose predicted peak fits `budget`.

    `rounding`: each peak counts the step's largest tensor once more, as an allocator that holds a tensor in a
    block of up to twice its size does (TensorFlow's: NOTE [ the allocator's blocks ]).
    """
    rows = []
    start = max(fitted.sizes)
    uniform = [option for option in options if all(option in unit_options for unit_options in fitted.options)]
    spare = (lambda model: model.largest_tensor()) if rounding else (lambda model: 0)  # noqa: E731
    for option in options:
        if option not in uniform:
            missing = [name for name, unit_options in zip(fitted.names, fitted.options) if option not in unit_options]
            rows.append({"option": option, "largest": None, "predicted_peak": None, "next_peak": None, "residual": None,
                         "note": f"does not apply to {len(missing)} of the {len(fitted.names)} units ({missing[0]}, ...)"})
            continue
        choice = [option] * len(fitted.names)

        def peak_at(size, choice=choice):
            model = fitted.at(size)
            return model.peak(choice) + spare(model)

        residual = fitted.residual(lambda model, choice=choice: model.peak(choice))
        rows.append(_row(option, peak_at, residual, budget, start, limit, multiple_of))
    if plan:
        def planned_peak(size):
            model = fitted.at(size)
            policies = _budget.solve(model, budget - spare(model))
            return model.peak(policies) + spare(model) if policies is not None else float("inf")

        # A plan changes with the size; its fit is as good as that of the options it is made of.
        residual = max((fitted.residual(lambda model, o=o: model.peak([o] * len(fitted.names))) for o in uniform), default=0.0)
        row = _row(PLAN, planned_peak, residual, budget, start, limit, multiple_of)
        if row["largest"]:
            model = fitted.at(row["largest"])
            row["policies"] = _budget.solve(model, budget - spare(model))
        rows.append(row)
    if rounding:  # what each answer's predicted peak counts once more
        for row in rows:
            if row["largest"]:
                row["largest_tensor"] = spare(fitted.at(row["largest"]))
    return rows


def _row(option, peak_at, residual, budget, start, limit, multiple_of):
    row = {"option": option, "largest": None, "predicted_peak": None, "next_peak": None, "residual": residual}
    if residual > RESIDUAL_LIMIT:
        row["note"] = (
            f"memory does not follow the fitted curve: {100 * residual:.1f}% off at a measured size "
            f"(more than {100 * RESIDUAL_LIMIT:.0f}%); measure sizes nearer the answer"
        )
        return row
    found = largest(lambda size: peak_at(size) <= budget, start, limit, multiple_of)
    if not found:
        row["note"] = f"even {multiple_of} does not fit: {_budget.format_bytes(peak_at(multiple_of))} predicted"
        return row
    row["largest"] = found
    row["predicted_peak"] = peak_at(found)
    if found + multiple_of <= limit:
        following = peak_at(found + multiple_of)
        row["next_peak"] = following if following != float("inf") else None
        if following == float("inf"):
            row["note"] = f"no plan fits at {found + multiple_of}"
    else:
        row["note"] = f"fits up to the search's limit, {limit}"
    return row


def nearer_size(rows, sizes, axis, multiple_of):
    """Where to measure once more before answering along the sequence, or None (NOTE [ measuring nearer the answers ]).

    The least answer (no recompute's, where asked; the plan's, asked
    alone), rounded down to `multiple_of`, where it lies beyond twice the
    largest size measured.
    """
    answers = [row["largest"] for row in rows if row["largest"] and row["option"] != PLAN]
    answers = answers or [row["largest"] for row in rows if row["largest"]]
    if DEGREES[axis] < 2 or not answers:
        return None
    nearer = min(answers) // multiple_of * multiple_of
    return nearer if nearer > 2 * max(sizes) else None


def default_options():
    return [_budget.NONE, _policy.FULL, _policy.SAVE_DOTS, _policy.ATTENTION_CORE]


def checked_inputs(make_inputs, sizes, axis, flatten):
    """`[make_inputs(size) for size in sizes]`, each checked to have `size` along `axis` in some input."""
    if not callable(make_inputs):
        raise TypeError(
            "keras_recompute: largest_fit(model, budget, make_inputs) takes make_inputs, a function of a size that "
            f"returns a batch of that size as the model takes it (lambda n: x[:n]); received {make_inputs!r} of "
            f"type {type(make_inputs).__name__}."
        )
    index = AXES[axis]
    batches, shapes = [], []
    for size in sizes:
        inputs = make_inputs(size)
        leaves = [leaf for leaf in flatten(inputs) if hasattr(leaf, "shape")]
        leaf_shapes = [tuple(int(d) if d is not None else -1 for d in leaf.shape) for leaf in leaves]
        if not leaf_shapes:
            raise ValueError(f"keras_recompute: largest_fit's make_inputs({size}) returned no arrays: {inputs!r}.")
        if not any(len(shape) > index and shape[index] == size for shape in leaf_shapes):
            where = "the first (batch) axis" if axis == "batch" else "the second (sequence) axis"
            hint = (
                "" if axis == "batch" else
                " A model whose inputs have no sequence axis (features of a fixed size) can only be fitted "
                "along the batch: axis='batch'."
            )
            raise ValueError(
                f"keras_recompute: largest_fit(axis={axis!r}) needs make_inputs(size) to return inputs with "
                f"`size` along {where}; make_inputs({size}) returned shapes {leaf_shapes}. Make it build a batch "
                f"of that size from its argument.{hint}"
            )
        batches.append(inputs)
        shapes.append(leaf_shapes)
    if len(set(map(tuple, shapes))) < len(shapes):
        raise ValueError(
            f"keras_recompute: largest_fit's make_inputs returned the same shapes for different sizes "
            f"({dict(zip(sizes, shapes))}): it must use its size argument."
        )
    return batches


def check_arguments(axis, sizes, budget, multiple_of, headroom=0.0):
    if axis not in AXES:
        raise ValueError(f"keras_recompute: largest_fit(axis=...) takes one of {list(AXES)}; received {axis!r}.")
    kind, value = _budget.parse_budget(budget, "largest_fit", fractions=False)
    if kind != "bytes":
        raise ValueError(
            f"keras_recompute: largest_fit(budget=...) takes a size (bytes, or '8GiB'); received {budget!r}, a "
            "fraction of the plain model's activations, which changes with the size being sought."
        )
    sizes = list(DEFAULT_SIZES[axis] if sizes is None else sizes)
    needed = DEGREES[axis] + 2
    if len(set(sizes)) < needed or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(
            f"keras_recompute: largest_fit(axis={axis!r}) needs at least {needed} different positive integer "
            f"sizes to fit a polynomial of degree {DEGREES[axis]} and see how far the model is from it; "
            f"received sizes={sizes!r}."
        )
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ValueError(
            f"keras_recompute: largest_fit(headroom=...) takes the fraction of the budget to keep free, in [0, 1); "
            f"received {headroom!r}."
        )
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"keras_recompute: largest_fit(multiple_of=...) takes a positive int; received {multiple_of!r}.")
    return value, sorted(set(sizes))
