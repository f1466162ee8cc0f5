"""What compiling moves: keras-hub backbones on random inputs, the plain and recomputed steps compiled and op by op.

`verify` compares the compiled recomputed step with the compiled plain one. A compiler (XLA) makes
the two different programs, and a model that amplifies float rounding (BatchNorm deep in a
convnet) can differ beyond reassociation with no defect at all. This measures, per backbone (built
as keras-hub's backbone test builds it, `keras_hub_verify_all.py`, with random inputs in [0, 1)
instead of the tests' constant images), the largest difference of every weight's first update at
SGD lr 1.0 (normwise: over the largest plain update) between:

- `plain_compiled_vs_op_by_op`: the plain step compiled and run op by op (`run_eagerly=True`);
- `recomputed_vs_plain_op_by_op`: the recomputed and plain steps, both op by op;
- `recomputed_vs_plain_compiled`: both compiled (what verify compares first);
- `ratio`: the last over the first (NOTE [ what compiling moves ] in keras_recompute/_verify.py
  allows 10x), and `verify` itself: its verdict with the yardstick.

```
KERAS_BACKEND=jax python benchmarks/verify_compiled_rounding.py ../keras-hub --out benchmarks/results/verify_compiled_rounding.json
```
"""

import argparse
import glob
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _record  # noqa: E402
import keras_hub_verify_all  # noqa: E402

MODELS = ["densenet", "mobilenet", "resnet", "efficientnet", "cspnet", "xception", "vgg", "hgnetv2"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", help="a checkout of keras-hub's source")
    parser.add_argument("--models", nargs="+", default=MODELS, help="model folders (keras_hub/src/models/<name>)")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    sys.modules.setdefault("grain", types.ModuleType("grain"))  # keras_hub_verify_all.py's docstring
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import keras_recompute

    folder = os.path.join(args.checkout, "keras_hub", "src", "models")
    results = []
    for name in args.models:
        path = sorted(glob.glob(os.path.join(folder, name, "*_backbone_test.py")))[0]
        config, reason = keras_hub_verify_all._config(path, name)
        if config is None:
            results.append({"model": name, "skipped": reason})
            continue
        cls, init_kwargs, input_data = config
        rng = np.random.RandomState(0)
        x = keras.tree.map_structure(
            lambda a: rng.rand(*np.shape(a)).astype(np.asarray(a).dtype) if np.asarray(a).dtype.kind == "f" else a,
            input_data,
        )
        y = np.zeros((keras.tree.flatten(x)[0].shape[0],), "float32")
        keras.utils.set_random_seed(1)
        model = keras_hub_verify_all._head_model(keras, cls(**init_kwargs))
        start = [np.array(v) for v in model.variables]

        def update(**settings):
            """The first update of every weight (SGD at lr 1.0) of the step compiled with these settings."""
            model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse", **settings)
            for _ in range(2):  # the first call traces and compiles; both run from the same variables and seed
                for variable, value in zip(model.variables, start):
                    variable.assign(value)
                keras.utils.set_random_seed(0)
                model.train_on_batch(x, y)
            return [np.asarray(v, np.float64) - w for v, w in zip(model.variables, start)]

        plain, plain_eager = update(), update(run_eagerly=True)
        keras_recompute.recompute_model(model, enabled=True)
        recomputed, recomputed_eager = update(), update(run_eagerly=True)
        scale = max(float(np.max(np.abs(u))) for u in plain if u.size) or 1.0

        def apart(a, b):
            return max(float(np.max(np.abs(p - q), initial=0.0)) for p, q in zip(a, b)) / scale

        result = {
            "model": name,
            "backbone": cls.__name__,
            "plain_compiled_vs_op_by_op": apart(plain, plain_eager),
            "recomputed_vs_plain_op_by_op": apart(recomputed_eager, plain_eager),
            "recomputed_vs_plain_compiled": apart(recomputed, plain),
        }
        compiled = result["plain_compiled_vs_op_by_op"]
        result["ratio"] = result["recomputed_vs_plain_compiled"] / compiled if compiled else None
        for variable, value in zip(model.variables, start):
            variable.assign(value)
        model.compile(optimizer="sgd", loss="mse")
        report = keras_recompute.verify(model, x, y, trials=2, memory=False)
        result["verify"] = (
            "ok (compiler's rounding)" if report.ok and report.op_by_op is not None
            else "ok" if report.ok else "cannot tell" if report.cannot_tell else "DIFFERS"
        )
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.out:
        import keras_hub

        record = dict(_record.metadata(), backend=keras.backend.backend(), keras_hub=keras_hub.__version__,
                      keras_hub_source=keras_hub_verify_all._source(args.checkout), inputs="random, uniform [0, 1)",
                      results=results)
        with open(args.out, "w") as file:
            file.write(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
