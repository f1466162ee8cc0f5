"""`recompute_model` on models one did not write: peak memory and step time, ratios from one run.

Cases:
    gemma     keras-hub's `GemmaBackbone` (decoder blocks of its own class, which no
              integration knows) with a classifier on its mean output, trained with
              `train_on_batch`: none, each block's `call` patched by hand with
              `recompute_grad`, and `recompute_model(backbone)`.
    segments  a functional chain of Dense(gelu) layers, `recompute_model(model,
              segments="sqrt")`, at growing depths: how the peak grows with depth
              (Chen et al. 2016: with the square root).

Each configuration runs in a fresh process (see benchmarks/_measure.py for how
memory is read on each backend; on JAX also XLA's buffer assignment for the
compiled step); step time is the fastest of `--steps` steps after a warm-up
step.

Usage:
    python benchmarks/models.py gemma --backend tensorflow    # also jax, torch
    python benchmarks/models.py segments                      # TensorFlow (BFC allocator)
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

GEMMA_METHODS = ("none", "by hand", "recompute_model")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", choices=("gemma", "segments"))
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"), default="tensorflow")
    parser.add_argument("--layers", type=int, default=6, help="gemma: decoder blocks")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--depths", type=int, nargs="+", default=[64, 128, 256], help="segments: chain depths")
    parser.add_argument("--rows", type=int, default=4096, help="segments: batch rows")
    parser.add_argument("--width", type=int, default=64, help="segments: Dense width")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", help="also write the results as JSON to this file")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "SIZE"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(args):
    method, size = args.child[0], int(args.child[1])
    os.environ["RECOMPUTE"] = "0" if method == "none" else "1"
    import keras
    import numpy as np

    from keras_recompute import recompute_grad, recompute_model

    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    if args.case == "gemma":
        import keras_hub

        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=1000,
            num_layers=args.layers,
            num_query_heads=4,
            num_key_value_heads=1,
            hidden_dim=args.hidden,
            intermediate_dim=4 * args.hidden,
            head_dim=args.hidden // 4,
            dropout=0.1,
        )
        if method == "by hand":
            for block in backbone.transformer_layers:
                block.call = recompute_grad(block.call)
        elif method == "recompute_model":
            recompute_model(backbone)
        pooled = keras.layers.GlobalAveragePooling1D()(backbone.output)
        model = keras.Model(backbone.input, keras.layers.Dense(2)(pooled))
        inputs = {"token_ids": rng.randint(1, 1000, size=(size, args.seq)), "padding_mask": np.ones((size, args.seq), "int32")}
        labels = rng.randint(0, 2, size=(size,))
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        optimizer = keras.optimizers.Adam(1e-4)
    else:
        depth = size
        inputs_layer = keras.Input((args.width,))
        hidden = inputs_layer
        for _ in range(depth):
            hidden = keras.layers.Dense(args.width, activation="gelu")(hidden)
        model = keras.Model(inputs_layer, keras.layers.Dense(1)(hidden))
        if method == "sqrt":
            recompute_model(model, segments="sqrt")
        inputs = rng.normal(size=(args.rows, args.width)).astype("float32")
        labels = np.zeros((args.rows, 1), "float32")
        loss, optimizer = "mse", keras.optimizers.SGD(1e-4)
    model.compile(optimizer=optimizer, loss=loss)
    model.train_on_batch(inputs, labels)  # builds and compiles
    _measure.reset_peak(args.backend)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        value = float(np.asarray(model.train_on_batch(inputs, labels)))
        times.append(time.perf_counter() - start)
    record = {"peak": _measure.peak(args.backend), "rss": _measure.rss_peak(), "step": min(times) if times else None, "loss": value}
    if args.backend == "jax":
        record["xla_temp"] = _measure.xla_temp_bytes(model, inputs, labels)
    print(json.dumps(record))


def child_arguments(args, method, size, rows=None):
    """A child's command line; `rows` overrides the segments case's rows (its RSS baseline: 1)."""
    arguments = [args.case, "--backend", args.backend, "--child", method, size]
    for name in ("layers", "hidden", "seq", "batch", "width", "steps"):
        arguments += [f"--{name}", getattr(args, name)]
    return arguments + ["--rows", args.rows if rows is None else rows]


def run_gemma(args):
    script = os.path.abspath(__file__)
    print(
        f"keras-hub GemmaBackbone on {args.backend}: {args.layers} blocks x hidden {args.hidden}, seq {args.seq}, "
        f"batch {args.batch}, dropout 0.1, Adam; fastest of {args.steps} steps"
    )
    xla = args.backend == "jax"
    xla_header = f" {'XLA temp MB':>12} {'vs none':>8}" if xla else ""
    print(f"{'method':<16} {'peak MB':>9} {'vs none':>8}{xla_header} {'step s':>8} {'vs none':>8}  loss")
    results = {}
    for method in GEMMA_METHODS:
        record = _measure.measured(script, child_arguments(args, method, args.batch), args.backend, child_arguments(args, method, 1))
        results[method] = record
        if "error" in record:
            print(f"{method:<16} failed: {record['error']}")
            continue
        base = results["none"]
        xla_columns = f" {record['xla_temp'] / 2**20:>12.1f} {base['xla_temp'] / record['xla_temp']:>7.2f}x" if xla else ""
        print(
            f"{method:<16} {record['peak'] / 2**20:>9.1f} {base['peak'] / record['peak']:>7.2f}x{xla_columns} "
            f"{record['step']:>8.3f} {record['step'] / base['step']:>7.2f}x  {record['loss']:.4f}"
        )
    if "error" not in results["by hand"] and "error" not in results["recompute_model"]:
        ratio = results["recompute_model"]["step"] / results["by hand"]["step"]
        print(f"recompute_model's step time against the same blocks patched by hand: {ratio:.2f}x")
    return results


def run_segments(args):
    script = os.path.abspath(__file__)
    print(
        f"functional chain of Dense({args.width}, gelu), {args.rows} rows, SGD, on {args.backend}: "
        f"peak by depth, none and segments='sqrt'"
    )
    print(f"{'depth':>6} {'none MB':>9} {'sqrt MB':>9} {'ratio':>7}")
    results = {}
    for depth in args.depths:
        results[depth] = {}
        for method in ("none", "sqrt"):
            results[depth][method] = _measure.measured(
                script, child_arguments(args, method, depth), args.backend, child_arguments(args, method, depth, rows=1)
            )
        none, sqrt = results[depth]["none"], results[depth]["sqrt"]
        print(f"{depth:>6} {none['peak'] / 2**20:>9.0f} {sqrt['peak'] / 2**20:>9.0f} {none['peak'] / sqrt['peak']:>6.1f}x")
    first, last = args.depths[0], args.depths[-1]
    for method in ("none", "sqrt"):
        growth = results[last][method]["peak"] / results[first][method]["peak"]
        exponent = math.log(growth) / math.log(last / first)
        print(f"{method}: the peak grows {growth:.2f}x from {first} to {last} layers: depth^{exponent:.2f}")
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    results = run_gemma(args) if args.case == "gemma" else run_segments(args)
    _measure.write_json(args.out, vars(args), {**results, "case": args.case})


if __name__ == "__main__":
    main()
