"""The call's context on the TensorFlow path: tf_keras, logits attached to outputs, TF1 graphs.

`test_context.py` covers Keras 3 on every backend. Here: the same three
things (a patched instance, masks attached to tensors, a frozen block with a
trainable sub-layer) with tf_keras, whose layers keep masks and `trainable`
their own way; and `_keras_logits`, which Keras's softmax attaches to its
output and TensorFlow's cross-entropy reads (NOTE [ logits attached to
outputs ] in backends/tensorflow.py), on Keras 3 and tf_keras.
"""

import numpy as np
import pytest
tf = pytest.importorskip("tensorflow")  # absent on a JAX or PyTorch GPU machine: the file skips

from _twins import FRAMEWORKS, MODES, assert_close, compile_mode, framework, on_and_off
from keras_recompute import recompute_grad, recompute_scope
from test_tf_graph import run_case


@pytest.fixture(params=FRAMEWORKS)
def K(request):
    return framework(request.param)


@pytest.fixture
def reproducible(request):
    """`reproducible(K, mode)`: tf_keras under XLA draws from a `tf.random.Generator`.

    Its default (legacy stateful) random ops draw differently on every XLA
    run, the plain layer's included: there would be nothing to compare with.
    """
    import tf_keras

    switched = []

    def switch(K, mode):
        if K.__name__ == "tf_keras" and mode == "jit":
            tf_keras.backend.experimental.enable_tf_random_generator()
            switched.append(True)

    yield switch
    if switched:
        tf_keras.backend.experimental.disable_tf_random_generator()


def block_class(K):
    class Block(K.layers.Layer):
        """Self-attention reading the mask attached to its input; seeded dropout; BatchNorm."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = K.layers.MultiHeadAttention(2, 8)
            self.dropout = K.layers.Dropout(0.5, seed=2)
            self.norm = K.layers.LayerNormalization()
            self.batch_norm = K.layers.BatchNormalization()
            self.dense = K.layers.Dense(16)
            self.supports_masking = True

        def call(self, inputs, training=None):
            hidden = self.norm(inputs + self.attention(inputs, inputs, training=training))
            return hidden + self.dropout(self.dense(self.batch_norm(hidden, training=training)), training=training)

    return Block


def text_model(K, masked, patched):
    """Embedding (padding mask when `masked`), two blocks (instances patched when `patched`), pooling."""
    K.utils.set_random_seed(0)
    Block = block_class(K)
    ids = K.Input((8,), dtype="int32")
    hidden = K.layers.Embedding(30, 16, mask_zero=masked)(ids)
    blocks = [Block(), Block()]
    for block in blocks:
        hidden = block(hidden)
    model = K.Model(ids, K.layers.Dense(3)(K.layers.GlobalAveragePooling1D()(hidden)))
    if patched:
        for block in blocks:
            block.call = recompute_grad(block.call)
    return model


def token_ids():
    ids = np.random.RandomState(0).randint(1, 30, size=(4, 8)).astype("int32")
    ids[1::2, 5:] = 0
    return tf.constant(ids)


@pytest.mark.parametrize("mode,masked", [("eager", False)] + [(mode, True) for mode in MODES], ids=str)
def test_patched_instances_and_masks_match_the_plain_model(K, mode, masked, reproducible):
    reproducible(K, mode)
    runs = on_and_off(K, lambda: text_model(K, masked=masked, patched=True), token_ids(), mode)
    assert all(g is not None for g in runs[True][0][1])
    if masked:  # the mask matters: without it the same weights give other outputs
        model = text_model(K, masked=True, patched=False)
        unmasked = text_model(K, masked=False, patched=False)
        unmasked.set_weights(model.get_weights())
        assert float(tf.reduce_max(tf.abs(model(token_ids()) - unmasked(token_ids())))) > 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_tf_keras_frozen_parent_with_a_trainable_child(mode):
    """tf_keras keeps `trainable` on layers: the innermost layer decides, not the frozen parent."""
    import tf_keras as K

    class Block(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.frozen = K.layers.Dense(16, activation="tanh")
            self.live = K.layers.Dense(16)

        @recompute_grad
        def call(self, inputs):
            return self.live(self.frozen(inputs))

    block = Block()
    x = tf.random.stateless_normal((4, 12), seed=[1, 2])
    block(x)
    block.trainable = False
    block.live.trainable = True
    assert block.trainable_weights == [] and len(block.live.trainable_weights) == 2

    def gradients(on):
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.sin(block(x)))
            return tape.gradient(loss, block.live.trainable_weights + block.frozen.weights)

        with recompute_scope(on):
            return compile_mode(step, mode)(x)

    plain, recomputed = gradients(False), gradients(True)
    assert_close(recomputed[:2], plain[:2], what="the trainable child's gradients")
    # The frozen layer's weights, asked for explicitly, get none (tf_keras's
    # plain tape gives them one, since their tf.Variables stay trainable; its
    # trainers never ask for them).
    assert recomputed[2:] == [None, None]


def softmax_head(K, activation):
    class Head(K.layers.Layer):
        """Ends in a softmax whose probabilities saturate: only the logits keep a gradient."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = K.layers.Dense(16, activation="tanh")
            self.scores = K.layers.Dense(5, activation="softmax" if activation == "keras" else None)

        @recompute_grad
        def call(self, inputs):
            scores = self.scores(self.hidden(inputs))
            return scores if activation == "keras" else tf.nn.softmax(scores)

    return Head


@pytest.mark.parametrize("activation", ["keras", "tf.nn.softmax"])
@pytest.mark.parametrize("mode", MODES)
def test_cross_entropy_reads_the_logits_as_without_recompute(K, mode, activation):
    """NOTE [ logits attached to outputs ]: the loss takes the logits, not the clipped probabilities."""
    head = softmax_head(K, activation)()
    x = tf.random.stateless_normal((6, 12), seed=[3, 4]) * 30.0
    labels = tf.one_hot([0, 1, 2, 3, 4, 0], 5)
    head(x)
    head.scores.kernel.assign(head.scores.kernel * 40.0)

    def gradients(on):
        def step(x):
            with tf.GradientTape() as tape:
                probabilities = head(x)
                loss = tf.reduce_sum(K.losses.categorical_crossentropy(labels, probabilities))
            return loss, tape.gradient(loss, head.trainable_weights)

        with recompute_scope(on):
            return compile_mode(step, mode)(x)

    (plain_loss, plain), (loss, recomputed) = gradients(False), gradients(True)
    assert_close(loss, plain_loss, what="loss")
    assert_close(recomputed, plain, what="gradients")
    # The probabilities saturate: the loss is large, and finite only through the logits.
    assert float(plain_loss) > 50.0


def test_session_patched_instance_masks_and_frozen_parts():
    """TF1-style graph: a patched instance whose attention reads an attached mask, partly frozen."""
    result = run_case("context")
    assert result["gradients"] == result["expected_gradients"], result
    assert result["max_relative_error"] <= 1e-5, result
    assert result["mask_matters"] > 1e-3, result
