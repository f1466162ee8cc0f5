"""Where a TensorFlow step's allocator peak leaves the planner's count: a keras.applications CNN, per uniform plan.

`memory_report` counts, on TensorFlow, the tensors a traced backward reads
of its forward (NOTE [ measuring a unit on TensorFlow ] in
`backends/tensorflow.py`). The BFC allocator's figures hold more: each
configuration runs in a fresh process (TF_CPU_ALLOCATOR_USE_BFC=1) and
reports, for `fit`'s compiled step (SGD, MSE) with no recompute, `full` or
`save_dots` on every unit:
  * `predicted`: the planner's peak for that plan (`measured_costs`), as it
    counts it where the allocator keeps no figures (not calibrated);
  * with `--calibrated`, `calibrated`: `memory_report`'s peak of the plan
    applied, calibrated to the allocator (its step run at a quarter and a
    half of the batch: NOTE [ calibrating a CNN to TensorFlow's allocator ]);
  * `peaks`: the allocator's peak of three steps after the first;
  * `persistent`: bytes in use after the steps above those before them
    (what the compiled step holds between steps);
  * `live`, `counted`: bytes in use at the end of the forward of a
    `tf.function` step like `fit`'s (read there by a `tf.py_function` that
    the backward waits for), above those before the step; and the traced
    backward's reads of that step's own graph, as the planner counts them.
With `--no-constant-folding`, Grappler's constant folding is off.

```
python benchmarks/tf_allocator_gap.py --models MobileNetV2 ResNet50 --out benchmarks/results/tf_allocator_gap.json
python benchmarks/tf_allocator_gap.py --models MobileNetV2 --policies full --no-constant-folding --out benchmarks/results/tf_allocator_gap_no_folding.json
python benchmarks/tf_allocator_gap.py --models MobileNetV2 --calibrated --out benchmarks/results/tf_allocator_gap_calibrated.json
```
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

CHILD = r"""
import json, sys
import numpy as np, keras, tensorflow as tf
import keras_recompute
from keras_recompute import _model
from keras_recompute.backends import tensorflow as backend
name, policy, batch, size, fold = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
calibrate = sys.argv[6] == "1"
sys.path.insert(0, sys.argv[7])
import _measure
if not fold:
    tf.config.optimizer.set_experimental_options({"constant_folding": False})
current = lambda: tf.config.experimental.get_memory_info("CPU:0")["current"]  # noqa: E731
model = _measure.applications_under_a_head(name, size)
x = tf.constant(np.random.RandomState(0).rand(batch, size, size, 3).astype("float32"))
y = tf.constant(np.random.RandomState(1).rand(batch, 1).astype("float32"))
record = {}
calibrates = backend.states_step_bytes
backend.states_step_bytes = lambda model: False  # the planner's count, as where the allocator keeps no figures
_, costs, _, _ = _model.measured_costs(model, x.numpy(), where="memory_report")
backend.states_step_bytes = calibrates
record["predicted"] = costs.peak([policy] * len(costs.units))
if policy != "none":
    keras_recompute.recompute_model(model, policy=policy, enabled=True)
if calibrate:  # the report of the plan applied, calibrated to the allocator (its step run at a quarter and a half)
    record["calibrated"] = keras_recompute.memory_report(model, x.numpy()).predicted_peak
model.optimizer.build(model.trainable_variables)
before = current()
model.train_on_batch(x, y)
record["peaks"] = []
for _ in range(3):
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.train_on_batch(x, y)
    record["peaks"].append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
record["persistent"] = current() - before
probes, variables = [], model.trainable_variables

def probe(_):
    probes.append(current())
    return np.float32(0)

@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        loss = loss + 0.0 * tf.py_function(probe, [loss], tf.float32)  # the backward waits for the probe
    model.optimizer.apply(tape.gradient(loss, variables), variables)
    return loss

step(x, y)
start = current()
step(x, y)
record["live"] = probes[-1] - start
concrete = step.get_concrete_function(x, y)
operations = concrete.graph.get_operations()
forward = [i for i, op in enumerate(operations) if op.type == "EagerPyFunc"][0] + 1
record["counted"] = backend._kept_bytes(operations, forward, concrete.outputs)[0]
print(json.dumps(record))
"""

POLICIES = ["none", "full", "save_dots"]


def _child(name, policy, args):
    fold = 0 if args.no_constant_folding else 1
    return _measure.child(CHILD, [name, policy, args.batch, args.size, fold, int(args.calibrated)], "tensorflow")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["MobileNetV2"])
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=POLICIES)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=128, help="the images' height and width")
    parser.add_argument("--no-constant-folding", action="store_true", help="Grappler's constant folding off")
    parser.add_argument("--calibrated", action="store_true", help="also memory_report's peak of the plan applied")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = {}
    for name in args.models:
        for policy in args.policies:
            row = results[f"{name} {policy}"] = _child(name, policy, args)
            if "error" in row:
                print(f"{name:12s} {policy:9s} {row['error']}", flush=True)
                continue
            row["peak_over_predicted"] = max(row["peaks"]) / row["predicted"]
            row["live_over_counted"] = row["live"] / row["counted"]
            if "calibrated" in row:
                row["peak_over_calibrated"] = max(row["peaks"]) / row["calibrated"]
                print(f"{name:12s} {policy:9s} calibrated {row['calibrated'] / 1e6:6.1f} MB "
                      f"({row['peak_over_calibrated']:.2f}x)", flush=True)
            print(
                f"{name:12s} {policy:9s} predicted {row['predicted'] / 1e6:6.1f} MB  peaks "
                + "/".join(f"{p / 1e6:.1f}" for p in row["peaks"])
                + f" MB ({row['peak_over_predicted']:.2f}x)  persistent {row['persistent'] / 1e6:5.1f} MB  "
                f"end of forward: live {row['live'] / 1e6:6.1f} MB, counted {row['counted'] / 1e6:6.1f} MB "
                f"({row['live_over_counted']:.2f}x)",
                flush=True,
            )
    _measure.write_json(args.out, vars(args), results)


if __name__ == "__main__":
    main()
