"""The docs: every figure sourced and equal to its results JSON, and the README's quick start runs.

NOTE [ sourced figures ] in `benchmarks/docs_figures.py` says how a figure names
its source. A figure edited by hand, or a benchmark run again without
`python benchmarks/docs_figures.py --fix`, fails `test_every_figure_has_a_source_and_agrees`.
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import _fresh  # noqa: E402
import docs_figures  # noqa: E402

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")


def test_every_figure_has_a_source_and_agrees():
    if BACKEND != "tensorflow":
        pytest.skip("framework-free: the TensorFlow run checks it")
    problems = []
    for path in docs_figures.documents():
        problems += docs_figures.check_file(path)[0]
    assert not problems, "\n".join(problems[:40]) + "\n(python benchmarks/docs_figures.py; NOTE [ sourced figures ])"


@pytest.mark.parametrize(
    "text, problem",
    [
        ("fits 6.7x the batch.", "has no source"),
        ("fits 9.9x<!--= max_batch_bert4keras_base: results.methods.full.batch / results.methods.none.batch --> it.", "9.9x is "),
        ("| a | b |\n|---|---|\n| none | 7 |", "opens with a figure that has no source"),
        ("```\nnone  165 MB\n```", "no command that prints them"),
        ("a 3.0x<!--= no_such_file: x --> b", "no results file"),
        ("a 3.0x<!--= : results.x --> b", "no file and no"),
        ("a 3.0x<!--= ci_times: stops[0]\n/ 60 --> b", "does not end on its line"),
        ("a 3.0x<!--at 0000000--> b", "no commit of this repository"),
    ],
)
def test_the_check_catches(tmp_path, text, problem):
    """What the check must refuse: no source, a figure edited by hand, a console block without its command."""
    path = tmp_path / "page.md"
    path.write_text(text + "\n")
    problems = docs_figures.check_file(str(path))[0]
    assert any(problem in found for found in problems), problems


def test_the_check_passes_and_fixes_a_sourced_figure(tmp_path):
    with open(os.path.join(ROOT, "benchmarks", "results", "max_batch_bert4keras_base.json")) as source:
        methods = json.load(source)["results"]["methods"]
    right = "%.1fx" % (methods["full"]["batch"] / methods["none"]["batch"])
    path = tmp_path / "page.md"
    sourced = "<!-- source: max_batch_bert4keras_base results.methods -->\nfits **%s**<!--= : full.batch / none.batch --> the batch, %s<!--given-->."
    path.write_text(sourced % (right, "2500 MiB"))
    assert docs_figures.check_file(str(path))[0] == []
    path.write_text(sourced % ("9.9x", "2500 MiB"))
    problems, fixed = docs_figures.check_file(str(path), fix=True)
    assert problems == [] and f"**{right}**" in fixed


def _quick_start():
    with open(os.path.join(ROOT, "README.md")) as readme:
        text = readme.read()
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.in_children
def test_the_quick_start_runs_as_written(tmp_path):
    """The README's quick start, unedited, in a fresh process on this backend."""
    pytest.importorskip("keras_hub")
    script = tmp_path / "quick_start.py"
    script.write_text(_quick_start())
    done = _fresh.run([str(script)], cwd=str(tmp_path), env=dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verdict: OK" in done.stdout and "predicted peak" in done.stdout


def test_plot_makes_a_figure_of_each_results_file_or_says_why_not(tmp_path):
    """`benchmarks/plot.py benchmarks/results/*.json` ends well, and names every file it skips."""
    pytest.importorskip("matplotlib")
    if BACKEND != "tensorflow":
        pytest.skip("framework-free: the TensorFlow run checks it")
    files = sorted(os.path.join(docs_figures.RESULTS, name) for name in os.listdir(docs_figures.RESULTS) if name.endswith(".json"))
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "plot.py"), *files, "--outdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    made = set(os.listdir(tmp_path))
    for path in files:
        stem = os.path.splitext(os.path.basename(path))[0]
        assert stem + ".png" in made or f"{path}: skipped" in done.stdout, stem
    # The figures the docs show are among those made.
    for name in ("max_batch_bert4keras_base", "max_batch_bert4keras_large", "max_batch_keras_hub_base_seq512", "budget_tensorflow"):
        assert name + ".png" in made


def test_every_mutant_applies_to_the_source():
    """`tests/mutants.py` breaks the library one way at a time to show the suite notices; a mutant whose text has
    left its file, or whose tests the suite runs in another backend's run only (named on pytest's command line
    they would run where the suite never runs them), would be reported stale there, and nothing would show it."""
    import mutants

    stale = {m.name: m.problem() for m in mutants.MUTANTS if m.problem()}
    assert not stale, stale
    names = [m.name for m in mutants.MUTANTS]
    assert len(set(names)) == len(names)
    assert set(mutants.QUICK) <= set(names), set(mutants.QUICK) - set(names)
