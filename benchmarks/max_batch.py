"""The largest batch that fits a memory budget, per recompute method, and its time per sample.

Models:
    bert4keras  bert4keras 0.11.5's BERT with a classifier on [CLS], on tf_keras,
                `train_on_batch` (a `tf.function`): `--size base` (12 x 768, 12
                heads, FFN 3072) or `--size large` (24 x 1024, 16 heads, FFN
                4096); seq 128 unless `--seq`.
    keras-hub   keras-hub's `BertBackbone` BERT-base (12 x 768) with a classifier
                on its pooled output, Keras 3 `train_on_batch`; seq 512 unless
                `--seq`. `--backend jax` or `torch` needs a GPU (on a CPU they
                keep no allocator statistics to hold to a budget).

Methods (those that apply to the model):
    none            no recompute
    theirs          bert4keras's own recompute (per layer; its gradients are wrong,
                    see docs/benchmarks.md)
    enable          our integration's `enable()`: bert4keras per layer, keras-hub
                    per TransformerEncoder
    full            `recompute_model(model)`: each transformer block one unit
    save_dots       `recompute_model(model, policy="save_dots")`
    attention_core  `recompute_model(model, policy="attention_core")`
    budget          `recompute_model(model, budget=<the budget>, inputs=batch)`
                    (`--plan-budget-mb` for another budget than the allocator's):
                    at each batch tried, the plan with the least recompute time
                    that fits (keras-hub: over its blocks; bert4keras: over its
                    blocks, which are pieces of its graph)

Memory is the allocator's peak, and the budget is the allocator's limit: on a
CPU TensorFlow's BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC=1`) with
`TF_CPU_BFC_MEM_LIMIT_IN_MB` set to the budget, so a batch that does not fit
fails with an out-of-memory error, as on a device; on a GPU the device's own
allocator (`--budget-mb` should then be below the device's memory). The batch
is found by doubling, then bisection; each probe is a child process that
builds the model, takes one step (compiling), then one more, and fits when
both ran and the peak of the second is within the budget; with `--repeats n`,
when n probes of it all fit. TensorFlow's BFC allocator gives a tensor a
free block of up to twice its size, whichever it meets (NOTE [ the
allocator's blocks ] in `keras_recompute/_fit.py`), and at the edge the same
batch runs in one child and runs out of memory in the next (bert4keras
BERT-base, `save_dots` at batch 18: two probes of three ran, and one of three
in another try): a batch found with one probe each is one that ran once,
with three, one that runs. Time per sample is
the fastest of `--steps` steps at the largest batch, over its batch, in a child
without the limit (next to it an allocator's retries stall a step).

Usage:
    python benchmarks/max_batch.py bert4keras --size base --budget-mb 2500 --out benchmarks/results/max_batch_bert4keras_base.json
    python benchmarks/max_batch.py keras-hub --budget-mb 4000 --methods none full
    python benchmarks/max_batch.py bert4keras --budget-mb 2500 --repeats 3 --methods save_dots --merge --out benchmarks/results/max_batch_bert4keras_base.json
    python benchmarks/plot.py benchmarks/results/*.json    # the figures in docs/images/
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("none", "theirs", "enable", "full", "save_dots", "attention_core", "budget")
POLICIES = ("full", "save_dots", "attention_core")
SIZES = {"base": dict(layers=12, hidden=768, heads=12, intermediate=3072), "large": dict(layers=24, hidden=1024, heads=16, intermediate=4096)}
# What the seed articles claim for recompute, to print beside ours.
SEED_CLAIMS = {
    ("bert4keras", "base"): "bert4keras article: about 3x the batch at +25% time per sample",
    ("bert4keras", "large"): "bert4keras article: about 4x the batch",
    ("keras-hub", "base"): "PyTorch checkpointing article (BERT-base): batch 24 -> 132 (5.5x) at +36% time",
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=("bert4keras", "keras-hub"))
    parser.add_argument("--size", choices=tuple(SIZES), default="base")
    parser.add_argument("--seq", type=int, help="sequence length (bert4keras 128, keras-hub 512)")
    parser.add_argument("--budget-mb", type=float, required=True, help="the allocator's limit, in MiB")
    parser.add_argument("--methods", nargs="+", choices=METHODS, help="default: all that apply to the model")
    parser.add_argument("--plan-budget-mb", type=float, help="budget: the budget the plan is made for (default: --budget-mb; docs/usage.md advises a little less than the memory there is)")
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"), default="tensorflow", help="keras-hub only")
    parser.add_argument("--steps", type=int, default=2, help="timed steps at the largest batch, after one compiling step")
    parser.add_argument("--limit", type=int, default=1024, help="the largest batch tried")
    parser.add_argument("--repeats", type=int, default=1, help="a batch fits when this many probes of it all fit (TensorFlow's runs differ at the edge)")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    parser.add_argument("--merge", action="store_true", help="--out: keep the other methods of an earlier run of the same model there")
    parser.add_argument("--retime", action="store_true", help="--out: time again, at the batches found there, the methods given")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.seq = args.seq or (128 if args.model == "bert4keras" else 512)
    applicable = tuple(m for m in METHODS if args.model == "bert4keras" or m != "theirs")
    args.methods = args.methods or list(applicable)
    for method in args.methods:
        if method not in applicable:
            parser.error(f"method {method!r} does not apply to {args.model}; choose from {list(applicable)}")
    if args.model == "bert4keras" and args.backend != "tensorflow":
        parser.error("bert4keras runs on TensorFlow (tf_keras) only")
    return args


def keras_hub_child(args):
    """One probe of keras-hub's BertBackbone: prints its record as JSON."""
    import json

    method, batch = args.child[0], int(args.child[1])
    os.environ["RECOMPUTE"] = "0" if method == "none" else "1"
    import keras
    import keras_hub
    import numpy as np

    from keras_recompute import recompute_model
    from keras_recompute.integrations import keras_hub as recompute_keras_hub

    if method == "enable":
        recompute_keras_hub.enable()
    keras.utils.set_random_seed(0)
    size = SIZES[args.size]
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=30522,
        num_layers=size["layers"],
        num_heads=size["heads"],
        hidden_dim=size["hidden"],
        intermediate_dim=size["intermediate"],
        dropout=0.1,
        max_sequence_length=max(512, args.seq),
    )
    if method in POLICIES:
        recompute_model(backbone, policy=method)
    logits = keras.layers.Dense(2)(backbone.output["pooled_output"])
    model = keras.Model(backbone.inputs, logits)
    model.compile(optimizer=keras.optimizers.Adam(1e-5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    inputs = {
        "token_ids": rng.randint(1, 30522, size=(batch, args.seq)).astype("int32"),
        "segment_ids": np.zeros((batch, args.seq), "int32"),
        "padding_mask": np.ones((batch, args.seq), "int32"),
    }
    labels = rng.randint(0, 2, size=(batch,)).astype("int32")
    backend = keras.backend.backend()
    plan = None
    if method == "budget":
        try:
            recompute_model(model, budget=int((args.plan_budget_mb or args.budget_mb) * 2**20), inputs=inputs)
        except ValueError as error:  # below the least peak any plan reaches: does not fit
            print(json.dumps({"error": str(error)[:160]}))
            return
        plan = _measure.planned_policies(model, inputs)
    model.train_on_batch(inputs, labels)  # builds and compiles
    _measure.reset_peak(backend)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = float(np.asarray(model.train_on_batch(inputs, labels)))
        times.append(time.perf_counter() - start)
    print(json.dumps({"peak": _measure.peak(backend), "step": min(times), "loss": loss, "plan": plan}))


def probe(args, method, batch, limited=True, steps=1):
    """Trains `batch` rows with `method` in a child (limited to the budget): its record, or {"error": ...}."""
    limit = {"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(int(args.budget_mb))} if limited else {}
    if args.model == "bert4keras":
        import bert4keras_bert

        child_args = bert4keras_bert.parse_args([])
        vars(child_args).update(SIZES[args.size], seq=args.seq, batch=batch, steps=steps)
        if method in POLICIES:
            child_args.policy = method
        if method == "budget":
            child_args.plan_budget_mb = args.plan_budget_mb or args.budget_mb
        name = {"enable": "ours"}.get(method, "model" if method in POLICIES else method)
        return bert4keras_bert.run_child(child_args, name, "function", extra_env=limit)
    arguments = ["keras-hub", "--child", method, batch, "--size", args.size, "--seq", args.seq, "--budget-mb", args.budget_mb, "--steps", steps]
    if args.plan_budget_mb:
        arguments += ["--plan-budget-mb", args.plan_budget_mb]
    return _measure.run(os.path.abspath(__file__), arguments, args.backend, extra_env=limit, label=f"{method}, batch {batch}")


def largest_batch(args, method):
    """(the largest batch within the budget, its record, every probe as {"batch", "peak", "fits"})."""
    budget = args.budget_mb * 2**20
    records, probes = {}, []

    def fits(batch):
        for _ in range(args.repeats):  # the first that does not fit settles it
            record = records[batch] = probe(args, method, batch)
            ok = "error" not in record and record["peak"] is not None and record["peak"] <= budget
            probes.append({"batch": batch, "peak": record.get("peak"), "fits": ok, "error": record.get("error")})
            if not ok:
                return False
        return True

    batch = _measure.largest_batch(fits, limit=args.limit)
    return batch, timed(args, method, batch) if batch else None, sorted(probes, key=lambda p: p["batch"])


def timed(args, method, batch):
    """The step time at `batch`, from a child without the allocator's limit.

    Next to the limit an allocator that has to free cached blocks and retry
    stalls (TensorFlow's BFC waits before a retry): the probe that fits
    proves the batch fits, but its step time would count those stalls.
    """
    record = probe(args, method, batch, limited=False, steps=args.steps)
    return None if "error" in record else record


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return keras_hub_child(args)
    size = SIZES[args.size]
    title = (
        f"{args.model} BERT-{args.size} ({size['layers']} x {size['hidden']}), seq {args.seq}, dropout 0.1, Adam, "
        f"{args.backend}; budget {args.budget_mb:.0f} MiB"
    )
    print(title)
    print(f"{'method':<15} {'batch':>6} {'vs none':>8} {'s/sample':>9} {'vs none':>8}  loss")
    if args.retime:
        return retime(args)
    results = {"title": title, "budget_bytes": args.budget_mb * 2**20, "methods": {}}
    earlier = _earlier(args) if args.merge else {}
    base = earlier.get("none")
    for method in args.methods:
        batch, record, probes = largest_batch(args, method)
        per = record["step"] / batch if record else None
        results["methods"][method] = {
            "batch": batch, "seconds_per_sample": per, "loss": record and record["loss"], "repeats": args.repeats,
            "probes": probes,
        }
        if method == "budget":
            results["methods"][method]["plan_budget_mb"] = args.plan_budget_mb or args.budget_mb
        if method == "none":
            base = results["methods"][method]
        if not batch:
            print(f"{method:<15} {0:>6}  (not even one row fits)")
            continue
        ratios = ("", "")
        if base and base["batch"]:
            ratios = (f"{batch / base['batch']:.2f}x", f"{per / base['seconds_per_sample']:.2f}x")
        print(f"{method:<15} {batch:>6} {ratios[0]:>8} {per:>9.3f} {ratios[1]:>8}  {record['loss']:.4f}")
        if record.get("plan"):
            print(f"{'':<15} plan at batch {batch}: {record['plan']}")
            results["methods"][method]["plan"] = record["plan"]
    claim = SEED_CLAIMS.get((args.model, args.size))
    if claim:
        print(f"seed's claim: {claim}")
        results["seed_claim"] = claim
    if earlier:
        merged = {**earlier, **results["methods"]}
        results["methods"] = {method: merged[method] for method in METHODS if method in merged}
    _measure.write_json(args.out, vars(args), results)


def retime(args):
    """`--retime`: the step time of each method at the batch an earlier run (`--out`) found."""
    import json

    with open(args.out) as source:
        data = json.load(source)
    for method in args.methods:
        found = data["results"]["methods"][method]
        record = timed(args, method, found["batch"])
        found.update(seconds_per_sample=record and record["step"] / found["batch"], loss=record and record["loss"])
        print(f"{method:<15} batch {found['batch']:>5}  {found['seconds_per_sample']:.3f} s/sample")
    data["results"]["timed_again"] = {"methods": args.methods, "steps": args.steps}
    _measure.write_json(args.out, data["arguments"], data["results"])


def _earlier(args):
    """The methods of the run in `--out` (`--merge`): the same model and budget, or an error; none if it is not there yet."""
    import json

    if not os.path.exists(args.out):
        return {}
    with open(args.out) as source:
        data = json.load(source)
    same = ("model", "size", "seq", "budget_mb", "backend")
    if any(data["arguments"][name] != getattr(args, name) for name in same):
        raise SystemExit(f"--merge: {args.out} is a run of another model or budget ({', '.join(same)} differ)")
    return {method: found for method, found in data["results"]["methods"].items() if method not in args.methods}


if __name__ == "__main__":
    main()
