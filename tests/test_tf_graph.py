"""The graph path: TF1-style graphs (`tf.compat.v1`, Sessions) with tf_keras.

TF 1.x itself cannot be installed on a supported Python (its wheels stop at
3.7); `tf.compat.v1.disable_eager_execution()` with tf_keras is the same graph
machinery. It cannot be undone in a process, so each case is a subprocess.
"""

import json
import os
import subprocess

import _fresh

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_graph_child.py")
ROOT = os.path.dirname(os.path.dirname(CHILD))


def run_case(case, **environment):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **environment)
    done = _fresh.run([CHILD, case], env=env)
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


def test_policies_in_a_graph_recompute_what_they_say_and_order_the_peak():
    """`save_dots` and `attention_core` in a TF1 graph: what the session ran, and each peak.

    The session's trace counts the ops each step ran (8 blocks, each with 4
    weight einsums and 2 weight matmuls around attention's 2 batched einsums
    and one softmax): `full` runs the forward again, `save_dots` only
    attention's einsums and softmax, `attention_core` only the core. Their updates equal
    the plain model's in `test_updates_tensorflow.py` (compared there as updates
    at lr 1.0, not as losses, which let a wrong `save_dots` gradient pass here).
    `attention_core` is not asked to lower the peak: with tf_keras's attention
    in a TF1 graph it does not (docs/exactness.md, "What is not saved").
    """
    result = run_case("policy")
    print({policy: (record["ran"], f"{record['peak'] / 2**20:.1f} MB") for policy, record in result.items()})
    plain = result["none"]["ran"]
    extra = {
        policy: {kind: result[policy]["ran"][kind] - plain[kind] for kind in plain}
        for policy in ("full", "save_dots", "attention_core")
    }
    assert plain["Softmax"] == 8, plain
    # The recompute check's ops (its fingerprints' matmuls) are not counted.
    assert extra["full"] == {"Softmax": 8, "Einsum": 48, "MatMul": 16}, extra  # every einsum and matmul again
    assert extra["save_dots"] == {"Softmax": 8, "Einsum": 16, "MatMul": 0}, extra  # no weight einsum or matmul again
    assert extra["attention_core"] == {"Softmax": 8, "Einsum": 16, "MatMul": 0}, extra
    peaks = {policy: record["peak"] for policy, record in result.items()}
    assert peaks["none"] > 1.3 * peaks["save_dots"] > 1.3 * peaks["full"], peaks
