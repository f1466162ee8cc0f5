"""`keras_recompute.layers` on Keras 3 (every backend) and the keras-hub integration.

tf_keras's layers are tested in test_layers_tf_keras.py (TensorFlow run).
"""

import os

import keras
import numpy as np
import pytest
from keras import ops

from _keras3_twins import MODES, assert_close, assert_recomputes, compare_on_and_off, loss_and_gradients
from keras_recompute import layers as recompute_layers
from keras_recompute import recompute_scope

RNG = np.random.RandomState(0)


@pytest.fixture(autouse=True)
def _same_data_whatever_ran_before():
    """Each test draws its data from the start of the stream: a file run alone, or shuffled, gives the same."""
    RNG.seed(0)


def normal(*shape):
    return RNG.standard_normal(shape).astype("float32")


def test_default_framework_is_keras3_here():
    assert issubclass(recompute_layers.Dense, keras.layers.Dense)
    assert recompute_layers.for_keras(keras) is recompute_layers.for_keras(keras)
    with pytest.raises(TypeError, match="Keras module"):
        recompute_layers.for_keras(np)


@pytest.mark.parametrize("mode", MODES)
def test_dense_and_attention_match_the_stock_layers(mode):
    x = normal(2, 6, 16)
    for stock, ours, call in (
        (keras.layers.Dense(8, activation="gelu"), recompute_layers.Dense(8, activation="gelu"), None),
        (
            keras.layers.MultiHeadAttention(2, 8, dropout=0.0),
            recompute_layers.MultiHeadAttention(2, 8, dropout=0.0),
            lambda layer, xs: layer(xs[0], xs[0], xs[0], training=True),
        ),
    ):
        call = call or (lambda layer, xs: layer(xs[0]))
        call(stock, [ops.convert_to_tensor(x)])
        with recompute_scope(False):
            call(ours, [ops.convert_to_tensor(x)])
        assert [w.shape for w in ours.weights] == [w.shape for w in stock.weights]
        ours.set_weights(stock.get_weights())  # a stock layer's weights load unchanged
        expected = loss_and_gradients(stock, [x], mode, call)
        with recompute_scope(True):
            actual = loss_and_gradients(ours, [x], mode, call)
        assert_close(actual[0], expected[0], what=f"{type(ours).__name__} outputs")
        assert_close(actual[1], expected[1], what=f"{type(ours).__name__} gradients")
        if mode == MODES[0]:  # equal numbers prove nothing if the decorator did nothing
            assert_recomputes(ours, [x], call)


@pytest.mark.parametrize("mode", MODES)
def test_feed_forward_and_transformer_block_on_and_off(mode):
    x = normal(2, 6, 16)
    padding = np.array([[1] * 6, [1] * 4 + [0] * 2], "int32")
    feed_forward = recompute_layers.FeedForward(32, dropout_rate=0.2)
    block = recompute_layers.TransformerBlock(32, 2, dropout=0.2, activation="gelu", layer_norm_epsilon=1e-12)
    with recompute_scope(False):
        feed_forward(x)
        block(x, padding_mask=padding)
    assert [w.name for w in feed_forward.weights][:1] == ["kernel"]
    compare_on_and_off(feed_forward, [x], mode, lambda layer, xs: layer(xs[0], training=True))
    compare_on_and_off(block, [x, padding], mode, lambda layer, xs: layer(xs[0], padding_mask=xs[1], training=True))
    if mode == MODES[0]:
        assert_recomputes(feed_forward, [x], lambda layer, xs: layer(xs[0], training=True))
        assert_recomputes(block, [x, padding], lambda layer, xs: layer(xs[0], padding_mask=xs[1], training=True))


def test_save_and_load_without_custom_objects(tmp_path):
    inputs = keras.Input((6, 16))
    hidden = recompute_layers.Dense(16)(inputs)
    hidden = recompute_layers.TransformerBlock(32, 2, dropout=0.1)(hidden)
    hidden = recompute_layers.FeedForward(24)(hidden)
    outputs = recompute_layers.MultiHeadAttention(2, 8)(hidden, hidden)
    model = keras.Model(inputs, outputs)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in model.layers]
    x = normal(2, 6, 16)
    np.testing.assert_allclose(
        ops.convert_to_numpy(loaded(x)), ops.convert_to_numpy(model(x)), rtol=1e-6, atol=1e-6
    )
    config = model.layers[2].get_config()
    assert config["intermediate_dim"] == 32 and config["num_heads"] == 2


keras_hub = pytest.importorskip("keras_hub")


def test_transformer_block_loads_keras_hub_encoder_weights():
    x = normal(2, 6, 16)
    encoder = keras_hub.layers.TransformerEncoder(32, 2, activation="gelu")
    block = recompute_layers.TransformerBlock(32, 2, activation="gelu")
    encoder(x)
    block(x)
    block.set_weights(encoder.get_weights())
    np.testing.assert_allclose(ops.convert_to_numpy(block(x)), ops.convert_to_numpy(encoder(x)), rtol=1e-5, atol=1e-5)


def test_decorated_transformer_encoder_subclass():
    from keras_recompute import recompute_grad

    class Encoder(keras_hub.layers.TransformerEncoder):
        @recompute_grad
        def call(self, inputs, padding_mask=None, attention_mask=None, training=None):
            return super().call(inputs, padding_mask=padding_mask, attention_mask=attention_mask, training=training)

    x = normal(2, 6, 16)
    layer = Encoder(32, 2, dropout=0.1)
    with recompute_scope(False):
        layer(x)
    compare_on_and_off(layer, [x], MODES[-1], lambda layer, xs: layer(xs[0], training=True))
    assert_recomputes(layer, [x], lambda layer, xs: layer(xs[0], training=True))


def test_bert_backbone_from_config(keras_hub_enabled):
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=100,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.1,
        max_sequence_length=16,
    )
    ids = RNG.randint(0, 100, size=(2, 16)).astype("int32")
    segments = np.zeros((2, 16), "int32")
    padding = np.ones((2, 16), "int32")

    def call(model, xs):
        outputs = model({"token_ids": xs[0], "segment_ids": xs[1], "padding_mask": xs[2]}, training=True)
        return outputs["sequence_output"]

    assert all(getattr(type(layer).call, "_keras_recompute_keras_hub", False) for layer in backbone.transformer_layers)
    compare_on_and_off(backbone, [ids, segments, padding], MODES[-1], call)
    assert_recomputes(backbone, [ids, segments, padding], call)  # an enable() that did nothing fails here
