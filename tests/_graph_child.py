"""Child process of test_tf_graph.py: TF1-style graph mode with tf_keras.

`tf.compat.v1.disable_eager_execution()` cannot be undone in a process, so each
case runs here, in a fresh one, and prints one JSON line.

Usage: python _graph_child.py CASE
"""

import collections
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()

import tf_keras as K  # noqa: E402

from _compare import normwise_errors  # noqa: E402
from keras_recompute import recompute_grad, recompute_scope  # noqa: E402
from keras_recompute.backends import tensorflow as tf_backend  # noqa: E402


class Block(K.layers.Layer):
    """Dense, dropout, batch norm, a keyword tensor and a mask: all of it in a graph."""

    def __init__(self, dropout=0.5, **kwargs):
        super().__init__(**kwargs)
        self.up = K.layers.Dense(16, activation="tanh")
        self.dropout = K.layers.Dropout(dropout, seed=11)
        self.norm = K.layers.BatchNormalization(momentum=0.5)
        self.down = K.layers.Dense(8)

    def call(self, inputs, training=None, mask=None, scale=None):
        hidden = self.dropout(self.up(inputs), training=training)
        hidden = self.norm(hidden, training=training)
        output = self.down(hidden)
        if scale is not None:
            output = output * scale
        if mask is not None:
            output = tf.where(mask[:, None], output, tf.zeros_like(output))
        return inputs + output


class RecomputedBlock(Block):
    @recompute_grad
    def call(self, inputs, training=None, mask=None, scale=None):
        return super().call(inputs, training=training, mask=mask, scale=scale)


def model_for(block_class):
    inputs = K.Input((8,))
    return K.Model(inputs, K.layers.Dense(4)(block_class()(inputs, training=True)))


def data():
    random = np.random.RandomState(0)
    return random.normal(size=(32, 8)).astype("float32"), random.normal(size=(32, 4)).astype("float32")


def case_fit():
    """model.fit and train_on_batch: the same weights after training."""
    x, y = data()
    results = {}
    for recompute in (False, True):
        K.backend.clear_session()
        K.utils.set_random_seed(0)
        with recompute_scope(recompute):
            # In a graph the switch acts when the graph is built.
            model = model_for(RecomputedBlock)
            if recompute is False:
                initial = model.get_weights()
            else:
                model.set_weights(initial)
            model.compile(optimizer=K.optimizers.legacy.SGD(0.1), loss="mse")
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
            model.train_on_batch(x[:16], y[:16])
        results[recompute] = model.get_weights()
    return {
        "max_relative_error": max(normwise_errors(results[True], results[False])),
        "moved": float(np.max(np.abs(results[True][0] - initial[0]))),
    }


def case_mixed():
    """model.fit under mixed_float16 with loss scaling: the twin's losses."""
    K.mixed_precision.set_global_policy("mixed_float16")
    result = case_fit()
    K.mixed_precision.set_global_policy("float32")
    return result


def case_session():
    """A raw Session loop: tf.compat.v1.gradients and an optimizer's minimize."""
    x_value, _ = data()
    K.utils.set_random_seed(0)
    x = tf.compat.v1.placeholder(tf.float32, (None, 8))
    scale = tf.compat.v1.placeholder(tf.float32, ())
    mask = tf.compat.v1.placeholder(tf.bool, (None,))
    plain, ours = Block(), RecomputedBlock()
    plain(x), ours(x)

    def loss_of(layer):
        # Keywords inside a graph: tf.recompute_grad raises for them.
        return tf.reduce_sum(tf.sin(layer(x, training=True, mask=mask, scale=scale)))

    plain_loss = loss_of(plain)
    with recompute_scope(True):
        ours_loss = loss_of(ours)
        ours_grads = tf.compat.v1.gradients(ours_loss, [x] + ours.trainable_weights)
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(ours_loss, var_list=ours.trainable_weights)
    plain_grads = tf.compat.v1.gradients(plain_loss, [x] + plain.trainable_weights)
    assert all(g is not None for g in ours_grads)
    session = tf.compat.v1.Session()
    session.run(tf.compat.v1.global_variables_initializer())
    for source, target in zip(plain.weights, ours.weights):
        target.load(session.run(source), session)
    feed = {x: x_value, scale: 1.5, mask: np.arange(len(x_value)) % 3 > 0}
    expected, actual = session.run([plain_grads, ours_grads], feed)
    session.run(train, feed)
    return {
        "max_relative_error": max(normwise_errors(actual, expected)),
        "gradients": len(actual),
    }


def case_context():
    """A patched instance whose attention reads a mask attached by `Embedding(mask_zero=True)`,
    inside a frozen block with one trainable sub-layer; `tf.compat.v1.gradients` in a Session."""

    class Masked(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = K.layers.MultiHeadAttention(2, 4)
            self.dropout = K.layers.Dropout(0.5, seed=12)
            self.norm = K.layers.BatchNormalization(momentum=0.5)
            self.frozen = K.layers.Dense(8, activation="tanh")
            self.live = K.layers.Dense(8)

        def call(self, inputs, training=None):
            hidden = self.norm(inputs + self.attention(inputs, inputs), training=training)
            return self.live(self.dropout(self.frozen(hidden), training=training))

    ids_value = np.random.RandomState(0).randint(1, 20, size=(4, 6)).astype("int32")
    ids_value[1::2, 4:] = 0
    ids = tf.compat.v1.placeholder(tf.int32, (None, 6))
    K.utils.set_random_seed(0)

    def model(patched, masked=True):
        embedding = K.layers.Embedding(20, 8, mask_zero=masked)
        block = Masked()
        if patched:
            block.call = recompute_grad(block.call)
        # Frozen before the graph is built: the recompute is built later, in
        # `gradients`, and must see the layers as the forward did.
        block.trainable = False
        block.live.trainable = True
        loss = tf.reduce_sum(tf.sin(block(embedding(ids), training=True)))
        return embedding, block, loss

    plain_embedding, plain_block, plain_loss = model(False)
    with recompute_scope(True):
        embedding, block, loss = model(True)
        trained = embedding.trainable_weights + block.live.trainable_weights
        gradients = _dense(tf.compat.v1.gradients(loss, trained))
    plain_trained = plain_embedding.trainable_weights + plain_block.live.trainable_weights
    plain_gradients = _dense(tf.compat.v1.gradients(plain_loss, plain_trained))
    _, unmasked_block, unmasked_loss = model(False, masked=False)
    session = tf.compat.v1.Session()
    session.run(tf.compat.v1.global_variables_initializer())
    for source, target in zip(plain_embedding.weights + plain_block.weights, embedding.weights + block.weights):
        target.load(session.run(source), session)
    for source, target in zip(plain_block.weights, unmasked_block.weights):
        target.load(session.run(source), session)
    feed = {ids: ids_value}
    expected, actual = session.run([plain_gradients, [g for g in gradients if g is not None]], feed)
    values = session.run([plain_loss, unmasked_loss], feed)
    return {
        "max_relative_error": max(normwise_errors(actual, expected)),
        "gradients": sum(g is not None for g in actual),
        "expected_gradients": len(trained),
        "mask_matters": float(abs(values[0] - values[1])),
    }


def _dense(gradients):
    """Gradients as tensors (an embedding's is `IndexedSlices`); None stays None."""
    return [None if g is None else tf.convert_to_tensor(g) for g in gradients]


def case_model():
    """`recompute_model` on a functional model in a TF1 graph: blocks and segments, then compile and fit."""
    from keras_recompute import _model, recompute_model

    class Wide(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.up = K.layers.Dense(512, activation="gelu")
            self.dropout = K.layers.Dropout(0.2, seed=3)
            self.down = K.layers.Dense(64)

        def call(self, inputs, training=None):
            return inputs + self.down(self.dropout(self.up(inputs), training=training))

    x, y = np.random.RandomState(0).normal(size=(512, 64)).astype("float32"), np.zeros((512, 4), "float32")
    report = {}
    for plan in ("blocks", "segments"):
        for on in (False, True):
            K.backend.clear_session()
            K.utils.set_random_seed(0)
            inputs = K.Input((64,))
            hidden = inputs
            for i in range(4):
                # `training=True`, not the learning phase: see NOTE [ dropout inside a graph branch ].
                hidden = Wide(name=f"block_{i}")(hidden, training=True)
            model = K.Model(inputs, K.layers.Dense(4)(hidden))
            # Both twins rebuild the outputs (a seeded tf_keras dropout draws its next
            # seed each time it is called); only one recomputes. The switch of a graph
            # acts when it is built.
            with recompute_scope(on):
                recompute_model(model) if plan == "blocks" else recompute_model(model, segments=4)
            model.compile(optimizer=K.optimizers.legacy.SGD(1e-3), loss="mse")
            losses = [float(model.train_on_batch(x, y))]
            tf.config.experimental.reset_memory_stats("CPU:0")
            losses += [float(model.train_on_batch(x, y)) for _ in range(2)]
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            key = "" if on else "plain_"
            report.setdefault(plan, {}).update({key + "losses": losses, key + "peak": peak})
        report[plan]["units"] = _model.recomputed_units(model)
    try:  # after compile, the training graph exists: the plan must come first
        recompute_model(model)
    except Exception as error:  # noqa: BLE001 - reported to the test
        report["after_compile"] = str(error)
    assert "before model.compile" in report.pop("after_compile", "")
    return report


def case_policy():
    """`recompute_model(policy=...)` on attention blocks in a TF1 graph: the plain losses, and each peak."""
    from keras_recompute import recompute_model

    class Attention(K.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            # tf_keras's attention dropout takes no seed: the twins would draw other masks.
            self.attention = K.layers.MultiHeadAttention(4, 16)
            self.norm = K.layers.LayerNormalization()
            self.up = K.layers.Dense(256, activation="gelu")
            self.dropout = K.layers.Dropout(0.2, seed=3)
            self.down = K.layers.Dense(64)

        def call(self, inputs, training=None):
            hidden = self.norm(inputs + self.attention(inputs, inputs, training=training))
            return hidden + self.down(self.dropout(self.up(hidden), training=training))

    random = np.random.RandomState(0)
    x, y = random.normal(size=(4, 128, 64)).astype("float32"), random.normal(size=(4, 128, 4)).astype("float32")
    report = {}
    for policy in ("none", "full", "save_dots", "attention_core"):
        K.backend.clear_session()
        K.utils.set_random_seed(0)
        inputs = K.Input((128, 64))
        hidden = inputs
        for i in range(8):
            hidden = Attention(name=f"block_{i}")(hidden, training=True)
        model = K.Model(inputs, K.layers.Dense(4)(hidden))
        # Every twin rebuilds its outputs (see case_model); "none" with the switch off.
        with recompute_scope(policy != "none"):
            recompute_model(model, policy="full" if policy == "none" else policy)
        # The session's trace of the last step says which ops ran: a recompute runs its ops a second time.
        run_metadata = tf.compat.v1.RunMetadata()
        model.compile(optimizer=K.optimizers.legacy.SGD(1e-3), loss="mse", run_metadata=run_metadata,
                      options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
        losses = [float(model.train_on_batch(x, y))]
        tf.config.experimental.reset_memory_stats("CPU:0")
        losses += [float(model.train_on_batch(x, y)) for _ in range(2)]
        graph = tf.compat.v1.get_default_graph()
        ran = collections.Counter(  # the recompute check's fingerprints (their matmuls) left out
            graph.get_operation_by_name(node.node_name).type
            for device in run_metadata.step_stats.dev_stats
            for node in device.node_stats
            if node.node_name not in ("_SOURCE", "_SINK") and _op_named(graph, node.node_name)
            and tf_backend.CHECK_SCOPE not in node.node_name
        )
        ops = {kind: ran[kind] for kind in ("Softmax", "Einsum", "MatMul")}
        report[policy] = {"losses": losses, "peak": tf.config.experimental.get_memory_info("CPU:0")["peak"], "ran": ops}
    return report


def case_updates():
    """Each policy's first updates at lr 1.0 and 1e-3, repeated (NOTE [ comparing updates, not losses ]).

    `recompute_model` on the built model, which has a BatchNormalization: its moving statistics are
    among the weights compared (moved twice, they were off by their own update), and the model
    takes a new tensor afterwards.
    """
    from _updates import RATES, TRIALS, attention_model, data, repeated_updates, worst

    from keras_recompute import recompute_model

    if os.environ.get("READ_AGAIN"):  # the mutation test: save_dots' gradient reads its weights again
        from keras_recompute.backends import tensorflow as tensorflow_path

        def kept_matmul(kept, inputs, linear, variables):  # as before issue 38
            @tf.custom_gradient
            def kept_op(kept, inputs, *reads):
                def grad(upstream):
                    with tf.GradientTape(watch_accessed_variables=False) as tape:
                        tape.watch(inputs)
                        tape.watch(variables)
                        value = linear(inputs)
                    return [None] + tape.gradient(value, [inputs] + variables, output_gradients=upstream)

                return tf.identity(kept), grad

            return kept_op(kept, inputs, *[tf.identity(v) for v in variables])

        tensorflow_path._kept_matmul = kept_matmul
    x, y = data()
    report = {}
    for policy in ("none", "full", "save_dots", "attention_core"):
        model = attention_model(K, batch_norm=True)
        if policy != "none":
            recompute_model(model, policy=policy, enabled=True)
        assert model(tf.constant(x), training=True).shape[1:] == (16, 1)  # the model takes a new tensor
        model.compile(optimizer=K.optimizers.legacy.SGD(RATES[0]), loss="mse")
        for rate in RATES:
            K.backend.set_value(model.optimizer.lr, rate)
            trials = 1 if policy == "none" else TRIALS // 4  # a TF1 graph has no order: every trial was off
            initial, updates = repeated_updates(model, lambda: model.train_on_batch(x, y), trials)
            if policy == "none":
                report.setdefault("none", {})[rate] = (initial, updates[0])
                continue
            reference_initial, reference = report["none"][rate]
            assert all(np.array_equal(a, b) for a, b in zip(initial, reference_initial))
            report.setdefault(policy, {})[str(rate)] = worst(updates, reference, initial)
    del report["none"]
    return report


def _op_named(graph, name):
    try:
        graph.get_operation_by_name(name)
        return True
    except KeyError:
        return False


def case_memory():
    """Peak memory of one training step in a Session, plain and recomputed."""
    peaks = {}
    for recompute in (False, True):
        graph = tf.Graph()
        with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:

            class Deep(K.layers.Layer):
                def __init__(self, **kwargs):
                    super().__init__(**kwargs)
                    self.up = K.layers.Dense(512, activation="gelu")
                    self.down = K.layers.Dense(64)

                @recompute_grad(enabled=recompute)
                def call(self, inputs, training=None):
                    return inputs + self.down(tf.tanh(self.up(inputs)))

            x = tf.random.normal((1024, 64), seed=1)
            hidden = x
            blocks = [Deep() for _ in range(12)]
            for block in blocks:
                hidden = block(hidden, training=True)
            loss = tf.reduce_sum(hidden**2)
            weights = [w for block in blocks for w in block.trainable_weights]
            train = tf.compat.v1.train.GradientDescentOptimizer(1e-6).minimize(loss, var_list=weights)
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(train)
            tf.config.experimental.reset_memory_stats("CPU:0")
            session.run(train)
            peaks[recompute] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {"plain": peaks[False], "recompute": peaks[True]}


if __name__ == "__main__":
    print(json.dumps(globals()[f"case_{sys.argv[1]}"]()))
