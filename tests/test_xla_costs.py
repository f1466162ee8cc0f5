"""`benchmarks/xla_costs.py`'s bytes by kind: what a compiled JAX program's instructions read and write, by what
they came from (issue 39: where a policy's traffic goes on the GPU's compiler)."""

import os
import sys

import pytest

from _keras3_twins import BACKEND

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="a JAX program's text")


def _compiled(function, *args):
    import jax

    compiled = jax.jit(function).lower(*args).compile()
    cost = compiled.cost_analysis()
    return compiled.as_text(), (cost[0] if isinstance(cost, (list, tuple)) else cost)["bytes accessed"]


def test_a_program_without_loops_moves_what_xla_counts():
    import jax.numpy as jnp
    import xla_costs

    hlo, counted = _compiled(lambda x, w: (jnp.tanh(x @ w) * 2).sum(axis=0), jnp.ones((256, 512)), jnp.ones((512, 512)))
    kinds = xla_costs.bytes_by_kind(hlo)
    assert sum(kinds.values()) == counted, (kinds, counted)
    assert kinds.get("matmul", 0) > 0, kinds


def test_a_dropout_draw_is_random_and_its_loop_counted_each_trip():
    """Threefry's rounds are a loop of five trips over two words an element: the draw moves five times its body."""
    import jax
    import jax.numpy as jnp
    import xla_costs

    def step(x, w, key):
        hidden = jnp.tanh(x @ w)
        return jnp.where(jax.random.bernoulli(key, 0.9, hidden.shape), hidden, 0.0).sum()

    hlo, counted = _compiled(jax.grad(step, argnums=1), jnp.ones((256, 512)), jnp.ones((512, 512)), jax.random.key(0))
    kinds = xla_costs.bytes_by_kind(hlo)
    words = 256 * 512 * 4 * 2  # the loop's two words an element, read and written
    assert kinds.get("random", 0) >= 5 * 2 * words, kinds
    assert kinds.get("matmul", 0) > 0 and sum(kinds.values()) > counted, (kinds, counted)


def test_the_matmuls_operations_are_counted_once_each_time_they_run():
    import jax
    import jax.numpy as jnp
    import xla_costs

    x, w = jnp.ones((256, 512)), jnp.ones((512, 384))
    once, _ = _compiled(lambda x, w: jnp.tanh(x @ w), x, w)
    assert xla_costs.matmul_flops(once) == 2 * 256 * 512 * 384
    gradient, _ = _compiled(jax.grad(lambda x, w: jnp.tanh(x @ w).sum(), argnums=1), x, w)  # forward, and dw
    assert xla_costs.matmul_flops(gradient) == 2 * (2 * 256 * 512 * 384)


def test_a_wait_xla_cannot_fuse_is_counted_as_waiting():
    """NOTE [ how the recompute waits on JAX ]: an input made to wait, read by a matmul (a library call), is a copy."""
    import jax.numpy as jnp
    import xla_costs

    from keras_recompute.backends import jax as jax_backend

    def recomputed(x, w, gradient):
        return jnp.tanh(jax_backend._wait(x, jax_backend._zero_from(gradient)) @ w)

    hlo, counted = _compiled(recomputed, jnp.ones((256, 512)), jnp.ones((512, 384)), jnp.ones((4,)))
    kinds = xla_costs.bytes_by_kind(hlo)
    copied = 2 * 256 * 512 * 4  # x read and written
    assert copied <= kinds.get("wait", 0) <= copied + 64, kinds
    assert kinds.get("matmul", 0) > 0, kinds
