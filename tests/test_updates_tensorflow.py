"""tf_keras and TF1-style graphs: the first weight updates, repeated, equal the plain model's (issue 38).

See NOTE [ comparing updates, not losses ] in `_updates.py`; Keras 3 is in `test_updates.py`.
"""

import pytest

pytest.importorskip("tensorflow")
K = pytest.importorskip("tf_keras")

from _updates import RATES, TRIALS, attention_model, data, repeated_updates, worst  # noqa: E402
from test_tf_graph import run_case  # noqa: E402

from keras_recompute import recompute_model  # noqa: E402

POLICIES = ("full", "save_dots", "attention_core")


def _compiled(model, jit):
    model.compile(optimizer=K.optimizers.SGD(RATES[0]), loss="mse", jit_compile=jit)
    return model


@pytest.mark.parametrize("policy", POLICIES)
def test_tf_keras_first_updates_equal_plain_in_every_repeat(policy):
    """tf_keras's `tf.function` step. XLA compiles a step into one program, with no scheduler to
    race: Keras 3's XLA step repeats in test_updates.py, tf_keras's policies under XLA match
    their twin in test_policy.py."""
    x, y = data()
    plain = _compiled(attention_model(K), False)
    model = _compiled(recompute_model(attention_model(K), policy=policy, enabled=True), False)
    for rate in RATES:
        plain.optimizer.learning_rate = rate
        model.optimizer.learning_rate = rate
        initial, (reference,) = repeated_updates(plain, lambda: plain.train_on_batch(x, y), 1)
        _, updates = repeated_updates(model, lambda: model.train_on_batch(x, y), TRIALS)
        error, wrong = worst(updates, reference, initial)
        assert wrong == 0, f"lr {rate}: {wrong} of {TRIALS} trials off the plain update, worst {error:.3g}"


def test_tf1_graph_first_updates_equal_plain_in_every_repeat():
    """A built model under `recompute_model`, BatchNorm inside: its statistics move as the plain model's, once."""
    for policy, by_rate in run_case("updates").items():
        for rate, (error, wrong) in by_rate.items():
            assert wrong == 0, f"{policy} at lr {rate}: {wrong} trials off the plain update, worst {error:.3g}"


def test_the_repeated_updates_catch_a_recompute_that_reads_its_weights_again():
    """The mutation the tests above exist for, kept as a test: put back, the TF1 graph's updates are wrong."""
    report = run_case("updates", READ_AGAIN="1")
    assert report["save_dots"]["1.0"][1] > 0, report


def test_the_repeated_updates_catch_a_doubled_gradient(monkeypatch):
    from _mutations import double_gradients

    double_gradients(monkeypatch)
    x, y = data()
    plain = _compiled(attention_model(K), False)
    model = _compiled(recompute_model(attention_model(K), policy="full", enabled=True), False)
    initial, (reference,) = repeated_updates(plain, lambda: plain.train_on_batch(x, y), 1)
    error, wrong = worst(repeated_updates(model, lambda: model.train_on_batch(x, y), 1)[1], reference, initial)
    assert wrong == 1 and error > 0.1, error
