"""What `memory_report` predicts for a keras.applications CNN with a frozen backbone, against its step's peak.

Transfer learning trains a head over a frozen backbone, then the upper layers too: a unit no trained
weight reaches keeps nothing in a compiled step (NOTE [ a unit no gradient reaches ] in
`keras_recompute/_memory.py`). Each configuration runs in a fresh process: `peak`, the peak of
`fit`'s step (SGD, MSE; the second step, the first traces it): on TensorFlow the BFC allocator's,
of the compiled step; on PyTorch the profiler's allocation records (`_measure.torch_cpu_peak`);
`predicted`, `memory_report`'s predicted peak, with `--before DIR` (a checkout's `keras_recompute`
folder's parent) also as that version predicts it; and where a plan can lower the peak,
`recompute_model(budget=)` half way between the least plan and no recompute: the budget and that
plan's measured peak. On PyTorch `planned` is the step with a plan of no recompute in place
(`budget="100GB"`): the model runs as the pieces `memory_report` measured, each of which frees its
intermediate tensors when it returns, where Keras's own run of a functional graph keeps every
layer's output until the graph's call returns (`plain`).

```
python benchmarks/frozen_prediction.py --out benchmarks/results/frozen_prediction_tensorflow.json
python benchmarks/frozen_prediction.py --backend torch --size 96 --batch 16 --out benchmarks/results/frozen_prediction_torch.json
```
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

CHILD = r"""
import json, sys
import numpy as np, keras
import keras_recompute
name, frozen, mode, batch, size, budget = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
sys.path.insert(0, sys.argv[7])
import _measure
torch = keras.backend.backend() == "torch"
model = _measure.applications_under_a_head(name, size, frozen)
x = np.random.RandomState(0).rand(batch, size, size, 3).astype("float32")
y = np.random.RandomState(1).rand(batch, 1).astype("float32")
if mode == "report":
    report = keras_recompute.memory_report(model, inputs=x)  # compiled on TensorFlow: `fit` runs a compiled step
    print(json.dumps({"predicted": report.predicted_peak, "floor": report.floor, "units": len(report.rows),
                      "unreached": getattr(report, "unreached", None)}))
    sys.exit()
record = {}
if mode in ("budget", "planned"):
    keras_recompute.recompute_model(model, budget=budget if mode == "budget" else "100GB", inputs=x, enabled=True)
    record["plan"] = [row["policy"] for row in keras_recompute.memory_report(model, inputs=x).rows]
model.optimizer.build(model.trainable_variables)
model.train_on_batch(x, y)
if torch:
    held = [v.value for v in model.variables + model.optimizer.variables]
    record["peak"] = _measure.torch_cpu_peak(lambda: model.train_on_batch(x, y), held)
else:
    import tensorflow as tf

    tf.config.experimental.reset_memory_stats("CPU:0")
    model.train_on_batch(x, y)
    record["peak"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
print(json.dumps(record))
"""

MODELS = ["ResNet50", "MobileNetV2"]
FROZEN = ["none", "all", "lower_half"]


def _child(name, frozen, mode, args, source, budget=0):
    return _measure.child(CHILD, [name, frozen, mode, args.batch, args.size, int(budget)], args.backend, source)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["tensorflow", "torch"], default="tensorflow")
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--frozen", nargs="+", choices=FROZEN, default=FROZEN)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=128, help="the images' height and width")
    parser.add_argument("--before", help="the parent folder of an earlier keras_recompute, predicting as `before`")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = {}
    for name in args.models:
        for frozen in args.frozen:
            row = results[f"{name} {frozen}"] = {"plain": _child(name, frozen, "plain", args, _measure.ROOT)}
            if args.backend == "torch":  # the model as the report measures it: as pieces
                row["planned"] = _child(name, frozen, "planned", args, _measure.ROOT)
            row["report"] = _child(name, frozen, "report", args, _measure.ROOT)
            if args.before:
                row["report_before"] = _child(name, frozen, "report", args, os.path.abspath(args.before))
            peak = row.get("planned", row["plain"]).get("peak")
            for key in ("report", "report_before"):
                if peak and "predicted" in row.get(key, {}):
                    row[key]["over_peak"] = row[key]["predicted"] / peak
            report = row["report"]
            if "predicted" in report and report["floor"] < 0.95 * report["predicted"]:
                budget = (report["floor"] + report["predicted"]) // 2
                row["budget"] = dict(_child(name, frozen, "budget", args, _measure.ROOT, budget), budget=budget)
                if "peak" in row["budget"]:
                    row["budget"]["peak_over_budget"] = row["budget"]["peak"] / budget
            before = row.get("report_before", {})
            print(
                f"{name:12s} {frozen:10s} plain {row['plain'].get('peak', 0) / 1e6:7.1f} MB  "
                f"peak {(peak or 0) / 1e6:7.1f} MB  predicted {report.get('predicted', 0) / 1e6:7.1f} MB "
                f"({report.get('over_peak', 0):.2f}x)"
                + (f"  before {before['predicted'] / 1e6:7.1f} MB ({before['over_peak']:.2f}x)" if "over_peak" in before else "")
                + (f"  budget {row['budget']['budget'] / 1e6:.1f} MB: peak {row['budget'].get('peak', 0) / 1e6:.1f} MB"
                   if "budget" in row else ""),
                flush=True,
            )
    _measure.write_json(args.out, vars(args), results)


if __name__ == "__main__":
    main()
