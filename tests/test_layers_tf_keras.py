"""`keras_recompute.layers` built on tf_keras (Keras 2): gradients and serialization."""

import os

import numpy as np
import pytest
tf = pytest.importorskip("tensorflow")  # absent on a JAX or PyTorch GPU machine: the file skips
tf_keras = pytest.importorskip("tf_keras")

from _twins import MODES, assert_close, assert_recomputes, compare_with_twin, loss_and_gradients, compile_mode
from keras_recompute import layers as recompute_layers
from keras_recompute import recompute_scope

LAYERS = recompute_layers.for_keras(tf_keras)


def normal(*shape):
    return tf.random.stateless_normal(shape, seed=[len(shape), shape[-1]])


def test_classes_subclass_tf_keras():
    assert issubclass(LAYERS.Dense, tf_keras.layers.Dense)
    assert issubclass(LAYERS.MultiHeadAttention, tf_keras.layers.MultiHeadAttention)
    assert LAYERS.Dense is not recompute_layers.for_keras(__import__("keras")).Dense


@pytest.mark.parametrize("mode", MODES)
def test_dense_and_attention_match_the_stock_layers(mode):
    x = normal(2, 6, 16)
    cases = (
        (tf_keras.layers.Dense(8, activation="gelu"), LAYERS.Dense(8, activation="gelu"), lambda layer, x: layer(x)),
        (
            tf_keras.layers.MultiHeadAttention(2, 8),
            LAYERS.MultiHeadAttention(2, 8),
            lambda layer, x: layer(x, x, x, training=True),
        ),
    )
    for stock, ours, call in cases:
        call(stock, x)
        with recompute_scope(False):
            call(ours, x)
        ours.set_weights(stock.get_weights())
        compare_with_twin(stock, ours, x, mode, call=call)
        if mode == MODES[0]:  # equal numbers prove nothing if the decorator did nothing
            assert_recomputes(lambda z: call(ours, z), x, ours.trainable_weights)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_feed_forward_and_transformer_block_on_and_off(mode):
    x = normal(2, 6, 16)
    padding = tf.constant([[1] * 6, [1] * 4 + [0] * 2])
    for layer, call in (
        (LAYERS.FeedForward(32, dropout_rate=0.2), lambda layer, x: layer(x, training=True)),
        (
            LAYERS.TransformerBlock(32, 2, dropout=0.2, activation="gelu"),
            lambda layer, x: layer(x, padding_mask=padding, training=True),
        ),
    ):
        with recompute_scope(False):
            call(layer, x)
        results = []
        for on in (False, True):
            tf_keras.utils.set_random_seed(0)
            with recompute_scope(on):
                run = compile_mode(lambda y: loss_and_gradients(lambda z: call(layer, z), y, layer.trainable_weights), mode)
                results.append(run(x))
        assert_close(results[1][0], results[0][0], what=f"{type(layer).__name__} outputs")
        assert_close(results[1][1], results[0][1], what=f"{type(layer).__name__} gradients")
        if mode == "eager":
            assert_recomputes(lambda z: call(layer, z), x, layer.trainable_weights)


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_save_and_load_without_custom_objects(tmp_path, suffix):
    inputs = tf_keras.Input((6, 16))
    hidden = LAYERS.Dense(16)(inputs)
    hidden = LAYERS.TransformerBlock(32, 2, dropout=0.1)(hidden)
    hidden = LAYERS.FeedForward(24)(hidden)
    outputs = LAYERS.MultiHeadAttention(2, 8)(hidden, hidden)
    model = tf_keras.Model(inputs, outputs)
    path = os.path.join(tmp_path, "model" + suffix)
    model.save(path)
    loaded = tf_keras.models.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in model.layers]
    x = normal(2, 6, 16)
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6, atol=1e-6)
