"""Runs every example, each in a process of its own, and fails if any fails (CI runs it beside the suite).

    python examples/run_all.py            # as each example's docstring runs it
    python examples/run_all.py --quick    # the two fine-tunes on 64 sentences for one epoch

Each example prints its own figures; this prints one line per example (its
exit status, its time and its last line) and, for one that failed, the end of
its output. The examples ran nowhere before (2026-12-03): the bert4keras
fine-tune's `recompute_model` run had failed since it was written.
"""

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# (script, arguments, arguments under --quick): the demo first.
EXAMPLES = (
    ("quickstart.py", [], []),
    ("tf2_gradient_checkpointing.py", [], []),
    ("memory_report.py", [], []),
    ("verify_model.py", [], []),
    ("largest_fit.py", [], []),
    ("keras_hub_finetune.py", [], ["--epochs", "1", "--samples", "64"]),
    ("keras_hub_finetune.py", ["--lora", "8"], ["--lora", "8", "--epochs", "1", "--samples", "64"]),
    ("bert4keras_finetune.py", [], ["--epochs", "1", "--samples", "64"]),
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the fine-tunes on 64 sentences for one epoch")
    parser.add_argument("names", nargs="*", help="run only these examples (file names)")
    args = parser.parse_args()
    failed = []
    for script, full, quick in EXAMPLES:
        if args.names and script not in args.names:
            continue
        command = [sys.executable, os.path.join(HERE, script)] + (quick if args.quick else full)
        started = time.time()
        done = subprocess.run(command, capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        name = " ".join([script] + command[2:])
        print(f"{name:<60} exit {done.returncode}  {time.time() - started:5.0f} s  {lines[-1] if lines else ''}", flush=True)
        if done.returncode:
            failed.append(name)
            print((done.stdout + done.stderr)[-4000:], flush=True)
    if failed:
        sys.exit(f"{len(failed)} example(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
