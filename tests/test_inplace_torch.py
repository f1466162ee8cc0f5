"""PyTorch: an in-place write to a tensor a backward needs raises under recompute where it raises without.

NOTE [ in-place writes to what a recompute saves ] in `backends/torch.py`. A
graph piece of `recompute_model` holding `y = block(h); h.add_(1)` gave no
error and a first update 0.53 off the same model written out of place; with
`offload=True` a write to a block's input after its forward was not seen.
"""

import keras
import numpy as np
import pytest

from _compare import assert_close
from _keras3_twins import BACKEND, torch_tensor

from keras_recompute import RecomputeError, recompute_grad, recompute_model

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="in-place writes to tensors are PyTorch's")

IDS = np.random.RandomState(0).randint(0, 20, size=(4, 8)).astype("int32")
TARGETS = np.random.RandomState(1).normal(size=(4, 8, 1)).astype("float32")
INPLACE_MESSAGE = "modified by an inplace operation"


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16, activation="tanh")

    def call(self, inputs):
        return self.dense(inputs) * 2.0


class Shift(keras.layers.Layer):
    """`relu(h + 1)`, in place on `h` or not."""

    def __init__(self, in_place, **kwargs):
        super().__init__(**kwargs)
        self.in_place = in_place

    def call(self, hidden):
        import torch

        if self.in_place:
            hidden.add_(1)
            return torch.relu_(hidden)
        return torch.relu(hidden + 1)


def stages_model(in_place):
    """Embedding, then three stages of `h = Dense(x)`, `y = Block(h)`, `x = y + Shift(h)`: `Block` saved `h`."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((8,), dtype="int32")
    hidden = keras.layers.Embedding(20, 16)(ids)
    for _ in range(3):
        projected = keras.layers.Dense(16)(hidden)
        hidden = keras.layers.Add()([Block()(projected), Shift(in_place)(projected)])
    model = keras.Model(ids, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    return model


def first_update(model):
    before = [np.array(w) for w in model.get_weights()]
    model.train_on_batch(IDS, TARGETS)
    return [np.array(w) - w0 for w, w0 in zip(model.get_weights(), before)]


@pytest.mark.parametrize("offload", (False, True), ids=("stored", "offload"))
def test_graph_pieces_raise_on_a_write_the_plain_model_raises_on(offload):
    with pytest.raises(RuntimeError, match=INPLACE_MESSAGE):
        first_update(stages_model(in_place=True))
    model = recompute_model(stages_model(in_place=True), enabled=True, offload=offload)
    with pytest.raises(RecomputeError, match=INPLACE_MESSAGE) as raised:
        first_update(model)
    assert "_piece_" in str(raised.value)  # names the unit
    # Written out of place, the same pieces give the plain update.
    expected = first_update(stages_model(in_place=False))
    assert_close(first_update(recompute_model(stages_model(in_place=False), enabled=True, offload=offload)), expected)


@pytest.mark.parametrize("offload", (False, True), ids=("stored", "offload"))
def test_a_write_to_a_block_input_after_its_forward_raises(offload):
    """The checkpoint saves the block's input; the caller writes it after the call, before the backward."""
    keras.utils.set_random_seed(0)
    plain, recomputed = Block(), Block()
    recomputed.call = recompute_grad(recomputed.call, enabled=True, offload=offload)
    for block in (plain, recomputed):
        inputs = torch_tensor(np.random.RandomState(0).randn(4, 16).astype("float32"), requires_grad=True)
        hidden = inputs * 3.0  # not a leaf: written in place below
        output = block(hidden)
        hidden.add_(1)
        with pytest.raises(RuntimeError, match=INPLACE_MESSAGE):
            (output.sum() + hidden.sum()).backward()


def test_a_write_inside_the_call_after_an_op_saved_it_raises():
    import torch

    class WritesSaved(keras.layers.Layer):
        def call(self, inputs):
            hidden = inputs * 2.0
            output = torch.tanh(hidden) * hidden  # the product saves `hidden`
            hidden.mul_(3.0)
            return output + hidden

    inputs = torch_tensor(np.random.RandomState(0).randn(4, 16).astype("float32"), requires_grad=True)
    with pytest.raises(RuntimeError, match=INPLACE_MESSAGE):
        WritesSaved()(inputs).sum().backward()
    layer = WritesSaved()
    layer.call = recompute_grad(layer.call, enabled=True)
    with pytest.raises(RecomputeError, match=INPLACE_MESSAGE):
        layer(inputs).sum().backward()
