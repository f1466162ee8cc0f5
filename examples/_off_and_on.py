"""Runs an example's `train()` once per variant (by default RECOMPUTE=0, then 1), each in a fresh process.

The example's command-line arguments are passed to every child. Each child
uses TensorFlow's BFC allocator (so its peak memory is measured) and prints a
line ending in `peak N MB`; the parent prints the lines and the ratio of each
peak to the first variant's.
"""

import os
import subprocess
import sys

CHILD = "KERAS_RECOMPUTE_EXAMPLE_CHILD"
OFF_AND_ON = (("RECOMPUTE=0", {"RECOMPUTE": "0"}), ("RECOMPUTE=1", {"RECOMPUTE": "1"}))


def main(script, train, variants=OFF_AND_ON):
    """`train()` in this process if it is a child; else one child per variant, and their peaks.

    Args:
        script: the example's `__file__`.
        train: the function a child runs.
        variants: `(label, environment)` pairs, one child each.
    """
    if os.environ.get(CHILD):
        train()
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(script)))
    peaks = []
    for label, variables in variants:
        env = dict(
            os.environ,
            TF_CPU_ALLOCATOR_USE_BFC="1",
            PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
            **variables,
        )
        env[CHILD] = "1"
        out = subprocess.run([sys.executable, script, *sys.argv[1:]], env=env, capture_output=True, text=True)
        if out.returncode:  # say why, not only that it failed
            sys.exit(f"{label}: the child failed (exit status {out.returncode}):\n{out.stderr[-4000:]}")
        line = out.stdout.strip().splitlines()[-1]
        print(line)
        peaks.append((label, float(line.rsplit("peak ", 1)[1].split()[0])))
    first_label, first = peaks[0]
    for label, peak in peaks[1:]:
        print(f"{label}: peak memory {first / peak:.1f}x lower than {first_label} ({first - peak:.0f} MB saved)")
