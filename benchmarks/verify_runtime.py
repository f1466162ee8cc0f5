"""What `keras_recompute.verify` takes on a BERT-base-sized model, and what it reports.

A keras-hub `BertBackbone` of BERT-base's shape (12 layers of 768, 12 heads,
FFN 3072; built from a config, nothing downloaded) with a classifier head,
compiled with Adam, verified at a batch of `--batch` x `--seq` with the
default trials (20 recomputed steps, 3 plain). Prints the report and the
wall time of the whole call, split into the steps and `memory_report`'s
prediction (measured separately: `memory=False`, then `memory=True`).

Usage:
    KERAS_BACKEND=torch python benchmarks/verify_runtime.py --out benchmarks/results/verify_runtime_torch_cpu.json
"""

import argparse
import json
import os
import platform
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=3072)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--policy", default="full")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import keras
    import keras_hub
    import numpy as np

    import keras_recompute

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=30522, num_layers=args.layers, num_heads=args.heads, hidden_dim=args.hidden,
        intermediate_dim=args.ffn, max_sequence_length=512, dropout=0.1,
    )
    names = ("token_ids", "segment_ids", "padding_mask")
    inputs = {name: keras.Input((args.seq,), dtype="int32", name=name) for name in names}
    model = keras.Model(inputs, keras.layers.Dense(2)(backbone(inputs)["pooled_output"]))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    batch = {
        "token_ids": rng.randint(1, 30522, size=(args.batch, args.seq)).astype("int32"),
        "segment_ids": np.zeros((args.batch, args.seq), "int32"),
        "padding_mask": np.ones((args.batch, args.seq), "int32"),
    }
    labels = rng.randint(0, 2, size=(args.batch,))

    started = time.perf_counter()
    report = keras_recompute.verify(model, batch, labels, policy=args.policy, trials=args.trials, memory=False)
    steps_seconds = time.perf_counter() - started
    started = time.perf_counter()
    keras_recompute.memory_report(model, batch)
    memory_seconds = time.perf_counter() - started
    print(report)
    print(f"verify took {steps_seconds:.0f} s (memory=False); memory=True adds memory_report's {memory_seconds:.0f} s")
    result = {
        "benchmark": "verify_runtime",
        "backend": keras.config.backend(),
        "device": "cpu",
        "dtype": "float32",
        "command": "KERAS_BACKEND=" + keras.config.backend() + " python " + " ".join(sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "arguments": vars(args),
        "ok": report.ok,
        "units": len(report.units),
        "verify_seconds_memory_false": round(steps_seconds, 1),
        "memory_report_seconds": round(memory_seconds, 1),
        "plain_step_seconds": round(report.plain_seconds, 3),
        "recomputed_step_seconds": round(report.recomputed_seconds, 3),
    }
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
