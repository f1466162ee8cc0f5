"""Child process of test_bert4keras.py: a small bert4keras BERT trained with and without recompute.

Usage: python _bert4keras_child.py ours|model|theirs [eager|function|graph]
       python _bert4keras_child.py feedforward
  ours    keras_recompute.integrations.bert4keras.enable(), RECOMPUTE toggled by a scope
  model   keras_recompute.recompute_model(model): each transformer block one unit
  model_over_theirs  the same, with bert4keras's own recompute on (RECOMPUTE=1 at its
          import): recompute_model must take it off, with a warning
  budget  recompute_model(model, budget=..., inputs=...): a budget half-way between the
          least peak any plan reaches and the plain peak, over the blocks (graph pieces)
  theirs  bert4keras's own recompute (RECOMPUTE=1 when bert4keras is imported)
  ours_over_theirs  enable() where bert4keras's own recompute is on (RECOMPUTE=1 at its
          import): ours must replace theirs, not wrap it
Trains three SGD steps with dropout, first with every patched `call` plain, then
recomputed, from the same weights and random state. Prints a JSON line: the
losses of both runs and, per step, how many of the gradients differ by more
than 1e-4 (relative to the largest value) and the largest such difference.

`function` also reports how many ops a traced training step has with the
patched calls plain and recomputed (the recompute adds its forward again).

`graph`: a TF1-style graph (`tf.compat.v1.disable_eager_execution()`), where
dropout follows the learning-phase placeholder inside `tf.cond`: three
`train_on_batch` steps with recompute on; the recompute check (on by default)
raises if a recomputed output differs from its forward's. Then, without
dropout (its unseeded masks differ between two models), a plain model and a
recomputed one from the same weights take one SGD step at lr 1.0: their
updates, and the ops each training function added to the graph. Prints the
losses, the updates' normwise error and the op counts.
"""

import json
import os
import sys

method = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "function"
os.environ["TF_KERAS"] = "1"
os.environ["TF_USE_LEGACY_KERAS"] = "1"
THEIRS_ON = ("theirs", "model_over_theirs", "ours_over_theirs")  # RECOMPUTE=1 at bert4keras's import
OURS = ("ours", "ours_over_theirs")  # enable()
os.environ["RECOMPUTE"] = "1" if method in THEIRS_ON else "0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if mode == "graph":
    tf.compat.v1.disable_eager_execution()
import tf_keras  # noqa: E402
from bert4keras import layers as bert_layers  # noqa: E402
from bert4keras.models import build_transformer_model  # noqa: E402

from _compare import RTOL, normwise_errors  # noqa: E402
from keras_recompute import recompute_scope  # noqa: E402
from keras_recompute.integrations import bert4keras as recompute_bert4keras  # noqa: E402

if method == "feedforward":
    # keras_recompute.layers.FeedForward takes bert4keras's FeedForward weights unchanged.
    from keras_recompute import layers as recompute_layers

    x = tf.random.stateless_normal((2, 6, 32), seed=[1, 2])
    theirs_layer = bert_layers.FeedForward(64, activation="gelu")
    ours_layer = recompute_layers.for_keras(tf_keras).FeedForward(64, activation="gelu")
    theirs_layer(x)
    ours_layer(x)
    shapes = [tuple(w.shape) for w in ours_layer.get_weights()]
    ours_layer.set_weights(theirs_layer.get_weights())
    difference = float(tf.reduce_max(tf.abs(ours_layer(x) - theirs_layer(x))))
    print(json.dumps({"difference": difference, "shapes": shapes}))
    sys.exit(0)

if method in THEIRS_ON:
    # bert4keras 0.11.5's recompute calls functions that TF 2.21 moved from
    # `tape` to `record` (private TF API; tested on TF 2.21 only).
    from tensorflow.python.eager import record, tape

    for name in ("stop_recording", "record_operation"):
        if not hasattr(tape, name):
            setattr(tape, name, getattr(record, name))

CONFIG = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    hidden_act="gelu",
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    max_position_embeddings=32,
    type_vocab_size=2,
)

# Their recompute wrappers, as bert4keras's import left them, and the plain calls inside.
theirs = {name: vars(getattr(bert_layers, name))["call"] for name in recompute_bert4keras.LAYERS}
plain = {name: recompute_bert4keras._undecorated(call) for name, call in theirs.items()}
if method in OURS:
    recompute_bert4keras.enable()
    ours = {name: vars(getattr(bert_layers, name))["call"] for name in recompute_bert4keras.LAYERS}


def set_calls(calls):
    for name, call in calls.items():
        setattr(getattr(bert_layers, name), "call", call)


# Built with the plain calls (tf_keras reads `call`'s signature once, when the layer is made).
set_calls(plain)
tf_keras.utils.set_random_seed(0)
if mode == "graph":
    # A TF1 graph is built when the layers are called: recompute must be on then.
    set_calls(ours)
    with recompute_scope(True):
        model = build_transformer_model(with_mlm=True, **CONFIG)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    rng = np.random.RandomState(0)
    token_ids, segment_ids, labels = (rng.randint(0, n, size=(4, 16)) for n in (100, 2, 100))
    losses = [float(model.train_on_batch([token_ids, segment_ids], labels)) for _ in range(3)]
    updates, ops = {}, {}
    for recompute in (False, True):
        tf_keras.utils.set_random_seed(0)
        with recompute_scope(recompute):
            twin = build_transformer_model(
                with_mlm=True, **dict(CONFIG, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
            )
            if recompute:
                twin.set_weights(initial)
            initial = twin.get_weights()
            twin.compile(optimizer=tf_keras.optimizers.legacy.SGD(1.0), loss="sparse_categorical_crossentropy")
            before = len(tf.compat.v1.get_default_graph().get_operations())
            twin.train_on_batch([token_ids, segment_ids], labels)  # builds the training function
            ops[recompute] = len(tf.compat.v1.get_default_graph().get_operations()) - before
        updates[recompute] = [w - w0 for w, w0 in zip(twin.get_weights(), initial)]
    error = max(normwise_errors(updates[True], updates[False]))
    print(json.dumps({"losses": losses, "update_error": error, "ops": [ops[False], ops[True]]}))
    sys.exit(0)
model = build_transformer_model(with_mlm=True, **CONFIG)
initial = model.get_weights()
rng = np.random.RandomState(0)
token_ids = tf.constant(rng.randint(1, 100, size=(4, 16)), tf.int32)
segment_ids = tf.constant(rng.randint(0, 2, size=(4, 16)), tf.int32)
labels = tf.constant(rng.randint(0, 100, size=(4, 16)), tf.int32)


def train(recompute):
    model.set_weights(initial)
    tf_keras.utils.set_random_seed(1)

    def step():
        with tf.GradientTape() as tape:
            probabilities = model([token_ids, segment_ids], training=True)
            loss = tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(labels, probabilities))
        grads = tape.gradient(loss, model.trainable_weights)
        for weight, grad in zip(model.trainable_weights, grads):
            weight.assign_sub(0.5 * tf.convert_to_tensor(grad))
        return loss, grads

    if mode == "function":
        step = tf.function(step)
    results = []
    with recompute_scope(recompute):
        for _ in range(3):
            loss, grads = step()
            results.append((float(loss), [np.asarray(tf.convert_to_tensor(g)) for g in grads]))
    return results


expected = train(False)
units, warned, policies = [], False, []
if method == "budget":
    from keras_recompute import _model, memory_report, recompute_model

    batch = [token_ids, segment_ids]
    plain_report = memory_report(model, batch)
    budget = (plain_report.floor + plain_report.plain_peak) // 2
    recompute_model(model, budget=budget, inputs=batch, enabled=True)
    planned = memory_report(model, batch)
    assert planned.measure_seconds == 0 and planned.predicted_peak <= budget, (planned, budget)
    units, policies = _model.recomputed_units(model), [row["policy"] for row in planned.rows]
elif method in ("model", "model_over_theirs"):
    import warnings

    from keras_recompute import _model, recompute_model

    if method == "model_over_theirs":
        set_calls(theirs)  # as RECOMPUTE=1 at bert4keras's import leaves its layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recompute_model(model)
    warned = any("bert4keras's own recompute" in str(w.message) for w in caught)
    units = _model.recomputed_units(model)
else:
    set_calls(ours if method in OURS else theirs)
actual = train(True)
ops = []
if mode == "function":

    @tf.function
    def traced_step():
        with tf.GradientTape() as tape:
            probabilities = model([token_ids, segment_ids], training=True)
            loss = tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(labels, probabilities))
        return tape.gradient(loss, model.trainable_weights)

    for recompute in (False, True):
        with recompute_scope(recompute):
            ops.append(len(traced_step.get_concrete_function().graph.get_operations()))
        traced_step = tf.function(traced_step.python_function)

report = {"losses": [loss for loss, _ in actual], "plain_losses": [loss for loss, _ in expected], "steps": [], "units": units, "warned": warned, "policies": policies, "ops": ops}
for (_, grads), (_, plain_grads) in zip(actual, expected):
    errors = normwise_errors(grads, plain_grads)
    report["steps"].append({"differ": sum(error > RTOL for error in errors), "count": len(errors), "max": max(errors)})
print(json.dumps(report))
