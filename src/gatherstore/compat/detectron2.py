"""Today's ``detectron2.utils.comm`` with objects gathered through gatherstore.

Same names, signatures and answers as detectron2's; ``all_gather``,
``gather`` and ``shared_random_seed`` go through gatherstore's routes and
stores on any process group (never GPU memory), ``reduce_dict`` and
``synchronize`` through the process group.  The per-machine local process group
is created as detectron2's ``launch()`` creates it, and gathers on it go through
gatherstore too; before it exists, local rank and size are answered by host
instead of failing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import gatherstore as gs
from gatherstore.compat._common import NO_PROCESS_GROUP, gather_all, gather_to
from gatherstore.compat._patching import Patch, patch_module

__all__ = [
    "_LOCAL_PROCESS_GROUP",
    "all_gather",
    "create_local_process_group",
    "gather",
    "get_local_process_group",
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

#: The group of this machine's ranks, once ``create_local_process_group`` (or a
#: launcher) made it; None otherwise.
_LOCAL_PROCESS_GROUP: dist.ProcessGroup | None = None
# (num_workers_per_machine, default group) the local group above was made for here
_made_for: list[tuple[int, Any] | None] = [None]
_MISSING_LOCAL_GROUP = (
    "Local process group is not yet created! Please use detectron2's `launch()` to start "
    "processes and initialize pytorch process group. If you need to start processes in other "
    "ways, please call comm.create_local_process_group(num_workers_per_machine) after calling "
    "torch.distributed.init_process_group()."
)


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return gs.get_world_size()


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return gs.get_rank()


def _local_group() -> dist.ProcessGroup | None:
    """``_LOCAL_PROCESS_GROUP`` while it belongs to the current process group, else None."""
    made_for = _made_for[0]
    if _LOCAL_PROCESS_GROUP is None or not gs.is_distributed():
        return None
    if made_for is not None and made_for[1] is not dist.distributed_c10d._get_default_group():
        return None  # made for a process group that has since been destroyed
    return _LOCAL_PROCESS_GROUP


def create_local_process_group(num_workers_per_machine: int) -> None:
    """Create the group of the ranks on this machine (machine m: ranks m*n to m*n+n-1).

    Every rank must call it, after the process group exists; detectron2's
    ``launch()`` does.  Calling it again with the same count does nothing.

    Raises:
        ValueError: no process group.
        AssertionError: a local group exists already, or the world size is not
            a multiple of ``num_workers_per_machine``.
    """
    global _LOCAL_PROCESS_GROUP
    default = dist.distributed_c10d._get_default_group() if gs.is_distributed() else None
    if _local_group() is not None and _made_for[0] == (num_workers_per_machine, default):
        return
    if _made_for[0] is not None and _local_group() is None:  # one of a finished job
        _LOCAL_PROCESS_GROUP, _made_for[0] = None, None
    assert _LOCAL_PROCESS_GROUP is None, "the local process group was created already"
    world = get_world_size()
    assert world % num_workers_per_machine == 0, (
        f"world size {world} is not a multiple of num_workers_per_machine={num_workers_per_machine}"
    )
    if default is None:
        raise ValueError(NO_PROCESS_GROUP)
    machine = get_rank() // num_workers_per_machine
    for first in range(0, world, num_workers_per_machine):
        group = dist.new_group(list(range(first, first + num_workers_per_machine)))
        if first == machine * num_workers_per_machine:
            _LOCAL_PROCESS_GROUP = group
    _made_for[0] = (num_workers_per_machine, default)


def get_local_process_group() -> dist.ProcessGroup:
    """The group of this machine's ranks made by ``create_local_process_group``.

    Raises:
        AssertionError: it was not created (also without a process group).
    """
    group = _local_group()
    assert group is not None, _MISSING_LOCAL_GROUP
    return group


def get_local_rank() -> int:
    """Rank within this machine: in the local process group once it exists, else by host.

    detectron2 asserts before the local group exists; the ranks sharing this
    host give the right answer instead.
    """
    group = _local_group()
    return gs.get_local_rank() if group is None else dist.get_rank(group=group)


def get_local_size() -> int:
    """Processes on this machine: the local process group's size, else by host (1 serially)."""
    group = _local_group()
    return gs.get_local_size() if group is None else dist.get_world_size(group=group)


def is_main_process() -> bool:
    """Whether this is rank 0."""
    return get_rank() == 0


def synchronize() -> None:
    """Barrier among all processes (nothing in a single process)."""
    gs.barrier()


def all_gather(data: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``data``, in group-rank order, through gatherstore's store, on
    any process group (e.g. the local one); ``[]`` on a rank outside ``group``, as
    detectron2 returns there."""
    if get_world_size() == 1 or gs.get_world_size(group) == 1:
        return [data]
    return gather_all(data, group)


def gather(data: Any, dst: int = 0, group: Any = None) -> list[Any]:
    """Every rank's ``data`` on global rank ``dst`` (as torch's ``gather_object``, which
    detectron2 passes it to, takes it); an empty list on the other ranks."""
    if get_world_size() == 1 or gs.get_world_size(group) == 1:
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
