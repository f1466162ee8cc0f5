"""Runs the test suite once per Keras backend, every backend even when one fails.

```
python tests/run_backends.py                       # tensorflow, jax, torch, torch-gpu-like; two at a time
python tests/run_backends.py --jobs 1              # one after another, the output as it comes
python tests/run_backends.py --backends jax -- -k memory
```

Each backend's run is a fresh `python -m pytest tests` with `KERAS_BACKEND`
set (Keras reads it once, at import). Two runs stand in for the GPU machine,
which has no TensorFlow and runs each backward in autograd's device thread:
`jax` runs with TensorFlow hidden (`tests/conftest.py`,
KERAS_RECOMPUTE_TESTS_WITHOUT_TENSORFLOW: the tests that need it skip, and run
in the `tensorflow` run), and `torch-gpu-like` runs PyTorch's suite with
TensorFlow hidden and every backward in a thread of its own
(KERAS_RECOMPUTE_TESTS_BACKWARD_THREAD), beside `torch`, the plain CPU run. With `--jobs` above 1 the runs overlap:
most tests are small, spend their time in one Python thread tracing and
dispatching, and leave the second core idle, so two runs take little longer
than the longer of them. Nothing in the suite is timed, and each memory figure
is measured in a child process of its own, so an overlapping run changes no
result. The output of an overlapped run is printed whole when it ends. The exit
status is non-zero when any run failed, and a summary at the end names each
backend's result and time. Each run prints its 15 slowest tests (pytest's
`--durations`; another `--durations` after `--` overrides it): where a CI run's
time goes, read from its log.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

# Each run: its Keras backend and what else its environment sets.
RUNS = {
    "tensorflow": ("tensorflow", {}),
    "jax": ("jax", {"KERAS_RECOMPUTE_TESTS_WITHOUT_TENSORFLOW": "1"}),
    "torch": ("torch", {}),
    "torch-gpu-like": ("torch", {"KERAS_RECOMPUTE_TESTS_WITHOUT_TENSORFLOW": "1", "KERAS_RECOMPUTE_TESTS_BACKWARD_THREAD": "1"}),
}
BACKENDS = tuple(RUNS)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--jobs", type=int, default=2, help="backends run at once (default 2; 1: in turn, output streamed)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    tests = os.path.dirname(os.path.abspath(__file__))
    streamed = args.jobs == 1
    waiting, running, results = list(args.backends), {}, {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a CI time limit: still show what ran
    try:
        while waiting or running:
            while waiting and len(running) < args.jobs:
                backend = waiting.pop(0)
                keras_backend, settings = RUNS[backend]
                shown = " ".join(f"{name}={value}" for name, value in settings.items())
                print(f"\n===== {backend} (KERAS_BACKEND={keras_backend} {shown}): started =====", flush=True)
                log = None if streamed else tempfile.TemporaryFile(mode="w+")
                process = subprocess.Popen(
                    [sys.executable, "-m", "pytest", tests, "-q", "--durations=15", *args.pytest_args],
                    env=dict(os.environ, KERAS_BACKEND=keras_backend, **settings),
                    stdout=log,
                    stderr=subprocess.STDOUT if log else None,
                )
                running[backend] = (process, log, time.monotonic())
            for backend, (process, log, started) in list(running.items()):
                if process.poll() is not None:
                    del running[backend]
                    results[backend] = (process.returncode, time.monotonic() - started)
                    _show(backend, log)
            time.sleep(0.5)
    finally:
        for backend, (process, log, _) in running.items():  # interrupted: stop them, show their output so far
            process.kill()
            _show(f"{backend} (interrupted)", log)
    print("\n===== summary =====")
    for backend in args.backends:
        code, seconds = results[backend]
        verdict = "passed" if code == 0 else f"FAILED (pytest exit {code})"
        print(f"{backend:<15} {verdict:<24} {seconds / 60:5.1f} min")
    return 0 if all(code == 0 for code, _ in results.values()) else 1


def _show(backend, log):
    """Prints the output of an overlapped run (a streamed one has printed it already)."""
    if log is not None:
        print(f"\n===== {backend}: output =====", flush=True)
        log.seek(0)
        sys.stdout.write(log.read())
        log.close()
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
