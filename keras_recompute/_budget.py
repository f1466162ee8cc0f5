"""Planning to a memory budget: the budget's forms, the peak of a plan, and the solver.

Plain numbers only: no framework is imported here. What each unit's options
keep and cost is measured by the backends (`measure_unit` in each backend's
file); `_memory` gathers those numbers into `UnitCosts` and applies the plan.

NOTE [ the peak of a plan ]
A training step keeps, through its forward, what each unit's option keeps
(`kept`: nothing but its inputs for `"full"`, everything its backward reads
for `"none"`), plus what lies outside the units (embeddings, a head), plus
what stays resident (weights, optimizer slots, the batch). The backward then
runs the units last to first. While it runs unit i:
  * the units before it still hold what they kept (the prefix sum of `kept`);
  * the gradients of the weights of unit i and every unit after it exist
    (Keras applies them all at once, after the backward), except in a
    TensorFlow graph (`applied_as_made`): there each variable's update runs
    as soon as its gradient exists and frees it, so only unit i's and the
    next unit's gradients are alive, and at the end the first unit's and
    those outside the units (8 blocks of 8 MiB of weights at batch 4: the
    step peaked 16 MiB above its resident bytes, not the 64 MiB of all the
    gradients; bert4keras BERT-base, whose 440 MB of gradients dwarf its
    activations at a small batch, was predicted 26% over before);
  * unit i holds its transient: the gradients flowing in and out of it
    (twice its output) and those of its largest intermediate as its backward
    makes them (attention's softmax has the gradients of its probabilities
    and of its scores alive at once: twice the largest tensor it keeps).
    Recomputed, it also holds what its recompute makes again (`none`'s kept
    minus its option's kept; on TensorFlow what the traced backward reads,
    needed or not: NOTE [ measuring a unit on TensorFlow ] in
    `backends/tensorflow.py`), which its backward frees as it goes: by the
    softmax's gradient, what came after it is gone (one largest tensor, not
    two, on top). Calibrated on TensorFlow's BFC peak of a 12-block encoder
    (benchmarks/budget.py), and checked there on JAX and PyTorch. Then, where
    the largest tensor is most of a unit (attention scores at sequence
    256-930, width 64: `largest_fit` along the sequence), one largest tensor
    under-predicted `full` by 2-23% on TensorFlow (its executor orders a
    graph's ops differently from run to run: the same step peaked 23.0 and
    30.2 MB at sequences 512 and 525) and by 17-36% on PyTorch (2.3-2.6
    score-sized tensors short: Keras's seeded dropout on PyTorch makes a
    full, a draw, a quotient, zeros and the result, each of the scores'
    size, while the recompute holds the rest), and held within 2% under
    XLA (JAX). So the count depends on the backend and the unit's dropout
    (`_memory._recompute_largest`): 2 on TensorFlow where the unit drops
    out (over-predicting by 4-25% where it varies: an answer that fits),
    else 1. (Those PyTorch figures were read by summing the profiler's
    records per op, which reads a step up to one large tensor low.)
On PyTorch, which runs eagerly, the transient is measured instead: each
option's step of the unit is run once under the profiler (NOTE [ measuring a
unit on PyTorch ]), and what its backward held above what the unit keeps and
its weights' gradients is the transient. Two more points are
measured there, where an eager step's Python holds what a graph frees: a
unit's forward (`forward`: its locals, keras-hub Gemma's masked softmax holds
its scores, the masked scores, the probabilities and the masked ones, four
tensors of the scores' size, on top of the units before it) and the loss's
backward on the model's outputs, before any unit's (`loss`: a language
model's logits, their log-softmax and its gradient on top of all the units
kept). keras-hub Gemma with LoRA, 4 blocks, sequence 1024 without recompute:
predicted 217 MiB with the count of largest tensors, measured 259 MiB. And
Keras's PyTorch trainer frees the last step's gradients after the forward
(`zero_grad`), so every forward point holds them (`forward_held`), and keeps
the model's outputs until it computes the metrics after the update, so every
point of the backward and the end hold them (`outputs_held`): a language
model's logits, 27 MiB beside keras-hub Gemma's blocks at sequence 1728,
where `full`'s step was predicted 235 MiB and measured 256 without them.
Every option keeps the unit's inputs: its first layers save them, or its
recompute starts from them.
The optimizer's update adds its own temporaries (`update`). Adam's update of
one variable makes about two of its size (`m * beta_1`, `sqrt(v)`; tf_keras's
legacy Adam on an embedding's sparse gradient, Keras 3's Adam on any); Keras's
PyTorch optimizers update every weight at once (`torch._foreach_*`), each
operation making new tensors as large as all the weights: Adam holds three
times all the trainable bytes at its height (`_memory.TORCH_UPDATE`, measured
per optimizer). Where Keras applies the gradients after the backward, the
update exists only at the end. In a graph TensorFlow runs each variable's
update while the backward runs, as soon as its gradient exists: at unit i's
point, the update of unit i's or the next unit's weights (`update_bytes`,
twice the unit's largest weight), and the whole update (twice the largest
weight, an embedding's) at the end, where the gradients of the weights outside
the units are made. Counted at every point before (twice the largest weight),
it over-predicted keras-hub BERT small's step by 60 MB, 8-18% at the batches
`largest_fit` answers on TensorFlow (2-4% either way since), and missed
PyTorch's step at a small batch by 30% (the end, where all the weights'
update peaks). On bert4keras BERT-base at batch 8 (an embedding of 89 MiB,
legacy Adam) the step's peak was 45 MiB (`save_dots` on every block) and 96
MiB (on all but the last) above the prediction without any update, and 13 MiB
under it with SGD.
So the peak is `resident + outside + max over i of (kept[0..i] +
gradients[i..] + update[i] + transient[i])`, of `forward_held + kept[0..i-1] +
inputs[i] + forward[i]` (unit i's forward) and of `kept[all] + loss` (the loss's
backward), and at the very end, `resident + update + all gradients + outside`.
That maximum over a prefix is what makes this more than a knapsack: the
solver walks the units in order with the prefix sum as its state.

NOTE [ the solver ]
For each unit, one option (`"none"` and the policies that apply to it), each
with the bytes it keeps, its transient and the seconds its recompute costs.
Minimize the total seconds subject to every unit's point of the backward
staying within the budget. A dynamic program over units in order, whose state
is the prefix sum of kept bytes, in quanta (`quanta` of them up to the
budget): of the prefixes that fall in one quantum, the fastest is kept (the
one that keeps less on a tie). Sums and constraints use exact bytes, so a plan
it returns never predicts more than the budget; it may miss the fastest plan
only where two prefixes within one quantum trade time for memory. Of plans
alike in time (units alike), it takes the one that recomputes the earlier
units, as Megatron's "block" method does: their recompute comes last in the
backward, when the later units have freed what they kept, and the measured
peak is lower than with the same units recomputed late (475 against 493 MiB
for 6 of 12 blocks in benchmarks/budget.py). O(units x options x quanta):
milliseconds for a 48-block model.
"""

import math
import re

NONE = "none"

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_budget(budget, where="recompute_model", fractions=True):
    """Reads a budget: `("bytes", n)` for a size, `("fraction", f)` for a float in (0, 1].

    Args:
        budget: an int (bytes), a string with a unit (`"512MB"`, `"12GiB"`;
            MB and GB are powers of 10, MiB and GiB powers of 2), or a float
            in (0, 1], a fraction of the plain model's activation memory.
        where: the function the budget was passed to, as errors name it.
        fractions: whether `where` takes a fraction; its errors offer one only then (`largest_fit` takes sizes).

    Raises:
        ValueError: if `budget` is none of these, or not positive.
    """
    hint = "Pass a number of bytes (an int) or a size with a unit ('512MB', '12GiB')" + (
        ", or a float in (0, 1], the fraction of the plain model's activation memory to keep." if fractions else "."
    )
    if isinstance(budget, bool):
        raise ValueError(f"keras_recompute: {where}(budget=...) got {budget!r}. {hint}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"keras_recompute: {where}(budget=...) got {budget!r} bytes. {hint}")
        return "bytes", budget
    if isinstance(budget, float):
        if not fractions and not (0.0 < budget <= 1.0):  # in (0, 1]: `where` says why it takes no fraction
            raise ValueError(f"keras_recompute: {where}(budget=...) got the float {budget!r}. {hint}")
        if not (0.0 < budget <= 1.0) or math.isnan(budget):
            raise ValueError(
                f"keras_recompute: {where}(budget=...) got the float {budget!r}; a float is a fraction "
                f"and must lie in (0, 1]. {hint}"
            )
        return "fraction", budget
    if isinstance(budget, str):
        match = _SIZE.match(budget)
        unit = match.group(2).lower() if match else None
        if match and (unit or "b") in _UNITS:
            size = float(match.group(1)) * _UNITS[unit or "b"]
            if size >= 1:
                return "bytes", int(size)
        raise ValueError(
            f"keras_recompute: {where}(budget=...) could not read {budget!r} as a size. {hint} "
            f"Units: {', '.join(_UNITS)} (any case)."
        )
    raise ValueError(
        f"keras_recompute: {where}(budget=...) got {budget!r} of type {type(budget).__name__}. {hint}"
    )


def format_bytes(size):
    """`size` bytes in the unit that reads best (kB, MB or GB, powers of 10, as the budget's "MB").

    Below 0.1 MB in kB, below 1 kB in bytes: a small model's units read "12.3 kB", not "0.0 MB".
    """
    if abs(size) >= 10**9:
        return f"{size / 10**9:.2f} GB"
    if abs(size) >= 10**5:
        return f"{size / 10**6:.1f} MB"
    if abs(size) >= 10**3:
        return f"{size / 10**3:.1f} kB"
    return f"{int(size)} bytes"


class Option:
    """One way to run a unit: what it keeps through the forward, its transient, its time."""

    def __init__(self, policy, kept, transient, seconds, forward=0):
        self.policy = policy
        self.kept = int(kept)
        self.transient = int(transient)
        self.seconds = float(seconds)
        self.forward = int(forward)

    def __repr__(self):
        return (
            f"Option({self.policy!r}, kept={self.kept}, transient={self.transient}, seconds={self.seconds:.4g}, "
            f"forward={self.forward})"
        )


class UnitCosts:
    """A unit's options (by policy name, `"none"` included), the bytes of its weights' gradients and of its inputs.

    `update_bytes`: what the optimizer's update of the unit's weights
    allocates at once (twice its largest weight; 0 without an optimizer).
    `largest`: the largest tensor the unit makes (its forward's, made again
    by a recompute), in bytes. `reached`: whether a gradient reaches the unit
    in the step (else every option keeps nothing and costs nothing: NOTE [ a
    unit no gradient reaches ] in `_memory`).
    """

    def __init__(self, name, options, gradient_bytes, input_bytes=0, update_bytes=0, largest=0, reached=True):
        self.name = name
        self.options = dict(options)
        self.gradient_bytes = int(gradient_bytes)
        self.input_bytes = int(input_bytes)
        self.update_bytes = int(update_bytes)
        self.largest = int(largest)
        self.reached = bool(reached)

    def like(self, options):
        """This unit with other options."""
        return UnitCosts(
            self.name, options, self.gradient_bytes, self.input_bytes, self.update_bytes, self.largest, self.reached
        )


def offloaded(model, policies):
    """`model` with the inputs of each unit run under one of `policies` kept in host memory.

    NOTE [ offload ] in `_policy`: those inputs leave what the forward keeps
    on the device, and are back on it while the unit's backward runs (its
    transient). Counted for the options whose kept bytes are their inputs
    and no more (`"full"`); the others are counted as they are, which can
    only over-predict their peak.
    """
    units = []
    for unit in model.units:
        options = {}
        for name, option in unit.options.items():
            if name in policies:
                moved = min(unit.input_bytes, option.kept)
                option = Option(name, option.kept - moved, option.transient + moved, option.seconds, option.forward)
            options[name] = option
        units.append(unit.like(options))
    return model.like(units)


class Model:
    """Everything a plan's peak depends on besides the units' choices (NOTE [ the peak of a plan ]).

    `update` is what the optimizer's update allocates while the step runs (0
    for a model with no optimizer yet: its slots are not in `resident` either).
    `applied_as_made`: the step applies each gradient as soon as it is made
    and frees it (a TensorFlow graph), rather than all after the backward.
    `loss`: what the loss's backward holds on the model's outputs (measured
    on PyTorch). `forward_held`: what the forward holds besides the units'
    (Keras's PyTorch trainer frees the last step's gradients after the
    forward: all the gradients there). `scratch`: what the compiled step holds
    whatever its size (NOTE [ the compiler's scratch ] in `backends/jax.py`:
    a GPU's matrix-product workspace; 0 on a CPU and where nothing is
    compiled). `outputs_held`: the model's outputs, held through the backward
    and the update besides the units' (Keras's PyTorch trainer keeps them for
    its metrics, computed after the update).
    """

    def __init__(
        self, units, resident, outside, outside_gradient_bytes, update=0, applied_as_made=False, loss=0, forward_held=0,
        scratch=0, outputs_held=0,
    ):
        self.units = list(units)
        self.resident = int(resident)
        self.outside = int(outside)
        self.outside_gradient_bytes = int(outside_gradient_bytes)
        self.update = int(update)
        self.applied_as_made = bool(applied_as_made)
        self.loss = int(loss)
        self.forward_held = int(forward_held)
        self.scratch = int(scratch)
        self.outputs_held = int(outputs_held)

    def like(self, units, scratch=None, update=None):
        """A model of other units (and `scratch` and `update`, where given), everything else as this one."""
        return Model(
            units, self.resident, self.outside, self.outside_gradient_bytes, self.update if update is None else update,
            self.applied_as_made, self.loss, self.forward_held, self.scratch if scratch is None else scratch,
            self.outputs_held,
        )

    def peak(self, choice):
        """The predicted peak, in bytes, with `choice[i]` the policy of unit i (`"none"`: kept)."""
        return self.peak_point(choice)[0]

    def peak_point(self, choice):
        """`(bytes, point)`: the predicted peak and where in the step it is (`point_text` says it in words).

        `point`: `(i, "forward")` or `(i, "backward")` for unit i's, `"loss"`
        for the loss's backward, None for the end, after the backward. The
        first point of the largest value, in the order below.
        """
        fixed = self._fixed()
        peak, point = fixed + self._held(len(self.units)), None
        kept = 0
        for index, (unit, policy) in enumerate(zip(self.units, choice)):
            option = unit.options[policy]
            forward = fixed + self.forward_held + kept + unit.input_bytes + option.forward
            if forward > peak:
                peak, point = forward, (index, "forward")
            kept += option.kept
            backward = fixed + self._held(index) + kept + option.transient
            if backward > peak:
                peak, point = backward, (index, "backward")
        if fixed + kept + self.loss > peak:  # the loss's backward, before any unit's
            peak, point = fixed + kept + self.loss, "loss"
        return peak, point

    def point_text(self, point):
        """A `peak_point` point in words."""
        if point is None:
            if self.applied_as_made:
                return "at the end of the backward, at the last gradients' update"
            return "after the backward, " + ("at the optimizer's update" if self.update else "with every gradient")
        if point == "loss":
            return "in the loss's backward"
        index, phase = point
        return f"in {self.units[index].name}'s {phase}"

    def largest_tensor(self):
        """The largest tensor the units' backward makes, whatever the plan: a unit's, or a unit's weight's gradient."""
        return max([unit.largest for unit in self.units] + [unit.update_bytes // 2 for unit in self.units], default=0)

    def seconds(self, choice):
        return sum(unit.options[policy].seconds for unit, policy in zip(self.units, choice))

    def activation_bytes(self, choice):
        """What the forward keeps, outside and in the units: the part a fraction budget scales."""
        return self.outside + sum(unit.options[policy].kept for unit, policy in zip(self.units, choice))

    def _held(self, index):
        """The gradients, the optimizer's update and the outputs held, alive while unit `index`'s backward runs.

        `index == len(units)`: at the end, after the backward.
        """
        return self._gradients(index) + self._updating(index) + self.outputs_held

    def _updating(self, index):
        """What the optimizer's update allocates while unit `index`'s backward runs (`len(units)`: at the end).

        After the backward, all of it. Applied as made: the update of the
        gradients then alive (unit `index`'s and the next unit's).
        """
        if index == len(self.units):
            return self.update
        if not self.applied_as_made:
            return 0
        return max((u.update_bytes for u in self.units[index:index + 2]), default=0)

    def _gradients(self, index):
        """The weights' gradients alive while unit `index`'s backward runs (`len(units)`: at the end).

        All of them from unit `index` on, where the optimizer runs after the backward. Applied as
        made: unit `index`'s, and the next unit's, which its update may not have freed yet; at the
        end, the first unit's and those outside the units (made last).
        """
        if not self.applied_as_made:
            if index == len(self.units):
                return self.outside_gradient_bytes + sum(u.gradient_bytes for u in self.units)
            return sum(u.gradient_bytes for u in self.units[index:])
        if index == len(self.units):
            return self.outside_gradient_bytes + (self.units[0].gradient_bytes if self.units else 0)
        return sum(u.gradient_bytes for u in self.units[index:index + 2])

    def _fixed(self):
        """What every point of the step holds whatever the plan: resident, outside, the compiler's scratch."""
        return self.resident + self.outside + self.scratch

    def floor(self):
        """The least peak any plan reaches, to 0.1% (the solver, bisected over budgets)."""
        plain = self.peak([NONE] * len(self.units))
        low, high = self._fixed(), plain
        while high - low > max(1, high // 1000):
            middle = (low + high) // 2
            low, high = (low, middle) if solve(self, middle) is not None else (middle, high)
        choice = solve(self, high)
        return self.peak(choice) if choice is not None else plain


def solve(model, budget, quanta=2000):
    """The choice of options, one per unit, that fits `budget` bytes with the least recompute time.

    Args:
        model: a `Model`.
        budget: the peak allowed, in bytes.
        quanta: how finely kept memory is counted (NOTE [ the solver ]).

    Returns:
        A list of policy names, one per unit; `None` if no choice fits.
    """
    if not model.units:
        return [] if model.peak([]) <= budget else None
    room = budget - model._fixed()
    if room < 0:
        return None
    quantum = max(1, math.ceil(room / quanta))
    # best[k] = (seconds, kept, choices): the fastest prefix whose kept bytes fall in quantum k.
    best = {0: (0.0, 0, ())}
    for index, unit in enumerate(model.units):
        held = model._held(index)
        following = {}
        for seconds, kept, choices in best.values():
            for policy, option in unit.options.items():
                total = kept + option.kept
                forward = model.forward_held + kept + unit.input_bytes + option.forward
                if total + option.transient + held > room or forward > room:
                    continue
                key = total // quantum
                # Of plans alike in time, the one that recomputes earlier units (NOTE [ the solver ]).
                later = 0.0 if policy == NONE else 1e-9 * index
                candidate = (seconds + option.seconds + later, total, choices + (policy,))
                if key not in following or candidate[:2] < following[key][:2]:
                    following[key] = candidate
        best = following
        if not best:
            return None
    for _, _, choices in sorted(best.values(), key=lambda entry: entry[:2]):
        if model.peak(list(choices)) <= budget:
            return list(choices)
    return None
