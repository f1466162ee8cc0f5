"""The first weight updates of a compiled training step, repeated, equal the plain model's (issue 38).

See NOTE [ comparing updates, not losses ] in `_updates.py`. Every policy, at
lr 1.0 and 1e-3, in the train step Keras compiles on each backend: TensorFlow's
`tf.function` and XLA, JAX's jit, PyTorch's eager step; and `fit` over two
batches. tf_keras and TF1-style graphs: `test_updates_tensorflow.py`.
"""

import keras
import pytest

from _keras3_twins import BACKEND
from _updates import RATES, TRIALS, attention_model, data, repeated_updates, worst

from keras_recompute import recompute_model

POLICIES = ("full", "save_dots", "attention_core")
# Keras's compiled step on each backend; TensorFlow's without XLA is where the race was.
JIT = {"tensorflow": (False, True), "jax": (True,), "torch": (False,)}[BACKEND]


def _compiled(model, rate, jit):
    model.compile(optimizer=keras.optimizers.SGD(rate), loss="mse", jit_compile=jit)
    return model


def _rate(model, rate):
    """The learning rate is a variable: set, it changes no compiled step."""
    model.optimizer.learning_rate = rate
    return model


@pytest.mark.parametrize("jit", JIT, ids=lambda jit: "jit" if jit else "nojit")
@pytest.mark.parametrize("policy", POLICIES)
def test_first_updates_equal_plain_in_every_repeat(policy, jit):
    x, y = data()
    plain = attention_model(keras)
    model = recompute_model(attention_model(keras), policy=policy, enabled=True)
    # PyTorch runs each step eagerly: there is no scheduler to race, and a few trials say as much.
    # A JAX step is one XLA program whose updates are new arrays: no write can overtake a read.
    trials = {"tensorflow": TRIALS, "jax": TRIALS // 4}.get(BACKEND, 4)
    _compiled(plain, RATES[0], jit)
    _compiled(model, RATES[0], jit)
    for rate in RATES:
        initial, (reference,) = repeated_updates(_rate(plain, rate), lambda: plain.train_on_batch(x, y), 1)
        _, updates = repeated_updates(_rate(model, rate), lambda: model.train_on_batch(x, y), trials)
        error, wrong = worst(updates, reference, initial)
        assert wrong == 0, f"lr {rate}: {wrong} of {trials} trials off the plain update, worst {error:.3g}"


@pytest.mark.parametrize("policy", POLICIES)
def test_fit_over_two_batches_equals_plain_in_every_repeat(policy):
    """`fit` runs the compiled step twice in a row: the second step reads what the first one wrote."""
    x, y = data()
    fit = lambda model: model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)  # noqa: E731
    plain = _compiled(attention_model(keras), 1.0, JIT[0])
    initial, (reference,) = repeated_updates(plain, lambda: fit(plain), 1)
    model = _compiled(recompute_model(attention_model(keras), policy=policy, enabled=True), 1.0, JIT[0])
    trials = 12 if BACKEND != "torch" else 2
    error, wrong = worst(repeated_updates(model, lambda: fit(model), trials)[1], reference, initial)
    assert wrong == 0, f"{wrong} of {trials} fits off the plain one, worst {error:.3g}"


def test_a_budget_plan_updates_as_plain_in_every_repeat():
    """`budget=` half-way between the least peak and the plain one: a mix of policies per block."""
    from keras_recompute import _model, memory_report

    x, y = data()
    plain = _compiled(attention_model(keras), 1.0, JIT[0])
    initial, (reference,) = repeated_updates(plain, lambda: plain.train_on_batch(x, y), 1)
    model = _compiled(attention_model(keras), 1.0, JIT[0])
    report = memory_report(model, x)
    recompute_model(model, budget=(report.floor + report.plain_peak) // 2, inputs=x, enabled=True)
    assert _model.recomputed_units(model), "the plan recomputes nothing: the test would prove nothing"
    trials = TRIALS // 2 if BACKEND != "torch" else 2
    error, wrong = worst(repeated_updates(model, lambda: model.train_on_batch(x, y), trials)[1], reference, initial)
    assert wrong == 0, f"{wrong} of {trials} trials off the plain update, worst {error:.3g}"
