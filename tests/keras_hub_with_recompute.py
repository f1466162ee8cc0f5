"""Runs keras-hub's own test files with `recompute_model` applied to every backbone they build.

keras-hub's wheel ships no tests: point this at a checkout of its source (of the version installed)
and name the test files, relative to it. Each file runs once per Keras backend, in a pytest of its
own, with `RECOMPUTE=1` and this file as a pytest plugin: every `keras_hub.models.Backbone` built
gets `recompute_model(backbone)` at the end of its construction (its transformer blocks recompute,
in every dtype policy the tests try), and `integrations.keras_hub.enable()` recomputes every
`TransformerEncoder` and `TransformerDecoder`. Tests marked large (they download presets) are left
out, as keras-hub's own configuration leaves them out by default.

```
python tests/keras_hub_with_recompute.py ../keras-hub \\
    keras_hub/src/models/llama/llama_backbone_test.py keras_hub/src/models/mistral/mistral_backbone_test.py
python tests/keras_hub_with_recompute.py ../keras-hub --backends jax -- -k basics
```

The files are copied to a temporary folder, so they import keras-hub as installed (its
`src/tests/test_case.py` is in the wheel). The summary counts each backend's results and how many
backbones were recomputed: a run that recomputed none proved nothing and fails.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

BACKENDS = ("tensorflow", "jax", "torch")
_COUNT_FILE = "KERAS_RECOMPUTE_BACKBONES_FILE"


def pytest_configure(config):
    """As a pytest plugin: `recompute_model` on every keras-hub backbone built in the session,
    and `integrations.keras_hub.enable()` (its `TransformerEncoder` and `TransformerDecoder`)."""
    del config
    import keras_hub

    from keras_recompute import recompute_model
    from keras_recompute.integrations import keras_hub as recompute_keras_hub

    recompute_keras_hub.enable()

    backbone = keras_hub.models.Backbone
    original = backbone.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)  # a functional model: built by now
        recompute_model(self)
        with open(os.environ[_COUNT_FILE], "a") as count:
            count.write(f"{type(self).__name__}\n")

    backbone.__init__ = __init__


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", help="a checkout of keras-hub's source")
    parser.add_argument("files", nargs="+", help="test files, relative to the checkout")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.files:
            shutil.copy(os.path.join(args.checkout, name), folder)
        files = [os.path.join(folder, os.path.basename(name)) for name in args.files]
        for backend in args.backends:
            counted = os.path.join(folder, f"backbones_{backend}.txt")
            open(counted, "w").close()
            env = dict(
                os.environ,
                KERAS_BACKEND=backend,
                RECOMPUTE="1",
                TF_CPP_MIN_LOG_LEVEL="3",
                PYTHONPATH=os.pathsep.join([here, root, os.environ.get("PYTHONPATH", "")]),
                **{_COUNT_FILE: counted},
            )
            print(f"\n===== KERAS_BACKEND={backend} =====", flush=True)
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "keras_hub_with_recompute", "-p", "no:cacheprovider",
                 "--rootdir", folder, "-m", "not large and not extra_large and not kaggle_key_required",
                 *files, *args.pytest_args],
                env=env, cwd=folder, capture_output=True, text=True, check=False,
            )
            lines = done.stdout.strip().splitlines()
            print("\n".join(line for line in lines if line.startswith(("FAILED", "ERROR"))), flush=True)
            with open(counted) as count:
                backbones = len(count.read().split())
            results[backend] = (done.returncode, lines[-1] if lines else done.stderr[-500:], backbones)
    print("\n===== summary =====")
    for backend, (code, last, backbones) in results.items():
        print(f"{backend:<11} {last}  ({backbones} backbones recomputed)")
    return 0 if all(code == 0 and backbones > 0 for code, _, backbones in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
