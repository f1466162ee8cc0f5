"""bert4keras 0.11.5 on TF 2.21 with tf_keras: `integrations.bert4keras.enable()` is exact.

Each case is a child process (bert4keras must see TF_KERAS and
TF_USE_LEGACY_KERAS before TensorFlow builds `tf.keras`); see
_bert4keras_child.py. A 2-layer BERT with an MLM head and dropout trains three
steps with every patched `call` plain, then recomputed.
"""

import json
import os

import numpy as np
import pytest

import _fresh

pytest.importorskip("tensorflow")  # bert4keras runs on tf_keras
pytest.importorskip("bert4keras")

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bert4keras_child.py")
ROOT = os.path.dirname(os.path.dirname(CHILD))


def run(method, mode):
    # The child's tf.keras is tf_keras: TensorFlow reads which at import, in the zygote (NOTE [ forked children ]).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), TF_USE_LEGACY_KERAS="1")
    done = _fresh.run([CHILD, method, mode], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "method, mode",
    # ours_over_theirs: RECOMPUTE=1 when bert4keras was imported, its layers carry its own recompute; enable() must
    # decorate the plain call under it, not wrap theirs (which doubles the gradient of q = k = v: a test below).
    [("ours", "eager"), ("ours", "function"), ("ours_over_theirs", "function")],
)
def test_enable_gives_the_plain_losses_and_gradients(method, mode):
    report = run(method, mode)
    assert report["losses"] == pytest.approx(report["plain_losses"], rel=1e-6)
    for step, result in enumerate(report["steps"]):
        assert result["count"] == 42, "every weight of the 2-layer BERT has a gradient"
        assert result["differ"] == 0, f"step {step}: {result['differ']} gradients differ (max {result['max']:.3g})"
    if mode == "function":  # equal numbers prove nothing if enable() did nothing
        plain, recomputed = report["ops"]
        assert recomputed > plain, f"{recomputed} ops in a recomputed step, {plain} in a plain one"


@pytest.mark.parametrize("method,mode", [("model", "eager"), ("model", "function"), ("model_over_theirs", "function")])
def test_recompute_model_recomputes_each_block_exactly(method, mode):
    """`recompute_model(model)`: bert4keras builds a block from separate layers; each block is one unit.

    With bert4keras's own recompute on (RECOMPUTE=1 at its import), it is taken off, with a warning.
    """
    report = run(method, mode)
    assert report["warned"] == (method == "model_over_theirs")
    assert report["units"] == [f"Transformer-{i}-MultiHeadSelfAttention .. Transformer-{i}-FeedForward-Norm" for i in range(2)]
    assert report["losses"] == pytest.approx(report["plain_losses"], rel=1e-6)
    for step, result in enumerate(report["steps"]):
        assert result["count"] == 42 and result["differ"] == 0, f"step {step}: {result}"
    if mode == "function":
        plain, recomputed = report["ops"]
        assert recomputed > plain, f"{recomputed} ops in a recomputed step, {plain} in a plain one"


def test_a_budget_plans_bert4keras_blocks_exactly():
    """`recompute_model(model, budget=..., inputs=...)` over bert4keras's blocks (pieces of its graph)."""
    report = run("budget", "function")
    blocks = [f"Transformer-{i}-MultiHeadSelfAttention .. Transformer-{i}-FeedForward-Norm" for i in range(2)]
    assert len(report["policies"]) == 2 and report["policies"].count("full") < 2, report["policies"]
    assert report["units"] == [b for b, p in zip(blocks, report["policies"]) if p != "none"] != []
    assert report["losses"] == pytest.approx(report["plain_losses"], rel=1e-6)
    for step, result in enumerate(report["steps"]):
        assert result["count"] == 42 and result["differ"] == 0, f"step {step}: {result}"


def test_bert4keras_own_recompute_is_wrong_where_ours_is_not():
    """The same comparison catches bert4keras's own recompute (q = k = v doubles a gradient)."""
    report = run("theirs", "function")
    assert report["steps"][0]["differ"] >= 10, report


def test_graph_mode_trains_with_dropout_inside_tf_cond_and_updates_as_plain():
    """bert4keras's own recompute does nothing in graph mode, and with dropout on fails to build its gradient.

    Ours builds and trains with dropout (its recompute check runs in every step), and without
    dropout its first SGD update at lr 1.0 is the plain model's; its training function is larger.
    """
    report = run("ours", "graph")
    losses = report["losses"]
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert report["update_error"] <= 1e-5, report
    plain, recomputed = report["ops"]
    assert recomputed > plain, report


def test_feed_forward_loads_bert4keras_weights():
    report = run("feedforward", "eager")
    assert report["shapes"] == [[32, 64], [64], [64, 32], [32]]
    assert report["difference"] < 1e-6
