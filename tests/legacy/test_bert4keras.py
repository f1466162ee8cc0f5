"""bert4keras 0.11.5 on standalone Keras 2.3, where its users trained: `enable()` against the plain BERT."""

import json

import numpy as np
import pytest

import keras
from keras_recompute import recompute_scope

bert4keras_models = pytest.importorskip("bert4keras.models")

CONFIG = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=64,
    hidden_act="gelu",
    max_position_embeddings=64,
    type_vocab_size=2,
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
)


def _classifier(config_path, recompute):
    np.random.seed(0)  # Keras 2.3's Dropout draws its op seed from numpy: both twins draw the same masks
    with recompute_scope(recompute):
        bert = bert4keras_models.build_transformer_model(config_path)
        first = keras.layers.Lambda(lambda t: t[:, 0])(bert.output)
        return keras.models.Model(bert.inputs, keras.layers.Dense(1)(first))


def test_enable_trains_a_bert_with_dropout_as_plain(tmp_path):
    """Each weight's first update (SGD, lr 1.0) in 3 repeated steps: bitwise plain's; dropout on, new masks each step."""
    from keras_recompute.integrations import bert4keras as recompute_bert4keras

    recompute_bert4keras.enable()
    config_path = str(tmp_path / "bert.json")
    with open(config_path, "w") as config:
        json.dump(CONFIG, config)
    plain, recomputed = _classifier(config_path, False), _classifier(config_path, True)
    recomputed.set_weights(plain.get_weights())
    random = np.random.RandomState(0)
    tokens = random.randint(1, 100, size=(8, 16))
    x, y = [tokens, np.zeros_like(tokens)], random.randn(8, 1).astype("float32")
    updates = []
    for model in (plain, recomputed):
        model.compile(keras.optimizers.SGD(lr=1.0), "mse")
        start = model.get_weights()
        trials = []
        for _ in range(3):
            model.set_weights(start)
            model.train_on_batch(x, y)
            trials.append(np.concatenate([(after - before).ravel() for after, before in zip(model.get_weights(), start)]))
        updates.append(trials)
    want, got = updates
    for mine, theirs in zip(got, want):
        np.testing.assert_array_equal(mine, theirs)
    assert np.linalg.norm(want[1] - want[0]) > 1e-3 * np.linalg.norm(want[0]), "dropout draws new masks each step"
    ops = [op.name for op in recomputed.output.graph.get_operations()]
    assert any("IdentityN_grad" in name and "MatMul" in name for name in ops), "the attention and feed-forward are recomputed"
