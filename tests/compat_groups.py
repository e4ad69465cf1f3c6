"""Process groups for the compat tests' subgroup cases, and torch's object collectives refused:
a drop-in that reaches them on any group fails."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

#: torch.distributed's object collectives (pickled through tensors), which no drop-in calls
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
)

#: the ranks of each group of :func:`subgroups`, in the 4-rank job
PAIRS = ([0, 1], [2, 3])
TAIL = [1, 2, 3]


@contextlib.contextmanager
def torch_objects_refused() -> Iterator[list[str]]:
    """Inside, torch.distributed's object collectives (as ``torch.distributed`` and
    ``distributed_c10d`` name them) raise AssertionError; yields the names of those called,
    so that a caller that swallows the error is caught too."""
    called: list[str] = []

    def refusing(name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            called.append(name)
            raise AssertionError(f"torch.distributed.{name} was called")

        return refuse

    originals = [(m, n, getattr(m, n)) for m in (dist, c10d) for n in OBJECT_COLLECTIVES]
    for module, name, _ in originals:
        setattr(module, name, refusing(name))
    try:
        yield called
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def subgroups() -> tuple[Any, Any]:
    """In every rank of a 4-rank job (all must call it): this rank's pair of ``PAIRS`` (two
    disjoint groups) and the group of ``TAIL`` (rank 0 is outside it, ranks within it are
    not the global ones)."""
    rank = dist.get_rank()
    made = [dist.new_group(ranks) for ranks in PAIRS]
    return made[rank // 2], dist.new_group(TAIL)


def pair_of(rank: int) -> list[int]:
    """The global ranks of ``rank``'s pair."""
    return PAIRS[rank // 2]
