"""The exchange protocol: a few bytes from every rank, through a c10d store, in O(W) requests.

Each rank sets its key and counts itself in; the last rank to arrive reads all
keys once and publishes one verdict (every value, or a summary computed once
and the values only for the ranks that need them), which every rank waits for
with its own timeout.  Equal values are sent once.  On a timeout one rank judges
which keys are missing and publishes that verdict instead, so every rank, and a
late rank once it arrives, raises the same error naming the same ranks.  The
job-level use of it (steps, labels, bounds against a frozen store host) is
``gatherstore.job.control``.
"""

from __future__ import annotations

import datetime as _dt
import json
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from gatherstore._errors import GatherTimeout, ranks_named, seconds

__all__ = [
    "HOST_GRACE",
    "READ_WAIT",
    "Outcome",
    "Summarize",
    "exchange_on",
    "late_error",
    "summary_of",
    "wait_for_readers",
]

# the verdict key's value: every rank's value, a summary of them, or the ranks that were late
_VALUES, _SUMMARY, _LATE = b"V", b"S", b"L"

#: Computes, on one rank, what every rank needs from all values (None: send all values).
Summarize = Callable[[list[bytes]], bytes | None]


@dataclass(frozen=True)
class Outcome:
    """What one rank got from an exchange: every value (``values``; None where only
    the summary was sent to it), the ``summary``, or the ranks that were ``late``.
    ``unread``: on a rank 0 that hosts the store, the key the last reader sets once
    every rank has read, when they had not within ``READ_WAIT`` (see
    ``wait_for_readers``); None when they have."""

    values: list[bytes] | None = None
    summary: bytes | None = None
    late: list[int] | None = None
    unread: str | None = None


# how long ranks that timed out wait for the one rank judging who is late
_JUDGE_GRACE = 5.0
#: Seconds a rank 0 that hosts the store waits, in an exchange, for the others to read it.
READ_WAIT = 1.0
#: Seconds past an exchange's timeout after which its store host counts as frozen
#: (an exchange may take up to _JUDGE_GRACE more than its timeout to agree on a verdict).
HOST_GRACE = 2 * _JUDGE_GRACE


def summary_of(summarize: Summarize | None, values: list[bytes]) -> bytes | None:
    """``summarize(values)``; None when there is none or it fails (all values go out then)."""
    if summarize is None:
        return None
    try:
        return summarize(values)
    except Exception:  # a summary is an optimisation: every rank can still decide from all values
        return None


def exchange_on(
    store: Any,
    prefix: str,
    rank: int,
    world: int,
    value: bytes,
    *,
    timeout: float,
    rank0_hosts: bool = False,
    summarize: Summarize | None = None,
    full: Collection[int] | None = None,
) -> Outcome:
    """One exchange among ``world`` ranks on a c10d ``store`` under ``prefix``.

    Returns every rank's ``value`` in rank order (with ``summarize``: the summary,
    and the values only on the ranks in ``full``, default all), or the ranks missing
    at the first timeout: one verdict that every rank (a late one included, once
    it arrives) returns.  A rank 0 that hosts the store waits for the others to read,
    :data:`READ_WAIT` at most (a quarter of ``timeout`` if less): a program may
    destroy the group, and the store, right after.  Past that (a rank died before
    its read) it goes on, so as not to be late for the next exchange, and its exit
    waits instead (the outcome's ``unread`` key, see ``wait_for_readers``).  Each
    rank deletes its own key once it has read the values' verdict (so no rank
    deletes W keys in a row), and the last rank to read deletes the rest (every key,
    after a timeout).

    Raises:
        RuntimeError: the store failed (torch's ``DistStoreError``).
    """
    keys = [f"{prefix}{r}" for r in range(world)]
    verdict = prefix + "all"
    full = range(world) if full is None else full
    store.set(keys[rank], value)
    if store.add(prefix + "arrived", 1) == world:  # the last arriver gathers, once
        store.compare_set(verdict, "", _proposal(store, prefix, keys, summarize, full))
    try:
        store.wait([verdict], _dt.timedelta(seconds=timeout))
    except RuntimeError:  # a timeout, or the store is gone (then the next call raises)
        _judge(store, prefix, keys, summarize, full)
    outcome = _read(store, prefix, rank in full)
    # the values are out; unless a judge ran (it, or a stalled last arriver, may still
    # gather), nothing reads this rank's key again
    keep = outcome.late is not None or store.add(prefix + "judge", 0) > 0
    if not keep:
        store.delete_key(keys[rank])
    if store.add(prefix + "read", 1) == world:  # the last reader tidies up the rest
        left = keys if keep else []
        for key in [*left, verdict, *(prefix + k for k in ("arrived", "judge", "read", "full"))]:
            store.delete_key(key)
        if outcome.late is None and rank0_hosts and rank != 0:
            store.set(prefix + "done", b"")
    elif outcome.late is None and rank0_hosts and rank == 0:
        done = prefix + "done"
        if not wait_for_readers(store, done, min(timeout / 4, READ_WAIT)):
            return replace(outcome, unread=done)
    return outcome


def _proposal(
    store: Any, prefix: str, keys: list[str], summarize: Summarize | None, full: Collection[int]
) -> bytes:
    """The verdict once every key is in: all values, or a summary (the values go
    to a key of their own first, for the ranks in ``full``)."""
    values = store.multi_get(keys)
    summary = summary_of(summarize, values)
    if summary is None:
        return _pack(values)
    if full:
        store.set(prefix + "full", _pack(values))
    return _SUMMARY + summary


def _read(store: Any, prefix: str, in_full: bool) -> Outcome:
    """This rank's outcome from the verdict (and the values' key, for a rank in ``full``)."""
    packed = store.get(prefix + "all")
    if packed.startswith(_LATE):
        return Outcome(late=list(json.loads(packed[len(_LATE) :])))
    if packed.startswith(_SUMMARY):
        values = _unpack(store.get(prefix + "full")) if in_full else None
        return Outcome(values=values, summary=packed[len(_SUMMARY) :])
    return Outcome(values=_unpack(packed))


def _judge(
    store: Any, prefix: str, keys: list[str], summarize: Summarize | None, full: Collection[int]
) -> None:
    """After a timeout, decide the verdict: the ranks whose keys are missing.

    One rank checks the W keys while the others wait a little for its verdict
    (so a timeout costs O(W) requests too); the first proposal wins, so every
    rank agrees even when a late rank arrives between two ranks' timeouts.  When
    every key is in, the last arriver died or stalled between counting itself in
    and publishing: the judge gathers the values itself, at once (both would
    publish the same verdict, and the first to land wins).
    """
    verdict = prefix + "all"
    first = store.add(prefix + "judge", 1) == 1
    if not first:
        try:
            store.wait([verdict], _dt.timedelta(seconds=_JUDGE_GRACE))
            return
        except RuntimeError:  # the judge is gone or stuck: judge too
            pass
    late = [r for r, key in enumerate(keys) if not store.check([key])]
    if late:
        store.compare_set(verdict, "", _LATE + json.dumps(late).encode())
        return
    store.compare_set(verdict, "", _proposal(store, prefix, keys, summarize, full))


def _pack(values: list[bytes]) -> bytes:
    """Values as one, each distinct value once: the runs of equal values (index into
    the distinct ones, length), the distinct values' lengths, then their bytes.
    When every rank sends the same bytes this is O(1), not O(W)."""
    distinct: dict[bytes, int] = {}
    runs: list[int] = []
    for value in values:
        index = distinct.setdefault(value, len(distinct))
        if runs and runs[-2] == index:
            runs[-1] += 1
        else:
            runs += [index, 1]
    head = struct.pack(
        f"<II{len(runs)}I{len(distinct)}I",
        len(runs) // 2,
        len(distinct),
        *runs,
        *map(len, distinct),
    )
    return _VALUES + head + b"".join(distinct)


def _unpack(packed: bytes) -> list[bytes]:
    """What ``_pack`` packed."""
    body = memoryview(packed)[len(_VALUES) :]
    count, kinds = struct.unpack_from("<II", body)
    runs = struct.unpack_from(f"<{2 * count}I", body, 8)
    lengths = struct.unpack_from(f"<{kinds}I", body, 8 + 8 * count)
    distinct, offset = [], 8 + 8 * count + 4 * kinds
    for length in lengths:
        distinct.append(bytes(body[offset : offset + length]))
        offset += length
    values: list[bytes] = []
    for index, run in zip(runs[::2], runs[1::2], strict=True):
        values += [distinct[index]] * run
    return values


def wait_for_readers(store: Any, unread: str, timeout: float) -> bool:
    """Whether every rank read an exchange (the key ``unread`` its last reader sets)
    within ``timeout`` s: a rank 0 that hosts the store and leaves right after an
    exchange would take the store away from ranks still reading it."""
    try:
        store.wait([unread], _dt.timedelta(seconds=max(timeout, 0.001)))
    except RuntimeError:  # not yet: a rank died before its read, or is frozen
        return False
    store.delete_key(unread)
    return True


def late_error(what: str, late: list[int], timeout: float) -> GatherTimeout:
    return GatherTimeout(
        f"{what}: {ranks_named(late)} did not arrive within {seconds(timeout)} s: still busy, "
        "stuck, or stopped (raise the timeout if the work legitimately takes longer)",
        ranks=late,
        timeout=timeout,
    )
