"""The `RECOMPUTE` switch and the scope that overrides it.

The switch is read each time a decorated call runs (at trace time inside a
`tf.function`), never at import, so a test or a training script may set it
late, and `recompute_scope` overrides it for the calls made inside it.
"""

import contextvars
import os

ENV_VAR = "RECOMPUTE"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

# The innermost `recompute_scope` value, or None outside every scope.
_scope_override = contextvars.ContextVar("keras_recompute_scope", default=None)


def parse_bool(value, name=ENV_VAR):
    """Parses a boolean switch the way `RECOMPUTE` is parsed.

    Args:
        value: the text received, or `None` for an unset variable.
        name: the variable's name, used in the error message.

    Returns:
        `True` for `1 true yes on`, `False` for `0 false no off`, the empty
        string and `None`; case and surrounding spaces are ignored.

    Raises:
        ValueError: for any other text.
    """
    if value is None:
        return False
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(
        f"keras_recompute: environment variable {name}={value!r} is not a "
        f"boolean. Expected one of {sorted(_TRUE)} to enable recompute or "
        f"{sorted(_FALSE - {''})} (or unset) to disable it."
    )


def is_enabled():
    """Returns whether recompute is on for a call made now.

    The innermost `recompute_scope` decides; outside every scope, the
    environment variable `RECOMPUTE` does (unset means off).

    Returns:
        bool.

    Raises:
        ValueError: if `RECOMPUTE` holds a value that is not a boolean.
    """
    override = _scope_override.get()
    if override is not None:
        return override
    return parse_bool(os.environ.get(ENV_VAR))


def recompute_scope(enabled):
    """Turns recompute on or off for the decorated calls made inside it.

    It overrides the `RECOMPUTE` environment variable, and an inner scope
    overrides an outer one. Inside a `tf.function` the scope acts when the
    function is traced: a function traced inside `recompute_scope(True)`
    keeps recomputing when called later outside it.

    Args:
        enabled: `True` or `False`.

    Raises:
        TypeError: if `enabled` is not a bool.

    Example:

    ```python
    with keras_recompute.recompute_scope(True):
        loss = train_step(x, y)
    ```
    """
    if not isinstance(enabled, bool):
        raise TypeError(
            "keras_recompute: recompute_scope(enabled) takes True or False; "
            f"received {enabled!r} of type {type(enabled).__name__}."
        )
    return _Scope(enabled)


class _Scope:
    """`recompute_scope`'s context manager; it can be entered again (PyTorch enters a recompute's
    context each time the recompute runs: a double backward runs it twice)."""

    def __init__(self, enabled):
        self._enabled = enabled
        self._tokens = []

    def __enter__(self):
        self._tokens.append(_scope_override.set(self._enabled))

    def __exit__(self, *exc_info):
        _scope_override.reset(self._tokens.pop())
        return False
