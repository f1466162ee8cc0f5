"""Weights after `model.fit` with recompute on and off, in the training setups users write, per backend and policy.

Exactness is proven only where it was tried. The suite compares gradients and
first updates on blocks, keras-hub models, masks, LoRA and mixed precision;
this tries what a user's `compile` and model add around them, on Keras 3's
three backends and on tf_keras: Adam, gradient accumulation
(`gradient_accumulation_steps`, not in tf_keras), an EMA of the weights
(`use_ema`), several steps per call (`steps_per_execution`, not on PyTorch,
which refuses it), XLA (`jit_compile=True`, TensorFlow and tf_keras: under XLA
tf_keras's default random ops draw differently on every run, plain's too, and
that row's plain spread says so; a second row draws from a
`tf.random.Generator`, which repeats), a clipped loss-scaled optimizer
(`LossScaleOptimizer` around `SGD(global_clipnorm=)`), a Dense called twice in
a block, one block instance called twice in the model, and an LSTM inside a
block. The model: Dense 16, two blocks of MultiHeadAttention (2 heads of 8,
attention dropout 0.1) + LayerNormalization + Dense 32 gelu + Dropout 0.2 +
Dense 16, and a head; its blocks' class `call` is decorated with
`recompute_grad` (`full`), and `save_dots` and `attention_core` are applied
over it with `recompute_model`.

Each setup is built from one seed and fit for 2 steps (32 samples, batch 16):
plain twice (the spread: on a CPU plain is bitwise the same), then once per
policy with recompute on. The error is normwise: the final weights'
difference from plain's, one norm over the whole model, over the norm of
plain's weights. Each policy's row also counts the calls of the blocks' call
and of the attention cores against plain's (on JAX, which traces a call once
and replays it, the exponentials in the program of a gradient), so a row
whose recompute did not run cannot pass for exact. Each backend runs in a
fresh process.

    python benchmarks/user_setups.py --out benchmarks/results/user_setups.json

SGD's update is its gradient times the rate: a wrong gradient shows at once.
Adam divides each element by its own gradient's size, so an element whose
gradient is rounding (an attention key bias's) moves by up to the rate,
either way: Adam's rows are held to 1e-4 (their rounding measured up to
9e-6), SGD's to 1e-5 (as the suite's).
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _record  # noqa: E402

CHILD = r"""
import json, os, sys
import numpy as np
if os.environ.get("USER_SETUPS_TF_KERAS"):
    import tf_keras as keras
    BACKEND = "tf_keras"
else:
    import keras
    BACKEND = keras.backend.backend()
import keras_recompute
from keras_recompute import recompute_grad

CALLS = {"block": 0, "core": 0}
core = keras.layers.MultiHeadAttention._compute_attention


def counted_core(self, *args, **kwargs):
    CALLS["core"] += 1
    return core(self, *args, **kwargs)


keras.layers.MultiHeadAttention._compute_attention = counted_core


class Block(keras.layers.Layer):
    def __init__(self, kind="plain", **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        self.attention = keras.layers.MultiHeadAttention(2, 8, dropout=0.1)
        self.norm = keras.layers.LayerNormalization()
        self.up = keras.layers.Dense(32, activation="gelu")
        self.down = keras.layers.Dense(16)
        self.dropout = keras.layers.Dropout(0.2)
        if kind == "shared_dense":
            self.square = keras.layers.Dense(16)
        if kind == "lstm":
            self.rnn = keras.layers.LSTM(16, return_sequences=True, dropout=0.1)

    @recompute_grad
    def call(self, x, training=None):
        CALLS["block"] += 1
        hidden = self.norm(x + self.attention(x, x, training=training))
        if self.kind == "shared_dense":
            hidden = self.square(self.square(hidden))
        if self.kind == "lstm":
            hidden = hidden + self.rnn(hidden, training=training)
        return hidden + self.dropout(self.down(self.up(hidden)), training=training)


def build(kind):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 12))
    hidden = keras.layers.Dense(16)(inputs)
    if kind == "reused_block":
        block = Block()
        hidden = block(block(hidden))
    else:
        hidden = Block(kind)(Block(kind)(hidden))
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


SGD = lambda **kw: keras.optimizers.SGD(0.1, **kw)
LossScale = getattr(keras.optimizers, "LossScaleOptimizer", None) or keras.mixed_precision.LossScaleOptimizer
SETUPS = {
    "sgd": dict(optimizer=SGD),
    "adam": dict(optimizer=lambda: keras.optimizers.Adam(1e-2), tolerance=1e-4),
    "ema": dict(optimizer=lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=2), tolerance=1e-4),
    "loss_scale_clipnorm": dict(optimizer=lambda: LossScale(SGD(global_clipnorm=0.5))),
    "shared_dense": dict(optimizer=SGD, kind="shared_dense"),
    "reused_block": dict(optimizer=SGD, kind="reused_block"),
    "lstm": dict(optimizer=SGD, kind="lstm"),
}
if BACKEND != "tf_keras":  # tf_keras's optimizers do not accumulate
    SETUPS["gradient_accumulation"] = dict(optimizer=lambda: SGD(gradient_accumulation_steps=2))
if BACKEND != "torch":  # Keras on PyTorch refuses steps_per_execution > 1
    SETUPS["steps_per_execution"] = dict(optimizer=SGD, compile=dict(steps_per_execution=2))
if BACKEND in ("tensorflow", "tf_keras"):
    SETUPS["jit_compile"] = dict(optimizer=SGD, compile=dict(jit_compile=True))
if BACKEND == "tf_keras":
    # tf_keras's default (legacy, stateful) random ops draw differently on every run under XLA, plain's too
    # (docs/exactness.md): its XLA row draws from a `tf.random.Generator`, whose seed makes plain repeatable.
    SETUPS["jit_compile_generator"] = dict(optimizer=SGD, compile=dict(jit_compile=True), generator=True)


def fit(setup, on, policy=None):
    if BACKEND == "tf_keras":
        switch = keras.backend.experimental
        switch.enable_tf_random_generator() if setup.get("generator") else switch.disable_tf_random_generator()
    model = build(setup.get("kind", "plain"))
    if policy is not None:
        keras_recompute.recompute_model(model, blocks=Block, policy=policy)
    model.compile(optimizer=setup["optimizer"](), loss="mse", **setup.get("compile", {}))
    random = np.random.RandomState(0)
    x = random.normal(size=(32, 6, 12)).astype("float32")
    y = random.normal(size=(32, 6, 1)).astype("float32")
    CALLS.update(block=0, core=0)
    with keras_recompute.recompute_scope(on):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        calls = dict(CALLS) if BACKEND != "jax" else {"exp": exponentials(model, x[:16], y[:16])}
    return [np.array(w, np.float64) for w in model.get_weights()], calls


def exponentials(model, x, y):
    # JAX traces a call once and its recompute replays the traced program, so Python's calls do not
    # count it: the exponentials (softmax, gelu) in the program of a gradient do.
    import jax

    trainable = [v.value for v in model.trainable_variables]
    other = [v.value for v in model.non_trainable_variables]

    def loss(trainable):
        outputs, _ = model.stateless_call(trainable, other, x, training=True)
        return keras.ops.mean((outputs - y) ** 2)

    def count(jaxpr):
        found = 0
        for equation in jaxpr.eqns:
            found += equation.primitive.name == "exp"
            for value in equation.params.values():
                for inner in value if isinstance(value, (list, tuple)) else [value]:
                    inner = getattr(inner, "jaxpr", inner)
                    found += count(inner) if hasattr(inner, "eqns") else 0
        return found

    return count(jax.make_jaxpr(jax.grad(loss))(trainable).jaxpr)


def error(weights, reference):
    difference = np.sqrt(sum(((w - r) ** 2).sum() for w, r in zip(weights, reference)))
    return float(difference / np.sqrt(sum((r ** 2).sum() for r in reference)))


rows = []
for name, setup in SETUPS.items():
    plain, plain_calls = fit(setup, False)
    again, _ = fit(setup, False)
    spread = error(again, plain)
    for policy in ("full", "save_dots", "attention_core"):
        row = dict(setup=name, policy=policy, plain_spread=spread, plain_calls=plain_calls)
        try:
            weights, calls = fit(setup, True, None if policy == "full" else policy)
            row.update(error=error(weights, plain), calls=calls)
            counted = "exp" if BACKEND == "jax" else "core" if policy == "attention_core" else "block"
            row["recomputed"] = calls[counted] > plain_calls[counted]
            row["ok"] = row["recomputed"] and row["error"] <= setup.get("tolerance", 1e-5) + spread
        except Exception as failure:  # recorded, not raised: every row runs
            row.update(failure=f"{type(failure).__name__}: {str(failure)[:500]}", ok=False)
        rows.append(row)
        print(BACKEND, name, policy, {k: row.get(k) for k in ("error", "recomputed", "ok", "failure")},
              file=sys.stderr, flush=True)
print(json.dumps(rows))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["tensorflow", "jax", "torch", "tf_keras"])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = {}
    for backend in args.backends:
        env = dict(os.environ, KERAS_BACKEND=backend)
        if backend == "tf_keras":  # Keras 2 (tf_keras) on TensorFlow
            env.update(KERAS_BACKEND="tensorflow", USER_SETUPS_TF_KERAS="1")
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{backend} failed:\n{done.stderr[-3000:]}")
        results[backend] = json.loads(done.stdout.strip().splitlines()[-1])
        for row in results[backend]:
            shown = row.get("failure") or f"error {row['error']:.1e} (plain's spread {row['plain_spread']:.0e})"
            print(f"{backend:10s} {row['setup']:22s} {row['policy']:14s} {'ok ' if row['ok'] else 'BAD'} {shown}",
                  flush=True)
    rows = [row for backend in results.values() for row in backend]
    summary = {"ok": sum(row["ok"] for row in rows), "rows": len(rows)}
    print(f"{summary['ok']} of {summary['rows']} rows ok")
    if args.out:
        from importlib.metadata import version  # the parent imports no framework

        record = dict(_record.metadata(), keras=version("keras"), summary=summary, results=results)
        with open(args.out, "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")
    if not all(row["ok"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
