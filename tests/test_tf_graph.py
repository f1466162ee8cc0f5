"""The graph path: TF1-style graphs (`tf.compat.v1`, Sessions) with tf_keras.

TF 1.x itself cannot be installed on a supported Python (its wheels stop at
3.7); `tf.compat.v1.disable_eager_execution()` with tf_keras is the same graph
machinery. It cannot be undone in a process, so each case is a subprocess.
"""

import json
import os
import subprocess
import sys

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_graph_child.py")
ROOT = os.path.dirname(os.path.dirname(CHILD))


def run_case(case):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, CHILD, case], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fit_and_train_on_batch_match_twin():
    """Dropout, BatchNormalization and keywords inside; the same weights after training."""
    result = run_case("fit")
    assert result["moved"] > 1e-3
    assert result["max_relative_error"] <= 1e-5, result


def test_mixed_float16_fit_matches_twin():
    result = run_case("mixed")
    assert result["moved"] > 1e-3
    assert result["max_relative_error"] <= 1e-3, result


def test_session_gradients_and_minimize_match_twin():
    """Keywords (`training`, a boolean `mask`, a float `scale`) pass through in a graph."""
    result = run_case("session")
    assert result["gradients"] == 7  # the input and six weights
    assert result["max_relative_error"] <= 1e-5, result


def test_session_peak_memory_falls():
    """Fails if the graph runtime runs the recompute early (the peak would not fall)."""
    result = run_case("memory")
    ratio = result["plain"] / result["recompute"]
    print(f"graph mode: plain {result['plain'] / 2**20:.0f} MB, recompute {result['recompute'] / 2**20:.0f} MB")
    assert ratio >= 2.0, result
