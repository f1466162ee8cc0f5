"""Exactness on a device: each policy's first-step gradients against the plain model's own spread.

A BERT-like encoder (`backends.py`'s, small by default) with dropout is built
with the same seed in a fresh process per configuration, compiled with SGD at
learning rate 1, and trained one `train_on_batch` step: the weight change is
minus the gradient. The plain model runs twice (`none`, `none_again`): on a GPU
JAX is not bitwise reproducible from process to process, so the difference
between the two plain runs is the yardstick each policy is read against.
PyTorch (and the CPU) reproduce plain bitwise; there each policy should differ
by reassociation alone (below 1e-5 normwise in float32).

Printed per method: the first loss, and the normwise difference of all the
gradients from the first plain run's (the largest difference over the largest
gradient, as the tests measure), also as a multiple of the plain spread, and the
weight whose update differs most.

On a GPU JAX multiplies float32 in TF32 by default (XLA's default precision):
two programs that fuse the same step differently round differently, and a
recompute is such a program. The `none_highest` row (JAX on a GPU) is the
plain step with full-precision float32 matmuls: its difference from `none` is
what TF32 itself costs, the yardstick for a policy's difference there.
`--matmul-precision highest` runs every row that way (as the tests do).

In mixed_bfloat16 XLA on a GPU keeps a bfloat16 intermediate in float32 inside
a fusion ("excess precision") and rounds it where it is written to memory: a
program fused otherwise rounds elsewhere. The `none_strict` row (JAX on a GPU,
mixed_bfloat16) is the plain step with `--xla_allow_excess_precision=false`,
every bfloat16 result rounded: what the fusion's choices cost plain.
`--excess-precision off` runs every row that way; if the policies' difference
is that rounding, it falls there to plain's spread.

Rounding inside a matmul's kernel is beyond that switch: XLA fuses a bias or an
activation into the matmul (the CPU's XNNPACK/YNN fusions; a GPU's cuBLASLt
epilogues and Triton GEMM fusions) and rounds their result once, in float32, where
a program that keeps the matmul's output for the backward rounds it twice.
`--matmul-fusions off` compiles every row without those fusions (flags for the
platform the rows run on). With both off, every bfloat16 rounding is where the
program says: on the CPU every policy and offload is then plain bit for bit.

Usage:
    python benchmarks/first_step.py --backend torch                     # float32
    python benchmarks/first_step.py --backend jax --dtype mixed_bfloat16
    python benchmarks/first_step.py --backend jax --dtype mixed_bfloat16 --excess-precision off --matmul-fusions off
    python benchmarks/first_step.py --backend torch --out benchmarks/results/first_step_torch.json
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402
import backends  # noqa: E402

METHODS = ("none", "none_again", "none_highest", "none_strict", "ours", "save_dots", "attention_core", "offload")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"), default=os.environ.get("KERAS_BACKEND", "jax"))
    parser.add_argument("--dtype", choices=("float32", "mixed_bfloat16"), default="float32")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--methods", nargs="+", choices=METHODS, help="default: all that apply (offload, none_highest: JAX and PyTorch, JAX on a GPU)")
    parser.add_argument("--matmul-precision", choices=("default", "highest"), default="default", help="JAX's float32 matmuls (default: TF32 on a GPU)")
    parser.add_argument("--excess-precision", choices=("default", "off"), default="default", help="off: XLA rounds every bfloat16 result (JAX)")
    parser.add_argument("--matmul-fusions", choices=("default", "off"), default="default", help="off: XLA fuses nothing into a matmul's kernel (JAX)")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "NPZ"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return args


def _default_methods(args, platform):
    """All that apply: offload not on TensorFlow; `none_highest` where JAX multiplies float32 in TF32 (a GPU);
    `none_strict` where it keeps bfloat16 in float32 inside fusions (a GPU, mixed_bfloat16)."""
    gpu = args.backend == "jax" and platform == "gpu"
    tf32 = gpu and args.dtype == "float32" and args.matmul_precision == "default"
    excess = gpu and args.dtype == "mixed_bfloat16" and args.excess_precision == "default"
    return [
        m for m in METHODS
        if (m != "offload" or args.backend != "tensorflow") and (m != "none_highest" or tf32) and (m != "none_strict" or excess)
    ]


# XLA's flags that keep a matmul's kernel to the matmul, per platform (an unknown flag stops XLA: each platform's own).
MATMUL_FUSIONS_OFF = {
    "cpu": "--xla_cpu_use_xnnpack=false --xla_cpu_experimental_ynn_fusion_type= --xla_cpu_strict_dot_conv_math=true",
    "gpu": "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=false",
}


def _child_env(args, method, platform="cpu"):
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if args.matmul_precision == "highest" or method == "none_highest":
        env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    flags = []
    if args.excess_precision == "off" or method == "none_strict":
        flags.append("--xla_allow_excess_precision=false")
    if args.matmul_fusions == "off":
        flags.append(MATMUL_FUSIONS_OFF.get(platform, ""))
    if flags:
        env["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + flags).strip()
    return env


def child(args):
    """One first step of one configuration: its loss, and its gradients saved to NPZ."""
    method, path = args.child
    os.environ["RECOMPUTE"] = "0" if method.startswith("none") else "1"
    import keras
    import numpy as np

    keras.config.set_dtype_policy(args.dtype)
    keras.utils.set_random_seed(7)
    model = backends.build_model(args, "none" if method.startswith("none") else method)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    ids = rng.randint(0, args.vocab, size=(args.batch, args.seq)).astype("int32")
    labels = rng.randint(0, 2, size=(args.batch,)).astype("int32")
    before = [np.array(keras.ops.convert_to_numpy(w), dtype="float64") for w in model.trainable_weights]
    loss = float(np.asarray(model.train_on_batch(ids, labels)))
    after = [np.array(keras.ops.convert_to_numpy(w), dtype="float64") for w in model.trainable_weights]
    np.savez(path, *[b - a for b, a in zip(before, after)])
    print(json.dumps({"loss": loss, "weights": [w.path for w in model.trainable_weights]}))


def normwise(actual, expected):
    """The largest difference over the largest magnitude among `expected`'s arrays."""
    import numpy as np

    scale = max(float(np.max(np.abs(e))) for e in expected if e.size)
    return max(float(np.max(np.abs(a - e))) for a, e in zip(actual, expected) if e.size) / scale


def differing(actual, expected, names):
    """Each weight whose update differs from `expected`'s at all, with its largest difference: where the
    backward, last block first, first departs from plain's tells which op departs."""
    import numpy as np

    found = {}
    for name, a, e in zip(names, actual, expected):
        difference = float(np.max(np.abs(a - e))) if e.size else 0.0
        if difference:
            found[name] = difference
    return found


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    import numpy as np

    platform = backends._platform(args.backend) if args.backend != "tensorflow" else "cpu"
    if args.methods is None:
        args.methods = _default_methods(args, platform)
    print(f"first-step gradients: Keras 3 on {args.backend} ({platform}), {args.dtype}, {args.blocks} blocks x "
          f"hidden {args.hidden}, seq {args.seq}, batch {args.batch}, dropout {args.dropout}, SGD lr=1"
          + (", float32 matmuls at full precision" if args.matmul_precision == "highest" else "")
          + (", every bfloat16 result rounded (no excess precision)" if args.excess_precision == "off" else "")
          + (", nothing fused into a matmul's kernel" if args.matmul_fusions == "off" else ""), flush=True)
    script = os.path.abspath(__file__)
    sizes = []
    for name in ("blocks", "hidden", "heads", "ffn", "seq", "batch", "vocab", "dropout", "dtype"):
        sizes += [f"--{name}", str(getattr(args, name))]
    losses, gradients, names = {}, {}, []
    with tempfile.TemporaryDirectory() as folder:
        for method in args.methods:
            path = os.path.join(folder, f"{method}.npz")
            record = _measure.run(
                script, ["--child", method, path, "--backend", args.backend, *sizes], args.backend,
                extra_env=_child_env(args, method, platform),
            )
            losses[method] = record.get("loss")
            names = record.get("weights") or names
            if "error" in record:
                print(f"{method:<15} error: {record['error']}", flush=True)
                continue
            with np.load(path) as saved:
                gradients[method] = [saved[f"arr_{index}"] for index in range(len(saved.files))]
    reference = gradients.get("none")
    spread = normwise(gradients["none_again"], reference) if reference is not None and "none_again" in gradients else None
    rows = []
    for method in args.methods:
        row = {"method": method, "loss": losses[method]}
        if method in gradients and reference is not None and method != "none":
            row["difference"] = normwise(gradients[method], reference)
            found = differing(gradients[method], reference, names) if len(names) == len(reference) else {}
            row["worst"] = max(found, key=found.get) if found else None  # the weight that differs most
            if len(names) == len(reference):
                row["differing"] = found
            if spread:
                row["times_spread"] = row["difference"] / spread
        rows.append(row)
        shown = f"{row['difference']:.3g}" if "difference" in row else "-"
        times = f"  ({row['times_spread']:.2f}x plain's spread)" if "times_spread" in row else ""
        loss = f"{row['loss']:.6f}" if row["loss"] is not None else "error"
        where = f"  (most: {row['worst']})" if row.get("worst") else ""
        if "differing" in row:
            where += f"  {len(row['differing'])} of {len(names)} weights differ"
        print(f"{method:<15} first loss {loss}  gradients vs none: {shown}{times}{where}", flush=True)
    _measure.write_json(args.out, vars(args), {"platform": platform, "plain_spread": spread, "rows": rows})


if __name__ == "__main__":
    main()
