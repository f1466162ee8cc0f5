"""bert4keras's BERT on standalone Keras 2.3.1 + TensorFlow 1.15, where its users trained: plain, ours, bert4keras's own.

Run it with a legacy environment's Python (`tests/legacy/run.py` builds them
under `~/.cache/keras_recompute/legacy`):

```
PY=$(ls -d ~/.cache/keras_recompute/legacy/tf1.15-keras2.3-*)/bin/python
PYTHONPATH=. $PY benchmarks/legacy_bert4keras.py --size base --budget-mb 4096 --check --out benchmarks/results/legacy_bert4keras_base_tf1.15_cpu.json
PYTHONPATH=. $PY benchmarks/legacy_bert4keras.py --size large --budget-mb 8192 --out benchmarks/results/legacy_bert4keras_large_tf1.15_cpu.json
```

The model: bert4keras 0.11.5's `build_transformer_model` BERT (`--size base`:
12 x 768, 12 heads, FFN 3072; `large`: 24 x 1024, 16 heads, FFN 4096;
vocabulary 21128, as its Chinese checkpoints), a softmax classifier on [CLS],
Adam, sequence `--seq` (128), float32, `train_on_batch`. The methods:
  none     no recompute;
  ours     `keras_recompute.integrations.bert4keras.enable()` with `RECOMPUTE=1`:
           each of bert4keras's attention and feed-forward layers recomputed;
  theirs   bert4keras's own `RECOMPUTE=1` (its `recompute_grad`), on the same
           layers. With dropout on it cannot build the gradient here (a `tf.cond`
           under a `GradientTape`: it raises), so every method runs with dropout
           off (`--dropout 0`) unless `--dropout` is given, which leaves theirs out.

Each measurement is a child process: it builds the model, takes one step (to
build everything), then measures the peak resident memory of further steps
above what the process held before them (`/proc/self/clear_refs`; glibc
returns buffers of 128 KB and up at once, `MALLOC_MMAP_THRESHOLD_`) and the
time of each. The budget is what a training step may use above what the process holds
before it (the weights, Adam's slots, TensorFlow itself). The step's peak
grows linearly with the batch (activations; the gradients and workspaces
are the intercept): it is measured at two batches, `--batches`, and the
largest batch under `--budget-mb` is read off the line; then a child runs a
step at that batch, and while its peak is over the budget (the line is a
little off far from its points) the batch steps down and a child runs again:
`largest_batch` is the largest batch run whose peak was within the budget.
Time per sample is the fastest step at the larger measured batch over that
batch. `--reuse` takes the measured points of an earlier run's JSON.

`--retime FILE` times each method again at the larger batch, in turns, and
rewrites the time per sample in FILE (memory figures kept).

`--check` also compares each method's first weight update (SGD at lr 1.0, a
small BERT, dropout off, the same weights from a file) with plain's: bert4keras
reads `RECOMPUTE` when it is imported, so plain and theirs run in two processes.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import _record  # this folder is on the path of a script run from it
from legacy_memory import _status

SIZES = {
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "tiny": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64),
}
METHODS = ("none", "ours", "theirs")


def _config(size, dropout, vocab):
    config = dict(SIZES[size], vocab_size=vocab, hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2)
    config.update(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return config


def _build(args):
    """The classifier, with the method's recompute switched on (RECOMPUTE is set by the parent)."""
    import numpy as np

    if args.method == "ours":
        from keras_recompute.integrations import bert4keras as recompute_bert4keras

        recompute_bert4keras.enable()
    import keras
    from bert4keras.models import build_transformer_model

    path = os.path.join(tempfile.mkdtemp(), "bert.json")
    with open(path, "w") as out:
        json.dump(_config(args.size, args.dropout, args.vocab), out)
    np.random.seed(0)
    bert = build_transformer_model(path)
    first = keras.layers.Lambda(lambda t: t[:, 0])(bert.output)
    return keras.models.Model(bert.inputs, keras.layers.Dense(2, activation="softmax")(first))


def _data(batch, seq, vocab):
    import numpy as np

    random = np.random.RandomState(0)
    tokens = random.randint(1, vocab, size=(batch, seq))
    return [tokens, np.zeros_like(tokens)], random.randint(0, 2, size=(batch, 1))


def child_memory(args):
    import keras

    model = _build(args)
    model.compile(keras.optimizers.Adam(1e-5), "sparse_categorical_crossentropy")
    x, y = _data(args.batch, args.seq, args.vocab)
    model.train_on_batch(x, y)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak (VmHWM) starts again from now
    seconds = []
    for _ in range(args.steps):
        started = time.perf_counter()
        model.train_on_batch(x, y)
        seconds.append(time.perf_counter() - started)
    print(json.dumps({"step_peak_bytes": _status("VmHWM") - before, "step_seconds": seconds}))


def child_update(args):
    """Each weight's first update at SGD lr 1.0, from the weights in `args.weights` (written if absent)."""
    import keras
    import numpy as np

    model = _build(args)
    if os.path.exists(args.weights):
        model.load_weights(args.weights)
    else:
        model.save_weights(args.weights)
    model.compile(keras.optimizers.SGD(lr=1.0), "sparse_categorical_crossentropy")
    start = model.get_weights()
    model.train_on_batch(*_data(args.batch, args.seq, args.vocab))
    update = np.concatenate([(after - before).ravel() for after, before in zip(model.get_weights(), start)])
    np.save(args.weights + "." + args.method + ".npy", update)
    print(json.dumps({"saved": True}))


def _run(args, method, batch, child, extra=()):
    command = [sys.executable, os.path.abspath(__file__), "--child", child, "--method", method, "--batch", str(batch)]
    for name in ("size", "seq", "steps", "dropout", "vocab"):
        command += ["--%s" % name, str(getattr(args, name))]
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", TF_CPP_MIN_LOG_LEVEL="3", PYTHONHASHSEED="0")
    environment["RECOMPUTE"] = "1" if method != "none" else "0"
    process = subprocess.run(
        command + list(extra), env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True
    )
    lines = [line for line in process.stdout.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not lines:
        error = (process.stderr.strip().splitlines() or ["exit %d" % process.returncode])[-1]
        print("  %s at batch %d failed: %s" % (method, batch, error), flush=True)
        return {"error": error}
    return json.loads(lines[-1])


def check_updates(args, methods):
    """Each method's first update against plain's, normwise, on a tiny BERT with dropout off."""
    import numpy as np

    small = argparse.Namespace(**dict(vars(args), size="tiny", seq=16, vocab=100, dropout=0.0))
    weights = os.path.join(tempfile.mkdtemp(), "weights.h5")
    errors = {}
    for method in ("none",) + tuple(m for m in methods if m != "none"):
        result = _run(small, method, 8, "update", ["--weights", weights])
        if "error" in result:
            errors[method] = {"error": result["error"]}
            continue
        if method != "none":
            got, want = np.load(weights + ".%s.npy" % method), np.load(weights + ".none.npy")
            errors[method] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            print("  first update of %-6s against plain: %.3g normwise" % (method, errors[method]), flush=True)
    return errors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=21128)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--budget-mb", type=float, default=4096)
    parser.add_argument("--batches", type=int, nargs=2, default=[4, 12])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--check", action="store_true", help="compare first updates with plain's (a tiny BERT)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--reuse", help="an earlier --out of the same model: its measured points are not measured again")
    parser.add_argument("--rounds", type=int, default=2, help="--retime: rounds of every method, in turns")
    parser.add_argument(
        "--retime", help="an earlier --out of the same model: time each method again at the larger batch, in turns, "
        "and take the time per sample from these runs (the memory figures are kept)")
    parser.add_argument("--child", choices=("memory", "update"), help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "memory":
        return child_memory(args)
    if args.child == "update":
        return child_update(args)
    methods = [m for m in args.methods if not (m == "theirs" and args.dropout > 0)]
    if args.retime:
        return retime(args, methods)

    import keras
    import tensorflow as tf

    budget = args.budget_mb * 2**20
    earlier = {}
    if args.reuse:
        with open(args.reuse) as source:
            earlier = json.load(source)["results"]
    results = {}
    for method in methods:
        print("%s:" % method, flush=True)
        points = {}
        for batch in args.batches:
            reused = earlier.get(method, {}).get("points", {}).get(str(batch))
            points[batch] = reused if reused and "error" not in reused else _run(args, method, batch, "memory")
            if "error" in points[batch]:
                break
            print("  batch %3d: step peak %8.1f MB, fastest step %.2f s" % (
                batch, points[batch]["step_peak_bytes"] / 2**20, min(points[batch]["step_seconds"])), flush=True)
        result = {"points": {str(batch): point for batch, point in points.items()}}
        if all("error" not in point for point in points.values()):
            (b1, p1), (b2, p2) = [(batch, points[batch]["step_peak_bytes"]) for batch in args.batches]
            per_sample = (p2 - p1) / float(b2 - b1)
            fixed = p1 - per_sample * b1
            if per_sample <= 0 or fixed >= budget:
                print("  the peak does not grow with the batch, or the budget is below its intercept: no answer")
                results[method] = result
                continue
            predicted = largest = int((budget - fixed) // per_sample)
            one_step = argparse.Namespace(**dict(vars(args), steps=1))
            check = _run(one_step, method, largest, "memory")
            for _ in range(3):  # the line is a little off far from its points: step down until a run fits
                peak = check.get("step_peak_bytes", float("inf"))
                if peak <= budget:
                    break
                over = peak - budget if peak < float("inf") else 0.05 * budget
                largest -= max(1, int(-(-over // per_sample)))
                print("  batch %d went over the budget: trying %d" % (largest + max(1, int(-(-over // per_sample))), largest))
                check = _run(one_step, method, largest, "memory")
            result.update(
                per_sample_mb=per_sample / 2**20,
                fixed_mb=fixed / 2**20,
                predicted_batch=predicted,
                largest_batch=largest,
                largest_batch_peak_mb=check.get("step_peak_bytes", float("nan")) / 2**20,
                largest_batch_fits=check.get("step_peak_bytes", float("inf")) <= budget,
                seconds_per_sample=min(points[b2]["step_seconds"]) / b2,
            )
            print("  %.1f MB a sample above %.1f MB: largest batch in %.0f MB is %d; run there: peak %.1f MB (%s)" % (
                result["per_sample_mb"], result["fixed_mb"], args.budget_mb, largest, result["largest_batch_peak_mb"],
                "fits" if result["largest_batch_fits"] else "OVER"), flush=True)
        results[method] = result
    plain = results.get("none", {})
    print("\nTensorFlow %s, Keras %s, bert4keras BERT-%s, seq %d, batch-linear peak, float32, CPU, budget %.0f MB" % (
        tf.__version__, keras.__version__, args.size, args.seq, args.budget_mb))
    for method, result in results.items():
        if "largest_batch" not in result:
            print("%-7s failed" % method)
            continue
        ratios = ""
        if plain.get("largest_batch") and method != "none":
            result["largest_batch_vs_none"] = result["largest_batch"] / float(plain["largest_batch"])
            result["time_per_sample_vs_none"] = result["seconds_per_sample"] / plain["seconds_per_sample"]
            ratios = "  (%.2fx the batch, %.2fx the time a sample)" % (
                result["largest_batch_vs_none"], result["time_per_sample_vs_none"])
        print("%-7s %6.1f MB a sample; largest batch %4d; %.3f s a sample%s" % (
            method, result["per_sample_mb"], result["largest_batch"], result["seconds_per_sample"], ratios))
    record = {
        "command": "PYTHONPATH=. python " + " ".join(["benchmarks/legacy_bert4keras.py"] + (argv if argv is not None else sys.argv[1:])),
        "device": _record.device(),
        "dtype": "float32",
        "date": time.strftime("%Y-%m-%d"),
        "commit": _record.commit(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
        "model": dict(size=args.size, seq=args.seq, vocab=args.vocab, dropout=args.dropout, optimizer="Adam"),
        "budget_mb": args.budget_mb,
        "results": results,
    }
    if args.check:
        record["first_update_error_vs_none"] = check_updates(args, methods)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(record, out, indent=2)
    return 0


def retime(args, methods):
    """`--retime FILE`: each method's step at the larger batch once more, one after another, in fresh processes.

    A run's time per sample comes from its points, measured method after
    method; if the machine was busier while one method ran, the ratios lie.
    This times every method again in turns (`--rounds` rounds of `--steps`
    steps each, the fastest taken) and rewrites the time per sample and its ratio in FILE (or `--out`),
    keeping the earlier times under `earlier_seconds_per_sample`.
    """
    with open(args.retime) as source:
        record = json.load(source)
    results = record["results"]
    batch = max(int(b) for b in results[methods[0]]["points"])
    fastest = {}
    for _ in range(args.rounds):
        for method in methods:
            timed = _run(args, method, batch, "memory")
            if "error" in timed:
                return 1
            fastest[method] = min([fastest.get(method, float("inf"))] + timed["step_seconds"])
    for method in methods:
        result = results[method]
        result["earlier_seconds_per_sample"] = result.get("seconds_per_sample")
        result["seconds_per_sample"] = fastest[method] / batch
        print("%-7s %.3f s a sample at batch %d (was %.3f)" % (method, result["seconds_per_sample"], batch, result["earlier_seconds_per_sample"]), flush=True)
    for method in methods:
        if method != "none":
            results[method]["time_per_sample_vs_none"] = results[method]["seconds_per_sample"] / results["none"]["seconds_per_sample"]
    record["retimed"] = {
        "command": "PYTHONPATH=. python " + " ".join(["benchmarks/legacy_bert4keras.py"] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"), "commit": _record.commit(), "batch": batch, "steps": args.steps, "rounds": args.rounds,
        "why": "the first run's points were timed method after method while the machine was busier for some",
    }
    with open(args.out or args.retime, "w") as out:
        json.dump(record, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
