"""Where a TensorFlow training step's memory peaks: its allocations in order, from TensorFlow's profiler.

A step's allocator peak says how high it went, not when or with what. Here the
second of two training steps runs under `tf.profiler` (host tracer level 3,
the BFC allocator's events: each allocation and free with the op that made
it), and this prints where the step peaked: the op running there, what was
alive there by scope (each block, the loss, the metrics), and the highest
point of each block's forward and backward.

Usage (`largest_fit.py`'s models):
    python benchmarks/tf_memory_timeline.py gemma-lora --at 1152 --option attention_core --out benchmarks/results/tf_memory_timeline_gemma_lora_attention_core_1152.json
"""

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

MiB = 2**20
BLOCK = re.compile(r"(?:decoder|transformer)_block_\d+|transformer_layer_\d+")  # keras-hub's block names


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=("keras-hub-bert", "gemma-lora"))
    parser.add_argument("--size", choices=("base", "small"), default="small")
    parser.add_argument("--at", type=int, required=True, help="the batch (BERT) or sequence length (Gemma)")
    parser.add_argument("--option", default="none", help="none, a policy, or plan")
    parser.add_argument("--budget-mb", type=float, default=256.0, help="the plan's budget (--option plan): the usable budget a largest_fit answered against (usable_bytes)")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def scope(op):
    """An allocation's place: its block and whether forward or backward, else its top-level scope."""
    op = op or "?"
    block = BLOCK.search(op)
    backward = op.startswith("gradient_tape/")
    if block:
        return f"{block.group(0)} {'backward' if backward else 'forward'}"
    return op.split("/")[1 if backward else 0][:40] + (" (backward)" if backward else "")


def memory_events(logdir):
    """`(allocator, events)`: the profiled run's allocations and frees, `(kind, stats)` in time order, of one allocator."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))[-1], "rb") as file:
        space.ParseFromString(file.read())
    events = []
    for plane in space.planes:
        names = {key: value.name for key, value in plane.event_metadata.items()}
        stats = {key: value.name for key, value in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                kind = names.get(event.metadata_id)
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                values = {}
                for stat in event.stats:
                    named = stats.get(stat.ref_value) if stat.ref_value else None  # a string stored once, by reference
                    values[stats.get(stat.metadata_id)] = stat.str_value or named or stat.int64_value or stat.uint64_value
                events.append((line.timestamp_ns * 1000 + event.offset_ps, kind, values))
    events.sort(key=lambda event: event[0])
    # One allocator's events (each counts its own bytes): the one that held the most (a GPU's, beside the host's).
    highest = collections.Counter()
    for _, _, values in events:
        name = values.get("allocator_name")
        highest[name] = max(highest[name], values.get("bytes_allocated", 0))
    allocator = highest.most_common(1)[0][0] if highest else None
    return allocator, [(kind, values) for _, kind, values in events if values.get("allocator_name") == allocator]


def timeline(events):
    """The peak, the op there, what was alive there by scope, and each scope's highest point."""
    live, peak, at, alive_at_peak, highest = {}, -1, None, {}, collections.OrderedDict()
    for kind, values in events:
        address = values.get("addr")
        if kind == "MemoryAllocation":
            live[address] = (values.get("allocation_bytes") or values.get("requested_bytes") or 0, values.get("tf_op"))
        else:
            live.pop(address, None)
        allocated = values.get("bytes_allocated", 0)
        where = scope(values.get("tf_op"))
        highest[where] = max(highest.get(where, 0), allocated)
        if allocated > peak:
            peak, at, alive_at_peak = allocated, values.get("tf_op"), dict(live)
    by_scope = collections.Counter()
    for size, op in alive_at_peak.values():
        by_scope[scope(op)] += size
    return {
        "peak": peak,
        "op_at_peak": at,
        "allocated_before_the_step": peak - sum(size for size, _ in alive_at_peak.values()),
        "alive_at_peak_by_scope": dict(by_scope.most_common()),
        "highest_by_scope": {key: value for key, value in highest.items() if value >= 0.25 * peak},
    }


def main(argv=None):
    args = parse_args(argv)
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")
    import tensorflow as tf

    import keras_recompute
    import largest_fit

    build_args = largest_fit.parse_args([args.model, "--backend", "tensorflow", "--size", args.size,
                                         "--budget-mb", str(args.budget_mb)])
    model, make = largest_fit.build(build_args)
    inputs, labels = make(args.at)
    if args.option == "plan":
        keras_recompute.recompute_model(model, budget=int(args.budget_mb * MiB), inputs=inputs, enabled=True)
    elif args.option != "none":
        keras_recompute.recompute_model(model, policy=args.option, enabled=True)
    model.train_on_batch(inputs, labels)
    _measure.reset_peak("tensorflow")
    logdir = tempfile.mkdtemp(prefix="tf_memory_timeline_")
    tf.profiler.experimental.start(logdir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3))
    model.train_on_batch(inputs, labels)
    tf.profiler.experimental.stop()
    allocator, events = memory_events(logdir)
    result = timeline(events)
    result["allocator"], result["allocator_peak"] = allocator, _measure.peak("tensorflow")
    print(f"{args.model} at {args.at}, {args.option}: the step peaked at {result['peak'] / MiB:.1f} MiB "
          f"(the allocator's own peak: {result['allocator_peak'] / MiB:.1f}; {allocator}), running {result['op_at_peak']}")
    print(f"  allocated before the step (weights, slots, inputs): {result['allocated_before_the_step'] / MiB:.1f} MiB")
    print("  alive at the peak, by scope:")
    for key, value in result["alive_at_peak_by_scope"].items():
        if value >= MiB / 10:
            print(f"    {value / MiB:7.1f}  {key}")
    print("  the highest point of a scope, the twelve highest (all in the JSON):")
    for key, value in sorted(result["highest_by_scope"].items(), key=lambda item: -item[1])[:12]:
        print(f"    {value / MiB:7.1f}  {key}")
    _measure.write_json(args.out, dict(vars(args), backend="tensorflow"), result)


if __name__ == "__main__":
    main()
