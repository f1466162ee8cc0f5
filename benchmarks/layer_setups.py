"""`verify` on blocks built the ways users build them, per backend, compile mode, dtype and policy.

Exactness is proven only where it was tried. `user_setups.py` tries what a
user's `compile` adds around the blocks; this tries what users put inside
them, through `keras_recompute.verify` (the model's own compiled step, plain
against recomputed, SGD at lr 1.0, every weight's first update, the
recomputed step repeated): LoRA on a Dense and on an EinsumDense
(`enable_lora`), int8 weights under LoRA (`quantize("int8")`, as QLoRA),
kernel and activity regularizers, one Dense shared by two blocks, a kernel
read again transposed (tied weights), a weight a layer reads with a raw
`ops.matmul`, a frozen BatchNormalization, a frozen first block, causal
attention, `Embedding(mask_zero=True)` into attention, a `stop_gradient`, an
integer path (`argmax` into a gather), `ops.cond` on the data, `ops.fori_loop`,
a call that returns its input, an output the model does not use, a weight added
to the output, and the input returned scaled beside the output. Each block:
Dense 32 tanh, Dropout 0.2 (seeded), Dense 16, a residual; two blocks and a
head, 8 samples of 10 steps; `full` and `save_dots` each, `attention_core`
where the block has attention.

Each configuration (backend, compile mode, dtype) runs in a fresh process:
TensorFlow in `tf.function` (Keras's default), op by op (`run_eagerly=True`)
and under XLA (`jit_compile=True`); JAX's jit; PyTorch; each in float32 and
under `mixed_bfloat16` and `mixed_float16` (TensorFlow's and PyTorch's
`tf.function`/default step). A row's verdict is verify's: `ok`, `as op by
op` (ok: compiling moved the plain step, and the compiled recomputed step is
the plain step run op by op: NOTE [ what compiling moves ] in
`keras_recompute/_verify.py`), `graph rounding` (ok: a tf.function
difference that is none with Grappler's arithmetic optimizer off, and none op
by op: NOTE [ a graph optimizer's rewrite ]), `cannot tell` (where compiling
alone moves the plain step as far as the difference, and op by op the
recomputed step matches), `DIFFERS`, or `plain fails` (the model is wrong
without recompute: the plain step raised). A row
`refused` is Keras's (int8 under float16). verify's table names the units
it recomputed; each row records them, so a row where nothing was recomputed
cannot pass.

    python benchmarks/layer_setups.py --out benchmarks/results/layer_setups.json
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _record  # noqa: E402

CASES = [
    "lora", "einsum_lora", "quant_lora", "regularizer", "shared_dense", "tied", "raw_matmul", "frozen_batchnorm",
    "frozen_first_block", "causal_attention", "mask_zero_attention", "stop_gradient", "integer_path", "cond", "loop",
    "returns_its_input", "unused_output", "weight_in_output", "input_scaled_beside",
]
ATTENTION = ("causal_attention", "mask_zero_attention")

# backend, compile mode, dtype policy
CONFIGURATIONS = [
    ("tensorflow", "tf.function", "float32"),
    ("tensorflow", "eager", "float32"),
    ("tensorflow", "xla", "float32"),
    ("tensorflow", "tf.function", "mixed_bfloat16"),
    ("tensorflow", "tf.function", "mixed_float16"),
    ("jax", "jit", "float32"),
    ("jax", "jit", "mixed_bfloat16"),
    ("torch", "eager", "float32"),
    ("torch", "eager", "mixed_bfloat16"),
    ("torch", "eager", "mixed_float16"),
]

CHILD = r"""
import json, os, sys
import numpy as np
import keras
from keras import ops
from keras_recompute import verify

MODE, DTYPE = os.environ["LAYER_SETUPS_MODE"], os.environ["LAYER_SETUPS_DTYPE"]
CASES, ATTENTION = json.loads(os.environ["LAYER_SETUPS_CASES"]), json.loads(os.environ["LAYER_SETUPS_ATTENTION"])
keras.config.set_dtype_policy(DTYPE)
SEQ = 10


class Tied(keras.layers.Layer):
    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, h):
        return ops.matmul(h, ops.transpose(self.dense.kernel))[..., :16]


class RawMatmul(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 32), initializer="glorot_uniform")

    def call(self, x):
        return ops.tanh(ops.matmul(x, self.w))


class Block(keras.layers.Layer):
    def __init__(self, kind, shared=None, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        regularized = kind == "regularizer"
        self.d1 = keras.layers.Dense(32, activation="tanh", kernel_regularizer="l2" if regularized else None,
                                     activity_regularizer="l2" if regularized else None)
        self.d2 = shared if shared is not None else keras.layers.Dense(16)
        self.drop = keras.layers.Dropout(0.2, seed=3)
        if kind in ATTENTION:
            self.attention = keras.layers.MultiHeadAttention(2, 8, dropout=0.2, seed=5)
            self.norm = keras.layers.LayerNormalization()
        elif kind == "einsum_lora":
            self.einsum = keras.layers.EinsumDense("btd,df->btf", output_shape=(None, 32), activation="tanh")
        elif kind == "raw_matmul":
            self.raw = RawMatmul()
        elif kind == "tied":
            self.tied = Tied(self.d1)
        elif kind == "frozen_batchnorm":
            self.bn = keras.layers.BatchNormalization()

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="random_normal", name="w")

    def call(self, x, training=None):
        kind = self.kind
        if kind in ATTENTION:
            h = self.attention(x, x, use_causal_mask=kind == "causal_attention", training=training)
            return self.norm(x + self.drop(h, training=training))
        if kind == "einsum_lora":
            h = self.einsum(x)
        elif kind == "raw_matmul":
            h = self.raw(x)
        else:
            h = self.d1(x)
        if kind == "frozen_batchnorm":
            h = self.bn(h, training=training)
        h = self.drop(h, training=training)
        if kind == "stop_gradient":
            h = h + ops.stop_gradient(h * h)
        elif kind == "integer_path":
            h = h + ops.take(self.w, ops.argmax(h, axis=-1) % 16)[..., None]
        elif kind == "cond":
            h = ops.cond(ops.sum(x) > 0, lambda: h * 2.0, lambda: h * 3.0)
        elif kind == "loop":
            h = ops.fori_loop(0, 3, lambda i, a: ops.tanh(a) + h, h)
        y = x + self.d2(h)
        if kind == "tied":
            y = y + 0.1 * self.tied(h)
        elif kind == "returns_its_input":
            return (x, y)
        elif kind == "unused_output":
            return (y, self.d2(h) * 5.0)
        elif kind == "weight_in_output":
            y = y + self.w
        elif kind == "input_scaled_beside":
            return (y, x * 2.0)
        return y


def model_for(kind):
    keras.utils.set_random_seed(0)
    rs = np.random.RandomState(0)
    if kind == "mask_zero_attention":
        inputs = keras.Input((SEQ,), dtype="int32")
        h = keras.layers.Embedding(50, 16, mask_zero=True)(inputs)
        x = rs.randint(1, 50, size=(8, SEQ)).astype("int32")
        x[:, 6:] = 0
        x[0, 3:] = 0
    else:
        inputs = keras.Input((SEQ, 16))
        h = inputs
        x = rs.rand(8, SEQ, 16).astype("float32") - 0.5
    shared = keras.layers.Dense(16) if kind == "shared_dense" else None
    blocks = []
    for _ in range(2):
        out = Block(kind, shared=shared)(h)
        blocks.append(out)
        h = out[0] + out[1] if kind in ("returns_its_input", "input_scaled_beside") else out[0] if kind == "unused_output" else out
    if kind == "mask_zero_attention":
        h = keras.layers.GlobalAveragePooling1D()(h)
        y = rs.rand(8, 1).astype("float32")
    else:
        y = np.random.RandomState(1).rand(8, SEQ, 1).astype("float32")
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    layers = [layer for layer in model.layers if isinstance(layer, Block)]
    for block in layers:
        if kind == "quant_lora":
            block.d1.quantize("int8")
            block.d2.quantize("int8")
        if kind in ("lora", "quant_lora"):
            block.d1.enable_lora(4)
            block.d2.enable_lora(2)
        elif kind == "einsum_lora":
            block.einsum.enable_lora(4)
            block.d2.enable_lora(2)
        elif kind == "frozen_batchnorm":
            block.bn.trainable = False
    if kind == "frozen_first_block":
        layers[0].trainable = False
    compile_args = {"run_eagerly": MODE == "eager"}
    if keras.backend.backend() == "tensorflow":
        compile_args["jit_compile"] = MODE == "xla"
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse", **compile_args)
    return model, x, y


rows = []
for kind in CASES:
    for policy in ["full", "save_dots"] + (["attention_core"] if kind in ATTENTION else []):
        row = {"setup": kind, "policy": policy}
        try:
            model, x, y = model_for(kind)
        except ValueError as error:  # Keras refuses the setup itself (int8 under float16)
            row.update(verdict="refused", failure=f"Keras: {str(error)[:300]}", ok=True)
            rows.append(row)
            continue
        try:
            report = verify(model, x, y, blocks=Block, policy=policy, trials=4, memory=False)
        except Exception as error:
            row.update(verdict="raised", failure=f"{type(error).__name__}: {str(error)[:500]}", ok=False)
        else:
            failure = report.failure or ""
            rounding = report.ok and any(r["rounding"] for r in report.rows)
            as_op_by_op = rounding and report.op_by_op is not None and report.op_by_op["as_op_by_op"]
            verdict = ("as op by op" if as_op_by_op else "graph rounding" if rounding and report.rewrites is not None
                       else "ok" if report.ok
                       else "plain fails" if "the plain step raised" in failure
                       else "cannot tell" if report.cannot_tell else "DIFFERS")
            compared = [r for r in report.rows if r["unit"] in report.units]
            row.update(
                verdict=verdict,
                units=list(report.units),
                difference=max((r["difference"] for r in compared), default=None),
                plain_spread=report.plain_spread,
                op_by_op=report.op_by_op,
                rewrites=report.rewrites,
                failure=failure[:500] or None,
                # ok: verify's ok; cannot tell only where op by op the recomputed step matched; plain's own failure
                ok=bool(report.units) and (verdict in ("ok", "as op by op", "graph rounding", "plain fails") or (
                    verdict == "cannot tell" and report.op_by_op is not None and report.op_by_op["exact"])),
            )
        rows.append(row)
        print(keras.backend.backend(), MODE, DTYPE, kind, policy, row["verdict"], file=sys.stderr, flush=True)
print(json.dumps(rows))
"""


def run(configuration):
    backend, mode, dtype = configuration
    env = dict(os.environ, KERAS_BACKEND=backend, LAYER_SETUPS_MODE=mode, LAYER_SETUPS_DTYPE=dtype,
               LAYER_SETUPS_CASES=json.dumps(CASES), LAYER_SETUPS_ATTENTION=json.dumps(ATTENTION))
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    if done.returncode:
        return configuration, None, done.stderr[-3000:]
    return configuration, json.loads(done.stdout.strip().splitlines()[-1]), None


def summarize(results):
    """Rows ok, rows, and how many of each verdict (named with underscores: `cannot_tell`)."""
    verdicts = {}
    for row in results:
        key = row["verdict"].lower().replace(" ", "_")
        verdicts[key] = verdicts.get(key, 0) + 1
    return {"ok": sum(row["ok"] for row in results), "rows": len(results), "verdicts": verdicts}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["tensorflow", "jax", "torch"])
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--jobs", type=int, default=2, help="configurations run at a time, each its own process")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    CASES[:] = args.cases
    configurations = [c for c in CONFIGURATIONS if c[0] in args.backends]
    results, broken = [], []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for (backend, mode, dtype), rows, error in pool.map(run, configurations):
            if rows is None:
                broken.append(f"{backend} {mode} {dtype}:\n{error}")
                continue
            for row in rows:
                row.update(backend=backend, mode=mode, dtype=dtype)
                print(f"{backend:10s} {mode:11s} {dtype:14s} {row['setup']:20s} {row['policy']:14s} "
                      f"{row['verdict'] if row['ok'] else 'BAD ' + row['verdict']}"
                      + (f" ({row['failure'][:160]})" if row["verdict"] not in ("ok",) and row.get("failure") else ""),
                      flush=True)
            results.extend(rows)
    summary = summarize(results)
    print(f"{summary['ok']} of {summary['rows']} rows ok: {summary['verdicts']}")
    for text in broken:
        print(f"a configuration's process failed: {text}", file=sys.stderr)
    if args.out:
        from importlib.metadata import version  # the parent imports no framework

        record = dict(_record.metadata(), keras=version("keras"), summary=summary, results=results)
        with open(args.out, "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")
    if broken or not all(row["ok"] for row in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
