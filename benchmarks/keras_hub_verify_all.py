"""`keras_recompute.verify` on every keras-hub backbone, each built as keras-hub's own test builds it.

keras-hub's wheel ships no tests: point this at a checkout of its source (of the version installed).
For each `keras_hub/src/models/*/*_backbone_test.py` it takes the test's `setUp` (`init_kwargs`,
`input_data`: the small config keras-hub tests the backbone with), builds the backbone with them,
puts a head on it (a `Dense(1)` on each float output, averaged: the loss reaches every output and
every weight) and runs `verify(model, input_data, zeros)`: the model's compiled step, plain and with
`recompute_model` (its repeated blocks, or its graph cut between layers with weights, whichever
`blocks="auto"` finds), every weight's first update compared (NOTE [ what verify compares ]).

A test whose setUp has no `init_kwargs`/`input_data` (a few vision tests build theirs per test) is
recorded as skipped, with why. keras-hub's `test_case.py` imports `grain` at the top for its
preprocessing tests only; where grain is not installed a stub module stands in (nothing here uses it).

```
KERAS_BACKEND=torch python benchmarks/keras_hub_verify_all.py ../keras-hub --out benchmarks/results/keras_hub_verify_all_torch.json
KERAS_BACKEND=jax python benchmarks/keras_hub_verify_all.py ../keras-hub --models t5 bert --policy save_dots
```
"""

import argparse
import glob
import importlib.util
import inspect
import json
import os
import signal
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _record  # noqa: E402


class _Timeout(Exception):
    pass


_ALARMS = []  # one entry per alarm that went off: the exception may come back wrapped in Keras's own


def _alarm(*_):
    _ALARMS.append(1)
    raise _Timeout()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", help="a checkout of keras-hub's source")
    parser.add_argument("--models", nargs="+", help="model folders (keras_hub/src/models/<name>); default: all")
    parser.add_argument("--policy", default="full")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--limit", type=int, default=300, help="seconds a model may take before it is recorded as timed out")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def _head_model(keras, backbone):
    """The backbone and a head: a Dense(1) on each float output (the mean where its last axis is unknown), averaged."""
    outputs = backbone(backbone.input)
    total = None
    for index, tensor in enumerate(keras.tree.flatten(outputs)):
        if "float" not in str(tensor.dtype) or len(tensor.shape) < 2:
            continue
        if tensor.shape[-1] is not None:
            tensor = keras.layers.Dense(1, dtype="float32", name=f"head_{index}")(tensor)
        value = keras.ops.mean(tensor, axis=list(range(1, len(tensor.shape))))
        total = value if total is None else total + value
    return keras.Model(backbone.input, total)


def _config(path, name):
    """`(backbone class, init_kwargs, input_data)` from a backbone test's setUp, or a reason it has none."""
    import keras_hub
    from keras_hub.src.tests.test_case import TestCase

    spec = importlib.util.spec_from_file_location(f"keras_hub_verify_all_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(path) as file:
        source = file.read()
    cases = [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, TestCase) and c is not TestCase]
    classes = [
        c for c in vars(module).values()
        if inspect.isclass(c) and issubclass(c, keras_hub.models.Backbone) and c.__name__.endswith("Backbone")
        and f"cls={c.__name__}" in source.replace(" ", "")
    ]
    if not cases or not classes:
        return None, "no backbone test case (cls=...Backbone) found in the file"
    case = cases[0]
    test = case(next(m for m in dir(case) if m.startswith("test_")))
    test.setUp()
    if not hasattr(test, "init_kwargs") or not hasattr(test, "input_data"):
        return None, "its setUp makes no init_kwargs and input_data (each test builds its own)"
    return (classes[0], test.init_kwargs, test.input_data), None


def _verify_one(keras, verify, path, name, args):
    config, reason = _config(path, name)
    if config is None:
        return {"model": name, "skipped": reason}
    cls, init_kwargs, input_data = config
    keras.utils.set_random_seed(1)
    model = _head_model(keras, cls(**init_kwargs))
    model.compile(optimizer="sgd", loss="mse")
    batch = keras.tree.flatten(input_data)[0].shape[0]
    report = verify(model, input_data, keras.ops.zeros((batch,)), policy=args.policy, trials=args.trials, memory=False)
    if _ALARMS:  # the alarm went off inside a step, which verify reports (Keras's build wraps it: EfficientNet on JAX)
        raise _Timeout()
    return {
        "model": name,
        "backbone": cls.__name__,
        "units": len(report.units),
        "unit_names": report.units[:3] + (["..."] if len(report.units) > 3 else []),  # what blocks="auto" chose
        "ok": bool(report.ok),
        "compilers_rounding": any(row["rounding"] for row in report.rows),  # NOTE [ what compiling moves ]
        "cannot_tell": bool(report.cannot_tell),
        "worst_difference": max((row["difference"] for row in report.rows), default=None),
        "plain_spread": report.plain_spread,
        "failure": report.failure,
    }


def _source(checkout):
    """The checkout's commit, where it is a git checkout (else its path)."""
    import subprocess

    try:
        head = subprocess.check_output(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], stderr=subprocess.DEVNULL)
        return f"keras-team/keras-hub at {head.decode().strip()}"
    except (OSError, subprocess.CalledProcessError):
        return os.path.abspath(checkout)


def main(argv=None):
    args = parse_args(argv)
    sys.modules.setdefault("grain", types.ModuleType("grain"))  # see the docstring
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    from keras_recompute import verify

    folder = os.path.join(args.checkout, "keras_hub", "src", "models")
    names = args.models or sorted(os.listdir(folder))
    signal.signal(signal.SIGALRM, _alarm)
    results = []
    for name in names:
        for path in sorted(glob.glob(os.path.join(folder, name, "*_backbone_test.py"))):
            started = time.perf_counter()
            _ALARMS.clear()
            signal.alarm(args.limit)
            try:
                result = _verify_one(keras, verify, path, os.path.basename(path)[: -len("_backbone_test.py")], args)
            except Exception as error:  # noqa: BLE001 - recorded: a model this backend cannot build or train
                result = {"model": name, "error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
                if _ALARMS:  # _Timeout, or an error Keras raised from it
                    result["error"] = f"timed out after {args.limit} s"
            finally:
                signal.alarm(0)
            result["seconds"] = round(time.perf_counter() - started, 1)
            results.append(result)
            verdict = "ok" if result.get("ok") else result.get("skipped") or result.get("error") or result["failure"]
            print(f"{result['model']:<22} {result.get('backbone', ''):<28} {verdict}", flush=True)
    checked = [r for r in results if "ok" in r]
    summary = {
        "verified": len(checked),
        "ok": sum(r["ok"] for r in checked),
        "not_ok": [r["model"] for r in checked if not r["ok"]],
        "errors": [r["model"] for r in results if "error" in r],
        "skipped": [r["model"] for r in results if "skipped" in r],
    }
    print(json.dumps(summary))
    if args.out:
        import keras_hub

        record = dict(_record.metadata(), backend=keras.backend.backend(), keras_hub=keras_hub.__version__,
                      keras_hub_source=_source(args.checkout), policy=args.policy, trials=args.trials,
                      summary=summary, results=results)
        with open(args.out, "w") as file:
            file.write(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
