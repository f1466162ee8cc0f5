"""Mutations the suite must catch, kept where a test can apply them (issue 38: a test that survives
its own mutation proves nothing)."""

from keras import ops


def double_gradients(monkeypatch):
    """Every recomputed call's output carries twice its gradient (the same value), on any backend.

    `2 * out - stop_gradient(out)` is `out`, whose gradient is twice `out`'s: what a
    recompute that counted its gradient twice (bert4keras's, on `q = k = v`) gives.
    """
    from keras_recompute import _decorator

    dispatch = _decorator._dispatch

    def doubled(context, args, kwargs):
        call = dispatch(context, args, kwargs)

        def run(fn, args, kwargs, context, **options):
            return call(_doubling(fn), args, kwargs, context, **options)

        return run

    monkeypatch.setattr(_decorator, "_dispatch", doubled)


def _doubling(fn):
    def twice(*args, **kwargs):
        out = fn(*args, **kwargs)
        return 2.0 * out - ops.stop_gradient(out)

    return twice
