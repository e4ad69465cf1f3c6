"""Rank filters: run a function on one rank only, optionally waiting for it."""

from __future__ import annotations

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
    """Run ``fn`` on global rank 0 only; elsewhere return None."""
    return one_rank_only(0)(fn)


def one_rank_only(
    rank: int = 0, with_barrier: bool = False, timeout: Timeout = None
) -> Callable[[F], F]:
    """Decorator: run on ``rank`` only (None elsewhere), then optionally wait for it.

    With ``with_barrier`` the other ranks wait on the control plane (never the
    NCCL watchdog) for at most ``timeout`` seconds (None: the library default);
    if the function raises on ``rank``, the others raise
    [`RemoteRankError`][gatherstore.RemoteRankError] instead of waiting forever.

    Raises:
        ValueError: a bad ``timeout`` (when decorating).
        GatherTimeout: with ``with_barrier``, ranks that did not arrive in time, named.
        RemoteRankError: on the other ranks, when the function raised on ``rank``.
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
