"""What each policy adds to a JAX training step, from XLA's own cost analysis of the compiled step: no timing.

```
python benchmarks/xla_costs.py --blocks 2 --batch 4 --dtype mixed_bfloat16 --dropout 0 0.1 \
    --out benchmarks/results/xla_costs_bert_blocks_mixed_bfloat16.json
python benchmarks/xla_costs.py --blocks 2 --batch 4 --dropout 0 0.1 --wait add barrier \
    --out benchmarks/results/xla_costs_bert_blocks_mixed_bfloat16_wait.json
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

Beside XLA's totals, two counts read from the compiled program's text, where a policy's extra work
goes on the compiler that runs it: `bytes_by_kind`, what each top-level instruction reads and writes
(its operands and its result; a loop's body times its known trip count, where XLA's totals count it
once, and Keras's dropout is threefry, a loop of five), summed by the JAX op it came from (the
instructions' metadata): `random` (dropout's draws), `mask bits` (a policy's packed masks), `matmul`,
`reduction`, `layout` (copies, transposes, slices), `wait` (an instruction that only makes the recompute
wait for the gradient, NOTE [ how the recompute waits on JAX ]: a copy where XLA could not fuse it),
`elementwise` (the rest); and `matmul_flops`, the matmuls' operations, fused or not, cuBLAS's calls
included (a GPU's totals leave those out).
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


_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_NOT_MOVING = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "opt-barrier"}


def _shape_bytes(shape):
    """The bytes of an HLO shape's arrays (a tuple's summed); 8-bit float types count one byte."""
    total = 0
    for dtype, dims in _SHAPE.findall(shape):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        total += count * _ITEM_BYTES.get(dtype, 1 if dtype.startswith("f8") else 0)
    return total


_WAIT_NAME = "keras_recompute_wait"  # keras_recompute.backends.jax's name for it
_CARRYING = {"parameter", "constant", "convert", "bitcast", "broadcast", "copy", "reshape", "tuple", "get-tuple-element"}


def _kind(items):
    """The kind of an instruction, from `(opcode, line)` of it and, for a fusion, of the instructions it fuses."""
    names = " ".join(re.findall(r'op_name="([^"]*)"', " ".join(line for _, line in items)))
    opcodes = {opcode for opcode, _ in items}
    if _WAIT_NAME in names and all(_WAIT_NAME in line for opcode, line in items if opcode not in _CARRYING):
        return "wait"
    if re.search(r"_bernoulli|_uniform|threefry|random_bits|random_wrap", names) or any(o.startswith("rng") for o in opcodes):
        return "random"
    if "packbits" in names:
        return "mask bits"
    if opcodes & {"dot", "convolution"} or re.search(r"gemm|cublas", " ".join(line for _, line in items)):
        return "matmul"
    if opcodes & {"reduce", "reduce-window"}:
        return "reduction"
    if opcodes <= {"copy", "transpose", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad",
                   "bitcast", "reshape", "broadcast", "parameter", "constant", "tuple", "get-tuple-element"}:
        return "layout"
    return "elementwise"


def _instructions(hlo):
    """`{computation: [(name, shape, opcode, operand names, line)]}` of an HLO module's text."""
    computations, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if header and not line.startswith(" "):
            current = computations.setdefault(header.group(1), [])
            if line.startswith("ENTRY"):
                computations["__entry__"] = current
            continue
        found = re.match(r"^\s+(?:ROOT )?%(\S+) = ", line)
        if current is None or not found:
            continue
        rest = line[found.end():]
        if rest.startswith("("):  # a tuple shape: up to its closing parenthesis
            depth = 0
            for end, char in enumerate(rest):
                depth += {"(": 1, ")": -1}.get(char, 0)
                if depth == 0:
                    break
            shape, rest = rest[: end + 1], rest[end + 2:]
        else:
            shape, _, rest = rest.partition(" ")
        opcode, _, rest = rest.partition("(")
        depth, end = 1, 0
        for end, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        operands = re.findall(r"%([\w.\-]+)", rest[:end])
        current.append((found.group(1), shape, opcode, operands, line))
    return computations


def _dot_flops(line, shape, operands, shapes):
    """A matrix product's operations (2 a multiply-add), from its result and its left operand's contracted sizes."""
    contracting = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}|"lhs_contracting_dimensions":\[([^\]]*)\]', line)
    if not contracting or not operands:
        return 0
    dims = [int(d) for d in re.findall(r"[0-9]+", contracting.group(1) or contracting.group(2) or "")]
    left = _SHAPE.findall(shapes.get(operands[0], ""))
    result = _SHAPE.findall(shape)
    if not left or not result:
        return 0
    sizes = [int(d) for d in filter(None, left[0][1].split(","))]
    count = 2
    for dim in filter(None, result[0][1].split(",")):
        count *= int(dim)
    for dim in dims:
        count *= sizes[dim] if dim < len(sizes) else 1
    return count


def _executed(computations, into_fusions=False):
    """`(shape, opcode, operands, line, shapes, times)` for each instruction the program runs: the entry's, a loop
    body's times its known trip count, with `into_fusions` also those a fusion fuses (`shapes`: the shapes by
    name in the instruction's computation)."""

    def walk(name, times, seen):
        items = computations.get(name, [])
        shapes = {item[0]: item[1] for item in items}
        for _, shape, opcode, operands, line in items:
            yield shape, opcode, operands, line, shapes, times
            inner = re.search(r"body=%([\w.\-]+)", line) if opcode == "while" else None
            if opcode == "fusion" and into_fusions:
                inner = re.search(r"calls=%([\w.\-]+)", line)
            if inner and inner.group(1) not in seen:
                trips = re.search(r'"known_trip_count":\{"n":"([0-9]+)"', line) if opcode == "while" else None
                yield from walk(inner.group(1), times * (int(trips.group(1)) if trips else 1), seen | {inner.group(1)})

    return walk("__entry__", 1, frozenset())


def matmul_flops(hlo, computations=None):
    """The operations of a compiled program's matrix products (fused or not; a loop's each trip): a matmul the
    program runs twice counts twice."""
    return sum(
        times * _dot_flops(line, shape, operands, shapes)
        for shape, opcode, operands, line, shapes, times in _executed(computations or _instructions(hlo), True)
        if opcode == "dot" or (opcode == "custom-call" and re.search(r"gemm|matmul", line))
    )


def bytes_by_kind(hlo, computations=None):
    """What a compiled program's top-level instructions read and write, in bytes, by kind (see the module's doc)."""
    computations = computations or _instructions(hlo)
    totals = {}
    for shape, opcode, operands, line, shapes, times in _executed(computations):
        if opcode in _NOT_MOVING:
            continue
        moved = _shape_bytes(shape) + sum(_shape_bytes(shapes.get(o, "")) for o in operands)
        fused = re.search(r"calls=%([\w.\-]+)", line) if opcode == "fusion" else None
        inside = [(item[2], item[4]) for item in computations.get(fused.group(1), [])] if fused else []
        kind = _kind([(opcode, line)] + inside)
        totals[kind] = totals.get(kind, 0) + moved * times
    return totals


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="mixed_bfloat16")
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--wait", nargs="+", default=["add"], choices=("add", "barrier", "auto"),
                        help="how the recompute waits for the gradient (NOTE [ how the recompute waits on JAX ]; auto: "
                             "as the library chooses for the platform); each is compiled for every method but none")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "DROPOUT", "WAIT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def backends_arguments(args, dropout):
    return ["--backend", "jax", "--blocks", args.blocks, "--hidden", 768, "--heads", 12, "--ffn", 3072, "--seq",
            args.seq, "--batch", args.batch, "--dropout", dropout, "--dtype", args.dtype]


def child(args):
    method, dropout, wait = args.child
    os.environ["RECOMPUTE"] = "1" if method != "none" else "0"
    import jax
    import keras
    import numpy as np

    import backends
    from keras_recompute.backends import jax as jax_backend

    jax_backend._WAIT_BY = None if wait == "auto" else wait

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
    hlo = compiled.as_text()
    computations = _instructions(hlo)
    print(json.dumps({
        "flops": cost.get("flops"),
        "bytes_accessed": cost.get("bytes accessed"),
        "transcendentals": cost.get("transcendentals"),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "bytes_by_kind": bytes_by_kind(hlo, computations),
        "matmul_flops": matmul_flops(hlo, computations),
        "platform": jax.devices()[0].platform,
    }))


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    print(f"XLA's costs of a training step: {args.blocks} BERT-base blocks, seq {args.seq}, batch {args.batch}, "
          f"{args.dtype}, Adam")
    print(f"{'dropout':>7} {'method':<22} {'GFLOP':>8} {'vs none':>8} {'GB moved':>9} {'vs none':>8} {'temp MB':>8}")
    rows = []
    for dropout in args.dropout:
        base = None
        for method, wait in [(m, w) for w in args.wait for m in args.methods if m != "none" or w == args.wait[0]]:
            arguments = ["--blocks", args.blocks, "--seq", args.seq, "--batch", args.batch, "--dtype", args.dtype]
            record = _measure.run(os.path.abspath(__file__), arguments + ["--child", method, dropout, wait], "jax")
            record.update(method=method, dropout=dropout, wait=wait)
            rows.append(record)
            label = method if len(args.wait) == 1 or method == "none" else f"{method}, {wait}"
            if "error" in record:
                print(f"{dropout:>7} {label:<22} failed: {record['error']}")
                continue
            base = record if method == "none" else base
            flops = f"{record['flops'] / base['flops']:.3f}x" if base else ""
            moved = f"{record['bytes_accessed'] / base['bytes_accessed']:.3f}x" if base else ""
            print(f"{dropout:>7} {label:<22} {record['flops'] / 1e9:>8.1f} {flops:>8} "
                  f"{record['bytes_accessed'] / 1e9:>9.2f} {moved:>8} {record['temp_bytes'] / 2**20:>8.0f}", flush=True)
            kinds = sorted(record.get("bytes_by_kind", {}).items(), key=lambda item: -item[1])
            print(" " * 31 + f"matmuls {record.get('matmul_flops', 0) / 1e9:.1f} GFLOP; GB by kind: "
                  + ", ".join(f"{kind} {moved / 1e9:.2f}" for kind, moved in kinds), flush=True)
            _measure.write_json(args.out, vars(args), {"rows": rows})  # each row as it comes: a box may run out


if __name__ == "__main__":
    main()
