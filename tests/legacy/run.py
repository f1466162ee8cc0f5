"""Runs the legacy tests in the seed's own environments: standalone Keras 2.3.1 and tf.keras on TensorFlow 1.x to 2.3.

```
python tests/legacy/run.py                # TF 1.15, TF 2.0 and TF 2.1, each with Keras 2.3.1
python tests/legacy/run.py --all          # and TF 1.14, and TF 2.2 and 2.3 with their tf.keras
python tests/legacy/run.py --envs tf1.14-keras2.3 -- -k batch_norm
python tests/legacy/run.py --require      # CI: fail, not skip, without a Python 3.7
```

These TensorFlows install only on Python 3.7 (or older). The runner finds a
Python 3.7 (`--python`, `$LEGACY_PYTHON`, pyenv's versions, `python3.7` on
the PATH), builds one virtual environment per environment with its versions
pinned, cached under `~/.cache/keras_recompute/legacy` (a changed pin builds
a new one), installs this checkout into it, runs `tests/legacy` there with
pytest, and prints a summary line per environment. It exits non-zero when
an environment's tests fail, or, with `--require`, when no Python 3.7 is
found; without it a missing interpreter skips with a message.
"""

import argparse
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# protobuf 4 breaks these TensorFlows' import; h5py 3 breaks Keras 2.3's saving.
COMMON = ["h5py<3", "protobuf==3.20.3", "pytest<8"]
NO_DEPS = ["bert4keras==0.11.5"]
ENVIRONMENTS = {
    "tf1.15-keras2.3": ["tensorflow==1.15.5", "keras==2.3.1"],
    "tf2.1-keras2.3": ["tensorflow-cpu==2.1.4", "keras==2.3.1"],
    "tf1.14-keras2.3": ["tensorflow==1.14.0", "keras==2.3.1"],
    "tf2.0-keras2.3": ["tensorflow==2.0.4", "keras==2.3.1"],
    "tf2.2-tf.keras": ["tensorflow-cpu==2.2.3"],  # no standalone Keras: its own tf.keras
    "tf2.3-tf.keras": ["tensorflow-cpu==2.3.4"],
}
# What each environment runs (default: all of tests/legacy; each file skips where it does not apply).
TESTS = {name: [os.path.join("tests", "legacy", "test_tf_keras.py")] for name in ("tf2.2-tf.keras", "tf2.3-tf.keras")}
# TF 2.0 has no op callbacks: its tf.keras takes paths of its own (NOTE [ tensors closed over without op callbacks ]).
DEFAULT = ["tf1.15-keras2.3", "tf2.0-keras2.3", "tf2.1-keras2.3"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", choices=sorted(ENVIRONMENTS), help="environments to run (default: %s)" % " ".join(DEFAULT))
    parser.add_argument("--all", action="store_true", help="every environment")
    parser.add_argument("--python", help="a Python 3.7 interpreter (default: found)")
    parser.add_argument("--require", action="store_true", help="fail, not skip, when no Python 3.7 is found")
    parser.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "keras_recompute", "legacy"))
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    names = sorted(ENVIRONMENTS, key=list(ENVIRONMENTS).index) if args.all else (args.envs or DEFAULT)

    python = args.python or find_python()
    if python is None:
        message = "no Python 3.7 found (pyenv, python3.7 on the PATH, --python or $LEGACY_PYTHON)"
        print("legacy tests: %s: %s" % ("FAILED" if args.require else "skipped", message), flush=True)
        return 1 if args.require else 0

    results = []
    for name in names:
        started = time.monotonic()
        print("\n===== legacy %s: %s =====" % (name, " ".join(ENVIRONMENTS[name])), flush=True)
        try:
            bin_dir = environment(python, name, args.cache)
            tests = TESTS.get(name, [os.path.join("tests", "legacy")])
            command = [os.path.join(bin_dir, "python"), "-m", "pytest"] + tests + ["-q", "-p", "no:cacheprovider"]
            code = subprocess.call(command + args.pytest_args, cwd=ROOT, env=dict(os.environ, PYTHONNOUSERSITE="1"))
        except subprocess.CalledProcessError as error:
            print("could not build the environment: %s" % error, flush=True)
            code = "install"
        results.append((name, code, time.monotonic() - started))

    print("\n===== legacy summary (%s) =====" % python)
    for name, code, seconds in results:
        verdict = "passed" if code == 0 else ("FAILED (install)" if code == "install" else "FAILED (pytest exit %s)" % code)
        print("%-17s %-24s %5.1f min" % (name, verdict, seconds / 60))
    return 0 if all(code == 0 for _, code, _ in results) else 1


def find_python():
    """A Python 3.7 interpreter, or None."""
    candidates = [os.environ.get("LEGACY_PYTHON")]
    roots = [os.environ.get("PYENV_ROOT"), os.path.join(os.path.expanduser("~"), ".pyenv")]
    for root in filter(None, roots):
        candidates += sorted(glob.glob(os.path.join(root, "versions", "3.7*", "bin", "python3.7")), reverse=True)
    candidates.append(shutil.which("python3.7"))
    for candidate in filter(None, candidates):
        try:
            version = subprocess.check_output([candidate, "-c", "import sys; print(sys.version_info[:2])"], text=True)
        except (OSError, subprocess.CalledProcessError):
            continue
        if version.strip() == "(3, 7)":
            return candidate
    return None


def environment(python, name, cache):
    """The bin folder of `name`'s virtual environment, built if missing, with this checkout installed."""
    pins = ENVIRONMENTS[name] + COMMON
    key = hashlib.sha256(" ".join([python] + pins + NO_DEPS).encode()).hexdigest()[:10]
    folder = os.path.join(cache, "%s-%s" % (name, key))
    bin_dir = os.path.join(folder, "bin")
    pip = [os.path.join(bin_dir, "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if not os.path.exists(os.path.join(folder, "ready")):
        shutil.rmtree(folder, ignore_errors=True)
        print("building %s (once; cached)" % folder, flush=True)
        subprocess.check_call([python, "-m", "venv", folder])
        subprocess.check_call(pip + ["pip<24"])
        subprocess.check_call(pip + pins)
        subprocess.check_call(pip + ["--no-deps"] + NO_DEPS)
        open(os.path.join(folder, "ready"), "w").close()
    subprocess.check_call(pip + ["--no-deps", "--no-build-isolation", "-e", ROOT])  # this checkout, every run
    return bin_dir


if __name__ == "__main__":
    sys.exit(main())
