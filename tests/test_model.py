"""`recompute_model`: recompute a model without editing its classes (Keras 3, every backend).

Every way of choosing units (`"auto"`, a class, names, a predicate,
`segments=`, `limit=`) is compared with the plain model (`compare_on_and_off`:
outputs, every gradient, state after the steps), and proven to recompute what
it chose and nothing else: on TensorFlow and PyTorch the chosen units' `call`
runs twice in a step and every other layer's once; on JAX, which traces a call
once, each recomputed gelu adds one `erfc` to the program of the step.
"""

import collections
import contextlib
import functools
import json
import os

import warnings

import keras
import numpy as np
import pytest
from keras import layers

from _keras3_twins import BACKEND, FAST_MODE, MODES, assert_trained_alike, compare_on_and_off, step_program
from keras_recompute import _model, recompute_grad, recompute_model, recompute_scope

X = np.random.RandomState(0).standard_normal((8, 16)).astype("float32")


def train_call(model, xs):
    return model(xs[0], training=True)


class Block(layers.Layer):
    """A residual feed-forward block with dropout and BatchNorm: one gelu (one `erfc`) per call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(32, activation="gelu")
        self.dropout = layers.Dropout(0.3, seed=1)
        self.down = layers.Dense(16)
        self.norm = layers.BatchNormalization()

    def call(self, inputs, training=None):
        return self.norm(inputs + self.down(self.dropout(self.up(inputs), training=training)), training=training)


class Stack(keras.Model):
    """A subclassed model: its blocks are a list attribute."""

    def __init__(self, count=3, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Dense(16)
        self.stack = [Block(name=f"block_{i}") for i in range(count)]
        self.head = layers.Dense(3)

    def call(self, inputs, training=None):
        hidden = self.stem(inputs)
        for block in self.stack:
            hidden = block(hidden, training=training)
        return self.head(hidden)


def functional_blocks(count=3):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = layers.Dense(16, name="stem")(inputs)
    for i in range(count):
        hidden = Block(name=f"block_{i}")(hidden)
    return keras.Model(inputs, layers.Dense(3, name="head")(hidden))


def dense_chain(count=4):
    """No block layers: Dense(gelu) and Dropout, repeated, in a functional graph."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = inputs
    for i in range(count):
        hidden = layers.Dense(16, activation="gelu", name=f"dense_{i}")(hidden)
        hidden = layers.Dropout(0.2, seed=i, name=f"dropout_{i}")(hidden)
    return keras.Model(inputs, layers.Dense(3, name="head")(hidden))


def subclassed_stack():
    keras.utils.set_random_seed(0)
    model = Stack()
    model(X)
    return model


@contextlib.contextmanager
def counted_calls(*classes):
    """Counts, per layer name, how often each instance of `classes` runs its `call`."""
    counts = collections.Counter()
    originals = {cls: cls.__dict__["call"] for cls in classes}
    for cls, original in originals.items():

        @functools.wraps(original)
        def counted(self, *args, _original=original, **kwargs):
            counts[self.name] += 1
            return _original(self, *args, **kwargs)

        cls.call = counted
    try:
        yield counts
    finally:
        for cls, original in originals.items():
            cls.call = original


def assert_recomputes(make_model, apply, recomputed, others, counted=(Block,), gelus=None):
    """`apply(model)` recomputes the layers named in `recomputed`, and not those in `others`.

    TensorFlow and PyTorch count each layer's calls in one eager training
    step; JAX counts the `erfc`s (gelus) of the step's program (`gelus`: how
    many are recomputed, when `recomputed` does not say).
    """
    if BACKEND == "jax":
        plain = step_program(make_model(), [X], train_call).count(" erfc ")
        model = make_model()
        apply(model)
        with recompute_scope(True):
            program = step_program(model, [X], train_call)
        assert program.count(" erfc ") - plain == (len(recomputed) if gelus is None else gelus)
        return
    with counted_calls(*counted) as counts:
        model = make_model()
        apply(model)
        counts.clear()
        with recompute_scope(True):
            from _keras3_twins import loss_and_gradients

            loss_and_gradients(model, [X], "eager", train_call)
    assert {name: counts[name] for name in recomputed} == {name: 2 for name in recomputed}, counts
    assert {name: counts[name] for name in others} == {name: 1 for name in others}, counts


MODELS = {"functional": functional_blocks, "subclassed": subclassed_stack}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mode", MODES)
def test_auto_recomputes_the_repeated_blocks(mode, kind):
    model = MODELS[kind]()
    recompute_model(model)
    assert _model.recomputed_units(model) == ["block_0", "block_1", "block_2"]
    compare_on_and_off(model, [X], mode, train_call, steps=2)


@pytest.mark.parametrize("kind", list(MODELS))
def test_auto_recomputes_each_block_once_more(kind):
    assert_recomputes(MODELS[kind], recompute_model, ["block_0", "block_1", "block_2"], [])


@pytest.mark.parametrize("mode", MODES)
def test_auto_cuts_a_graph_without_block_layers_into_its_repeats(mode):
    """A functional graph of Dense and Dropout: each Dense with its Dropout is a block; the head is not."""
    model = dense_chain()
    recompute_model(model)
    assert _model.recomputed_units(model) == [f"dense_{i} .. dropout_{i}" for i in range(4)]
    compare_on_and_off(model, [X], mode, train_call, steps=2)


def ops_between_layers():
    """Dense layers with Keras ops between them (`keras.ops.tanh`: an `Operation` in the graph, not a layer), no
    repeats: auto cuts it between the layers with weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.ops.tanh(layers.Dense(16, name="dense_0")(inputs))
    hidden = keras.ops.sin(layers.Dense(24, name="dense_1")(hidden))
    hidden = keras.ops.mean(layers.Dense(8, name="dense_2")(hidden), axis=-1, keepdims=True)
    return keras.Model(inputs, hidden)


@pytest.mark.parametrize("mode", MODES)
def test_auto_cuts_a_graph_with_ops_between_its_layers(mode):
    """An op node holds no weights (it has no `weights` at all: auto raised AttributeError on it)."""
    model = ops_between_layers()
    recompute_model(model)
    assert len(_model.recomputed_units(model)) >= 2, _model.recomputed_units(model)
    compare_on_and_off(model, [X], mode, train_call, steps=2)


def test_auto_pieces_recompute_their_layers_once_more():
    def apply(model):
        recompute_model(model)

    assert_recomputes(dense_chain, apply, [f"dense_{i}" for i in range(4)], ["head"], counted=(layers.Dense,))


class FineTuned(keras.Model):
    """A subclassed model that holds a backbone model and a head."""

    def __init__(self, backbone, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.head = layers.Dense(3, name="head")

    def call(self, inputs, training=None):
        return self.head(self.backbone(inputs, training=training))


def residual_stages(kind="flat"):
    """A ResNet in Dense layers: a stem, two stages of a block whose shortcut changes the width (a Dense on it) and
    two blocks of one kind (ResNet's identity blocks), a head. `kind`: "flat", or the stages are a backbone model
    under a head, as transfer learning builds it (NOTE [ a model inside a model ]), in a functional ("nested") or
    a subclassed model ("subclassed")."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = layers.Dense(16, name="stem")(inputs)
    for stage, width in enumerate((24, 32)):
        shortcut = layers.Dense(width, name=f"s{stage}_shortcut")(hidden)
        hidden = layers.Add(name=f"s{stage}_b0_add")([shortcut, layers.Dense(width, activation="gelu", name=f"s{stage}_b0")(hidden)])
        for block in (1, 2):
            update = layers.Dropout(0.2, seed=block)(layers.Dense(width, activation="gelu", name=f"s{stage}_b{block}")(hidden))
            hidden = layers.Add(name=f"s{stage}_b{block}_add")([hidden, update])
    if kind == "flat":
        return keras.Model(inputs, layers.Dense(3, name="head")(hidden))
    backbone = keras.Model(inputs, hidden, name="backbone")
    if kind == "subclassed":
        model = FineTuned(backbone)
        model(X)
        return model
    outer_inputs = keras.Input((16,))
    return keras.Model(outer_inputs, layers.Dense(3, name="head")(backbone(outer_inputs)))


STAGES_RECOMPUTED = ["s0_b1", "s0_b2", "s1_shortcut", "s1_b0", "s1_b1", "s1_b2"]
STAGES_PLAIN = ["stem", "s0_shortcut", "s0_b0", "head"]


# Every mode for the flat model; the nested and subclassed ones, whose units "auto" finds otherwise but which run as the
# flat one's do, in one (a graph on TensorFlow: its XLA cases were 10 s of the suite's TensorFlow run).
_ONE_MODE = "function" if BACKEND == "tensorflow" else MODES[-1]


@pytest.mark.parametrize("mode, kind", [(mode, "flat") for mode in MODES] + [(_ONE_MODE, "nested"), (_ONE_MODE, "subclassed")])
def test_auto_takes_every_repetition_of_a_block_and_the_blocks_between(mode, kind):
    """NOTE [ a CNN's stages ]: both stages' identity blocks and the second stage's first block recompute, not only
    the first stage's two (the longest run, as before); the stem, the first stage's first block and the head do
    not. Nested, the backbone's graph is cut (NOTE [ a model inside a model ]): it was one unit, run whole again;
    a subclassed model holding it had no graph to cut, and "auto" took the stem and a shortcut (two Dense in a row)."""
    model = residual_stages(kind)
    recompute_model(model)
    units = _model.recomputed_units(model)
    assert units == [
        "s0_b1 .. s0_b1_add",
        "s0_b2 .. s0_b2_add",
        units[2],
        "s1_b1 .. s1_b1_add",
        "s1_b2 .. s1_b2_add",
    ] and units[2] in ("s1_shortcut .. s1_b0_add", "s1_b0 .. s1_b0_add"), units
    compare_on_and_off(model, [X], mode, train_call, steps=2)


@pytest.mark.parametrize("kind", ["flat", "nested", "subclassed"])
def test_auto_stages_recompute_their_layers_once_more(kind):
    apply = lambda model: recompute_model(model)  # noqa: E731
    assert_recomputes(functools.partial(residual_stages, kind), apply, STAGES_RECOMPUTED, STAGES_PLAIN, counted=(layers.Dense,), gelus=5)


@pytest.mark.parametrize("kind", ["nested", "subclassed"])
def test_a_report_and_a_budget_of_a_backbone_under_a_head_are_over_its_blocks(kind):
    """`memory_report` and `budget=` see the backbone's blocks, as "auto" does (they saw the backbone, one unit)."""
    from keras_recompute import memory_report

    batch = np.random.RandomState(1).standard_normal((256, 16)).astype("float32")
    model = residual_stages(kind)
    report = memory_report(model, batch)
    assert [row["name"] for row in report.rows] == _model.recomputed_units(recompute_model(residual_stages(kind)))
    recompute_model(model, budget=int(0.9 * report.predicted_peak), inputs=batch)
    assert 0 < len(_model.recomputed_units(model)) <= 5 and "_add" in _model.recomputed_units(model)[0]
    compare_on_and_off(model, [X], FAST_MODE, train_call)


@pytest.mark.parametrize("mode", MODES)
def test_auto_recomputes_each_call_of_a_shared_block(mode):
    """ALBERT calls one block layer again and again: each call is a unit (a piece that is one block layer), where a
    piece of one leaf layer is not a block (NOTE [ a CNN's stages ])."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    shared = Block(name="shared")
    hidden = layers.Dense(16, name="stem")(inputs)
    for _ in range(3):
        hidden = shared(hidden)
    model = keras.Model(inputs, layers.Dense(3, name="head")(hidden))
    recompute_model(model)
    assert _model.recomputed_units(model) == ["shared .. shared"] * 3
    compare_on_and_off(model, [X], mode, train_call, steps=2)


def test_a_model_called_twice_is_not_cut_into():
    """A Siamese tower (one backbone called on two inputs) is not cut: its pieces would run once per call."""
    keras.utils.set_random_seed(0)
    backbone = residual_stages()
    left, right = keras.Input((16,)), keras.Input((16,))
    model = keras.Model([left, right], layers.Add()([backbone(left), backbone(right)]))
    recompute_model(model)
    assert not any("_add" in name for name in _model.recomputed_units(model)), _model.recomputed_units(model)


ALL_BLOCKS = ["block_0", "block_1", "block_2"]


@pytest.mark.parametrize(
    "blocks,expected",
    [
        (Block, ALL_BLOCKS),
        ((Block, layers.Embedding), ALL_BLOCKS),
        (["block_0", "block_2"], ["block_0", "block_2"]),
        (lambda layer: layer.name in ("block_0", "block_2"), ["block_0", "block_2"]),
    ],
    ids=["class", "classes", "names", "predicate"],
)
def test_blocks_by_class_name_or_predicate(blocks, expected):
    model = functional_blocks()
    recompute_model(model, blocks=blocks)
    assert _model.recomputed_units(model) == expected
    compare_on_and_off(model, [X], FAST_MODE, train_call)
    others = [name for name in ALL_BLOCKS if name not in expected]
    assert_recomputes(functional_blocks, lambda m: recompute_model(m, blocks=blocks), expected, others)


def test_nested_layers_are_found_and_not_chosen_twice():
    """Blocks inside a model inside a model; a Dense inside a chosen block is not chosen again."""
    keras.utils.set_random_seed(0)
    inner = functional_blocks()
    inputs = keras.Input((16,))
    model = keras.Model(inputs, layers.Dense(2, name="outer_head")(inner(inputs)))
    recompute_model(model)  # auto: the run of blocks inside `inner`
    assert _model.recomputed_units(model) == ["block_0", "block_1", "block_2"]
    recompute_model(model, blocks=lambda layer: isinstance(layer, (Block, layers.Dense)))
    assert _model.recomputed_units(model) == ["stem", "block_0", "block_1", "block_2", "head", "outer_head"]
    compare_on_and_off(model, [X], FAST_MODE, train_call)


@pytest.mark.parametrize("segments", [1, 3, "sqrt"])
def test_segments_cut_the_graph(segments):
    model = dense_chain()
    recompute_model(model, segments=segments)
    expected = {1: 1, 3: 3, "sqrt": 3}[segments]  # 9 layers: about sqrt(9) pieces
    assert len(_model.recomputed_units(model)) == expected, _model.recomputed_units(model)
    compare_on_and_off(model, [X], FAST_MODE, train_call, steps=2)
    every = [f"dense_{i}" for i in range(4)] + ["head"]
    assert_recomputes(dense_chain, lambda m: recompute_model(m, segments=segments), every, [], counted=(layers.Dense,), gelus=4)


def test_more_segments_than_the_graph_has_cuts_warns_and_cuts_at_each():
    model = dense_chain()
    with pytest.warns(UserWarning, match=r"segments=99\) cut 'functional.*' into (\d+) pieces, not 99"):
        recompute_model(model, segments=99)
    cut = len(_model.recomputed_units(model))
    assert 3 < cut < 99
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="keras_recompute")  # as many as it has: no warning
        recompute_model(model, segments=cut)
    assert len(_model.recomputed_units(model)) == cut


def test_segments_under_mixed_precision():
    """Each piece recomputes under the forward's autocast: weights read in bfloat16 as the forward read them."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = dense_chain()
        recompute_model(model, segments=2)
        compare_on_and_off(model, [X], FAST_MODE, train_call, rtol=1e-2)
    finally:
        keras.config.set_dtype_policy("float32")


def test_segments_carry_a_mask_and_a_frozen_layer_through_fit():
    """Pieces of a graph whose first tensor is a mask (`Embedding(mask_zero=True)`), one Dense frozen.

    In a compiled `fit` the mask is a piece's first input: the recompute's
    ordering must take a boolean tensor (it raised in `tf.reduce_max`).
    """

    def build():
        keras.utils.set_random_seed(0)
        ids = keras.Input((12,), dtype="int32")
        hidden = layers.Embedding(50, 16, mask_zero=True)(ids)
        for i in range(3):
            attended = layers.MultiHeadAttention(2, 8, dropout=0.1, seed=1)(hidden, hidden)
            hidden = layers.LayerNormalization()(layers.Add()([hidden, attended]))
            up = layers.Dense(16, activation="gelu", trainable=i != 1)
            hidden = layers.Add()([hidden, layers.Dense(16)(layers.Dropout(0.1, seed=2)(up(hidden)))])
        model = keras.Model(ids, layers.Dense(2)(layers.GlobalAveragePooling1D()(hidden)))
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        recompute_model(model, segments=3)
        return model

    rng = np.random.RandomState(0)
    ids = rng.randint(1, 50, size=(8, 12)).astype("int32")
    ids[:, 9:] = 0
    labels = rng.randint(0, 2, size=(8,)).astype("int32")
    losses, models = {}, {}
    for on in (False, True):
        model = models[on] = build()
        initial = [np.asarray(keras.ops.convert_to_numpy(w), np.float64) for w in model.weights]
        keras.utils.set_random_seed(3)
        with recompute_scope(on):
            losses[on] = model.fit(ids, labels, epochs=3, batch_size=8, verbose=0).history["loss"]
    assert len(_model.recomputed_units(model)) == 3
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    assert_trained_alike(models[True], models[False], initial)


def test_segments_of_a_sequential_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,))] + [layers.Dense(16, activation="gelu") for _ in range(4)] + [layers.Dense(3)])
    recompute_model(model, segments=2)
    assert len(_model.recomputed_units(model)) == 2
    compare_on_and_off(model, [X], FAST_MODE, train_call)


def test_limit_recomputes_the_first_units_only():
    def apply(model):
        recompute_model(model, limit=2)

    model = functional_blocks()
    apply(model)
    assert _model.recomputed_units(model) == ["block_0", "block_1"]
    compare_on_and_off(model, [X], FAST_MODE, train_call)
    assert_recomputes(functional_blocks, apply, ["block_0", "block_1"], ["block_2"])


def test_applying_again_replaces_the_plan():
    def apply_twice(model):
        recompute_model(model)
        recompute_model(model)  # the same plan again: never wrapped twice
        recompute_model(model, limit=1)  # another plan replaces it

    model = functional_blocks()
    apply_twice(model)
    assert _model.recomputed_units(model) == ["block_0"]
    assert_recomputes(functional_blocks, apply_twice, ["block_0"], ["block_1", "block_2"])
    _model.unrecompute_model(model)
    assert _model.recomputed_units(model) == [] and all("call" not in layer.__dict__ for layer in model.layers)


def test_the_switch_decides_when_the_model_runs(monkeypatch):
    """`enabled=None` follows RECOMPUTE when the model runs; True or False fix it."""
    if BACKEND == "jax":
        pytest.skip("counts Python calls; JAX's proof is the program's erfc count")
    for enabled, switch, expected in ((None, "0", 1), (None, "1", 2), (False, "1", 1), (True, "0", 2)):
        monkeypatch.setenv("RECOMPUTE", switch)
        with counted_calls(Block) as counts:
            model = functional_blocks()
            recompute_model(model, enabled=enabled)
            counts.clear()
            from _keras3_twins import loss_and_gradients

            loss_and_gradients(model, [X], "eager", train_call)
        assert counts["block_1"] == expected, (enabled, switch, counts)


def test_fit_save_and_load(tmp_path):
    """`fit` gives the plain losses (a padding mask included); the saved model is the plain model."""
    ids = np.random.RandomState(1).randint(0, 30, size=(16, 8))
    ids[::2, 6:] = 0
    labels = np.random.RandomState(2).randint(0, 3, size=16)

    def model_for():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,), dtype="int32")
        hidden = layers.Embedding(30, 16, mask_zero=True)(inputs)
        for i in range(2):
            hidden = layers.MultiHeadAttention(2, 8, name=f"attention_{i}")(hidden, hidden)
            hidden = layers.Dense(16, activation="gelu", name=f"dense_{i}")(hidden)
        model = keras.Model(inputs, layers.Dense(3)(layers.GlobalAveragePooling1D()(hidden)))
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    losses, models = {}, {}
    for on in (False, True):
        model = models[on] = model_for()
        initial = [np.asarray(keras.ops.convert_to_numpy(w), np.float64) for w in model.weights]
        config = model.get_config()
        if on:
            recompute_model(model)
        keras.utils.set_random_seed(3)
        with recompute_scope(on):
            losses[on] = model.fit(ids, labels, epochs=3, batch_size=8, shuffle=False, verbose=0).history["loss"]
    assert _model.recomputed_units(model) == ["attention_0 .. dense_0", "attention_1 .. dense_1"]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    assert_trained_alike(models[True], models[False], initial)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    as_json = functools.partial(json.dumps, sort_keys=True, default=str)  # a file makes tuples lists
    assert model.get_config() == config  # recompute_model changes no config
    assert as_json(loaded.get_config()) == as_json(config)
    assert _model.recomputed_units(loaded) == []
    for saved, kept in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(saved, kept)
    np.testing.assert_allclose(loaded.predict(ids, verbose=0), model.predict(ids, verbose=0), rtol=1e-6, atol=1e-6)


class NoBlocks(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = layers.Dense(8)
        self.second = layers.Dropout(0.1)

    def call(self, inputs):
        return self.second(self.first(inputs))


@pytest.mark.parametrize(
    "arguments,error,match",
    [
        ({"blocks": ["block_0", "nope"]}, ValueError, r"names layers \['nope'\]"),
        ({"segments": 0}, ValueError, r"segments=.*positive int or 'sqrt'; received 0"),
        ({"segments": -2}, ValueError, "positive int or 'sqrt'"),
        ({"segments": 1.5}, ValueError, "positive int or 'sqrt'"),
        ({"segments": True}, ValueError, "positive int or 'sqrt'"),
        ({"segments": 2, "blocks": Block}, ValueError, "not both"),
        ({"limit": -1}, ValueError, r"limit=.*int >= 0"),
        ({"policy": "nope"}, ValueError, r"policy=.*'nope'.*\['full', 'save_dots', 'attention_core'\]"),
        ({"enabled": "yes"}, TypeError, "True, False or None"),
        ({"blocks": 3}, ValueError, "a layer class or tuple of classes, a list of layer names, or a predicate"),
        ({"blocks": layers.Embedding}, ValueError, "found no instances of Embedding"),
    ],
)
def test_bad_arguments_say_what_and_how(arguments, error, match):
    with pytest.raises(error, match=match):
        recompute_model(functional_blocks(), **arguments)


def test_a_bad_choice_leaves_the_earlier_plan():
    model = functional_blocks()
    recompute_model(model, limit=2)
    with pytest.raises(ValueError, match="nope"):
        recompute_model(model, blocks=["nope"])
    assert _model.recomputed_units(model) == ["block_0", "block_1"]


def test_segments_of_a_subclassed_model_suggest_blocks():
    with pytest.raises(ValueError, match="segments=.*no graph to cut.*blocks="):
        recompute_model(subclassed_stack(), segments=2)


class Encoder(layers.Layer):
    """Blocks in a list of a layer that is not a model, as keras-hub's `ViTEncoder` holds its `encoder_layers`."""

    def __init__(self, count=3, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [Block(name=f"block_{i}") for i in range(count)]
        self.norm = layers.LayerNormalization()

    def call(self, inputs, training=None):
        for block in self.blocks:
            inputs = block(inputs, training=training)
        return self.norm(inputs)


def encoder_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    return keras.Model(inputs, layers.Dense(3, name="head")(Encoder(name="encoder")(layers.Dense(16)(inputs))))


def test_auto_finds_blocks_held_by_a_layer():
    """NOTE [ blocks held by a layer ]: "auto" cut the graph around the whole encoder, which saved nothing."""
    model = encoder_model()
    recompute_model(model)
    assert _model.recomputed_units(model) == ["block_0", "block_1", "block_2"]
    compare_on_and_off(model, [X], FAST_MODE, train_call, steps=2)
    assert_recomputes(encoder_model, recompute_model, ["block_0", "block_1", "block_2"], [])


class CrossAttending(layers.Layer):
    """A decoder block's two attention layers side by side: not a run of blocks."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.self_attention = layers.MultiHeadAttention(2, 8)
        self.cross_attention = layers.MultiHeadAttention(2, 8)

    def call(self, inputs):
        hidden = inputs + self.self_attention(inputs, inputs)
        return hidden + self.cross_attention(hidden, inputs)


def test_attention_layers_side_by_side_are_not_blocks():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 16))
    model = keras.Model(inputs, layers.Dense(3, name="head")(CrossAttending(name="decoder")(inputs)))
    recompute_model(model)
    assert not any("attention" in name for name in _model.recomputed_units(model))


class DecoderBlock(Block):
    """A second class of block: an encoder-decoder's decoder."""


def chained(make_layers):
    """A functional model from a fixed seed: a Dense stem, the layers `make_layers()` returns in turn, a head."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = layers.Dense(16, name="stem")(inputs)
    for layer in make_layers():
        hidden = layer(hidden)
    return keras.Model(inputs, layers.Dense(3, name="head")(hidden))


def encoder_decoder_model():
    return chained(
        lambda: [Block(name=f"encoder_{i}") for i in range(3)]
        + [layers.Dense(16, name="bridge")]
        + [DecoderBlock(name=f"decoder_{i}") for i in range(2)]
    )


def test_auto_takes_every_run_of_blocks():
    """NOTE [ every run of blocks ]: "auto" took the longest run, and an encoder-decoder's decoder stayed plain."""
    names = ["encoder_0", "encoder_1", "encoder_2", "decoder_0", "decoder_1"]
    model = encoder_decoder_model()
    recompute_model(model)
    assert _model.recomputed_units(model) == names
    compare_on_and_off(model, [X], FAST_MODE, train_call, steps=2)
    assert_recomputes(encoder_decoder_model, recompute_model, names, ["stem", "bridge"], counted=(Block, layers.Dense))


def two_towers_model():
    """Two towers of blocks of one class: in the model's list their blocks interleave (a_0, b_0, a_1, ...)."""
    keras.utils.set_random_seed(0)
    first, second = keras.Input((16,)), keras.Input((16,))
    hidden = [layers.Dense(16, name="stem_a")(first), layers.Dense(16, name="stem_b")(second)]
    for i in range(2):
        hidden = [Block(name=f"a_{i}")(hidden[0]), Block(name=f"b_{i}")(hidden[1])]
    return keras.Model([first, second], layers.Dense(3, name="head")(layers.Concatenate()(hidden)))


def test_auto_finds_two_towers_whose_blocks_interleave():
    model = two_towers_model()
    assert [layer.name for layer in model.layers if layer.name[:2] in ("a_", "b_")] == ["a_0", "b_0", "a_1", "b_1"]
    recompute_model(model)
    assert _model.recomputed_units(model) == ["a_0", "a_1", "b_0", "b_1"]
    compare_on_and_off(model, [X, X[::-1].copy()], FAST_MODE, lambda model, xs: model(list(xs), training=True), steps=2)


def shared_dropout_model():
    """Blocks with one Dropout layer called between them, as keras-hub's RWKV-7 calls its dropout."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    dropout = layers.Dropout(0.2, seed=3)
    hidden = layers.Dense(16, name="stem")(inputs)
    for i in range(2):
        hidden = dropout(Block(name=f"block_{i}")(hidden))
    return keras.Model(inputs, layers.Dense(3, name="head")(hidden))


def test_auto_chains_blocks_through_layers_without_weights():
    """NOTE [ a chain of blocks ]: a Dropout layer between the blocks came between them in the model's list."""
    model = shared_dropout_model()
    recompute_model(model)
    assert _model.recomputed_units(model) == ["block_0", "block_1"]
    compare_on_and_off(model, [X], FAST_MODE, train_call, steps=2)
    assert_recomputes(shared_dropout_model, recompute_model, ["block_0", "block_1"], [])


class Projection(layers.Layer):
    """One Dense in a layer (keras-hub Gemma 4's clippable projections): not a block."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(16)

    def call(self, inputs):
        return self.dense(inputs)


class Mixer(layers.Layer):
    """Three projections side by side, and a stage's three blocks (a longer run than two stages)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.query, self.key, self.value = Projection(name="query"), Projection(name="key"), Projection(name="value")
        self.inner = [Block(name=f"{self.name}_block_{i}") for i in range(3)]

    def call(self, inputs, training=None):
        hidden = self.query(inputs) * self.key(inputs) + self.value(inputs)
        for block in self.inner:
            hidden = block(hidden, training=training)
        return hidden


def staged_model():
    return chained(lambda: [Mixer(name=f"stage_{i}") for i in range(2)])


def test_auto_takes_outer_runs_and_no_wrapper_of_one_layer():
    """NOTE [ every run of blocks ]: the stages, not the blocks in them; never the projections side by side."""
    model = staged_model()
    recompute_model(model)
    assert _model.recomputed_units(model) == ["stage_0", "stage_1"]
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    model = keras.Model(inputs, Mixer(name="mixer")(layers.Dense(16, name="stem")(inputs)))
    recompute_model(model)
    assert _model.recomputed_units(model) == ["mixer_block_0", "mixer_block_1", "mixer_block_2"]


class RecomputedAttending(layers.Layer):
    """Attention with dropout and a gelu FFN, its own call recomputed (`full`, following the switch)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(2, 8, dropout=0.2, seed=1)
        self.norm = layers.LayerNormalization()
        self.up = layers.Dense(32, activation="gelu")
        self.dropout = layers.Dropout(0.3, seed=2)
        self.down = layers.Dense(16)

    @recompute_grad
    def call(self, inputs, training=None):
        hidden = self.norm(inputs + self.attention(inputs, inputs, training=training))
        return hidden + self.down(self.dropout(self.up(hidden), training=training))


SEQUENCES = np.random.RandomState(1).standard_normal((8, 4, 16)).astype("float32")


@pytest.mark.parametrize("mode", MODES)
def test_attention_core_pieces_that_hold_recomputed_blocks(mode):
    """NOTE [ a recomputed call inside an attention_core unit ]: graph pieces under `attention_core` hold blocks
    whose own call recomputes; the blocks ran their forward with the cores patched and their recompute without, and
    PyTorch's step raised ("trying to save more tensors during recomputation than during the original forward")."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 16))
    hidden = inputs
    for i in range(4):
        hidden = RecomputedAttending(name=f"block_{i}")(hidden)
    model = keras.Model(inputs, layers.Dense(3, name="head")(hidden))
    recompute_model(model, segments=2, policy="attention_core")
    assert len(_model.recomputed_units(model)) == 2
    compare_on_and_off(model, [SEQUENCES], mode, train_call, steps=2)


def test_auto_without_blocks_says_what_it_looked_for():
    model = NoBlocks()
    model(X)
    with pytest.raises(ValueError, match="no repeated blocks.*transformer_layers.*blocks=.*segments="):
        recompute_model(model)
    with pytest.raises(TypeError, match="Keras 3 or tf_keras model"):
        recompute_model(object())


def test_auto_on_a_model_not_built_says_to_build_it():
    """A subclassed model's layers have no weights until it runs, so "auto" finds no blocks: it says why."""
    model = Stack()
    with pytest.raises(ValueError, match=r"no repeated blocks.*is not built yet.*model\(batch\).*model\.build"):
        recompute_model(model)
    model(X)
    recompute_model(model)
    assert _model.recomputed_units(model) == ["block_0", "block_1", "block_2"]
    built = NoBlocks()
    built(X)
    with pytest.raises(ValueError, match="no repeated blocks") as raised:
        recompute_model(built)
    assert "not built" not in str(raised.value)


def _keras_hub_backbone(family, lora):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    common = dict(vocabulary_size=100, num_layers=2, hidden_dim=32, intermediate_dim=64, dropout=0.1)
    backbone = {
        "Gemma": lambda: keras_hub.models.GemmaBackbone(num_query_heads=2, num_key_value_heads=1, head_dim=16, **common),
        "Llama": lambda: keras_hub.models.LlamaBackbone(num_query_heads=2, num_key_value_heads=1, **common),
        "GPT2": lambda: keras_hub.models.GPT2Backbone(num_heads=2, max_sequence_length=16, **common),
    }[family]()
    if lora:
        backbone.enable_lora(2)
    return backbone


def _recomputed_backbone_on_and_off(backbone, seq, mode, offload=False, **options):
    """`recompute_model(backbone)`, then `compare_on_and_off` on a padded batch of token ids."""
    recompute_model(backbone, offload=offload)
    assert _model.recomputed_units(backbone) == [layer.name for layer in backbone.transformer_layers]
    ids = np.random.RandomState(0).randint(1, 100, size=(2, seq)).astype("int32")
    padding = np.ones((2, seq), "int32")
    padding[1, seq - seq // 4 :] = 0
    call = lambda m, xs: m({"token_ids": xs[0], "padding_mask": xs[1]}, training=True)  # noqa: E731
    return compare_on_and_off(backbone, [ids, padding], mode, call, **options)


OFFLOAD = (False, True) if BACKEND in ("jax", "torch") else (False,)


@pytest.mark.parametrize("offload", OFFLOAD)
@pytest.mark.parametrize("family,lora", [("Gemma", True), ("Llama", False), ("GPT2", True)])
def test_keras_hub_backbones_recompute_their_transformer_layers(family, lora, offload):
    """Decoder blocks of their own classes, which `integrations.keras_hub` does not know; LoRA too; offload too."""
    backbone = _keras_hub_backbone(family, lora)
    runs = _recomputed_backbone_on_and_off(backbone, 16, FAST_MODE, offload)
    gradients = dict(zip([v.path for v in backbone.trainable_variables], runs[True][0][1][-len(backbone.trainable_variables) :]))
    lora_gradients = [path for path in gradients if "lora" in path]
    assert len(lora_gradients) == (8 if lora else 0)  # A and B of query and value, in 2 blocks
    assert all(gradients[path] is not None for path in lora_gradients)


@pytest.mark.parametrize("dtype", ["float16", "mixed_float16"])
@pytest.mark.parametrize("family", ["Llama", "Mistral"])
def test_keras_hub_decoders_in_float16(family, dtype):
    """Grouped-query attention in float16 (keras-hub's Llama and Mistral): what runs plain runs recomputed.

    On JAX the attention's float16 scores ask for a dot algorithm XLA's CPU backend refuses; the plain
    call falls back from it (NOTE [ dot algorithms the device refuses ]), and so must the recompute.
    Eager: on a CPU the plain model itself cannot be compiled in float16 on JAX.
    """
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    common = dict(vocabulary_size=100, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
                  intermediate_dim=64, dropout=0.1, dtype=dtype)
    if family == "Mistral":
        backbone = keras_hub.models.MistralBackbone(sliding_window=4, **common)
    else:
        backbone = keras_hub.models.LlamaBackbone(**common)
    runs = _recomputed_backbone_on_and_off(backbone, 8, "eager", rtol=1e-2)  # float16: a few units in the last place
    unused = "reverse_embeddings"  # the language-model head's, not the backbone's
    missing = [v.path for v, g in zip(backbone.trainable_variables, runs[True][0][1]) if g is None and unused not in v.path]
    assert not missing, f"every weight gets a gradient: {missing}"
