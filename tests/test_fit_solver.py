"""`_fit` over plain numbers: the fit of measured models in the size, the search, the refusals (no framework)."""

import numpy as np
import pytest

from keras_recompute import _budget, _fit

MB = 10**6


def model_at(size, kept_per=(4.0, 0.5), quadratic=0.0, cube=0.0, units=4, forward=0.0, loss=0.0, largest=0.0,
             cube_recomputed=False):
    """A synthetic measured model: each unit keeps `a s + q s^2 (+ c s^3)` plain, `b s` under full (whose recompute
    holds what plain keeps, but for the cube unless `cube_recomputed`); its forward holds `forward s^2` at its height,
    the loss's backward `loss s` (as measured on PyTorch); its largest tensor is `largest s`."""
    recomputed_cube = cube if cube_recomputed else 0.0
    plain, full = kept_per
    built = []
    for index in range(units):
        height = MB * forward * size**2
        options = {
            "none": _budget.Option("none", MB * (plain * size + quadratic * size**2 + cube * size**3), MB * size, 0.0, height),
            "full": _budget.Option("full", MB * full * size, MB * (size + plain * size + quadratic * size**2 + recomputed_cube * size**3),
                                   0.01 * size, height),
        }
        built.append(_budget.UnitCosts(f"block_{index}", options, 2 * MB, MB * full * size, largest=MB * largest * size))
    return _budget.Model(built, resident=50 * MB + MB * size, outside=MB * 0.2 * size, outside_gradient_bytes=3 * MB, update=4 * MB,
                         loss=MB * loss * size, forward_held=11 * MB if forward or loss else 0)


def fitted(sizes, degree, **kwargs):
    return _fit.FittedModel(sizes, [model_at(s, **kwargs) for s in sizes], degree)


def brute_largest(peak_at, budget, limit=5000):
    return max((s for s in range(1, limit) if peak_at(s) <= budget), default=0)


@pytest.mark.parametrize("degree, coefficients", [(1, [3.0, -2.0]), (2, [1.5, 0.25, 0.125])])
def test_the_fit_recovers_a_polynomial(degree, coefficients):
    xs = [64, 128, 192, 256]
    ys = [sum(c * x**k for k, c in enumerate(coefficients)) for x in xs]
    assert np.allclose(_fit.polynomial(xs, ys, degree), coefficients, rtol=1e-9, atol=1e-9)


def test_along_the_batch_the_fitted_model_is_the_measured_one_anywhere():
    fit = fitted([2, 4, 8], 1)
    for size in (3, 17, 300):
        for choice in (["none"] * 4, ["full"] * 4, ["full", "none", "full", "none"]):
            assert fit.at(size).peak(choice) == pytest.approx(model_at(size).peak(choice), rel=1e-8, abs=64)
    assert fit.residual(lambda m: m.peak(["none"] * 4)) < 1e-6


@pytest.mark.parametrize("kwargs", [{"forward": 0.02}, {"loss": 40.0}])
def test_a_forwards_height_and_the_losss_backward_are_fitted(kwargs):
    """Measured on PyTorch (NOTE [ the peak of a plan ]): where they are the peak, the fit follows them."""
    fit = fitted([64, 128, 192, 256], 2, **kwargs)
    for size in (100, 1000):
        for choice in (["none"] * 4, ["full"] * 4):
            measured = model_at(size, **kwargs)
            assert fit.at(size).peak(choice) == pytest.approx(measured.peak(choice), rel=1e-8, abs=64)
    plain = model_at(1000)
    assert model_at(1000, **kwargs).peak(["full"] * 4) > plain.peak(["full"] * 4)  # the point is the peak


def test_along_the_sequence_a_quadratic_is_followed():
    fit = fitted([64, 128, 192, 256], 2, quadratic=0.01)
    for size in (100, 1000, 4096):
        assert fit.at(size).peak(["none"] * 4) == pytest.approx(model_at(size, quadratic=0.01).peak(["none"] * 4), rel=1e-8, abs=64)


@pytest.mark.parametrize("axis, sizes, kwargs", [("batch", [2, 4, 8], {}), ("sequence", [64, 128, 192, 256], {"quadratic": 0.01})])
def test_the_largest_size_is_the_brute_force_answer_and_the_next_does_not_fit(axis, sizes, kwargs):
    fit = fitted(sizes, _fit.DEGREES[axis], **kwargs)
    budget = 900 * MB
    rows = {row["option"]: row for row in _fit.fit_rows(fit, budget, ["none", "full"], plan=True, limit=5000)}
    for option in ("none", "full"):
        want = brute_largest(lambda s: model_at(s, **kwargs).peak([option] * 4), budget)
        row = rows[option]
        assert row["largest"] == want > 0, (option, row)
        assert row["predicted_peak"] <= budget < row["next_peak"]
    assert rows["full"]["largest"] > rows["none"]["largest"]
    plan = rows["plan"]
    want = brute_largest(lambda s: 0 if _budget.solve(model_at(s, **kwargs), budget) is not None else 2 * budget, budget)
    assert plan["largest"] == want and plan["largest"] >= rows["full"]["largest"]
    assert len(plan["policies"]) == 4 and "full" in plan["policies"]


def test_multiple_of_rounds_down_to_a_multiple():
    fit = fitted([2, 4, 8], 1)
    budget = 700 * MB
    rows = {row["option"]: row for row in _fit.fit_rows(fit, budget, ["full"], plan=False, multiple_of=8, limit=5000)}
    want = brute_largest(lambda s: model_at(s).peak(["full"] * 4) if s % 8 == 0 else 2 * budget, budget)
    assert rows["full"]["largest"] == want and want % 8 == 0


def test_memory_that_does_not_follow_the_fit_gets_no_answer_but_its_residual():
    fit = fitted([2, 4, 8], 1, cube=0.05)  # cubic in the batch: a line cannot follow it
    rows = {row["option"]: row for row in _fit.fit_rows(fit, 900 * MB, ["none", "full"], plan=True, limit=5000)}
    none = rows["none"]
    assert none["largest"] is None and none["residual"] > _fit.RESIDUAL_LIMIT and "does not follow" in none["note"]
    assert rows["plan"]["largest"] is None
    assert rows["full"]["largest"] is not None  # full keeps a line: it still answers


def test_a_budget_under_the_smallest_size_answers_nothing():
    fit = fitted([2, 4, 8], 1)
    rows = _fit.fit_rows(fit, 10 * MB, ["none", "full"], plan=True, limit=5000)
    assert all(row["largest"] is None and "does not fit" in row["note"] for row in rows)


def test_an_option_that_does_not_apply_to_every_unit_says_so():
    fit = fitted([2, 4, 8], 1)
    rows = _fit.fit_rows(fit, 900 * MB, ["none", "attention_core"], plan=False, limit=5000)
    assert rows[1]["largest"] is None and "does not apply to 4 of the 4 units (block_0, ...)" in rows[1]["note"]
    assert "does not apply" in str(_fit.FitReport("t", "batch", 900 * MB, [2, 4, 8], rows, "eager", "eager"))


def test_the_report_reads():
    fit = fitted([2, 4, 8], 1)
    rows = _fit.fit_rows(fit, 900 * MB, ["none", "full"], plan=True, limit=5000)
    report = _fit.FitReport("title", "batch", 900 * MB, [2, 4, 8], rows, "compiled", "compiled: fit runs a compiled step")
    text = str(report)
    assert "largest batch" in text and "900.0 MB" in text and "plan" in text and "full x" in text
    assert report.largest("full") == rows[1]["largest"]


def counted(peak):
    """`peak`, and the sizes it was called at (each call is a compile where it is used)."""
    calls = []

    def call(size):
        calls.append(size)
        return peak(size)

    return call, calls


@pytest.mark.parametrize("found", [1, 57, 400, 571, 572, 900, 40000])
@pytest.mark.parametrize("peak", [lambda s: 1000 + 7 * s, lambda s: 100 + 0.01 * s * s, lambda s: 1000 + 3 * s + 0.002 * s * s])
def test_refine_finds_the_largest_fitting_size_from_any_prediction(found, peak):
    want = brute_largest(peak, 5000, limit=100000)
    call, calls = counted(peak)
    assert _fit.refine(call, 5000, found, limit=100000) == want
    assert peak(want) <= 5000 < peak(want + 1)
    assert want in calls and want + 1 in calls  # both sides of the answer were compiled
    if want / 2 <= found <= 2 * want:  # a prediction within 2x, as the calibrated fit's are: a few compiles
        assert len(calls) <= 8, calls


def test_refine_from_a_prediction_one_step_off_calls_twice():
    for found in (571, 572):
        call, calls = counted(lambda s: 1000 + 7 * s)
        assert _fit.refine(call, 5000, found, slope=7.0) == 571 and sorted(calls) == [571, 572]


def test_refine_in_multiples_past_a_known_size_and_where_nothing_fits():
    call, calls = counted(lambda s: 1000 + 7 * s)
    assert _fit.refine(call, 5000, 100, step=8, known=400) == 568 and all(s % 8 == 0 and s > 400 for s in calls)
    call, calls = counted(lambda s: float("inf") if s > 600 else 10 * s)  # no plan past 600: no secant there
    assert _fit.refine(call, 5000, 900) == 500
    call, calls = counted(lambda s: 10**9)
    assert _fit.refine(call, 5000, 7) == 0 and calls[-1] == 1
    call, calls = counted(lambda s: 10**9)
    assert _fit.refine(call, 5000, 7, known=3) == 3 and calls == [7, 4]


def test_checked_rows_move_each_answer_to_the_compilers_and_the_plan_to_at_least_the_best_option():
    fit = fitted([2, 4, 8], 1)
    budget = 900 * MB
    rows = _fit.fit_rows(fit, budget, ["none", "full"], plan=True, limit=5000)
    fitted_answers = {row["option"]: row["largest"] for row in rows}
    # The "compiler" holds 80% of what the units predict plain and 90% under full; no mixed plan fits past full.
    scale = {"none": 0.8, "full": 0.9}

    def peak_at(choice, size):
        if len(set(choice)) > 1:
            return 2 * budget
        return scale[choice[0]] * model_at(size).peak(choice)

    asked = []

    def plan_at(size, ruled_out):
        asked.append((size, tuple(ruled_out)))
        return ["full"] * 4 if "full" not in ruled_out else ["none", "full", "full", "full"]

    _fit.checked_rows(rows, 4, plan_at, peak_at, budget, limit=5000)
    rows = {row["option"]: row for row in rows}
    for option in ("none", "full"):
        want = brute_largest(lambda s: peak_at([option] * 4, s), budget)
        assert rows[option]["largest"] == want > fitted_answers[option], (option, rows[option])
        assert rows[option]["predicted_peak"] <= budget < rows[option]["next_peak"]
        assert rows[option]["fitted_largest"] == fitted_answers[option] and rows[option]["checked"] == "compiled"
    assert rows["plan"]["largest"] == rows["full"]["largest"] and rows["plan"]["policies"] == ["full"] * 4
    assert "no plan fits" not in (rows["plan"]["note"] or "") or rows["plan"]["next_peak"] is None
    assert all(("full" in ruled_out) == (size > rows["full"]["largest"]) for size, ruled_out in asked)


def test_a_plan_answered_alone_may_fall_back_on_every_option():
    """An option not asked for is not ruled out: `largest_fit(options=[])` answered a plan that stopped short of
    where `full` on every unit fits (keras-hub Gemma with LoRA on JAX: 1536 against 1728), as the planner's
    fallback was only the options whose rows were checked."""
    fit = fitted([2, 4, 8], 1)
    budget = 900 * MB
    rows = _fit.fit_rows(fit, budget, [], plan=True, limit=5000)

    def peak_at(choice, size):  # no mixed plan fits past full's own answer; full fits beyond the fit's answer
        return 2 * budget if len(set(choice)) > 1 else 0.9 * model_at(size).peak(choice)

    asked = []

    def plan_at(size, ruled_out):
        asked.append(tuple(ruled_out))
        return ["full"] * 4 if "full" not in ruled_out else ["none", "full", "full", "full"]

    _fit.checked_rows(rows, 4, plan_at, peak_at, budget, limit=5000)
    (row,) = rows
    assert row["largest"] == brute_largest(lambda s: peak_at(["full"] * 4, s), budget) and row["policies"] == ["full"] * 4
    assert asked and not any(asked)


def test_checked_rows_leave_the_fit_where_no_compiler_states_a_peak():
    fit = fitted([2, 4, 8], 1)
    rows = _fit.fit_rows(fit, 900 * MB, ["none", "full"], plan=True, limit=5000)
    before = [dict(row) for row in rows]
    _fit.checked_rows(rows, 4, lambda size, fitting: None, lambda choice, size: None, 900 * MB, limit=5000)
    assert rows == before


@pytest.mark.parametrize(
    "arguments, match",
    [
        ({"axis": "rows"}, "axis=...\\) takes one of"),
        ({"budget": 0.5}, "takes a size"),
        ({"sizes": [2, 4]}, "at least 3 different"),
        ({"axis": "sequence", "sizes": [64, 128, 256]}, "at least 4 different"),
        ({"sizes": [2, 4, 0]}, "positive integer"),
        ({"multiple_of": 0}, "multiple_of"),
        ({"headroom": 1.0}, "headroom=...\\) takes the fraction"),
        ({"headroom": -0.1}, "headroom"),
        ({"headroom": True}, "headroom"),
    ],
)
def test_bad_arguments_say_what_and_how(arguments, match):
    values = dict(axis="batch", sizes=None, budget="1GB", multiple_of=1, headroom=0.1)
    values.update(arguments)
    with pytest.raises(ValueError, match=match):
        _fit.check_arguments(values["axis"], values["sizes"], values["budget"], values["multiple_of"], values["headroom"])


@pytest.mark.parametrize("budget", [-5, 0, 1.5, float("nan"), "huge", True])
def test_a_bad_budget_is_not_answered_with_a_fraction_largest_fit_does_not_take(budget):
    """recompute_model's budget may be a fraction of the activations; largest_fit's may not: its errors say how to
    write a size and offer no fraction (they did: "or a float in (0, 1]", which it refuses)."""
    with pytest.raises(ValueError) as raised:
        _fit.check_arguments("batch", None, budget, 1, 0.1)
    message = str(raised.value)
    assert message.startswith("keras_recompute: largest_fit(budget=...)") and "'12GiB'" in message, message
    assert "fraction" not in message, message


def test_with_the_allocators_blocks_each_peak_counts_the_largest_tensor_once_more():
    """NOTE [ the allocator's blocks ]: on TensorFlow a tensor may hold a block of up to twice its size, so each
    answer's peak (each option's, the plan's) counts the step's largest tensor once more: here 3 MB a row, or a unit's
    weight's gradient (2 MB, its update's half) where that is larger."""
    fit = fitted([2, 4, 8], 1, largest=3.0)
    budget = 900 * MB
    plain = {row["option"]: row for row in _fit.fit_rows(fit, budget, ["none", "full"], plan=True, limit=5000)}
    rows = {row["option"]: row for row in _fit.fit_rows(fit, budget, ["none", "full"], plan=True, limit=5000, rounding=True)}
    for option in ("none", "full"):
        want = brute_largest(lambda s: model_at(s, largest=3.0).peak([option] * 4) + 3 * MB * s, budget)
        row = rows[option]
        assert row["largest"] == want < plain[option]["largest"], (option, row, plain[option])
        at = model_at(want, largest=3.0)
        assert row["largest_tensor"] == at.largest_tensor() == 3 * MB * want
        assert row["predicted_peak"] == pytest.approx(at.peak([option] * 4) + at.largest_tensor(), abs=64)
        assert row["predicted_peak"] <= budget < row["next_peak"]
    plan = rows["plan"]
    assert plan["largest"] >= rows["full"]["largest"] and plan["predicted_peak"] <= budget, plan
    assert plan["largest"] < plain["plan"]["largest"]
    at = model_at(plan["largest"], largest=3.0)
    assert at.peak(plan["policies"]) + at.largest_tensor() <= budget and plan["largest_tensor"] == at.largest_tensor()
    assert "largest_tensor" not in plain["full"]
    unit = _budget.UnitCosts("a", {"none": _budget.Option("none", MB, MB, 0.0)}, 2 * MB, update_bytes=4 * MB, largest=MB)
    assert _budget.Model([unit], 0, 0, 0).largest_tensor() == 2 * MB  # its weight's gradient: half its update


def test_the_default_headroom_is_a_tenth():
    assert _fit.HEADROOM == 0.1


def test_the_headroom_is_a_fraction_of_the_room_above_what_size_0_holds():
    """NOTE [ the headroom ]: 10% of the 600 MB above a fixed 300 MB is kept, 840 MB usable (a tenth of the whole
    budget would leave 810 MB: 20% of the room the size can take)."""
    assert _fit.usable(900 * MB, 300 * MB, 0.1) == pytest.approx(840 * MB)
    assert _fit.usable(900 * MB, 0, 0.1) == pytest.approx(810 * MB)
    assert _fit.usable(900 * MB, 300 * MB, 0.0) == 900 * MB
    assert _fit.usable(900 * MB, 950 * MB, 0.1) == 900 * MB  # nothing above it: nothing to keep
    fit = fitted([2, 4, 8], 1)
    whole = _fit.fit_rows(fit, 900 * MB, ["full"], plan=False, limit=5000)[0]
    kept = _fit.fit_rows(fit, 840 * MB, ["full"], plan=False, limit=5000)[0]
    assert kept["largest"] < whole["largest"] and kept["predicted_peak"] <= 840 * MB < kept["next_peak"]
    report = _fit.FitReport("title", "batch", 900 * MB, [2, 4, 8], [kept], "eager", "eager", headroom=0.1, fixed=300 * MB)
    assert report.usable == pytest.approx(840 * MB)
    assert (
        "10% of the room above the 300.0 MB it holds at batch 0 kept for the prediction's error: peaks predicted "
        "within 840.0 MB" in str(report)
    )


def flatten(structure):
    return list(structure.values()) if isinstance(structure, dict) else [structure]


def test_inputs_that_ignore_their_size_are_refused():
    with pytest.raises(ValueError, match="size` along the first"):
        _fit.checked_inputs(lambda n: np.zeros((4, 16)), [2, 4, 8], "batch", flatten)


def test_inputs_without_a_sequence_axis_are_refused_naming_the_batch():
    with pytest.raises(ValueError, match="no sequence axis.*axis='batch'"):
        _fit.checked_inputs(lambda n: {"features": np.zeros((n, 16))}, [64, 128, 192, 256], "sequence", flatten)


def test_inputs_that_follow_their_size_are_taken():
    batches = _fit.checked_inputs(lambda n: {"ids": np.zeros((2, n))}, [64, 128, 192, 256], "sequence", flatten)
    assert [b["ids"].shape for b in batches] == [(2, 64), (2, 128), (2, 192), (2, 256)]


def test_the_size_measured_nearer_the_answers_is_the_least_answer_past_twice_the_sizes():
    """NOTE [ measuring nearer the answers ]: along the sequence only, the plan's answer aside but where it is the only
    one, in multiples."""
    rows = [{"option": "none", "largest": 960}, {"option": "full", "largest": 1600}, {"option": "plan", "largest": 600},
            {"option": "attention_core", "largest": None}]
    assert _fit.nearer_size(rows, [64, 128, 192, 256], "sequence", 64) == 960
    assert _fit.nearer_size(rows, [64, 128, 192, 256], "sequence", 100) == 900
    assert _fit.nearer_size(rows, [64, 128, 192, 480], "sequence", 64) is None  # within twice the largest size measured
    assert _fit.nearer_size(rows, [2, 4, 8], "batch", 1) is None  # a line: extrapolated as measured
    assert _fit.nearer_size([{"option": "none", "largest": None}], [64, 128, 192, 256], "sequence", 1) is None
    # Asked alone (`options=[]`), the plan's answer is the least: extrapolated from 64-256 alone, keras-hub Gemma with
    # LoRA on TensorFlow answered 1472 where the same fit measured again answered 1600 (`full` bisected at 1664).
    assert _fit.nearer_size([{"option": "plan", "largest": 1472}], [64, 128, 192, 256], "sequence", 64) == 1472


@pytest.mark.parametrize("step", [1, 3, 64])
def test_the_benchmarks_bisection_finds_the_largest_fitting_multiple_from_any_start_probing_each_once(step):
    """`benchmarks/largest_fit.py --bisect` (NOTE [ the bisected figure ]): what the answers are checked against."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from largest_fit import bisect

    rng = np.random.RandomState(step)
    for _ in range(300):
        truth, start = int(rng.randint(0, 40)) * step, int(rng.randint(1, 50)) * step
        probed = []
        found = bisect(lambda size: probed.append(size) or size <= truth, start, step)
        assert found == truth and len(probed) == len(set(probed)), (truth, start, probed)
        assert len(probed) <= 2 * int(np.log2(abs(truth - start) // step + 1)) + 3, (truth, start, probed)
