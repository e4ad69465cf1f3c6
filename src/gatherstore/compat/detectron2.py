"""``detectron2.utils.comm`` with objects gathered through gatherstore.

Same names, signatures and answers as detectron2's; ``all_gather``,
``gather`` and ``shared_random_seed`` go through gatherstore's routes and
stores (never GPU memory), ``reduce_dict`` and ``synchronize`` through the
process group.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import gatherstore as gs

from ._common import gather_all, gather_to, group_size
from ._patching import Patch, patch_module

__all__ = [
    "_LOCAL_PROCESS_GROUP",
    "all_gather",
    "gather",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "patch",
    "reduce_dict",
    "shared_random_seed",
    "synchronize",
]

#: The group of this machine's ranks, when a launcher created one; None otherwise.
_LOCAL_PROCESS_GROUP: dist.ProcessGroup | None = None


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return gs.get_world_size()


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return gs.get_rank()


def get_local_rank() -> int:
    """Rank within this machine: from ``_LOCAL_PROCESS_GROUP`` when set, else by host.

    detectron2 asserts when its launcher did not create the local group;
    the ranks sharing this host give the right answer instead.
    """
    if _LOCAL_PROCESS_GROUP is not None and gs.is_distributed():
        return dist.get_rank(group=_LOCAL_PROCESS_GROUP)
    return gs.get_local_rank()


def get_local_size() -> int:
    """Processes on this machine (1 without a process group)."""
    if _LOCAL_PROCESS_GROUP is not None and gs.is_distributed():
        return dist.get_world_size(group=_LOCAL_PROCESS_GROUP)
    return gs.get_local_size()


def is_main_process() -> bool:
    """Whether this is rank 0."""
    return get_rank() == 0


def synchronize() -> None:
    """Barrier among all processes (nothing in a single process)."""
    gs.barrier()


def all_gather(data: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``data``, in rank order, through gatherstore's store."""
    if get_world_size() == 1 or group_size(group) == 1:
        return [data]
    return gather_all(data, group)


def gather(data: Any, dst: int = 0, group: Any = None) -> list[Any]:
    """Every rank's ``data`` on ``dst``; an empty list on the other ranks."""
    if get_world_size() == 1 or group_size(group) == 1:
        return [data]
    return gather_to(data, dst, group) or []


def shared_random_seed() -> int:
    """Rank 0's ``np.random.randint(2**31)``, the same on every rank (all must call it)."""
    return int(gs.broadcast_object(int(np.random.randint(2**31))))


def reduce_dict(
    input_dict: dict[str, torch.Tensor], average: bool = True
) -> dict[str, torch.Tensor]:
    """Sum (or average) scalar tensors onto rank 0, keys sorted; other ranks keep theirs."""
    if get_world_size() < 2:
        return input_dict
    with torch.no_grad():
        reduced = gs.reduce_dict(input_dict, average=average, dst=0)
    return {k: reduced[k] for k in sorted(input_dict)}


def patch() -> Patch:
    """Make the installed ``detectron2.utils.comm`` gather objects through gatherstore.

    Raises:
        ImportError: detectron2 is not installed.
    """
    names = ("all_gather", "gather", "shared_random_seed")
    return patch_module(
        "detectron2.utils.comm",
        "git+https://github.com/facebookresearch/detectron2.git",
        {n: globals()[n] for n in names},
    )
