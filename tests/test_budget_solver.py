"""The budget's forms and the solver, on plain numbers (no framework).

The solver is checked against brute force over every choice on random
models: it must find a plan exactly when one fits, never predict more than
the budget, and cost at most one quantum's worth more than the best plan.
"""

import itertools
import random

import pytest

from keras_recompute import _budget
from keras_recompute._budget import Model, Option, UnitCosts, parse_budget, solve


@pytest.mark.parametrize(
    "budget, expected",
    [
        (1000, ("bytes", 1000)),
        ("512MB", ("bytes", 512 * 10**6)),
        ("512 mb", ("bytes", 512 * 10**6)),
        ("12GiB", ("bytes", 12 * 2**30)),
        ("1.5GB", ("bytes", 1_500_000_000)),
        ("300KiB", ("bytes", 300 * 1024)),
        ("4096", ("bytes", 4096)),
        (0.5, ("fraction", 0.5)),
        (1.0, ("fraction", 1.0)),
    ],
)
def test_budget_forms(budget, expected):
    assert parse_budget(budget) == expected


@pytest.mark.parametrize(
    "budget, match",
    [
        (0, "0 bytes"),
        (-5, "-5 bytes"),
        (0.0, "must lie in"),
        (1.5, "must lie in"),
        (float("nan"), "must lie in"),
        ("12 apples", "could not read '12 apples'"),
        ("GB", "could not read 'GB'"),
        ("", "could not read ''"),
        (True, "got True"),
        ([1], r"got \[1\] of type list"),
    ],
)
def test_bad_budgets_say_what_and_how(budget, match):
    with pytest.raises(ValueError, match=match) as raised:
        parse_budget(budget)
    assert "keras_recompute: " in str(raised.value) and "'12GiB'" in str(raised.value)


def _random_model(rng, units):
    made = []
    for index in range(units):
        none_kept = rng.randint(50, 200)
        options = {"none": Option("none", none_kept, rng.randint(5, 20), 0.0)}
        for policy in ("full", "save_dots", "attention_core")[: rng.randint(1, 3)]:
            kept = rng.randint(0, none_kept)
            options[policy] = Option(policy, kept, options["none"].transient + none_kept - kept, rng.uniform(0.1, 1.0))
        made.append(UnitCosts(f"unit_{index}", options, rng.randint(1, 30)))
    return Model(made, resident=rng.randint(0, 100), outside=rng.randint(0, 50), outside_gradient_bytes=rng.randint(0, 20))


def _brute_force(model, budget):
    best = None
    for choice in itertools.product(*[list(u.options) for u in model.units]):
        if model.peak(list(choice)) <= budget:
            seconds = model.seconds(list(choice))
            if best is None or seconds < best:
                best = seconds
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_solver_finds_the_fastest_plan_that_fits(seed):
    rng = random.Random(seed)
    model = _random_model(rng, rng.randint(1, 5))
    plain = model.peak(["none"] * len(model.units))
    budget = rng.randint(int(model.floor() * 0.9), plain + 10)
    best = _brute_force(model, budget)
    choice = solve(model, budget, quanta=100000)
    if best is None:
        assert choice is None
        return
    assert choice is not None, "a plan fits, the solver found none"
    assert model.peak(choice) <= budget
    assert model.seconds(choice) == pytest.approx(best)


def test_coarse_quanta_stay_within_the_budget():
    rng = random.Random(7)
    for _ in range(20):
        model = _random_model(rng, 6)
        budget = (model.floor() + model.peak(["none"] * 6)) // 2
        choice = solve(model, budget, quanta=50)
        assert choice is not None and model.peak(choice) <= budget


def test_the_peak_counts_the_prefix_the_gradients_and_the_transient():
    units = [
        UnitCosts("a", {"none": Option("none", 100, 10, 0), "full": Option("full", 0, 110, 1)}, 5),
        UnitCosts("b", {"none": Option("none", 100, 10, 0), "full": Option("full", 0, 110, 1)}, 5),
    ]
    model = Model(units, resident=1000, outside=50, outside_gradient_bytes=7)
    # Unit b's backward: both units' kept, b's gradients, b's transient.
    assert model.peak(["none", "none"]) == 1000 + 50 + 100 + 100 + 5 + 10
    # With b recomputed, its recompute (110) on top of a's kept (100) and b's gradients.
    assert model.peak(["none", "full"]) == 1000 + 50 + 100 + 5 + 110
    # Unit a's backward with a recomputed: a's transient, both units' gradients.
    assert model.peak(["full", "none"]) == max(1000 + 50 + 100 + 5 + 10, 1000 + 50 + 0 + 10 + 110)
    # Recomputing the last unit saves nothing (its recompute comes back at once); the first one does.
    assert model.peak(["none", "none"]) == model.peak(["none", "full"]) == 1265
    assert solve(model, 1264) == ["full", "none"] and model.peak(["full", "none"]) == 1170
    assert solve(model, 1169) is None and model.floor() == 1170


def test_an_option_whose_recompute_does_not_fit_does_not_displace_one_that_does():
    """Two options of a unit that keep the same bytes fall in one quantum of the solver's state, where only the
    faster is kept: one whose transient (what its recompute holds) breaks the budget must not be that one, or the
    plan that fits is lost (a solver that left the transient out of its walk found no plan here)."""
    units = [
        UnitCosts("a", {"none": Option("none", 100, 10, 0), "full": Option("full", 0, 110, 1),
                        "save_dots": Option("save_dots", 0, 400, 0.5)}, 5),
        UnitCosts("b", {"none": Option("none", 100, 10, 0), "full": Option("full", 0, 110, 1)}, 5),
    ]
    model = Model(units, resident=1000, outside=50, outside_gradient_bytes=7)
    assert model.peak(["save_dots", "none"]) == 1000 + 50 + 10 + 400 > 1264  # faster, and over the budget
    for quanta in (2000, 100000):
        assert solve(model, 1264, quanta=quanta) == ["full", "none"]


def test_a_units_forward_and_the_losss_backward_are_points_of_the_step():
    """NOTE [ the peak of a plan ]: where measured (PyTorch), a unit's forward holds its inputs and its forward's
    height on top of what the units before it kept; the loss's backward holds what every unit kept."""
    def units(forward):
        options = {"none": Option("none", 100, 10, 0, forward=forward), "full": Option("full", 20, 110, 1, forward=forward)}
        return [UnitCosts(name, options, 5, input_bytes=20) for name in "ab"]

    plain = Model(units(0), resident=1000, outside=50, outside_gradient_bytes=7)
    assert plain.peak(["none", "none"]) == 1000 + 50 + 200 + 5 + 10
    # b's forward: a's kept, b's inputs and its forward's height (500), no gradient yet.
    tall = Model(units(500), resident=1000, outside=50, outside_gradient_bytes=7)
    assert tall.peak(["none", "none"]) == 1000 + 50 + 100 + 20 + 500
    assert tall.peak(["full", "none"]) == 1000 + 50 + 20 + 20 + 500
    assert solve(tall, 1000 + 50 + 100 + 20 + 500 - 1) == ["full", "none"]
    assert solve(tall, 1000 + 50 + 20 + 20 + 500 - 1) is None  # a's forward alone needs 1000 + 50 + 20 + 500
    # The loss's backward on all that every unit kept, before the last unit's backward.
    lossy = Model(units(0), resident=1000, outside=50, outside_gradient_bytes=7, loss=400)
    assert lossy.peak(["none", "none"]) == 1000 + 50 + 200 + 400
    assert lossy.peak(["full", "full"]) == max(1000 + 50 + 40 + 400, plain.peak(["full", "full"]))
    assert lossy.like(lossy.units).loss == 400
    # Keras's PyTorch trainer: the last step's gradients (here 30) alive through every forward.
    held = Model(units(500), resident=1000, outside=50, outside_gradient_bytes=7, forward_held=30)
    assert held.peak(["full", "none"]) == 1000 + 50 + 30 + 20 + 20 + 500 and held.like(held.units).forward_held == 30
    assert solve(held, 1000 + 50 + 30 + 20 + 20 + 500) == ["full", "none"] and solve(held, 1000 + 50 + 30 + 20 + 20 + 499) is None


def test_the_optimizer_update_is_counted_after_the_backward():
    """NOTE [ the peak of a plan ]: Keras applies the gradients after the backward: the update is at the end only."""
    units = [
        UnitCosts("a", {"none": Option("none", 100, 10, 0), "full": Option("full", 0, 110, 1)}, 5, update_bytes=60),
        UnitCosts("b", {"none": Option("none", 100, 10, 0), "full": Option("full", 0, 110, 1)}, 5, update_bytes=60),
    ]
    without = Model(units, resident=1000, outside=50, outside_gradient_bytes=7)
    updated = Model(units, resident=1000, outside=50, outside_gradient_bytes=7, update=150)
    end = 1000 + 50 + 7 + 10 + 150  # every gradient and the update: after the backward
    for choice in itertools.product(("none", "full"), repeat=2):
        assert updated.peak(list(choice)) == max(without.peak(list(choice)), end)
    assert updated.peak(["none", "none"]) == without.peak(["none", "none"]) == 1265  # a unit's point, untouched
    assert without.floor() == 1170 and updated.floor() == end == 1217
    assert solve(without, 1170) == ["full", "none"] and solve(updated, 1170) is None
    assert solve(updated, 1217) == ["full", "none"]


def test_applied_as_made_the_update_is_that_of_the_gradients_alive():
    """In a graph each update runs as its gradient is made: at unit i's point, the larger of units i's and i+1's."""
    option = {_budget.NONE: Option(_budget.NONE, 10, 5, 0.0)}
    units = [UnitCosts(f"unit_{i}", option, gradient_bytes=100, update_bytes=u) for i, u in enumerate((300, 20, 30, 40))]
    made = Model(units, resident=1000, outside=0, outside_gradient_bytes=7, update=600, applied_as_made=True)
    choice = [_budget.NONE] * 4
    points = {
        0: 1000 + 10 + 5 + 200 + 300,
        1: 1000 + 20 + 5 + 200 + 30,
        2: 1000 + 30 + 5 + 200 + 40,
        3: 1000 + 40 + 5 + 100 + 40,
        "end": 1000 + 100 + 7 + 600,  # the first unit's gradients, those outside, and the whole update
    }
    assert made.peak(choice) == max(points.values()) == 1707
    made.update = 0
    assert made.peak(choice) == points[0] == 1515
    assert solve(made, 1515) == choice and solve(made, 1514) is None
    # The next unit's update, too: its gradient is made first, and its update may still run.
    wide = {_budget.NONE: Option(_budget.NONE, 10, 500, 0.0)}
    units = [UnitCosts("unit_0", wide, 100, update_bytes=0)] + [
        UnitCosts(f"unit_{i}", option, 100, update_bytes=u) for i, u in ((1, 300), (2, 0), (3, 0))
    ]
    made = Model(units, resident=1000, outside=0, outside_gradient_bytes=7, applied_as_made=True)
    assert made.peak(choice) == 1000 + 10 + 500 + 200 + 300  # unit 0's point, unit 1's update


def test_format_bytes():
    assert _budget.format_bytes(512 * 10**6) == "512.0 MB"
    assert _budget.format_bytes(12 * 10**9) == "12.00 GB"
    assert _budget.format_bytes(10**5) == "0.1 MB"
    assert _budget.format_bytes(12_345) == "12.3 kB"
    assert _budget.format_bytes(999) == "999 bytes"
    assert _budget.format_bytes(0) == "0 bytes"


def test_of_plans_alike_in_time_the_earlier_units_recompute():
    option = {"none": Option("none", 100, 10, 0), "full": Option("full", 0, 110, 1)}
    model = Model([UnitCosts(f"unit_{i}", option, 0) for i in range(6)], resident=0, outside=0, outside_gradient_bytes=0)
    budget = model.peak(["full"] * 3 + ["none"] * 3)
    assert solve(model, budget) == ["full"] * 3 + ["none"] * 3


def test_applied_as_made_counts_a_units_gradients_and_the_next():
    """NOTE [ the peak of a plan ]: a graph applies each gradient as it is made; Keras's eager step after the backward."""
    units = [UnitCosts(f"unit_{i}", {_budget.NONE: Option(_budget.NONE, 10, 5, 0.0)}, gradient_bytes=100) for i in range(4)]
    after = Model(units, resident=1000, outside=0, outside_gradient_bytes=7)
    made = Model(units, resident=1000, outside=0, outside_gradient_bytes=7, applied_as_made=True)
    choice = [_budget.NONE] * 4
    # After the backward: unit 0's backward holds its 10 kept, 5 and all 400 of the gradients.
    assert after.peak(choice) == 1000 + 10 + 5 + 400
    # As made: unit 2's holds 30 kept, 5, and its and unit 3's gradients (the most of any point;
    # unit 3's holds 40 + 5 + 100, the end unit 0's 100 and the 7 outside).
    assert made.peak(choice) == 1000 + 30 + 5 + 200
    assert made.like(units).applied_as_made and _budget.offloaded(made, ()).applied_as_made
    assert solve(made, 1000 + 235) == choice and solve(after, 1000 + 235) is None


def test_the_peak_names_its_point_of_the_step():
    """`Model.peak_point`: the peak's point, the one the peak is computed at (a unit's forward or backward, the loss's
    backward, after the backward), said in words by `point_text`; the memory report prints it."""
    def units(forward=0):
        options = {"none": Option("none", 100, 10, 0, forward=forward), "full": Option("full", 20, 110, 1, forward=forward)}
        return [UnitCosts(name, options, 5, input_bytes=20) for name in "ab"]

    def model(update=0, loss=0, forward=0):
        return Model(units(forward), resident=1000, outside=50, outside_gradient_bytes=7, update=update, loss=loss)

    cases = [
        (model(), ["none", "none"], (1, "backward"), "in b's backward"),
        (model(forward=500), ["none", "none"], (1, "forward"), "in b's forward"),
        (model(loss=400), ["none", "none"], "loss", "in the loss's backward"),
        # The optimizer's update after the backward (Keras's PyTorch Adam: three times the weights, all at once),
        # above every unit's point: what recompute and offload cannot lower.
        (model(update=600), ["full", "full"], None, "after the backward, at the optimizer's update"),
    ]
    for made, choice, point, text in cases:
        peak, found = made.peak_point(choice)
        assert (found, made.point_text(found)) == (point, text)
        assert peak == made.peak(choice)
    # The update's point holds for every plan: the least peak is there.
    assert model(update=600).floor() == model(update=600).peak(["none", "none"]) == 1000 + 50 + 7 + 10 + 600
    applied = Model(units(), resident=1000, outside=50, outside_gradient_bytes=700, applied_as_made=True)
    assert applied.point_text(applied.peak_point(["full", "full"])[1]) == (
        "at the end of the backward, at the last gradients' update"
    )
