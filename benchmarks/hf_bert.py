"""The peer figure: Hugging Face `transformers` BERT with and without `gradient_checkpointing_enable()`.

The same shape as `backends.py --bert-base` (12 blocks x 768, 12 heads, FFN
3072, dropout 0.1, vocabulary 30522, a two-class head on the first token),
built from `BertConfig` with random weights (nothing is downloaded), trained
with Adam (lr 1e-4) in plain PyTorch, one fresh process per configuration:

    none         the plain model
    checkpoint   `model.gradient_checkpointing_enable()` (torch's checkpoint per layer,
                 non-reentrant)

`mixed_bfloat16` is `torch.autocast(dtype=torch.bfloat16)` around the forward,
weights in float32: what Keras's `mixed_bfloat16` policy computes. Memory is
the device allocator's peak over the timed steps (`torch.cuda.max_memory_allocated`;
none on a CPU), time the fastest of `--steps` steps after two warm-up steps.

Usage:
    python benchmarks/hf_bert.py --seq 512 --batch 32                       # float32
    python benchmarks/hf_bert.py --seq 512 --batch 32 --dtype mixed_bfloat16 --out benchmarks/results/gpu_..._hf_bert.json
    python benchmarks/hf_bert.py --blocks 2 --hidden 64 --heads 2 --ffn 128 --seq 32 --batch 2   # a CPU check
"""

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

METHODS = ("none", "checkpoint")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=3072)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--dtype", choices=("float32", "mixed_bfloat16"), default="float32")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--out", help="also write the results as JSON to this file")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(args):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = BertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.blocks,
        num_attention_heads=args.heads, intermediate_size=args.ffn, max_position_embeddings=max(512, args.seq),
        hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout, num_labels=2,
    )
    model = BertForSequenceClassification(config).to(device).train()
    if args.child == "checkpoint":
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)
    labels = torch.randint(0, 2, (args.batch,), generator=generator).to(device)
    autocast = (
        torch.autocast(device_type=device, dtype=torch.bfloat16) if args.dtype == "mixed_bfloat16" else contextlib.nullcontext()
    )

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        return float(loss)

    times = []
    for index in range(args.steps + 2):
        if index == 2:
            _measure.reset_peak("torch")
        start = time.perf_counter()
        loss = step()  # float(loss) waits for the device
        if index >= 2:
            times.append(time.perf_counter() - start)
    print(json.dumps({"peak": _measure.peak("torch"), "step": min(times) if times else None, "loss": loss}))


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    import transformers

    script = os.path.abspath(__file__)
    sizes = []
    for name in ("blocks", "hidden", "heads", "ffn", "seq", "batch", "vocab", "dropout", "dtype", "steps"):
        sizes += [f"--{name}", str(getattr(args, name))]
    print(
        f"Hugging Face transformers {transformers.__version__} BERT: {args.blocks} blocks x hidden {args.hidden}, "
        f"seq {args.seq}, batch {args.batch}, dropout {args.dropout}, Adam, {args.dtype}"
    )
    rows = []
    for method in args.methods:
        record = _measure.run(script, ["--child", method, *sizes], "torch")
        rows.append(dict(method=method, **record))
        if "error" in record:
            print(f"{method:<11} failed: {record['error']}", flush=True)
            continue
        base = rows[0] if rows[0]["method"] == "none" and "error" not in rows[0] else None
        peak = f"{record['peak'] / 2**20:.0f} MiB" if record["peak"] is not None else "no allocator"
        ratios = ""
        if base and method != "none":
            record["time_vs_none"] = record["step"] / base["step"]
            ratios = f"  time {record['time_vs_none']:.2f}x"
            if record["peak"] and base["peak"]:
                record["memory_vs_none"] = base["peak"] / record["peak"]
                ratios += f", memory {record['memory_vs_none']:.2f}x lower"
        print(f"{method:<11} peak {peak}, step {record['step']:.3f} s, loss {record['loss']:.4f}{ratios}", flush=True)
    _measure.write_json(args.out, vars(args), {"transformers": transformers.__version__, "rows": rows})


if __name__ == "__main__":
    main()
