"""Host time of a training step on Keras 3 + PyTorch, per method, and the ops each step dispatches, by kind.

Keras on PyTorch runs a step op by op from Python: when the device's kernels
are short (a GPU in bfloat16), the step's time is the host's time, and what a
method adds to it (a second Python forward, dispatch modes, hooks) is what
it costs. This measures that cost on any machine, GPU or not, by making the
kernels negligible: `backends.py`'s BERT encoder at a tiny size (by default 12
blocks of hidden 32, seq 8, batch 2), so that a step is all host time.

All methods are built in one process and timed in turns (a slower spell of
the machine falls on each alike); the fastest step of each counts. `floor` is
the plain step plus one plain training forward: what full recompute cannot
go below. Then one step of each method is run under a counting dispatch mode
and its ATen ops are counted by kind (matmul, random, copy, view, reduction,
elementwise and other), and, for `save_dots`, how many ops its own dispatch
modes saw (NOTE [ save_dots on PyTorch ] in keras_recompute/backends/torch.py).
`save_dots_unchecked` is `save_dots` with `check=False`: what the recompute check costs.

Usage:
    python benchmarks/host_overhead.py                       # float32
    python benchmarks/host_overhead.py --dtype mixed_bfloat16 --out benchmarks/results/host_overhead_torch.json
"""

import argparse
import collections
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

METHODS = ("none", "ours", "save_dots", "attention_core", "save_dots_unchecked")  # the last: check=False
KINDS = {
    "matmul": {"mm", "addmm", "bmm", "baddbmm", "matmul"},
    "random": {"bernoulli", "native_dropout", "uniform", "normal", "rand", "randint"},
    "copy": {"clone", "copy", "_to_copy", "to", "contiguous"},
    "view": {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze",
             "slice", "select", "as_strided", "alias", "detach", "split", "unbind", "split_with_sizes"},
    "reduction": {"sum", "mean", "var_mean", "_softmax", "native_layer_norm", "amax", "max", "norm",
                  "_softmax_backward_data", "native_layer_norm_backward"},
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "mixed_bfloat16"), default="float32")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15, help="timed steps of each method, in turns")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def kind_of(name):
    """The kind of an ATen op by its name (`add_` is `add`); elementwise if none of `KINDS`."""
    name = name.rstrip("_") if not name.startswith("_") else name
    return next((kind for kind, names in KINDS.items() if name in names), "elementwise")


def main(argv=None):
    args = parse_args(argv)
    os.environ["KERAS_BACKEND"] = "torch"
    os.environ["RECOMPUTE"] = "1"
    import keras
    import numpy as np
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import backends
    from keras_recompute.backends import torch as torch_backend

    keras.config.set_dtype_policy(args.dtype)
    model_args = backends.parse_args(
        ["--backend", "torch", "--blocks", str(args.blocks), "--hidden", str(args.hidden), "--heads", str(args.heads),
         "--ffn", str(args.ffn), "--seq", str(args.seq), "--batch", str(args.batch)]
    )
    rng = np.random.RandomState(0)
    ids = rng.randint(0, model_args.vocab, size=(args.batch, args.seq)).astype("int32")
    labels = rng.randint(0, 2, size=(args.batch,)).astype("int32")
    models = {}
    for method in METHODS:
        keras.utils.set_random_seed(0)
        models[method] = backends.build_model(model_args, method)
        for _ in range(3):
            models[method].train_on_batch(ids, labels)
    best, forward = {m: float("inf") for m in METHODS}, float("inf")
    for _ in range(args.rounds):
        for method, model in models.items():
            start = time.perf_counter()
            model.train_on_batch(ids, labels)
            best[method] = min(best[method], time.perf_counter() - start)
        start = time.perf_counter()
        outputs = models["none"](ids, training=True)
        forward = min(forward, time.perf_counter() - start)
        del outputs

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kinds = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.kinds[kind_of(func.__name__.split(".")[0])] += 1
            return func(*args, **(kwargs or {}))

    seen = collections.Counter()
    for mode in (getattr(torch_backend, "_KeepingDots", None), getattr(torch_backend, "_KeptDots", None)):
        if mode is None:  # an earlier version, with torch's selective checkpoint
            continue
        original = mode.__torch_dispatch__

        def counted(self, func, types, args=(), kwargs=None, _original=original):
            seen["ops seen by the save_dots modes"] += 1
            return _original(self, func, types, args, kwargs)

        mode.__torch_dispatch__ = counted
    ops = {}
    for method, model in models.items():
        seen.clear()
        with Count() as mode:
            model.train_on_batch(ids, labels)
        ops[method] = dict(sorted(mode.kinds.items()))
        ops[method]["total"] = sum(mode.kinds.values())
        if method.startswith("save_dots"):
            ops[method].update(seen)

    floor = best["none"] + forward
    results = {
        method: {
            "step_ms": round(best[method] * 1000, 2),
            "vs_none": round(best[method] / best["none"], 3),
            "vs_ours": round(best[method] / best["ours"], 3),
            "ops_per_step": ops[method],
        }
        for method in METHODS
    }
    print(
        f"Keras 3 on torch {torch.__version__}, {args.dtype}, CPU ({platform.processor() or platform.machine()}): "
        f"{args.blocks} blocks x hidden {args.hidden}, seq {args.seq}, batch {args.batch}"
    )
    print(f"plain step {best['none'] * 1000:.1f} ms, one training forward {forward * 1000:.1f} ms, "
          f"floor of full {floor * 1000:.1f} ms ({floor / best['none']:.2f}x)")
    for method, record in results.items():
        print(f"  {method:15s} {record['step_ms']:7.1f} ms  {record['vs_none']:.2f}x none  {record['vs_ours']:.2f}x full  "
              f"ops {record['ops_per_step']}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "benchmark": "host_overhead",
                    "device": "cpu",
                    "dtype": args.dtype,
                    "command": "python benchmarks/host_overhead.py " + " ".join(sys.argv[1:]),
                    "torch": torch.__version__,
                    "keras": keras.__version__,
                    "arguments": vars(args),
                    "forward_ms": round(forward * 1000, 2),
                    "floor_ms": round(floor * 1000, 2),
                    "results": results,
                },
                handle,
                indent=1,
            )


if __name__ == "__main__":
    main()
