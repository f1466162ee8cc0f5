"""`recompute_model` with tf_keras (Keras 2), and in TF1-style graphs.

`test_model.py` covers Keras 3 on every backend; here tf_keras models are
recomputed by block, by segments and by class, trained, saved and loaded;
TF1-style graphs and bert4keras run in child processes.
"""

import os

import numpy as np
import pytest
tf = pytest.importorskip("tensorflow")  # absent on a JAX or PyTorch GPU machine: the file skips
K = pytest.importorskip("tf_keras")

from _twins import MODES, on_and_off
from keras_recompute import _model, recompute_model, recompute_scope
from test_tf_graph import run_case

X = tf.random.stateless_normal((8, 16), seed=[5, 5])


class Block(K.layers.Layer):
    """A residual feed-forward block with seeded dropout and BatchNorm."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = K.layers.Dense(32, activation="gelu")
        self.dropout = K.layers.Dropout(0.3, seed=1)
        self.down = K.layers.Dense(16)
        self.norm = K.layers.BatchNormalization()

    def call(self, inputs, training=None):
        return self.norm(inputs + self.down(self.dropout(self.up(inputs), training=training)), training=training)


def functional_blocks(plan=None):
    K.utils.set_random_seed(0)
    inputs = K.Input((16,))
    hidden = inputs
    for i in range(3):
        hidden = Block(name=f"block_{i}")(hidden)
    model = K.Model(inputs, K.layers.Dense(3, name="head")(hidden))
    if plan is not None:
        plan(model)
    return model


def dense_chain(plan=None):
    K.utils.set_random_seed(0)
    inputs = K.Input((16,))
    hidden = inputs
    for i in range(4):
        hidden = K.layers.Dropout(0.2, seed=i, name=f"dropout_{i}")(K.layers.Dense(16, activation="gelu", name=f"dense_{i}")(hidden))
    model = K.Model(inputs, K.layers.Dense(3, name="head")(hidden))
    if plan is not None:
        plan(model)
    return model


PLANS = {
    "auto blocks": (functional_blocks, lambda m: recompute_model(m), ["block_0", "block_1", "block_2"]),
    "by class": (functional_blocks, lambda m: recompute_model(m, blocks=Block, limit=2), ["block_0", "block_1"]),
    "auto pieces": (dense_chain, lambda m: recompute_model(m), [f"dense_{i} .. dropout_{i}" for i in range(4)]),
    "segments": (dense_chain, lambda m: recompute_model(m, segments=2), None),
}


# Every mode for the blocks `"auto"` finds; `tf.function` for the other plans.
PLAN_CASES = [(mode, "auto blocks") for mode in MODES] + [("function", plan) for plan in list(PLANS)[1:]]


@pytest.mark.parametrize("mode,plan", PLAN_CASES)
def test_tf_keras_models_match_the_plain_model(mode, plan, reproducible):
    build, apply, units = PLANS[plan]
    reproducible(mode)
    model = build(apply)
    if units is not None:
        assert _model.recomputed_units(model) == units
    else:
        assert len(_model.recomputed_units(model)) == 2
    runs = on_and_off(K, lambda: build(apply), X, mode)
    assert all(g is not None for g in runs[True][0][1])


@pytest.fixture
def reproducible():
    """Under XLA, tf_keras's legacy random ops draw differently on every run: a generator is used."""
    switched = []

    def switch(mode):
        if mode == "jit":
            K.backend.experimental.enable_tf_random_generator()
            switched.append(True)

    yield switch
    if switched:
        K.backend.experimental.disable_tf_random_generator()


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_fit_save_and_load(tmp_path, suffix):
    y = tf.random.stateless_normal((8, 3), seed=[6, 6])
    losses = {}
    for on in (False, True):
        model = functional_blocks(recompute_model if on else None)
        model.compile(optimizer=K.optimizers.SGD(0.1), loss="mse")
        K.utils.set_random_seed(2)
        with recompute_scope(on):
            losses[on] = model.fit(X, y, epochs=3, batch_size=4, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    path = os.path.join(tmp_path, "model" + suffix)
    model.save(path)
    loaded = K.models.load_model(path, custom_objects={"Block": Block})
    assert _model.recomputed_units(loaded) == []
    for saved, kept in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(saved, kept)


def test_subclassed_tf_keras_model_by_class():
    class Stack(K.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.stack = [Block(name=f"block_{i}") for i in range(3)]

        def call(self, inputs, training=None):
            for block in self.stack:
                inputs = block(inputs, training=training)
            return inputs

    def build():
        K.utils.set_random_seed(0)
        model = Stack()
        model(X)
        recompute_model(model)
        return model

    assert _model.recomputed_units(build()) == ["block_0", "block_1", "block_2"]
    on_and_off(K, build, X, "function")
    with pytest.raises(ValueError, match="segments=.*no graph to cut.*blocks="):
        recompute_model(build(), segments=2)


def test_tf1_graph_segments_and_blocks_train_as_the_plain_model():
    """TF1-style graph: the plan rebuilds the model's outputs, which `compile` and `fit` train."""
    result = run_case("model")
    for plan, report in result.items():
        assert report["losses"] == pytest.approx(report["plain_losses"], rel=1e-5), plan
    assert result["blocks"]["units"] == ["block_0", "block_1", "block_2", "block_3"]
    assert len(result["segments"]["units"]) == 4
    # Here: 2.0x for the blocks, 1.6x for four pieces (one holds two blocks).
    assert result["blocks"]["plain_peak"] / result["blocks"]["peak"] >= 1.5, result
    assert result["segments"]["plain_peak"] / result["segments"]["peak"] >= 1.3, result
