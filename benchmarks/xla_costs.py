"""What each policy adds to a JAX training step, from XLA's own cost analysis of the compiled step: no timing.

```
python benchmarks/xla_costs.py --blocks 2 --batch 4 --dtype mixed_bfloat16 --dropout 0 0.1 \
    --out benchmarks/results/xla_costs_bert_blocks_mixed_bfloat16.json
```

`benchmarks/backends.py`'s BERT-shaped model (hidden 768, 12 heads, FFN 3072, seq 512 by default),
each method and dropout rate in a fresh process: the step is compiled as `backends.py --backend jax`
trains it (Keras's `train_step`, its state donated) and XLA states, for the program it compiled, its
floating-point operations, the bytes its instructions read and write, its transcendental functions
and its temporary buffers. A step on a GPU in bfloat16 is mostly bound by memory traffic, so the
bytes a policy adds are the first guess at the time it adds (issue 39: `save_dots` cost as much time
as `full` on the H200, where it saves nearly all of full's extra operations). On the CPU the figures
are the CPU compiler's; on a GPU, the GPU's (its fusions differ). Nothing runs but one step, to
build the model and the optimizer.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _measure  # noqa: E402

METHODS = ("none", "ours", "save_dots", "attention_core")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="mixed_bfloat16")
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "DROPOUT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def backends_arguments(args, dropout):
    return ["--backend", "jax", "--blocks", args.blocks, "--hidden", 768, "--heads", 12, "--ffn", 3072, "--seq",
            args.seq, "--batch", args.batch, "--dropout", dropout, "--dtype", args.dtype]


def child(args):
    method, dropout = args.child
    os.environ["RECOMPUTE"] = "1" if method != "none" else "0"
    import jax
    import keras
    import numpy as np

    import backends

    options = backends.parse_args([str(a) for a in backends_arguments(args, dropout)])
    keras.config.set_dtype_policy(args.dtype)
    keras.utils.set_random_seed(0)
    model = backends.build_model(options, method)
    rng = np.random.RandomState(0)
    ids = rng.randint(0, options.vocab, size=(args.batch, args.seq)).astype("int32")
    labels = rng.randint(0, 2, size=(args.batch,)).astype("int32")
    model.train_on_batch(ids, labels)  # builds the optimizer's slots
    compiled = _measure.compiled_train_step(model, ids, labels)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    print(json.dumps({
        "flops": cost.get("flops"),
        "bytes_accessed": cost.get("bytes accessed"),
        "transcendentals": cost.get("transcendentals"),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "platform": jax.devices()[0].platform,
    }))


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    print(f"XLA's costs of a training step: {args.blocks} BERT-base blocks, seq {args.seq}, batch {args.batch}, "
          f"{args.dtype}, Adam")
    print(f"{'dropout':>7} {'method':<15} {'GFLOP':>8} {'vs none':>8} {'GB moved':>9} {'vs none':>8} {'temp MB':>8}")
    rows = []
    for dropout in args.dropout:
        base = None
        for method in args.methods:
            arguments = ["--blocks", args.blocks, "--seq", args.seq, "--batch", args.batch, "--dtype", args.dtype]
            record = _measure.run(os.path.abspath(__file__), arguments + ["--child", method, dropout], "jax")
            record.update(method=method, dropout=dropout)
            rows.append(record)
            if "error" in record:
                print(f"{dropout:>7} {method:<15} failed: {record['error']}")
                continue
            base = record if method == "none" else base
            flops = f"{record['flops'] / base['flops']:.3f}x" if base else ""
            moved = f"{record['bytes_accessed'] / base['bytes_accessed']:.3f}x" if base else ""
            print(f"{dropout:>7} {method:<15} {record['flops'] / 1e9:>8.1f} {flops:>8} "
                  f"{record['bytes_accessed'] / 1e9:>9.2f} {moved:>8} {record['temp_bytes'] / 2**20:>8.0f}", flush=True)
    _measure.write_json(args.out, vars(args), {"rows": rows})


if __name__ == "__main__":
    main()
