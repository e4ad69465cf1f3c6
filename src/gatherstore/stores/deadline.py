"""The deadline of store work: no store call outlives the collective that makes it.

Object collectives run their store work inside ``deadline``; each backend
bounds its socket and request timeouts by ``time_left``, and the base
class refuses calls once the deadline has passed, so that a frozen server ends
in StoreUnavailableError within the call's timeout, not in a 60 s socket
timeout.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

__all__ = ["END_JOB_TIMEOUT", "MIN_TIMEOUT", "deadline", "expired", "time_left"]

#: Shortest timeout handed to a backend once the deadline is (nearly) over: a
#: socket timeout of 0 would mean "non-blocking", not "fail now".
MIN_TIMEOUT = 0.05
#: Seconds ``Store.end_job`` may take when no deadline is in force.
END_JOB_TIMEOUT = 10.0

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "gatherstore_store_deadline", default=None
)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Bound every store operation in this block to end within ``seconds``.

    Nested deadlines keep the earlier one.  A thread started inside the block
    inherits it only through ``contextvars.copy_context().run``.
    """
    end = time.monotonic() + seconds
    outer = _deadline.get()
    token = _deadline.set(end if outer is None else min(outer, end))
    try:
        yield
    finally:
        _deadline.reset(token)


def time_left(default: float | None = None) -> float | None:
    """Seconds left before the deadline in force (at least ``MIN_TIMEOUT``), capped at
    ``default``; ``default`` when no deadline is in force."""
    end = _deadline.get()
    if end is None:
        return default
    left = max(end - time.monotonic(), MIN_TIMEOUT)
    return left if default is None else min(left, default)


def expired() -> bool:
    """Whether the deadline in force has passed."""
    end = _deadline.get()
    return end is not None and time.monotonic() >= end
