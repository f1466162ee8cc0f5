"""What Keras keeps outside a call's arguments reaches the recompute (Keras 3, every backend).

NOTE [ the call's context ] in keras_recompute/_context.py lists it: the layer
behind a bound method (an instance patched with `block.call =
recompute_grad(block.call)`), masks Keras attaches to tensors
(`Embedding(mask_zero=True)`), and which variables train (a frozen block with
trainable parts, as keras-hub's `enable_lora` makes). Every test runs the same
model with recompute off and on, from the same variables and seeds, and
compares outputs, input gradients, every trainable variable's gradient, which
variables get one, and the state after the steps (`compare_on_and_off`).
"""

import gc

import keras
import numpy as np
import pytest
from keras import layers, ops
from keras.src.backend import get_keras_mask

from _keras3_twins import BACKEND, FAST_MODE, MODES, assert_recomputes, assert_trained_alike, compare_on_and_off, loss_and_gradients
from keras_recompute import layers as recompute_layers
from keras_recompute import recompute_grad, recompute_scope

# JAX traces a recomputed call once and replays the traced program, so Python
# runs it once; test_keras3.test_memory_falls proves its recompute.
COUNTS_CALLS = BACKEND != "jax"


def token_ids():
    """Two rows padded with zeros from position 5 on."""
    ids = np.random.RandomState(0).randint(1, 30, size=(4, 8)).astype("int32")
    ids[1::2, 5:] = 0
    return ids


def train_call(model, xs):
    return model(xs[0], training=True)


class Block(layers.Layer):
    """Self-attention that reads the mask attached to its input; dropout; BatchNorm."""

    def __init__(self, calls=None, **kwargs):
        super().__init__(**kwargs)
        self.calls = [] if calls is None else calls
        self.attention = layers.MultiHeadAttention(2, 8, dropout=0.3, seed=1)
        self.dropout = layers.Dropout(0.5, seed=2)
        self.norm = layers.LayerNormalization()
        self.batch_norm = layers.BatchNormalization()
        self.dense = layers.Dense(16)
        self.supports_masking = True

    def call(self, inputs, training=None):
        self.calls.append(1)
        hidden = self.norm(inputs + self.attention(inputs, inputs, training=training))
        return hidden + self.dropout(self.dense(self.batch_norm(hidden, training=training)), training=training)


class DecoratedBlock(Block):
    call = recompute_grad(Block.call)


def text_model(make_block, masked=True, blocks=2):
    """Embedding (padding mask attached when `masked`), blocks, masked average pooling, classifier."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((8,), dtype="int32")
    hidden = layers.Embedding(30, 16, mask_zero=masked)(ids)
    for _ in range(blocks):
        hidden = make_block()(hidden)
    return keras.Model(ids, layers.Dense(3)(layers.GlobalAveragePooling1D()(hidden)))


def patch_blocks(model):
    """Recomputes each `Block` instance of `model` without touching its class."""
    blocks = [layer for layer in model.layers if isinstance(layer, Block)]
    for block in blocks:
        block.call = recompute_grad(block.call)
    return blocks


@pytest.mark.parametrize("mode", MODES)
def test_patched_instances_match_the_plain_model(mode):
    """A bound method's layer is found: its dropout masks and BatchNorm state are replayed."""
    model = text_model(Block, masked=False)
    blocks = patch_blocks(model)
    compare_on_and_off(model, [token_ids()], mode, train_call, steps=2)
    if COUNTS_CALLS and mode == "eager":
        for on, per_block in ((False, 1), (True, 2)):
            for block in blocks:
                block.calls.clear()
            with recompute_scope(on):
                loss_and_gradients(model, [token_ids()], mode, train_call)
            assert [len(block.calls) for block in blocks] == [per_block] * len(blocks), f"recompute {on}"


def test_decorating_twice_recomputes_once():
    """Patching an instance twice, or one whose class is decorated, replaces instead of nesting."""
    twice, decorated = Block(), DecoratedBlock()
    for block in (twice, decorated):
        block.call = recompute_grad(block.call)
    twice.call = recompute_grad(twice.call, check=False)
    assert twice.call.__wrapped__.__func__ is Block.call
    assert decorated.call.__wrapped__.__func__ is Block.call
    x = np.random.RandomState(1).standard_normal((2, 8, 16)).astype("float32")
    for block in (twice, decorated):
        block(x)
        if COUNTS_CALLS:
            block.calls.clear()
            with recompute_scope(True):
                loss_and_gradients(block, [x])
            assert len(block.calls) == 2, f"{type(block).__name__}: the call ran {len(block.calls)} times"


def _keras_hub_encoder():
    import keras_hub

    return keras_hub.layers.TransformerEncoder(32, 2, dropout=0.2)


BLOCKS = {
    "decorated class": lambda: DecoratedBlock(),
    "patched instance": lambda: Block(),
    "keras_recompute TransformerBlock": lambda: recompute_layers.TransformerBlock(32, 2, dropout=0.2),
    "keras-hub TransformerEncoder": _keras_hub_encoder,
}


# Every mode for a user's block; one for the others, whose path is the same.
MASK_CASES = [(mode, "decorated class") for mode in MODES] + [(FAST_MODE, kind) for kind in list(BLOCKS)[1:]]


@pytest.mark.parametrize("mode,kind", MASK_CASES)
def test_masks_attached_to_tensors_reach_the_recompute(mode, kind, request):
    """`Embedding(mask_zero=True)`: sub-layers read the mask from their inputs, on and off alike."""
    if kind.startswith("keras-hub"):
        request.getfixturevalue("keras_hub_enabled")
    model = text_model(BLOCKS[kind])
    if kind == "patched instance":
        patch_blocks(model)
    compare_on_and_off(model, [token_ids()], mode, train_call, steps=2)
    if mode == FAST_MODE:  # the numbers above hold for a block that does not recompute, too
        assert_recomputes(model, [token_ids()], train_call)
    # The mask matters: without it the same weights give other outputs.
    unmasked = text_model(BLOCKS[kind], masked=False)
    unmasked.set_weights(model.get_weights())
    with recompute_scope(False):
        difference = ops.max(ops.abs(model(token_ids()) - unmasked(token_ids())))
    assert float(ops.convert_to_numpy(difference)) > 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_a_masking_layers_mask_reaches_the_recompute(mode):
    """`Masking` computes the mask from the values: padded steps are all zeros."""
    features = np.random.RandomState(3).standard_normal((4, 8, 16)).astype("float32")
    features[1::2, 5:] = 0.0
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 16))
    hidden = DecoratedBlock()(DecoratedBlock()(layers.Masking(0.0)(inputs)))
    model = keras.Model(inputs, layers.Dense(3)(layers.GlobalAveragePooling1D()(hidden)))
    compare_on_and_off(model, [features], mode, train_call, steps=2)


def test_masked_model_trains_to_the_plain_losses():
    """`train_on_batch` (compiled by Keras on TensorFlow and JAX): the same losses, step by step."""
    ids, labels = token_ids(), np.array([0, 1, 2, 1])
    losses, models = {}, {}
    for on in (False, True):
        model = models[on] = text_model(DecoratedBlock)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        initial = [np.asarray(ops.convert_to_numpy(w), np.float64) for w in model.weights]
        keras.utils.set_random_seed(5)
        with recompute_scope(on):
            losses[on] = [float(model.train_on_batch(ids, labels)) for _ in range(3)]
    # The first step is one program against another: equal up to float reassociation. Three steps
    # of SGD at lr 0.5 amplify that reassociation (on an AVX-512 CPU, JAX's third loss moved 1.8e-5
    # relative between the plain and the recomputed program, and 3.0e-5 between the plain program
    # compiled for AVX-512 and for AVX2): the weights' moves over the three steps, normwise, decide.
    np.testing.assert_allclose(losses[True][0], losses[False][0], rtol=1e-6)
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-4)
    assert_trained_alike(models[True], models[False], initial)
    assert losses[False][0] != losses[False][2]


class Passing(layers.Layer):
    """No `supports_masking`: the output's mask is the one its last sub-layer attached."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(2, 8)
        self.norm = layers.LayerNormalization()

    @recompute_grad
    def call(self, inputs):
        return self.norm(self.attention(inputs, inputs))


def test_outputs_carry_the_mask_the_plain_call_gives_them():
    embedding = layers.Embedding(30, 16, mask_zero=True)
    block = Passing()
    # Built first: building runs `MultiHeadAttention` on the input, which
    # clears the input's mask in place (Keras's doing, with or without us).
    block(embedding(token_ids()))
    outputs = {}
    for on in (False, True):
        with recompute_scope(on):
            outputs[on] = block(embedding(token_ids()))
    plain_mask = get_keras_mask(outputs[False])
    assert plain_mask is not None
    np.testing.assert_array_equal(ops.convert_to_numpy(get_keras_mask(outputs[True])), ops.convert_to_numpy(plain_mask))


class PartlyFrozen(layers.Layer):
    """Two dense layers, dropout and BatchNorm under one recomputed call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.frozen = layers.Dense(16, activation="tanh")
        self.live = layers.Dense(16)
        self.dropout = layers.Dropout(0.3, seed=4)
        self.batch_norm = layers.BatchNormalization()

    @recompute_grad
    def call(self, inputs, training=None):
        hidden = self.dropout(self.frozen(inputs), training=training)
        return self.batch_norm(self.live(hidden), training=training)


class Holder(layers.Layer):
    """A trainable layer around the block, as a backbone is around its frozen encoders."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = PartlyFrozen()
        self.head = layers.Dense(4)

    def call(self, inputs, training=None):
        return self.head(self.block(inputs, training=training))


def freeze_parent_keep_child(holder):
    holder.block.trainable = False  # freezes every layer under it ...
    holder.block.live.trainable = True  # ... then one is set back, as enable_lora does


def freeze_one_sublayer(holder):
    holder.block.frozen.trainable = False


@pytest.mark.parametrize("freeze", [freeze_parent_keep_child, freeze_one_sublayer])
@pytest.mark.parametrize("mode", MODES)
def test_frozen_parts_train_as_without_recompute(mode, freeze):
    x = np.random.RandomState(2).standard_normal((8, 12)).astype("float32")
    holder = Holder()
    holder(x)
    freeze(holder)
    trained = {v.path for v in holder.trainable_variables}
    assert {v.path for v in holder.block.live.trainable_variables} <= trained
    runs = compare_on_and_off(holder, [x], mode, lambda layer, xs: layer(xs[0], training=True), steps=2)
    _, gradients = runs[True][0]
    assert all(g is not None for g in gradients), "every trainable variable gets a gradient"


def lora_backbone(keras_hub, family):
    keras.utils.set_random_seed(0)
    config = dict(vocabulary_size=100, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64, max_sequence_length=16, dropout=0.1)
    backbone = getattr(keras_hub.models, f"{family}Backbone")(**config)
    backbone.enable_lora(4)
    return backbone


@pytest.mark.parametrize("family", ["Bert", "GPT2"])
def test_lora_fine_tuning_gets_every_gradient(keras_hub_enabled, family):
    """keras-hub's `enable_lora`: frozen encoders whose LoRA kernels and biases train."""
    backbone = lora_backbone(keras_hub_enabled, family)
    lora = [v.path for v in backbone.trainable_variables if "lora" in v.path]
    assert len(lora) == 8, lora  # A and B of query and value, in 2 blocks
    ids = np.random.RandomState(0).randint(1, 100, size=(2, 16)).astype("int32")
    padding = np.ones((2, 16), "int32")
    padding[1, 10:] = 0
    inputs = {"Bert": [ids, np.zeros((2, 16), "int32"), padding], "GPT2": [ids, padding]}[family]
    names = {"Bert": ["token_ids", "segment_ids", "padding_mask"], "GPT2": ["token_ids", "padding_mask"]}[family]

    def call(model, xs):
        outputs = model(dict(zip(names, xs)), training=True)
        return outputs["sequence_output"] if isinstance(outputs, dict) else outputs

    runs = compare_on_and_off(backbone, inputs, MODES[-1], call)
    _, gradients = runs[True][0]
    assert all(g is not None for g in gradients)


class Quantizable(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(32, activation="gelu")
        self.down = layers.Dense(16)
        self.dropout = layers.Dropout(0.2, seed=5)

    @recompute_grad
    def call(self, inputs, training=None):
        return inputs + self.down(self.dropout(self.up(inputs), training=training))


class QuantizedHolder(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = Quantizable()
        self.head = layers.Dense(4)

    def call(self, inputs, training=None):
        return self.head(self.block(inputs, training=training))


@pytest.mark.parametrize("lora", [False, True], ids=["int8", "int8 + LoRA"])
@pytest.mark.parametrize("mode", MODES)
def test_quantized_block_with_and_without_lora(mode, lora, monkeypatch):
    """`Dense.quantize("int8")` kernels are state, not weights: read as the forward read them."""
    x = np.random.RandomState(4).standard_normal((8, 16)).astype("float32")
    holder = QuantizedHolder()
    holder(x)
    # Keras collects the garbage when a layer drops a variable (the float kernel here): a whole collection of the
    # suite's process, 4-8 s a case late in TensorFlow's run, for nothing this test reads.
    with monkeypatch.context() as patch:
        patch.setattr(gc, "collect", lambda *args: 0)
        for dense in (holder.block.up, holder.block.down):
            dense.quantize("int8")
    if lora:
        holder.block.trainable = False
        for dense in (holder.block.up, holder.block.down):
            dense.trainable = True
            dense.enable_lora(2)
    compare_on_and_off(holder, [x], mode, lambda layer, xs: layer(xs[0], training=True), steps=2)
