"""`largest_fit`: the largest batch or sequence length predicted to fit a budget, then a step run there and one size above.

Models:
    keras-hub-bert   keras-hub `BertBackbone` BERT-base (12 x 768, seq 128,
                     dropout 0.1) with a classifier on the pooled output, Adam,
                     as `max_batch.py` builds it: the batch
    bert4keras       bert4keras BERT-base (12 x 768, seq 128, dropout 0.1),
                     legacy Adam, tf_keras, as `max_batch.py` builds it: the
                     batch, beside its bisected figures (TensorFlow only)
    gemma-lora       a small keras-hub `GemmaCausalLM` (4 blocks of 256, 4
                     heads, vocabulary 4096) with LoRA (rank 8) on, Adam,
                     trained on next tokens: the sequence length
`--size base` or `small` (4 blocks of 256) picks the BERTs' size.

For each option (none, `full`, `save_dots`, `attention_core` where it
applies, and `recompute_model(budget=...)`'s plan), a child process predicts
the largest size with `largest_fit` (from `--sizes`, three batches or four
sequence lengths); `--verify` then runs, each in a child of its own, one
training step at the predicted size and one at the next, and measures its
peak as the backend keeps it on a CPU (TensorFlow: the BFC allocator; JAX:
resident bytes plus XLA's buffers for the compiled step; PyTorch: the
profiler's allocation records; on a GPU, the device allocator). On
TensorFlow the step at the answer runs once more with the allocator limited
to the budget (`TF_CPU_BFC_MEM_LIMIT_IN_MB`), as on a device and as
`max_batch.py` bisects: its executor orders a graph's ops differently from
run to run, so the peak of an unlimited step moved by 12% of the
activations' room, while a limited allocator waits for frees before it
fails. There `fits_budget` is that run's: it ran, within the budget.

NOTE [ the bisected figure ]
`--bisect` finds, by runs, what the answer is checked against: per option
the largest size (in `--multiple-of` steps, galloping from the answer, then
halving) whose step fits the budget, run in this script's own child (the
same model, inputs and two steps as the answer's check). On TensorFlow a size
fits when each of `--repeats` runs of it (3) peaks within the budget: which
block of the allocator a tensor meets moves from process to process (NOTE
[ the allocator's blocks ] in keras_recompute/_fit.py), so one run at the
edge is a sample. That is the measure the answer predicts (`bisected`); the
figure a device would run (`bisected_limited`: the runs made with the
allocator limited to the budget, each one running) is larger: limited, the
executor waits for frees instead of running ops side by side, and keras-hub
Gemma under `full` ran at 1792 in 256 MiB where an unlimited run of the
same step peaked at 293-298 MiB. On JAX (XLA's figure for the compiled step)
and PyTorch (the profiler's records) the measure is the same in every
process: one run, its peak within the budget. The plan is not bisected: no
plan holds less than `full` on every block, so `full`'s figure bounds it.

Usage:
    python benchmarks/largest_fit.py keras-hub-bert --backend tensorflow --budget-mb 3000 --verify --out benchmarks/results/largest_fit_keras_hub_bert_tensorflow.json
    python benchmarks/largest_fit.py bert4keras --budget-mb 2500 --verify
    python benchmarks/largest_fit.py gemma-lora --backend jax --budget-mb 1500 --verify
    python benchmarks/largest_fit.py gemma-lora --backend torch --budget-mb 256 --multiple-of 64 --verify --bisect
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

MODELS = ("keras-hub-bert", "bert4keras", "gemma-lora")
AXIS = {"keras-hub-bert": "batch", "bert4keras": "batch", "gemma-lora": "sequence"}
SIZES = {"batch": [2, 4, 8], "sequence": [64, 128, 192, 256]}
OPTIONS = ("none", "full", "save_dots", "attention_core")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"), default="tensorflow")
    parser.add_argument("--size", choices=("base", "small"), default="base")
    parser.add_argument("--budget-mb", type=float, required=True, help="the budget, MiB")
    parser.add_argument("--sizes", type=int, nargs="+", help="sizes to measure at (default: batch 2 4 8; sequence 64 128 192 256)")
    parser.add_argument("--seq", type=int, default=128, help="the BERTs' sequence length")
    parser.add_argument("--batch", type=int, default=1, help="gemma-lora's batch")
    parser.add_argument("--options", nargs="+", default=list(OPTIONS) + ["plan"])
    parser.add_argument("--headroom", type=float, help="largest_fit's headroom (default: largest_fit's, 0.1)")
    parser.add_argument("--multiple-of", type=int, default=1, help="answer in multiples of this")
    parser.add_argument("--verify", action="store_true", help="run a step at each predicted size and the next")
    parser.add_argument("--bisect", action="store_true",
                        help="also find by runs the largest size whose step fits the budget (the figure to check the answer against)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="with --bisect on TensorFlow: a size fits when this many runs of it all do")
    parser.add_argument("--bisect-from", help="with --bisect: an earlier --out of the same model, backend, budget and step; its probes are not run again")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    parser.add_argument("--child", choices=("predict", "step"), help=argparse.SUPPRESS)
    parser.add_argument("--option", help=argparse.SUPPRESS)
    parser.add_argument("--at", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--usable", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build(args):
    """The model (compiled), `make(size) -> (inputs, labels)`."""
    import numpy as np

    if args.model == "bert4keras":
        os.environ["TF_KERAS"] = "1"
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
        import bert4keras_bert

        config = bert4keras_bert.parse_args([])
        if args.size == "small":
            vars(config).update(layers=4, hidden=256, heads=4, intermediate=1024)
        config.seq = args.seq
        model = bert4keras_bert.build_classifier(config)

        def make(size):
            rng = np.random.RandomState(size)
            tokens = rng.randint(1, config.vocab, size=(size, args.seq)).astype("int32")
            return [tokens, np.zeros_like(tokens)], rng.randint(0, 2, size=(size,)).astype("int32")

        return model, make
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    if args.model == "keras-hub-bert":
        base = args.size == "base"
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=30522, num_layers=12 if base else 4, num_heads=12 if base else 4,
            hidden_dim=768 if base else 256, intermediate_dim=3072 if base else 1024, dropout=0.1,
            max_sequence_length=max(512, args.seq),
        )
        model = keras.Model(backbone.input, keras.layers.Dense(2)(backbone.output["pooled_output"]))
        model.compile(optimizer=keras.optimizers.Adam(1e-5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

        def make(size):
            rng = np.random.RandomState(size)
            tokens = rng.randint(1, 30522, size=(size, args.seq)).astype("int32")
            inputs = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens), "padding_mask": np.ones_like(tokens)}
            return inputs, rng.randint(0, 2, size=(size,)).astype("int32")

        return model, make
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=4096, num_layers=4, num_query_heads=4, num_key_value_heads=1, hidden_dim=256,
        intermediate_dim=1024, head_dim=64,
    )
    backbone.enable_lora(8)
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def make(size):
        rng = np.random.RandomState(size)
        tokens = rng.randint(1, 4096, size=(args.batch, size)).astype("int32")
        return {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}, np.roll(tokens, -1, axis=1)

    return model, make


def child_predict(args):
    from keras_recompute import largest_fit

    model, make = build(args)
    options = [o for o in args.options if o != "plan"]
    started = time.perf_counter()
    report = largest_fit(model, int(args.budget_mb * 2**20), lambda size: make(size)[0], axis=AXIS[args.model],
                         sizes=args.sizes or SIZES[AXIS[args.model]], options=options, plan="plan" in args.options,
                         headroom=args.headroom, multiple_of=args.multiple_of)
    seconds = time.perf_counter() - started
    print(json.dumps({"rows": report.rows, "seconds": seconds, "execution": report.execution, "text": str(report),
                      "fixed": report.fixed, "usable": report.usable, "headroom": report.headroom, "sizes": report.sizes}))


def child_step(args):
    """One option at one size: two training steps; the second's peak as this backend keeps it."""
    import keras_recompute

    model, make = build(args)
    inputs, labels = make(args.at)
    if args.option == "plan":  # what a user does with the answer: plan at that size, for the same usable budget
        keras_recompute.recompute_model(model, budget=args.usable, inputs=inputs, enabled=True)
    elif args.option != "none":
        keras_recompute.recompute_model(model, policy=args.option, enabled=True)
    backend = "tensorflow" if args.model == "bert4keras" else args.backend
    model.train_on_batch(inputs, labels)
    _measure.reset_peak(backend)
    model.train_on_batch(inputs, labels)
    record = {"peak": _measure.peak(backend)}
    if record["peak"] is None and backend == "jax":
        from keras_recompute import _memory

        resident = _memory._variable_bytes(model.variables) + _memory._optimizer_bytes(model) + _memory._tensor_bytes(inputs)
        record["peak"] = resident + _measure.xla_temp_bytes(model, inputs, labels)
        record["peak_kind"] = "resident + XLA temporaries of the compiled step"
    elif record["peak"] is None:
        live = [v.value for v in model.variables + model.optimizer.variables]  # the gradients: in the records
        record["peak"] = _measure.torch_cpu_peak(lambda: model.train_on_batch(inputs, labels), live)
        record["peak_kind"] = "PyTorch profiler's allocation records"
    else:
        record["peak_kind"] = "allocator peak"
    print(json.dumps(record))


def _earlier_probes(args, backend):
    """`{(kind, option): {size: runs}}` from `--bisect-from`'s JSON, checked to be of the same model, backend and budget."""
    if not args.bisect_from:
        return {}
    with open(args.bisect_from) as file:
        earlier = json.load(file)
    same = ("model", "size", "seq", "batch", "budget_mb", "repeats")
    different = [key for key in same if earlier["arguments"].get(key) != vars(args).get(key)]
    if different or earlier["arguments"].get("backend") != backend:
        raise SystemExit(f"--bisect-from {args.bisect_from}: not the same runs ({', '.join(different) or 'backend'} differ)")
    return {
        (kind, record["option"]): {int(size): runs for size, runs in record[kind]["probes"].items()}
        for record in earlier["results"] for kind in ("bisected", "bisected_limited") if "probes" in record.get(kind, {})
    }


def bisect(fits, start, step):
    """The largest multiple of `step` for which `fits(size)` holds, searched from `start` (0 when none does).

    Gallops away from `start` (one step, two, four, ...) until the answer is
    bracketed, then halves: each size is probed once, a predicted answer within
    a few steps of the truth costs a few probes.
    """
    known = {}

    def probe(size):
        if size not in known:
            known[size] = size > 0 and fits(size)
        return known[size]

    if probe(start):
        low, width = start, step
        while probe(low + width):
            low, width = low + width, width * 2
        high = low + width
    else:
        high, width = start, step
        while high - width > 0 and not probe(high - width):
            high, width = high - width, width * 2
        low = max(high - width, 0)
    while high - low > step:  # low fits (or is 0), high does not
        middle = low + (high - low) // (2 * step) * step
        low, high = (middle, high) if probe(middle) else (low, middle)
    return low


def _child_arguments(args):
    arguments = [args.model, "--backend", args.backend, "--size", args.size, "--budget-mb", args.budget_mb,
                 "--seq", args.seq, "--batch", args.batch, "--multiple-of", args.multiple_of, "--options", *args.options]
    if args.headroom is not None:
        arguments += ["--headroom", args.headroom]
    if args.sizes:
        arguments += ["--sizes", *args.sizes]
    return arguments


def main(argv=None):
    args = parse_args(argv)
    if args.child == "predict":
        return child_predict(args)
    if args.child == "step":
        return child_step(args)
    backend = "tensorflow" if args.model == "bert4keras" else args.backend
    script = os.path.abspath(__file__)
    base = _child_arguments(args)
    predicted = _measure.run(script, base + ["--child", "predict"], backend, label="predicting")
    if "error" in predicted:
        raise SystemExit(f"largest_fit failed: {predicted['error']}")
    print(predicted["text"])
    budget, usable = args.budget_mb * 2**20, predicted["usable"]
    results = []

    def step(option, size, extra_env=None, where="", spare=0):  # one training step in a child of its own
        # The plan as the fit made it: for the usable budget, less the largest tensor it counts (TensorFlow).
        arguments = base + ["--child", "step", "--option", option, "--at", size, "--usable", int(usable - spare)]
        return _measure.run(script, arguments, backend, extra_env=extra_env, label=f"{option} at {size}{where}")

    for row in predicted["rows"]:
        keys = ("option", "largest", "predicted_peak", "next_peak", "residual", "policies", "note", "largest_tensor",
                "fitted_largest")
        record = {key: row.get(key) for key in keys}
        spare = row.get("largest_tensor") or 0
        if args.verify and row.get("largest"):
            for key, size in (("at_largest", row["largest"]), ("at_next", row["largest"] + args.multiple_of)):
                record[key] = step(row["option"], size, spare=spare)
            fitted = record["at_largest"]
            if "error" not in fitted:
                record["measured_over_predicted"] = fitted["peak"] / row["predicted_peak"]
                record["fits_budget"] = fitted["peak"] <= budget
            if backend == "tensorflow":  # as on a device: the allocator limited to the budget (what max_batch.py bisects)
                limited = step(row["option"], row["largest"], {"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(int(args.budget_mb))},
                               f" in {args.budget_mb:.0f} MiB", spare)
                record["in_budget"] = limited
                record["fits_budget"] = "error" not in limited and limited["peak"] <= budget
            following = record["at_next"]
            if "error" not in following:
                record["next_fits_usable"] = following["peak"] <= usable
        results.append(record)
    if args.bisect:  # NOTE [ the bisected figure ]
        limited = {"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(int(args.budget_mb))}
        kinds = [("bisected", None), ("bisected_limited", limited)] if backend == "tensorflow" else [("bisected", None)]
        earlier = _earlier_probes(args, backend)
        for kind, env in kinds:
            bisected = {}
            for record in results:  # the plan's last: it holds at least what full holds, on every block
                if record["option"] == "plan":
                    continue
                probes = {}

                def fits(size, option=record["option"], probes=probes, kind=kind, env=env):
                    runs = list(earlier.get((kind, option), {}).get(size, []))
                    if not runs:
                        for _ in range(args.repeats if backend == "tensorflow" else 1):
                            runs.append(step(option, size, env, " (bisecting)" if env is None else f" in {args.budget_mb:.0f} MiB (bisecting)"))
                            if "error" in runs[-1] or runs[-1]["peak"] > budget:
                                break
                    probes[size] = runs
                    return all("error" not in run and run["peak"] <= budget for run in runs)

                largest = bisect(fits, record.get("largest") or args.multiple_of, args.multiple_of)
                bisected[record["option"]] = largest
                record[kind] = {"largest": largest, "probes": {str(size): runs for size, runs in sorted(probes.items())}}
            for record in results:
                if record["option"] == "plan" and "full" in bisected:
                    record[kind] = {"largest": bisected["full"], "of": "full"}
        print(f"\n{'option':16} {'predicted':>9} " + " ".join(f"{kind:>16}" for kind, _ in kinds))
        for record in results:
            print(f"{record['option']:16} {str(record.get('largest')):>9} "
                  + " ".join(f"{str(record.get(kind, {}).get('largest')):>16}" for kind, _ in kinds))
    if args.verify:
        print(f"\n{'option':16} {'largest':>8} {'predicted':>10} {'measured':>10} {'ratio':>6} {'under budget':>12} {'next measured':>13}")
        for record in results:
            if not record.get("largest"):
                print(f"{record['option']:16} {'-':>8}  {record.get('note') or ''}")
                continue
            at, following = record["at_largest"], record["at_next"]
            measured = "error" if "error" in at else f"{at['peak'] / 2**20:.1f} MiB"
            after = "error" if "error" in following else f"{following['peak'] / 2**20:.1f} MiB"
            print(f"{record['option']:16} {record['largest']:>8} {record['predicted_peak'] / 2**20:>6.1f} MiB {measured:>10} "
                  f"{record.get('measured_over_predicted', float('nan')):>6.3f} {str(record.get('fits_budget', '-')):>12} {after:>13}")
    arguments = {key: value for key, value in vars(args).items() if key not in ("child", "option", "at", "out")}
    arguments["axis"] = AXIS[args.model]
    arguments["backend"] = backend
    arguments["prediction_seconds"] = predicted["seconds"]
    arguments["execution"] = predicted["execution"]
    arguments["fixed_bytes"], arguments["usable_bytes"] = predicted["fixed"], usable  # NOTE [ the headroom ]
    arguments["headroom"] = predicted["headroom"]
    arguments["sizes_measured"] = predicted["sizes"]  # with one nearer the answers (NOTE [ measuring nearer the answers ])
    _measure.write_json(args.out, arguments, results)


if __name__ == "__main__":
    main()
