"""One distributed training run in a fresh process, for tests/test_distributed.py.

    python tests/_distributed_child.py CASE RECOMPUTE [SIZE]

CASE:
    mirrored      Keras 3 (TensorFlow) under tf.distribute.MirroredStrategy on two
                  logical CPU devices.
    multiworker   tf_keras under tf.distribute.MultiWorkerMirroredStrategy; the
                  worker's TF_CONFIG comes from the environment.
    dataparallel  Keras 3 on JAX, keras.distribution.DataParallel over two
                  virtual CPU devices.
    modelparallel Keras 3 on JAX, keras.distribution.ModelParallel: a LayoutMap
                  shards the feed-forward and attention kernels over two devices.
    ddp           Keras 3 on PyTorch, one worker of torch's DistributedDataParallel
                  (gloo, on the CPU) in a training loop of torch's, as Keras's guide
                  to multi-GPU training with PyTorch writes it; RANK, WORLD_SIZE and
                  DDP_INIT_METHOD (a file:// store) come from the environment. It trains
                  twice in one process group, with recompute off, then on
                  (RECOMPUTE: both), each from the same weights and seeds.
RECOMPUTE: 0 or 1 (the blocks' `call` is decorated; the switch decides), or both (ddp).
SIZE: small (the default: losses) or memory (mirrored only: a larger encoder,
      the allocator's peak per replica device).

Prints one JSON line: the per-step losses, and for SIZE memory the peak bytes of
each replica device. The model: two blocks, each with attention (dropout 0.1),
dropout, BatchNormalization and a feed-forward pair, recomputed as one call;
SGD, three epochs of two steps, data the same on every worker.
"""

import hashlib
import json
import os
import sys

CASE, SWITCH = sys.argv[1], sys.argv[2]
SIZE = sys.argv[3] if len(sys.argv) > 3 else "small"
os.environ["RECOMPUTE"] = SWITCH if SWITCH != "both" else "0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if CASE == "ddp":
    os.environ["KERAS_BACKEND"] = "torch"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # two workers on one machine's CPU, as in CI (gloo)
elif CASE in ("dataparallel", "modelparallel"):
    os.environ["KERAS_BACKEND"] = "jax"
    if "--xla_force_host_platform_device_count=2" not in os.environ.get("XLA_FLAGS", ""):  # tests/test_distributed sets it
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"]).strip()
elif CASE == "multiworker":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
else:
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"

import numpy as np  # noqa: E402

SHAPES = {"small": dict(seq=8, hidden=16, heads=2, blocks=2, rows=16, batch=8), "memory": dict(seq=128, hidden=64, heads=4, blocks=6, rows=32, batch=32)}
shape = SHAPES[SIZE]
CALLS = [0]


def build(keras):
    from keras_recompute import recompute_grad

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = keras.layers.MultiHeadAttention(shape["heads"], shape["hidden"] // shape["heads"], dropout=0.1)
            self.dropout = keras.layers.Dropout(0.1)
            self.norm = keras.layers.BatchNormalization()
            self.ffn = keras.layers.Dense(4 * shape["hidden"], activation="gelu", name="ffn_in")
            self.out = keras.layers.Dense(shape["hidden"], name="ffn_out")

        @recompute_grad
        def call(self, inputs, training=None):
            CALLS[0] += 1  # Python runs: traces in TF graphs, where the recompute adds its own
            hidden = inputs + self.dropout(self.attention(inputs, inputs, training=training), training=training)
            hidden = self.norm(hidden, training=training)
            return hidden + self.out(self.ffn(hidden))

    inputs = keras.Input((shape["seq"], shape["hidden"]))
    hidden = inputs
    for _ in range(shape["blocks"]):
        hidden = Block()(hidden)
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(hidden))
    return keras.Model(inputs, outputs)


def data():
    rng = np.random.RandomState(0)
    x = rng.normal(size=(shape["rows"], shape["seq"], shape["hidden"])).astype("float32")
    y = rng.normal(size=(shape["rows"], 1)).astype("float32")
    return x, y


class StepLosses:
    """A callback's worth of per-step losses, for either Keras."""

    def __init__(self, keras):
        losses = self.losses = []

        class Callback(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                losses.append(float(logs["loss"]))

        self.callback = Callback()


def fit(keras, model, optimizer, x, y):
    model.compile(optimizer=optimizer, loss="mse")
    record = StepLosses(keras)
    model.fit(x, y, batch_size=shape["batch"], epochs=3, shuffle=False, verbose=0, callbacks=[record.callback])
    return record.losses


def mirrored():
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    devices = [device.name for device in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build(keras)
        optimizer = keras.optimizers.SGD(0.05)
    x, y = data()
    record = {"replicas": strategy.num_replicas_in_sync}
    if SIZE == "memory":
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=shape["batch"], epochs=1, verbose=0)  # builds and traces
        for device in devices:
            tf.config.experimental.reset_memory_stats(device)
        model.fit(x, y, batch_size=shape["batch"], epochs=1, verbose=0)
        record["peaks"] = [tf.config.experimental.get_memory_info(device)["peak"] for device in devices]
    else:
        record["losses"] = fit(keras, model, optimizer, x, y)
    return record


def multiworker():
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import tf_keras

    tf_keras.utils.set_random_seed(0)
    tf_keras.backend.experimental.enable_tf_random_generator()
    with strategy.scope():
        model = build(tf_keras)
        optimizer = tf_keras.optimizers.legacy.SGD(0.05)
    x, y = data()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(shape["batch"]).with_options(options)
    model.compile(optimizer=optimizer, loss="mse")
    record = StepLosses(tf_keras)
    model.fit(dataset, epochs=3, verbose=0, callbacks=[record.callback])
    return {"replicas": strategy.num_replicas_in_sync, "losses": record.losses}


def jax_distributed(case):
    import jax
    import keras

    devices = jax.devices("cpu")
    if case == "dataparallel":
        distribution = keras.distribution.DataParallel(devices=devices)
    else:
        mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*ffn_in.*kernel"] = (None, "model")
        layout_map[".*ffn_out.*kernel"] = ("model", None)
        layout_map[".*(query|key|value).*kernel"] = (None, "model", None)
        layout_map[".*attention_output.*kernel"] = ("model", None, None)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    model = build(keras)
    sharded = sorted({str(v.value.sharding.spec) for v in model.trainable_variables if hasattr(v.value.sharding, "spec")})
    x, y = data()
    losses = fit(keras, model, keras.optimizers.SGD(0.05), x, y)
    return {"replicas": len(devices), "losses": losses, "kernel_shardings": sharded, "gelus": gelus_in_gradient(model, x, y)}


def torch_ddp():
    """Each worker trains on its half of each batch; DDP averages the gradients. SGD at lr 0.05 (1.0 diverged in six
    steps); the weights' moves are compared, not the losses (NOTE [ what "equal" means in these tests ])."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import keras

    from keras_recompute import recompute_scope

    # A file store: no port to pick.
    dist.init_process_group(
        "gloo", init_method=os.environ["DDP_INIT_METHOD"], rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data()
    record, moves = {"replicas": world}, {}
    for switch in ("0", "1"):
        keras.utils.set_random_seed(0)
        model = build(keras)
        initial = [np.array(keras.ops.convert_to_numpy(w)) for w in model.trainable_weights]
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        keras.utils.set_random_seed(1 + rank)  # each worker its own dropout masks
        CALLS[0] = 0
        losses = []
        with recompute_scope(switch == "1"):
            for _ in range(3):
                for start in range(0, shape["rows"], shape["batch"]):
                    rows = slice(start + rank, start + shape["batch"], world)
                    optimizer.zero_grad()
                    loss = torch.mean((ddp(torch.tensor(x[rows]), training=True) - torch.tensor(y[rows])) ** 2)
                    loss.backward()
                    optimizer.step()
                    losses.append(float(loss.detach()))
        moves[switch] = [np.array(keras.ops.convert_to_numpy(w)) - w0 for w, w0 in zip(model.trainable_weights, initial)]
        record[switch] = {"losses": losses, "calls": CALLS[0]}
        # Freed before the process group is destroyed: a DDP freed after it destroyed the group holding the GIL, while
        # gloo's thread, which the destructor joins, waited for the GIL (a deadlock one run in three or four).
        del ddp, optimizer
    dist.destroy_process_group()
    # The moves are compared here: the workers print a few numbers, not the weights.
    record["move_norms"] = [float(np.linalg.norm(m)) for m in moves["1"]]
    record["move_differences"] = [float(np.linalg.norm(on - off)) for on, off in zip(moves["1"], moves["0"])]
    record["moves_digest"] = hashlib.sha256(b"".join(m.astype("float32").tobytes() for m in moves["1"])).hexdigest()
    return record


def gelus_in_gradient(model, x, y):
    """JAX: the gelus (`erfc`) in the program of a gradient step: the recompute adds one per block."""
    import jax
    import jax.numpy as jnp

    def loss(trainable, non_trainable):
        outputs, _ = model.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.mean((outputs - y) ** 2)

    values = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])
    return str(jax.make_jaxpr(jax.grad(loss))(*values)).count(" erfc ")


def main():
    if CASE == "mirrored":
        record = mirrored()
    elif CASE == "multiworker":
        record = multiworker()
    elif CASE == "ddp":
        record = torch_ddp()
    else:
        record = jax_distributed(CASE)
    print(json.dumps({**record, "calls": CALLS[0]}))


if __name__ == "__main__":
    main()
