"""The one exception type of keras_recompute."""


class RecomputeError(RuntimeError):
    """A recomputed call could not be made exact.

    Every message starts with `keras_recompute: `, says what was received and
    how to fix it.
    """
