"""Time: one ``Deadline`` per call, and the deadline of store work within it.

A collective creates one ``Deadline`` from its timeout and passes it down:
every exchange, transfer and store operation of the call waits at most what it
has left.  Store work runs inside ``deadline`` (a context that the backends
read): each backend bounds its socket and request timeouts by ``time_left``,
and the base class refuses calls once the deadline has passed, so that a frozen
server ends in StoreUnavailableError within the call's timeout, not in a 60 s
socket timeout.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Iterator

__all__ = [
    "END_JOB_TIMEOUT",
    "MIN_TIMEOUT",
    "REPORT_TIME",
    "Deadline",
    "deadline",
    "expired",
    "time_left",
]

#: Shortest wait handed out once a deadline is (nearly) over: a socket timeout of 0
#: would mean "non-blocking", a c10d store wait of 0 "forever", not "fail now".
MIN_TIMEOUT = 0.05
#: Seconds ``Store.end_job`` may take when no deadline is in force.
END_JOB_TIMEOUT = 10.0
#: Seconds of a call's timeout its store work leaves for telling the other ranks that
#: the store failed, before they stop waiting for this one (at most a quarter of it).
REPORT_TIME = 2.0


@dataclasses.dataclass(frozen=True)
class Deadline:
    """When one call must end: its ``timeout`` in seconds, ``ends`` in monotonic time."""

    timeout: float
    ends: float

    @classmethod
    def start(cls, timeout: float) -> Deadline:
        """The deadline ``timeout`` seconds from now."""
        return cls(timeout, time.monotonic() + timeout)

    def left(self) -> float:
        """Seconds left, at least ``MIN_TIMEOUT`` (the others may be there already)."""
        return max(self.ends - time.monotonic(), MIN_TIMEOUT)

    def passed(self) -> bool:
        """Whether the deadline is over."""
        return time.monotonic() >= self.ends

    def later(self, seconds: float) -> Deadline:
        """This deadline moved ``seconds`` later (time the call absorbs, such as a
        store's set-up at its first use, which has a deadline of its own)."""
        return dataclasses.replace(self, ends=self.ends + seconds)

    def for_store(self, *, whole: bool = False) -> contextlib.AbstractContextManager[None]:
        """Bound the store work inside to what is left, less the time kept to report a
        store failure before the other ranks stop waiting for this rank.

        ``whole`` gives the store work the whole timeout instead (the reads of a
        ``gather_iter``, paced by its consumer after the call has returned).
        """
        keep = min(self.timeout / 4, REPORT_TIME)
        return deadline((self.timeout if whole else self.left()) - keep)


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
