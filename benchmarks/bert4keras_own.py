"""How many of a small BERT's gradients bert4keras's own recompute gets wrong, eagerly and in a `tf.function`.

Runs `tests/_bert4keras_child.py theirs MODE` (a 2-layer bert4keras BERT with
an MLM head and dropout, three SGD steps plain and then with bert4keras's
`RECOMPUTE=1`, from the same weights and random state) and, for comparison,
the same child with `integrations.bert4keras.enable()` (`ours`). A gradient
counts as wrong when it differs by more than 1e-4 of the largest value.

    python benchmarks/bert4keras_own.py --out benchmarks/results/bert4keras_own_recompute.json
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

CHILD = os.path.join(_measure.ROOT, "tests", "_bert4keras_child.py")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the counts as JSON to this file")
    args = parser.parse_args(argv)
    results = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_measure.ROOT, os.environ.get("PYTHONPATH", "")]))
    for method in ("theirs", "ours"):
        for mode in ("eager", "function"):
            done = subprocess.run([sys.executable, CHILD, method, mode], env=env, capture_output=True, text=True, check=True)
            steps = json.loads(done.stdout.strip().splitlines()[-1])["steps"]
            results.setdefault(method, {})[mode] = steps
            first = steps[0]
            print(f"{method:<7} {mode:<9} first step: {first['differ']} of {first['count']} gradients wrong (largest {first['max']:.3g})")
    _measure.write_json(args.out, vars(args), results)


if __name__ == "__main__":
    main()
