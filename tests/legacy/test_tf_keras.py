"""TensorFlow 2.2/2.3 with its own tf.keras (no standalone Keras): refused by name, never trained wrong.

The TF2 path needs TensorFlow 2.4's APIs; the graph path serves standalone
Keras 2.3. A tf.keras layer here gets `RecomputeError` saying what to upgrade,
eagerly, in `fit` (where autograph wraps it) and in a TF1-style graph alike.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_recompute import RecomputeError, recompute_grad, recompute_scope

pytestmark = pytest.mark.skipif(not tf.__version__.startswith(("2.2", "2.3")), reason="TensorFlow 2.2 or 2.3")


class Recomputed(tf.keras.layers.Dense):
    @recompute_grad
    def call(self, inputs):
        return super().call(inputs)


@pytest.mark.parametrize("how", ["eager", "fit"])
def test_a_tf_keras_layer_is_refused_naming_the_upgrade(how):
    model = tf.keras.Sequential([Recomputed(4, input_shape=(3,)), tf.keras.layers.Dense(1)])
    x, y = np.ones((2, 3), "float32"), np.ones((2, 1), "float32")
    with recompute_scope(True), pytest.raises(Exception) as raised:
        if how == "eager":
            model(x)
        else:
            model.compile("sgd", "mse")
            model.fit(x, y, verbose=0)
    message = str(raised.value)
    assert "a tf.keras layer, needs TensorFlow 2.4 or newer" in message and "Upgrade TensorFlow" in message
    assert isinstance(raised.value, RecomputeError) or "RecomputeError" in message  # autograph wraps it in fit


def test_off_it_is_the_plain_layer():
    model = tf.keras.Sequential([Recomputed(4, input_shape=(3,), kernel_initializer="ones"), tf.keras.layers.Dense(1)])
    np.testing.assert_allclose(model.layers[0](np.ones((1, 3), "float32")).numpy(), 3 * np.ones((1, 4)))
