"""Child process of test_tf_graph.py: TF1-style graph mode with tf_keras.

`tf.compat.v1.disable_eager_execution()` cannot be undone in a process, so each
case runs here, in a fresh one, and prints one JSON line.

Usage: python _graph_child.py CASE
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()

import tf_keras as K  # noqa: E402

from keras_recompute import recompute_grad, recompute_scope  # noqa: E402


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
        "max_relative_error": max(_relative(a, e) for a, e in zip(results[True], results[False])),
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
        "max_relative_error": max(_relative(a, e) for a, e in zip(actual, expected)),
        "gradients": len(actual),
    }


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


def _relative(actual, expected):
    scale = max(float(np.max(np.abs(expected))), 1e-2)
    return float(np.max(np.abs(np.asarray(actual) - np.asarray(expected)))) / scale


if __name__ == "__main__":
    print(json.dumps(globals()[f"case_{sys.argv[1]}"]()))
