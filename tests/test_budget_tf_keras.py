"""`recompute_model(budget=...)` and `memory_report` on tf_keras (Keras 2), and the TF1-style graph error."""

import numpy as np
import pytest
tf = pytest.importorskip("tensorflow")  # absent on a JAX or PyTorch GPU machine: the file skips
K = pytest.importorskip("tf_keras")

from _twins import on_and_off
from keras_recompute import RecomputeError, _memory, _model, memory_report, recompute_model

X = tf.random.stateless_normal((8, 32, 16), seed=[5, 5])


class Block(K.layers.Layer):
    """Attention with dropout, add & norm, a gelu FFN with seeded dropout."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = K.layers.MultiHeadAttention(2, 8, dropout=0.2)
        self.norm = K.layers.LayerNormalization()
        self.up = K.layers.Dense(32, activation="gelu")
        self.dropout = K.layers.Dropout(0.3, seed=1)
        self.down = K.layers.Dense(16)

    def call(self, inputs, training=None):
        hidden = self.norm(inputs + self.attention(inputs, inputs, training=training))
        return hidden + self.down(self.dropout(self.up(hidden), training=training))


def blocks_model(budget=None):
    K.utils.set_random_seed(0)
    inputs = K.Input((32, 16))
    hidden = inputs
    for i in range(4):
        hidden = Block(name=f"block_{i}")(hidden)
    model = K.Model(inputs, K.layers.Dense(3, name="head")(hidden))
    if budget is not None:
        recompute_model(model, budget=budget, inputs=X)
    return model


def test_a_tf_keras_plan_meets_its_budget_and_matches_the_plain_model():
    model = blocks_model()
    plain = memory_report(model, X)
    assert [row["name"] for row in plain.rows] == [f"block_{i}" for i in range(4)]
    assert all(set(row["kept_bytes"]) == {"none", "full", "save_dots", "attention_core"} for row in plain.rows)
    budget = (plain.floor + plain.plain_peak) // 2
    recompute_model(model, budget=budget, inputs=X, enabled=True)
    report = memory_report(model, X)
    policies = [row["policy"] for row in report.rows]
    assert report.predicted_peak <= budget and policies.count("full") < 4 and policies.count("none") < 4, policies
    assert _model.recomputed_units(model) == [f"block_{i}" for i, p in enumerate(policies) if p != "none"]
    # Both twins are planned (measuring draws dropout masks, which advances tf_keras's seed counters).
    runs = on_and_off(K, lambda: blocks_model(budget), X, "function")
    assert all(g is not None for g in runs[True][0][1])


def test_a_tf1_graph_cannot_be_measured():
    with tf.Graph().as_default():
        model = blocks_model()
        with pytest.raises(RecomputeError, match="eager TensorFlow"):
            recompute_model(model, budget="1GB", inputs=np.zeros((8, 32, 16), "float32"))


@pytest.mark.parametrize("optimizer", ["adam", "legacy"])
def test_the_optimizer_counts_as_its_first_step_builds_it(optimizer):
    """Adam's slots count before they exist: a legacy tf_keras optimizer makes them on its first step."""
    model = K.Sequential([K.Input((16,)), K.layers.Dense(8), K.layers.Dense(2)])
    model.compile(optimizer=K.optimizers.legacy.Adam() if optimizer == "legacy" else "adam", loss="mse")
    before = _memory._optimizer_bytes(model)
    model.train_on_batch(np.zeros((4, 16), "float32"), np.zeros((4, 2), "float32"))
    assert before == _memory._optimizer_bytes(model) >= 2 * _memory._variable_bytes(model.trainable_variables)


class DropoutBlock(K.layers.Layer):
    """Its `call` takes no `training`: its dropout reads tf_keras's call context."""

    def __init__(self, rate, **kwargs):
        super().__init__(**kwargs)
        self.up = K.layers.Dense(64, activation="gelu")
        self.dropout = K.layers.Dropout(rate, seed=1)
        self.down = K.layers.Dense(16)

    def call(self, inputs):
        return inputs + self.down(self.dropout(self.up(inputs)))


class PassesTraining(DropoutBlock):
    def call(self, inputs, training=None):
        return inputs + self.down(self.dropout(self.up(inputs), training=training))


def test_a_block_whose_call_takes_no_training_is_measured_in_training():
    """Measured as the training forward runs it, its dropout on: what it keeps equals the block's that takes
    `training` and passes it on, and is more than with no dropout (measured with its dropout off, as it was
    until 2026-11-27, it kept what a block without dropout keeps)."""
    kept = {}
    for name, block, rate in (("no training", DropoutBlock, 0.5), ("training", PassesTraining, 0.5),
                              ("no dropout", DropoutBlock, 0.0)):
        inputs = K.Input((32, 16))
        hidden = inputs
        for i in range(2):
            hidden = block(rate, name=f"block_{i}")(hidden)
        model = K.Model(inputs, K.layers.Dense(3)(hidden))
        model.compile(optimizer="adam", loss="mse")
        kept[name] = [row["kept_bytes"]["none"] for row in memory_report(model, X, blocks=block).rows]
    assert kept["no training"] == kept["training"], kept
    assert all(a > b for a, b in zip(kept["no training"], kept["no dropout"])), kept
