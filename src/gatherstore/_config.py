"""Library defaults, each overridable by an environment variable."""

from __future__ import annotations

import datetime as _dt
import os
import re

__all__ = ["DEFAULT_TIMEOUT", "Timeout", "parse_size", "read_ahead", "to_seconds"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes of a size such as ``64MB``, ``1GB``, ``1.5G``, ``512KiB`` or ``4096`` (binary units).

    Raises:
        ValueError: ``text`` is not a positive size.
    """
    match = _SIZE.fullmatch(text)
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2).upper()]) if match else 0
    if nbytes <= 0:
        raise ValueError(f"{text!r} is not a size; use e.g. 64MB, 1GB or 4096 (bytes)")
    return nbytes


#: Seconds a collective waits by default (``GATHERSTORE_TIMEOUT`` overrides it).
DEFAULT_TIMEOUT = float(os.environ.get("GATHERSTORE_TIMEOUT", "1800"))

#: Bytes a reader of stored parts reads ahead of its consumer by default
#: (``GATHERSTORE_READ_AHEAD`` overrides it, e.g. ``256MB``); never more than
#: :data:`READ_AHEAD_SHARE` of the memory the check found free.  32 MiB keeps
#: 32 requests of small parts in flight and several chunks of big ones, and
#: stays a small share of what a gather returns.
DEFAULT_READ_AHEAD = parse_size(os.environ.get("GATHERSTORE_READ_AHEAD", "32MiB"))
READ_AHEAD_SHARE = 8


def read_ahead(explicit: int | None, headroom: int) -> int:
    """The read-ahead budget in bytes: ``explicit`` (a call's ``read_ahead=``), else the
    default capped at 1/:data:`READ_AHEAD_SHARE` of ``headroom``; at least 1 byte
    (then parts are read one at a time, on demand).

    Raises:
        ValueError: ``explicit`` is negative or not an int.
    """
    if explicit is not None:
        if not isinstance(explicit, int) or isinstance(explicit, bool) or explicit < 0:
            raise ValueError(
                f"read_ahead={explicit!r} is not valid: give a number of bytes (0 or more)"
            )
        return max(explicit, 1)
    return max(min(DEFAULT_READ_AHEAD, headroom // READ_AHEAD_SHARE), 1)


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
