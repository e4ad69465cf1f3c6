"""Rank filters: run a function on one rank only, optionally waiting for it."""

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from gatherstore._config import Timeout, to_seconds
from gatherstore._errors import RemoteRankError
from gatherstore.calls.entry import collective
from gatherstore.job import topology

__all__ = ["one_rank_only", "rank_zero_only"]

F = TypeVar("F", bound=Callable[..., Any])


def _report(failure: bytes, timeout: Timeout) -> list[bytes]:
    """Every rank's report after the function ran on ``rank``: a collective of its own,
    whose deadline starts once the function is done."""
    with collective("one_rank_only", timeout=timeout, sweep=False) as ctx:
        return ctx.send(failure)


def rank_zero_only(fn: F) -> F:
    """Decorator: run ``fn`` on global rank 0 only; elsewhere return None.

    The other ranks do not wait for it (``one_rank_only(0, with_barrier=True)`` does).

    Args:
        fn: the function to run on rank 0.

    Returns:
        ``fn``, wrapped: it returns ``fn``'s result on rank 0 and None elsewhere.

    Examples:
        >>> @gs.rank_zero_only
        ... def report(metrics):
        ...     print(metrics)
    """
    return one_rank_only(0)(fn)


def one_rank_only(
    rank: int = 0, with_barrier: bool = False, timeout: Timeout = None
) -> Callable[[F], F]:
    """Decorator: run the function on ``rank`` only (None elsewhere), then optionally
    make every rank wait for it.

    Args:
        rank: the global rank that runs the function.
        with_barrier: the other ranks wait until it has run, on the control plane (never
            the NCCL watchdog); if it raises on ``rank``, they raise ``RemoteRankError``
            instead of waiting forever.  Without a process group it changes nothing.
        timeout: how long they wait, at most: seconds or a ``timedelta``; None:
            ``GATHERSTORE_TIMEOUT``.

    Returns:
        A decorator; the function it wraps returns its result on ``rank`` and None
        elsewhere.

    Raises:
        ValueError: a bad ``timeout`` (when decorating).
        GatherTimeout: with ``with_barrier``, ranks that did not arrive in time, named.
        RemoteRankError: on the other ranks, when the function raised on ``rank``.

    Examples:
        >>> @gs.one_rank_only(0, with_barrier=True)
        ... def download():
        ...     fetch_weights("/shared/weights")  # every rank reads them afterwards
    """
    to_seconds(timeout)

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not with_barrier or not topology.is_distributed():
                return fn(*args, **kwargs) if topology.get_rank() == rank else None
            result, failure = None, b""
            try:
                if topology.get_rank() == rank:
                    result = fn(*args, **kwargs)
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}".encode()
                _report(failure, timeout)
                raise
            reported = _report(failure, timeout)
            if reported[rank]:
                raise RemoteRankError(rank, reported[rank].decode(), context=fn.__name__)
            return result

        return wrapper  # type: ignore[return-value]

    return decorate
