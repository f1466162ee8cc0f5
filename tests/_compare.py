"""The one comparison every twin test uses: equal up to float reassociation.

NOTE [ what "equal" means in these tests ]
A recomputed call computes the same function as its plain twin, with the same
weights, the same random draws and the same state. The numbers are still not
always the same bits: the gradient of a tensor used twice is a sum whose terms
arrive in another order, and under `tf.function`, XLA and JAX the recompute is
compiled into a different program than the twin's, so the compiler fuses and
vectorizes its reductions differently (and differently again on a CPU with
AVX-512, AVX2 or AVX alone). Reassociating a sum of n terms changes it by at
most about n * u * sum(|terms|), with u = 2**-24 for float32 (Higham, "Accuracy
and Stability of Numerical Algorithms", section 4.2). That bound is relative
to the size of the terms, not of the result: a gradient that is zero but for
rounding (the key bias of attention, a bias before a normalization) is a sum
of terms that cancel, and its error compared with its own size is arbitrary.

So the error is measured normwise: the largest difference in each tensor,
divided by the largest magnitude among all the tensors compared together
(the outputs of a call, or all its gradients). The tolerance, 1e-5 (about 170
units in the last place of float32 at that magnitude), is the bound above for
the reductions these tests make (at most 64 terms: 64 * 6e-8 = 4e-6) with
room for the chain of a few layers. Measured over the whole suite with XLA
built for AVX-512, AVX2 and AVX (`XLA_FLAGS=--xla_cpu_max_isa=...`), and with
oneDNN off, the largest float32 error was 7e-7; with XLA's LLVM at -O0, as the
suite compiles (NOTE [ XLA's LLVM at -O0 in the suite ] in tests/conftest.py),
over TensorFlow's XLA tests and JAX's twins, 9.5e-7 on AVX2 and 6.1e-7 on AVX
(`KERAS_RECOMPUTE_TESTS_ERRORS=path` logs each comparison's error). A real defect (a different
dropout mask, a lost or doubled gradient, stale state) gives errors of order
one, far above it. Low-precision tests pass their own tolerance.

`rtol=0` asks for bitwise equality: used where the very same computation runs
twice (recompute off against the plain call).
"""

import os

import numpy as np

RTOL = 1e-5


def assert_close(actual, expected, rtol=RTOL, what="value"):
    """Asserts two lists of arrays (or None) are equal up to reassociation.

    Args:
        actual: the recomputed run's leaves: NumPy arrays, or None for a
            missing gradient.
        expected: the plain twin's leaves, in the same order.
        rtol: the normwise tolerance; 0 for bitwise equality.
        what: a label for messages.
    """
    assert len(actual) == len(expected), f"{what}: {len(actual)} values, twin has {len(expected)}"
    floats = [np.asarray(e) for e in expected if e is not None and np.issubdtype(np.asarray(e).dtype, np.floating)]
    scale = max((float(np.max(np.abs(e.astype(np.float64)))) for e in floats if e.size), default=0.0)
    scale = max(scale, float(np.finfo(np.float32).tiny))
    for index, (a, e) in enumerate(zip(actual, expected)):
        if e is None:
            assert a is None, f"{what}[{index}]: twin has no gradient, recompute has one"
            continue
        assert a is not None, f"{what}[{index}]: recompute lost a gradient"
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"{what}[{index}]: shape {a.shape} != {e.shape}"
        if not np.issubdtype(e.dtype, np.floating) or rtol == 0:
            assert a.dtype == e.dtype, f"{what}[{index}]: dtype {a.dtype} != {e.dtype}"
            np.testing.assert_array_equal(a, e, err_msg=f"{what}[{index}]")
            continue
        if not e.size:
            continue
        error = float(np.max(np.abs(a.astype(np.float64) - e.astype(np.float64)))) / scale
        _log_error(error, e.dtype, rtol, f"{what}[{index}]")
        assert error <= rtol, (
            f"{what}[{index}]: normwise error {error:.3g} > {rtol} (shape {e.shape}, largest value "
            f"compared {scale:.3g}); see NOTE [ what \"equal\" means in these tests ] in tests/_compare.py"
        )


def _log_error(error, dtype, rtol, what):
    """KERAS_RECOMPUTE_TESTS_ERRORS=path: each comparison's error, a line each (`error dtype rtol test what`)."""
    path = os.environ.get("KERAS_RECOMPUTE_TESTS_ERRORS")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as log:
            log.write(f"{error:.3g} {dtype} {rtol} {test} {what}\n")


def normwise_errors(actual, expected):
    """Each pair's largest difference over the largest magnitude among all of `expected`.

    For children that report numbers instead of asserting (see `assert_close`).
    """
    expected = [np.asarray(e, np.float64) for e in expected]
    scale = max((float(np.max(np.abs(e))) for e in expected if e.size), default=0.0)
    scale = max(scale, float(np.finfo(np.float32).tiny))
    return [
        float(np.max(np.abs(np.asarray(a, np.float64) - e))) / scale if e.size else 0.0
        for a, e in zip(actual, expected)
    ]
