"""What every results JSON says of where it came from: command, device, dtype, date, commit.

Plain Python 3.7, no framework: the legacy benchmarks (Python 3.7) use it too,
and the parent processes that write the JSON import no framework.
`docs_figures.py` checks the docs against these files, so a figure in the docs
can always be traced to the run that measured it.
"""

import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def device():
    """The GPU's name where `nvidia-smi` finds one, else the CPU's model and core count."""
    try:
        names = subprocess.check_output(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], stderr=subprocess.DEVNULL, universal_newlines=True
        ).split("\n")
        names = [name.strip() for name in names if name.strip()]
        if names:
            return "GPU (%s)" % names[0]
    except (OSError, subprocess.CalledProcessError):
        pass
    return "CPU (%s, %d cores)" % (cpu_model(), os.cpu_count())


def changed_files():
    """The package's and the benchmarks' files that differ from the checkout's commit."""
    try:
        lines = subprocess.check_output(
            ["git", "status", "--porcelain", "--", "keras_recompute", "benchmarks/*.py"], cwd=ROOT, universal_newlines=True
        ).splitlines()
    except (OSError, subprocess.CalledProcessError):
        return []
    return sorted(line[3:].strip() for line in lines if line.strip())


def commit():
    """The checkout's commit, with `+changes` when the package or the benchmarks differ from it."""
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, universal_newlines=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if changed_files() else "")


def metadata(dtype="float32", argv=None):
    """The fields every results file starts with."""
    argv = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT) if argv else "?"
    backend = os.environ.get("KERAS_BACKEND")
    prefix = "KERAS_BACKEND=%s " % backend if backend and backend != "tensorflow" else ""
    return {
        "command": prefix + "python " + " ".join([script] + list(argv[1:])),
        "device": device(),
        "dtype": dtype,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "changed_files": changed_files(),
        "python": platform.python_version(),
    }
