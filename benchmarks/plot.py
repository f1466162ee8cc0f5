"""Figures from the benchmarks' JSON results (`--out`), for the README and docs/.

For each file, by the benchmark that wrote it:
    max_batch.py     memory against batch size (every probe's peak, one line per
                     method, the budget as a line), and the largest batch per method
                     with its time per sample against no recompute
    budget.py        the trade-off: each configuration's peak memory against its step
                     time (none, full, each uniform policy, limit=n, the planned
                     models), with the budgets as lines
    memory.py,       peak memory and step time per method (one group per mode)
    backends.py,
    bert4keras_bert.py
    largest_fit.py   the largest batch or sequence length predicted per option,
                     and the peaks predicted and measured there and one size on,
                     against the budget
Any other results file is skipped with a message naming it; a file is read
whole before its figure is written, so nothing is left half made.

Usage:
    python benchmarks/plot.py benchmarks/results/*.json            # into docs/images/
    python benchmarks/plot.py FILE.json --outdir /tmp/figures

Needs matplotlib (`pip install matplotlib`); nothing else in the project does.
"""

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLORS = {
    "none": "#7f7f7f",
    "theirs": "#d62728",
    "enable": "#ff7f0e",
    "ours": "#ff7f0e",
    "full": "#1f77b4",
    "model": "#1f77b4",
    "save_dots": "#2ca02c",
    "attention_core": "#9467bd",
}
LABELS = {"theirs": "theirs (wrong\ngradients)"}
MiB = 2**20


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_max_batch(data, path):
    plt = _pyplot()
    results = data["results"]
    methods = results["methods"]
    figure, (memory, batches) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.25, 1]})
    for method, found in methods.items():
        probes = [p for p in found["probes"] if p["fits"] and p["peak"]]
        if probes:
            memory.plot(
                [p["batch"] for p in probes], [p["peak"] / MiB for p in probes], "o-", label=method, color=COLORS.get(method, "#17becf"), markersize=4
            )
    memory.axhline(results["budget_bytes"] / MiB, color="black", linestyle="--", linewidth=1)
    memory.text(0.02, results["budget_bytes"] / MiB, " budget", va="bottom", transform=memory.get_yaxis_transform())
    memory.set_xscale("log", base=2)
    memory.set_xlabel("batch size")
    memory.set_ylabel("peak memory of a training step (MiB)")
    memory.set_title("memory against batch size")
    memory.legend(fontsize=8)
    names = list(methods)
    base = methods.get("none") or {}
    values = [methods[m]["batch"] for m in names]
    bars = batches.bar([LABELS.get(m, m) for m in names], values, color=[COLORS.get(m, "#17becf") for m in names])
    for bar, method in zip(bars, names):
        found = methods[method]
        label = f"{found['batch']}"
        if base.get("batch") and found.get("seconds_per_sample"):
            label += f"\n{found['batch'] / base['batch']:.1f}x batch\n{found['seconds_per_sample'] / base['seconds_per_sample']:.2f}x s/sample"
        batches.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    batches.set_ylabel("largest batch within the budget")
    batches.set_ylim(0, max(values + [1]) * 1.45)
    batches.tick_params(axis="x", labelrotation=30, labelsize=8)
    batches.set_title("largest batch, time per sample vs none")
    figure.suptitle(results["title"], fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_table(data, path):
    """Peak memory and step time per method, from a benchmark's rows."""
    plt = _pyplot()
    rows = _table_rows(data)
    labels = [f"{row['mode']}\n{row['method']}" if "mode" in row else row["method"] for row in rows]
    peaks = [(row.get("step_mb") or row.get("peak_mb") or (row.get("xla_temp") or row.get("peak") or 0) / MiB) for row in rows]
    steps = [row.get("step_s") or row.get("step") for row in rows]
    figure, (memory, time) = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = [COLORS.get(row["method"], "#17becf") for row in rows]
    memory.bar(range(len(rows)), peaks, color=colors)
    memory.set_ylabel("MiB")
    memory.set_title("memory of a training step")
    time.bar(range(len(rows)), steps, color=colors)
    time.set_ylabel("seconds")
    time.set_title("step time")
    for axis in (memory, time):
        axis.set_xticks(range(len(rows)), labels, fontsize=7, rotation=45, ha="right")
    figure.suptitle(f"{data['benchmark']} {_arguments(data['arguments'])}", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_tradeoff(data, path):
    """Memory against time, one point per configuration of a `budget.py` run."""
    plt = _pyplot()
    rows = [row for row in data["results"]["rows"] if row.get("peak") and row.get("step")]
    base = next(row for row in rows if row["config"] == "none")
    figure, axis = plt.subplots(figsize=(7.5, 4.8))
    seen = set()
    for row in rows:
        if row["config"] in seen:
            continue  # a hand choice recurs under each budget it fits
        seen.add(row["config"])
        planned = row["config"].startswith("budget=")
        kind = row["config"].split("=")[-1] if row["config"].startswith("policy=") else row["config"]
        color = "#d62728" if planned else COLORS.get(kind, "#17becf" if kind.startswith("limit") else "#7f7f7f")
        x, y = row["step"] / base["step"], row["peak"] / MiB
        axis.plot(x, y, "*" if planned else "o", color=color, markersize=12 if planned else 7)
        label = f"plan for {row['budget'] / MiB:.0f} MiB" if planned else row["config"].replace("policy=", "")
        offset, align = ((-8, 6), "right") if planned else ((6, 4), "left")
        axis.annotate(label, (x, y), textcoords="offset points", xytext=offset, ha=align, fontsize=7)
    for budget in sorted({row["budget"] for row in rows if row.get("budget")}):
        axis.axhline(budget / MiB, color="black", linestyle=":", linewidth=0.8)
    axis.set_xlabel("step time, against no recompute")
    axis.set_ylabel("peak memory of a training step (MiB)")
    arguments = data["arguments"]
    axis.set_title(
        f"memory against time, {arguments['backend']}: {arguments['blocks']} blocks, hidden {arguments['hidden']}, "
        f"seq {arguments['seq']}, batch {arguments['batch']}\n(dotted: the budgets; stars: recompute_model(budget=))",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _table_rows(data):
    """The rows of a table-shaped result that have both a memory figure and a step time."""
    results = data.get("results") or {}
    rows = results.get("rows") or results.get("table") or []
    return [
        row for row in rows
        if "error" not in row and (row.get("step_s") or row.get("step"))
        and (row.get("step_mb") or row.get("peak_mb") or row.get("xla_temp") or row.get("peak"))
    ]


def plot_largest_fit(data, path):
    plt = _pyplot()
    arguments, rows = data["arguments"], [row for row in data["results"] if row.get("largest")]
    axis = "sequence length" if arguments["axis"] == "sequence" else "batch"
    figure, (sizes, peaks) = plt.subplots(1, 2, figsize=(11, 4))
    names = [row["option"] for row in rows]
    colors = [COLORS.get(name, "#17becf") for name in names]
    bars = sizes.bar([LABELS.get(n, n) for n in names], [row["largest"] for row in rows], color=colors)
    base = next((row["largest"] for row in rows if row["option"] == "none"), None)
    bisected = [(bar, row["bisected"]["largest"]) for bar, row in zip(bars, rows) if (row.get("bisected") or {}).get("largest")]
    for bar, largest in bisected:  # what runs showed fits (--bisect): a black line across the bar
        sizes.plot([bar.get_x(), bar.get_x() + bar.get_width()], [largest, largest], color="black", linewidth=2)
    top = {id(bar): largest for bar, largest in bisected}
    for bar, row in zip(bars, rows):
        label = f"{row['largest']}" + (f"\n{row['largest'] / base:.1f}x" if base else "")
        height = max(bar.get_height(), top.get(id(bar), 0))
        sizes.annotate(label, (bar.get_x() + bar.get_width() / 2, height), ha="center", va="bottom", fontsize=8)
    sizes.set_ylim(0, max([row["largest"] for row in rows] + [largest for _, largest in bisected]) * 1.3)
    sizes.set_ylabel(f"largest {axis} predicted to fit")
    sizes.set_title(f"largest {axis} in {arguments['budget_mb']:.0f} MiB" + ("; bisected by runs: black line" if bisected else ""))
    for index, row in enumerate(rows):
        peaks.plot([index - 0.15], [row["predicted_peak"] / MiB], "o", color=colors[index], markersize=7)
        for key, marker in (("at_largest", "s"), ("at_next", "^")):
            measured = row.get(key) or {}
            if measured.get("peak"):
                peaks.plot([index + (0.1 if key == "at_largest" else 0.3)], [measured["peak"] / MiB], marker, color=colors[index], markersize=6, fillstyle="none")
    peaks.axhline(arguments["budget_mb"], color="black", linestyle="--", linewidth=1)
    peaks.set_xticks(range(len(rows)), [LABELS.get(n, n) for n in names])
    peaks.set_ylabel("MiB")
    peaks.set_title("predicted peak (o); measured at it (square), one on (triangle); budget dashed", fontsize=9)
    figure.suptitle(f"largest_fit: {arguments['model']}, {arguments['backend']}, {data.get('device', '')}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _arguments(arguments):
    keep = ("backend", "blocks", "layers", "hidden", "seq", "batch")
    return ", ".join(f"{name} {arguments[name]}" for name in keep if arguments.get(name) is not None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="JSON files written by the benchmarks' --out")
    parser.add_argument("--outdir", default=os.path.join(ROOT, "docs", "images"))
    args = parser.parse_args(argv)
    os.makedirs(args.outdir, exist_ok=True)
    skipped = 0
    for name in args.files:
        with open(name) as source:
            data = json.load(source)
        path = os.path.join(args.outdir, os.path.splitext(os.path.basename(name))[0] + ".png")
        plot = PLOTS.get(data.get("benchmark"))
        if plot is None or (plot is plot_table and not _table_rows(data)):
            print(f"{name}: skipped, no figure for the results of {data.get('benchmark') or 'this benchmark'}")
            skipped += 1
            continue
        plot(data, path)
        print(path)
    return 0


PLOTS = {
    "max_batch.py": plot_max_batch,
    "budget.py": plot_tradeoff,
    "memory.py": plot_table,
    "backends.py": plot_table,
    "bert4keras_bert.py": plot_table,
    "largest_fit.py": plot_largest_fit,
}

if __name__ == "__main__":
    main()
