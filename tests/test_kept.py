"""`benchmarks/kept.py`: what each policy keeps for the backward pass on JAX, counted by kind from JAX's residuals
(issue 39: how low `save_dots` and `attention_core` can take BERT-base's peak), checked on a model small enough to
count by hand."""

import os
import sys

import pytest

from _keras3_twins import BACKEND

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="JAX's residuals")

BLOCKS, BATCH, SEQ, HIDDEN, HEADS, FFN = 2, 2, 16, 32, 4, 64


@pytest.fixture(scope="module")
def records():
    import backends
    import keras
    import kept

    options = backends.parse_args(["--backend", "jax", "--blocks", str(BLOCKS), "--batch", str(BATCH), "--seq", str(SEQ),
                                   "--hidden", str(HIDDEN), "--heads", str(HEADS), "--ffn", str(FFN), "--vocab", "50"])
    policy, found = keras.config.dtype_policy(), {}
    with pytest.MonkeyPatch.context() as patch:
        try:
            for method in ("none", "ours", "save_dots", "attention_core"):
                patch.setenv("RECOMPUTE", "0" if method == "none" else "1")
                found[method] = kept.kept(options, method)
        finally:
            keras.config.set_dtype_policy(policy)  # kept() sets the model's
    return found


def test_save_dots_keeps_every_projection_and_packed_mask_and_full_keeps_neither(records):
    activation = BATCH * SEQ * HIDDEN
    # Per block: the query, key and value projections, attention's output projection, the FFN's two (float32).
    matmuls = BLOCKS * (5 * activation + BATCH * SEQ * FFN) * 4
    # Per block, a bit an element: the attention probabilities' mask and the two hidden dropouts'.
    masks = BLOCKS * (BATCH * HEADS * SEQ * SEQ + 2 * activation) // 8
    assert records["save_dots"]["kept_by_kind"].get("matmul") == matmuls, records["save_dots"]["kept_by_kind"]
    assert records["save_dots"]["kept_by_kind"].get("mask bits") == masks, records["save_dots"]["kept_by_kind"]
    assert records["attention_core"]["kept_by_kind"].get("mask bits") == BLOCKS * BATCH * HEADS * SEQ * SEQ // 8
    for kind in ("matmul", "mask bits"):
        assert kind not in records["ours"]["kept_by_kind"], records["ours"]["kept_by_kind"]
    # save_dots keeps what full keeps (each block's input) and its products and masks besides; full also keeps the
    # dropout's seeds (constants, a few bytes) to draw its masks again.
    ours = dict(records["ours"]["kept_by_op"])
    assert 0 < ours.pop("from a constant uint32") <= 16 * BLOCKS * 3
    assert records["save_dots"]["kept_by_op"] == ours


def test_plain_attention_keeps_three_score_shaped_tensors_a_block_and_the_policies_none(records):
    """The softmax's exponentials (float32), the dropout's boolean mask and the dropped probabilities (float32)."""
    scores = BATCH * HEADS * SEQ * SEQ
    assert records["none"]["scores"] == 4 * scores
    assert records["none"]["scores_shaped"] == BLOCKS * (4 + 1 + 4) * scores
    for method in ("ours", "save_dots", "attention_core"):
        assert records[method]["scores_shaped"] == 0, (method, records[method]["kept_by_op"])


def test_the_floor_is_the_state_and_what_is_kept(records):
    for record in records.values():
        assert record["floor"] == record["state"] + sum(record["kept_by_kind"].values())
        assert record["state"] > 3 * record["weights"]  # the weights, Adam's two slots, the token embedding
    assert records["ours"]["floor"] < records["save_dots"]["floor"] < records["attention_core"]["floor"] < records["none"]["floor"]
