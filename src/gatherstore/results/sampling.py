"""Where each rank's results sit in the dataset: a DistributedSampler's interleaving,
contiguous shards, or explicit dataset indices (``collect_results``'s ``order`` and
``indices``); pure functions, the same with or without a result set."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

__all__ = ["Order", "by_index", "check_results", "indices_of", "ordered"]

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


def by_index(parts: list[tuple[list[Any], list[int]]], size: int | None) -> list[Any]:
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


def ordered(parts: list[list[Any]], order: str, size: int | None) -> list[Any]:
    if order == "contiguous":
        merged = [r for part in parts for r in part]
    else:
        longest = max((len(p) for p in parts), default=0)
        merged = [p[i] for i in range(longest) for p in parts if i < len(p)]
    return merged if size is None else merged[:size]


def indices_of(
    counts: list[int], order: str, indices: Sequence[int] | None, rank: int, world: int
) -> list[int]:
    """The dataset index of each of this rank's results (``counts``: every rank's count)."""
    if indices is not None:
        return [int(i) for i in indices]
    if order == "interleaved":
        return list(range(rank, rank + world * counts[rank], world))
    start = sum(counts[:rank])
    return list(range(start, start + counts[rank]))
