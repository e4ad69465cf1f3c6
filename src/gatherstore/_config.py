"""Library defaults, each overridable by an environment variable."""

from __future__ import annotations

import datetime as _dt
import os

__all__ = ["DEFAULT_TIMEOUT", "Timeout", "to_seconds"]

#: Seconds a collective waits by default (``GATHERSTORE_TIMEOUT`` overrides it).
DEFAULT_TIMEOUT = float(os.environ.get("GATHERSTORE_TIMEOUT", "1800"))

Timeout = float | int | _dt.timedelta | None


def to_seconds(timeout: Timeout) -> float:
    """Seconds of a user timeout: a number, a timedelta, or None for the library default.

    Raises:
        ValueError: the timeout is not positive or has the wrong type.
    """
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, _dt.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(
            f"timeout={timeout!r} is not valid: give seconds (a number), a "
            "datetime.timedelta, or None for the default"
        )
    if seconds <= 0:
        raise ValueError(f"timeout={timeout!r} must be positive (seconds)")
    return seconds
