"""What each policy keeps for the backward pass on JAX, by kind, and the floor that sets under a step's peak: no
compiling, no timing.

```
python benchmarks/kept.py --bert-base --seq 512 --batch 32 --dtype mixed_bfloat16 \
    --out benchmarks/results/kept_jax_bert_base_mixed_bfloat16.json
```

`benchmarks/backends.py`'s model (the shape its arguments give; `--bert-base`: 12 blocks x 768), one method a
fresh process. Its training forward and loss are traced once, abstractly (nothing runs, so BERT-base at batch 32
takes seconds on a CPU), under JAX's `saved_residuals`: every array the forward leaves for the backward, with the
op that made it. For a recomputed block those are what its custom VJP keeps, which XLA cannot drop: the block's
inputs, and under `save_dots` its matmul outputs and packed dropout masks. For `none` they are what JAX's
linearization names, of which XLA fuses many away (broadcasts, casts): they over-count plain's, and plain's own
figure is the allocator's on a device.

Each record: `kept_by_kind` in bytes (`matmul`: outputs of `dot_general`; `mask bits`: the packed dropout masks
NOTE [ dropout masks under the policies on JAX ] keeps; `other`: the rest, among them each recomputed block's
input, by the op that made it in `kept_by_op`), the weights the backward reads (`weights`, the float
arguments, kept anyway), and `state`: the bytes of the model's variables and of its optimizer's, which a step
holds throughout. `state + sum(kept_by_kind)` is what is alive when the backward starts, under any schedule: a
floor under the step's peak, which the backward of the last unit then adds to (its recompute and its gradients).
`scores_shaped`: what of it has the attention scores' shape (broadcasts left out, which XLA does not
materialize): for `none`, what the attention cores keep, which `attention_core` recomputes instead (per block in
BERT-base: the softmax's exponentials, the dropout's boolean mask and the dropped probabilities). `scores`: the
bytes of one block's attention scores (batch x heads x seq x seq in the compute dtype), a unit of
that addition: Keras's attention with dropout materializes them, and the backward of a softmax holds its output and
its gradient at once, two of them. `--measured` names `backends.py` results JSON of the same shape (a GPU's):
each method's allocator peak there is copied into its row as `measured_peak` (and the file's name as
`measured_from`), beside the floor it is read against.
"""

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _measure  # noqa: E402

METHODS = ("none", "ours", "save_dots", "attention_core")
_MADE_BY = re.compile(r"output of (?:jitted function )?'?(\w+)")


def kind_of(source):
    """The kind of one residual, from `saved_residuals`' description of where it came from."""
    made_by = _MADE_BY.match(source or "")
    if "from the argument" in (source or ""):
        return "weights"
    if "keras_recompute_dropout_mask" in (source or ""):
        return "mask bits"
    if made_by and made_by.group(1) == "dot_general":
        return "matmul"
    return "other"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--measured", nargs="+", default=[],
                        help="backends.py results JSON of the same shape: their peaks go in the rows (the first with a method's)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, model_arguments = parser.parse_known_args(argv)
    import backends

    args.model = backends.parse_args(["--backend", "jax", *model_arguments])
    args.model_arguments = model_arguments
    return args


def child(args):
    os.environ["RECOMPUTE"] = "1" if args.child != "none" else "0"
    print(json.dumps(kept(args.model, args.child)))


def kept(options, method):
    """One method's record (see the module's doc) for `backends.py`'s model of `options`, with recompute as
    `RECOMPUTE` sets it."""
    import keras
    import numpy as np
    from jax._src.ad_checkpoint import saved_residuals  # JAX's own `print_saved_residuals` reads it

    import backends

    keras.config.set_dtype_policy(options.dtype)
    keras.utils.set_random_seed(0)
    model = backends.build_model(options, method)
    ids = np.zeros((options.batch, options.seq), "int32")
    labels = np.zeros((options.batch,), "int32")
    model.optimizer.build(model.trainable_variables)
    trainable = [v.value for v in model.trainable_variables]
    other = [v.value for v in model.non_trainable_variables]

    def loss(trainable, other):
        logits, _ = model.stateless_call(trainable, other, ids, training=True)
        return keras.ops.mean(keras.ops.sparse_categorical_crossentropy(labels, logits, from_logits=True))

    def nbytes(array):
        return int(np.prod(array.shape, dtype=np.int64)) * np.dtype(array.dtype).itemsize

    scores_shape = (options.batch, options.heads, options.seq, options.seq)
    kept_by_kind, kept_by_op, weights, scores_shaped = {}, {}, 0, 0
    for aval, source in saved_residuals(loss, trainable, other):
        kind = kind_of(source)
        if kind == "weights":
            weights += nbytes(aval)
            continue
        kept_by_kind[kind] = kept_by_kind.get(kind, 0) + nbytes(aval)
        if tuple(aval.shape) == scores_shape and not (source or "").startswith("output of broadcast_in_dim"):
            scores_shaped += nbytes(aval)
        if kind == "other":
            made_by = _MADE_BY.match(source or "")
            op = f"{made_by.group(1) if made_by else (source or '?')[:40]} {aval.dtype}"
            kept_by_op[op] = kept_by_op.get(op, 0) + nbytes(aval)
    state = sum(nbytes(v) for v in [*model.variables, *model.optimizer.variables])
    scores = options.batch * options.heads * options.seq**2 * np.dtype(keras.config.dtype_policy().compute_dtype).itemsize
    return {"method": method, "kept_by_kind": kept_by_kind, "kept_by_op": kept_by_op, "weights": weights, "state": state,
            "floor": state + sum(kept_by_kind.values()), "scores": int(scores), "scores_shaped": scores_shaped}


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    measured = {}
    for name in args.measured:
        with open(name) as source:
            for row in json.load(source)["results"]["rows"]:
                if row.get("peak") and row.get("method") not in measured:
                    measured[row.get("method")] = (row["peak"], os.path.splitext(os.path.basename(name))[0])
    rows = []
    for method in args.methods:
        record = _measure.run(__file__, [*args.model_arguments, "--child", method], "jax", label=method)
        record.setdefault("method", method)
        if method in measured:
            record["measured_peak"], record["measured_from"] = measured[method]
        rows.append(record)
        kinds = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(record.get("kept_by_kind", {}).items()))
        print(f"{method:<15} floor {record.get('floor', 0) / 2**20:8.0f} MiB  (state {record.get('state', 0) / 2**20:.0f}; "
              f"kept, MiB: {kinds}){'  ' + record['error'] if 'error' in record else ''}", flush=True)
    arguments = dict(vars(args.model), methods=args.methods, measured=args.measured)
    _measure.write_json(args.out, arguments, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
