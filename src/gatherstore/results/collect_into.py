"""Results by dataset index in a result set: ``collect_results(..., resume=name)`` and
Lightning's ``GatherPredictions(resume=name)``.

Each rank adds its results under the dataset indices the call implies (a
DistributedSampler's interleaving, contiguous shards, or explicit indices),
the sampler's padding beyond ``size`` left out; then every index below
``size`` must be stored, by this run or an earlier one (else every rank raises
ValueError naming the missing ones), and ``dst`` gets the values of indices
``0 .. size-1`` in order.  A preempted evaluation that calls it again, on any
number of ranks, keeps what earlier runs stored: ``ResultSet.pending`` says
which indices are left to compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gatherstore._config import Timeout
from gatherstore.calls.entry import collective, outside
from gatherstore.results.resultset import ResultSet
from gatherstore.results.sampling import check_results, indices_of
from gatherstore.stores.base import Store

__all__ = ["collect_into", "finish", "settle"]


def finish(rs: ResultSet, size: int | None, dst: int, timeout: Timeout) -> list[Any] | None:
    """The stored values of indices ``0 .. size-1`` (None: ``0 .. the largest``), in order,
    on ``dst``; None elsewhere.

    Raises:
        ValueError: an index below ``size`` is stored by no run (on every rank; without
            ``size``, a gap below the largest index, on ``dst``).
        and the errors of ``ResultSet.pending`` and ``ResultSet.gather``.
    """
    if size is not None:
        _no_gaps(rs.pending(range(size), timeout=timeout), size)
    pairs = rs.gather(group_dst=dst, timeout=timeout, keys=True)
    if pairs is None:
        return None
    found = {k: v for k, v in pairs if type(k) is int and k >= 0}
    count = size if size is not None else (max(found) + 1 if found else 0)
    _no_gaps([i for i in range(count) if i not in found], count)
    return [found[i] for i in range(count)]


def _no_gaps(missing: list[Any], count: int) -> None:
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise ValueError(
            f"collect_results: no run stored a result for dataset indices {shown} "
            f"({len(missing)} of {count} missing); compute them (ResultSet.pending says which) "
            "and call it again"
        )


def collect_into(
    name: str,
    results: Sequence[Any],
    size: int | None,
    order: str,
    indices: Sequence[int] | None,
    dst: int,
    store: str | Store | None,
    timeout: Timeout,
    *,
    group: Any = None,
) -> list[Any] | None:
    """``collect_results(results, size, ..., resume=name)``: see the module's docstring
    (``dst``: a rank of ``group``).

    Raises:
        ValueError: bad arguments (on every rank), or missing indices (see ``finish``).
        TypeError: a result of this rank cannot be pickled (``ResultSet.add``); the
            other ranks raise ``RemoteRankError`` naming this one.
        and the errors of ``ResultSet``.
    """
    if outside("collect_results", group):
        return None
    with ResultSet(name, store=store, timeout=timeout, group=group) as rs:
        with collective("collect_results", timeout=timeout, group=group) as call:
            mine = len(results) if isinstance(results, Sequence) else 0
            counts = [int(n) for n in call.send(str(mine).encode())]

            def keyed() -> list[int]:
                check_results(results, indices, order)
                return indices_of(counts, order, indices, call.rank, call.world)

            keys = call.agree(keyed)
            assert keys is not None
            # a result that cannot be pickled fails its add: on every rank at once
            call.agree(lambda: _add(rs, keys, results, size))
        return finish(rs, size, dst, timeout)


def _add(rs: ResultSet, keys: list[int], results: Sequence[Any], size: int | None) -> None:
    for key, result in zip(keys, results, strict=True):
        if size is None or key < size:
            rs.add(key, result)


def settle(
    rs: ResultSet,
    size: int | None,
    dst: int,
    timeout: Timeout,
    *,
    failed: BaseException | None = None,
    report: bool = False,
) -> list[Any] | None:
    """``finish``, then close the set; with ``report``, first raise ``failed`` (this
    rank's error, if any) on every rank.

    Raises:
        and the errors of ``finish`` (and ``failed``, or RemoteRankError naming it).
    """
    with rs:
        if report:
            what = f"result set {rs.name!r} (collect)"
            with collective(what, timeout=timeout, group=rs.group) as call:
                call.agree(lambda: _raise(failed))
        return finish(rs, size, dst, timeout)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error
