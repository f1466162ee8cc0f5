"""Peak memory and step time of a bert4keras BERT: no recompute, bert4keras's own, ours.

bert4keras 0.11.5 on TensorFlow 2.21 with tf_keras (`TF_KERAS=1`,
`TF_USE_LEGACY_KERAS=1`), a BERT-base shape by default (12 x 768, 12 heads,
FFN 3072, vocabulary 30522) with a classification head on `[CLS]`, dropout
0.1, Adam, trained with `train_on_batch`. Each configuration runs in a fresh
process with TensorFlow's BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC=1`); the
peak is `tf.config.experimental.get_memory_info("CPU:0")["peak"]` over the
timed steps (in a TF1 graph, the Session's allocator, the same one).

Methods:
    none     bert4keras as is, RECOMPUTE unset
    theirs   bert4keras's own recompute (RECOMPUTE=1 before importing it; it
             needs two TF functions put back where TF 2.21 moved them)
    ours     keras_recompute.integrations.bert4keras.enable(), RECOMPUTE=1: per layer
    model    keras_recompute.recompute_model(model), RECOMPUTE=1: each
             transformer block as one unit
    nested   both: each block one unit, and inside its recompute each
             attention and feed-forward layer recomputed again in its backward

Modes: function (TF2, `train_on_batch` compiles a `tf.function`); graph (a
TF1-style graph: `tf.compat.v1.disable_eager_execution()`).

`--per-sample B1 B2` also measures activation memory per sample: the growth
of the peak from batch B1 to batch B2, over B2 - B1 (weights and optimizer
state do not grow with the batch); take batches large enough that activations,
not the optimizer's update, set both peaks. `--budget-mb M` also finds, by doubling
and bisection, the largest batch whose peak fits M MB, and its time per
sample (one child process per probe; slow at BERT-base size on a CPU).

Usage:
    python benchmarks/bert4keras_bert.py                    # seq 128, batch 8: a few minutes
    python benchmarks/bert4keras_bert.py --seq 64 --layers 4
    python benchmarks/bert4keras_bert.py --modes function --methods none ours model --per-sample 8 40 --budget-mb 2500
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

METHODS = ("none", "theirs", "ours", "model", "nested")
MODES = ("function", "graph")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    parser.add_argument("--methods", nargs="+", default=list(METHODS[:4]), choices=METHODS, help="default: all but nested")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--per-sample", type=int, nargs=2, metavar=("B1", "B2"), help="activation memory per sample")
    parser.add_argument("--budget-mb", type=float, help="also find the largest batch that fits")
    parser.add_argument("--policy", default="full", help="model: recompute_model's policy")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--plan-budget-mb", type=float, help=argparse.SUPPRESS)  # method budget (max_batch.py)
    return parser.parse_args(argv)


def build_classifier(args, recompute_policy=None):
    """bert4keras's BERT of `args`' shape with a classifier on [CLS], compiled with legacy Adam (tf_keras).

    Needs `TF_KERAS=1` and `TF_USE_LEGACY_KERAS=1` set before bert4keras is imported.
    `recompute_policy`: `recompute_model(model, policy=...)` before compiling.
    """
    import tf_keras
    from bert4keras.models import build_transformer_model

    tf_keras.utils.set_random_seed(0)
    bert = build_transformer_model(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=512,
    )
    cls = tf_keras.layers.Lambda(lambda x: x[:, 0])(bert.output)
    model = tf_keras.Model(bert.inputs, tf_keras.layers.Dense(2)(cls))
    if recompute_policy:
        from keras_recompute import recompute_model

        recompute_model(model, policy=recompute_policy)
    model.compile(
        optimizer=tf_keras.optimizers.legacy.Adam(1e-5),
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def child(args):
    method, mode = args.child
    os.environ.update(TF_KERAS="1", TF_USE_LEGACY_KERAS="1", TF_CPU_ALLOCATOR_USE_BFC="1", TF_CPP_MIN_LOG_LEVEL="3")
    os.environ["RECOMPUTE"] = "1" if method == "theirs" else "0"  # bert4keras reads it at its import
    import numpy as np
    import tensorflow as tf

    if mode == "graph":
        tf.compat.v1.disable_eager_execution()
    if method == "theirs":
        from tensorflow.python.eager import record, tape

        for name in ("stop_recording", "record_operation"):
            if not hasattr(tape, name):
                setattr(tape, name, getattr(record, name))
    import bert4keras.models  # noqa: F401  (after the patch above)

    if method in ("ours", "nested"):
        from keras_recompute.integrations import bert4keras as recompute_bert4keras

        recompute_bert4keras.enable()
    os.environ["RECOMPUTE"] = "0" if method == "none" else "1"  # bert4keras read it at its import

    model = build_classifier(args, recompute_policy=args.policy if method in ("model", "nested") else None)
    rng = np.random.RandomState(0)
    token_ids = rng.randint(1, args.vocab, size=(args.batch, args.seq)).astype("int32")
    segment_ids = np.zeros((args.batch, args.seq), "int32")
    labels = rng.randint(0, 2, size=(args.batch,)).astype("int32")
    plan = None
    if method == "budget":  # max_batch.py: the plan for its budget at this batch (blocks are graph pieces)
        from keras_recompute import recompute_model

        try:
            recompute_model(model, budget=int(args.plan_budget_mb * 2**20), inputs=[token_ids, segment_ids])
        except ValueError as error:  # below the least peak any plan reaches: does not fit
            print(json.dumps({"error": str(error)[:160]}))
            return
        plan = _measure.planned_policies(model, [token_ids, segment_ids])
    model.train_on_batch([token_ids, segment_ids], labels)  # builds and compiles
    tf.config.experimental.reset_memory_stats("CPU:0")
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = float(np.asarray(model.train_on_batch([token_ids, segment_ids], labels)))
        times.append(time.perf_counter() - start)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    print(json.dumps({"peak": peak, "step": min(times), "loss": loss, "plan": plan}))


def run_child(args, method, mode, extra_env=None):
    arguments = ["--child", method, mode]
    for name in ("layers", "hidden", "heads", "intermediate", "vocab", "seq", "batch", "steps", "policy"):
        arguments += [f"--{name}", getattr(args, name)]
    if getattr(args, "plan_budget_mb", None):
        arguments += ["--plan-budget-mb", args.plan_budget_mb]
    return _measure.run(os.path.abspath(__file__), arguments, "tensorflow", extra_env=extra_env, label=f"{method} ({mode}), batch {args.batch}")


def per_sample(args, method, mode):
    """Activation memory per sample in bytes, from the peaks at two batch sizes."""
    small, large = args.per_sample
    records = [run_child(argparse.Namespace(**{**vars(args), "batch": batch, "steps": 1}), method, mode) for batch in (small, large)]
    if any("error" in record for record in records):
        return None
    return (records[1]["peak"] - records[0]["peak"]) / (large - small)


def largest_batch(args, method, mode):
    """The largest batch whose peak fits `--budget-mb`, and the record of its run."""
    budget = args.budget_mb * 2**20
    records = {}

    def fits(batch):
        records[batch] = run_child(argparse.Namespace(**{**vars(args), "batch": batch, "steps": 2}), method, mode)
        return "error" not in records[batch] and records[batch]["peak"] <= budget

    batch = _measure.largest_batch(fits, limit=4096)
    return batch, records.get(batch)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    results = {"table": [], "per_sample": {}, "largest_batch": {}}
    print(
        f"bert4keras BERT: {args.layers} x {args.hidden}, {args.heads} heads, FFN {args.intermediate}, "
        f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}, dropout 0.1, Adam; fastest of {args.steps} steps"
    )
    print(f"{'mode':<9} {'method':<7} {'peak MB':>8} {'vs none':>8} {'step s':>7} {'vs none':>8}  loss")
    for mode in args.modes:
        base = None
        for method in args.methods:
            record = run_child(args, method, mode)
            if "error" in record:
                print(f"{mode:<9} {method:<7} failed: {record['error']}")
                continue
            if method == "none":
                base = record
            ratios = ("", "")
            if base is not None:
                ratios = (f"{base['peak'] / record['peak']:.2f}x", f"{record['step'] / base['step']:.2f}x")
            print(
                f"{mode:<9} {method:<7} {record['peak'] / 2**20:>8.0f} {ratios[0]:>8} {record['step']:>7.2f} "
                f"{ratios[1]:>8}  {record['loss']:.4f}"
            )
            results["table"].append({"mode": mode, "method": method, **record})
    if args.per_sample:
        mode = args.modes[0]
        print(f"activation memory per sample ({mode}, from batch {args.per_sample[0]} to {args.per_sample[1]}):")
        for method in args.methods:
            value = per_sample(args, method, mode)
            results["per_sample"][method] = value
            base = results["per_sample"].get("none")
            ratio = f"  {base / value:.2f}x lower than none" if base and value else ""
            print(f"  {method:<7} {value / 2**20:8.1f} MB" + ratio if value else f"  {method:<7} failed")
    if args.budget_mb:
        mode = args.modes[0]
        print(f"largest batch within {args.budget_mb:.0f} MB ({mode}), and time per sample there:")
        for method in args.methods:
            batch, record = largest_batch(args, method, mode)
            per = record["step"] / batch if record and batch else float("nan")
            results["largest_batch"][method] = {"batch": batch, "seconds_per_sample": per}
            base = results["largest_batch"].get("none", {})
            ratio = f"  {batch / base['batch']:.2f}x the batch, {per / base['seconds_per_sample']:.2f}x the time per sample" if base.get("batch") else ""
            print(f"  {method:<7} batch {batch:>5}  {per:.3f} s/sample" + ratio)
    _measure.write_json(args.out, vars(args), results)


if __name__ == "__main__":
    main()
