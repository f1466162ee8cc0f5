"""The one exception type of keras_recompute, and the one warning a recomputed call gives."""

import threading
import warnings


class RecomputeError(RuntimeError):
    """A recomputed call could not be made exact.

    Every message starts with `keras_recompute: `, says what was received and
    how to fix it.
    """


_WARNED = set()
_WARNED_LOCK = threading.Lock()


def warn_runs_plain(name, why):
    """Warns, once a process for each call's `name`, that a call asked to recompute runs as the plain call.

    Args:
        name: the call's name (`Block.call`).
        why: what made it run plain, a phrase ending the sentence "... runs as
            the plain call (no recompute) {why}".
    """
    with _WARNED_LOCK:
        if (name, why) in _WARNED:
            return
        _WARNED.add((name, why))
    warnings.warn(f"keras_recompute: {name} runs as the plain call (no recompute) {why}", stacklevel=3)
