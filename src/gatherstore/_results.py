"""``collect_results``: the dataset-ordered results of a sharded evaluation on one rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from . import _control as control
from ._config import Timeout
from ._objects import check_arguments, gather_prepared
from ._topology import is_distributed
from .stores.base import Store

__all__ = ["check_results", "collect_results"]

Order = Literal["interleaved", "contiguous"]


def check_results(results: Any, indices: Sequence[int] | None, order: str) -> None:
    if order not in ("interleaved", "contiguous"):
        raise ValueError(f"order={order!r}: use 'interleaved' (DistributedSampler) or 'contiguous'")
    if not isinstance(results, Sequence) or isinstance(results, (str, bytes)):
        raise TypeError(f"results must be a list, not {type(results).__name__}")
    if indices is not None and len(indices) != len(results):
        raise ValueError(
            f"indices has {len(indices)} entries but results has {len(results)}; "
            "give one dataset index per result"
        )


def _by_index(parts: list[tuple[list[Any], list[int]]], size: int | None) -> list[Any]:
    found: dict[int, Any] = {}
    for results, indices in parts:
        for index, result in zip(indices, results, strict=True):
            found.setdefault(int(index), result)
    count = size if size is not None else (max(found) + 1 if found else 0)
    missing = [i for i in range(count) if i not in found]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise ValueError(
            f"collect_results: no rank returned a result for dataset indices {shown} "
            f"({len(missing)} of {count} missing); check the sampler and the indices passed"
        )
    return [found[i] for i in range(count)]


def _ordered(parts: list[list[Any]], order: str, size: int | None) -> list[Any]:
    if order == "contiguous":
        merged = [r for part in parts for r in part]
    else:
        longest = max((len(p) for p in parts), default=0)
        merged = [p[i] for i in range(longest) for p in parts if i < len(p)]
    return merged if size is None else merged[:size]


@control.serialized
def collect_results(
    results: list[Any],
    size: int | None = None,
    *,
    order: Order = "interleaved",
    indices: Sequence[int] | None = None,
    dst: int = 0,
    store: str | Store | None = None,
    timeout: Timeout = None,
    progress: bool | None = None,
    resume: str | None = None,
) -> list[Any] | None:
    """Gather every rank's ``results`` on ``dst`` in dataset order; None elsewhere.

    ``order="interleaved"`` undoes a DistributedSampler split (rank r held
    items r, r+W, ...); ``"contiguous"`` concatenates shards in rank order.
    With ``indices`` (one dataset index per result) the results are placed by
    index, duplicates dropped.  ``size`` drops the sampler's padding beyond it.
    Results that are None are kept.  ``progress`` shows parts and bytes as they
    arrive on ``dst`` (None: when stderr is a terminal and the gather is long, or
    as ``GATHERSTORE_PROGRESS=0/1`` says).

    With ``resume`` (a [`ResultSet`][gatherstore.ResultSet] name, in ``store``, which
    must outlive the job), the results are kept in that set under their dataset
    indices as well, and ``dst`` gets every index below ``size`` from this run or
    an earlier one: a preempted evaluation continues on any number of ranks
    (``ResultSet(name).pending(range(size))`` says which indices are left).

    Raises:
        ValueError: bad arguments (on every rank), or, with ``indices``, a
            dataset index no rank returned (with ``resume``: no run stored).
        GatherError: with ``resume``, the errors of [`ResultSet`][gatherstore.ResultSet].
    """
    if resume is not None:
        from ._rs_collect import collect_into

        return collect_into(resume, results, size, order, indices, dst, store, timeout)

    def payload() -> Any:
        check_results(results, indices, order)
        return (list(results), [int(i) for i in indices] if indices is not None else None)

    check_arguments("collect_results", store, timeout, rank=("dst", dst), progress=progress)
    if not is_distributed():
        parts = [payload()]
    else:
        gathered = gather_prepared(
            payload, dst, store, timeout, "collect_results", progress=progress
        )
        if gathered is None:
            return None
        parts = list(gathered)
    if indices is not None:
        return _by_index(parts, size)
    return _ordered([p[0] for p in parts], order, size)
