"""Stand-in for today's ``detectron2.utils.comm``: torch.distributed's object collectives
on a gloo group, a per-machine local process group that ``launch()`` creates."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

_LOCAL_PROCESS_GROUP: Any = None
_NO_LOCAL_GROUP = (
    "Local process group is not yet created! Call comm.create_local_process_group("
    "num_workers_per_machine) after torch.distributed.init_process_group()."
)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def get_rank() -> int:
    return dist.get_rank() if _initialized() else 0


@functools.lru_cache
def create_local_process_group(num_workers_per_machine: int) -> None:
    """One group per machine; every rank creates every group; cached, so made once."""
    global _LOCAL_PROCESS_GROUP
    assert _LOCAL_PROCESS_GROUP is None
    world = get_world_size()
    assert world % num_workers_per_machine == 0
    mine = get_rank() // num_workers_per_machine
    for machine in range(world // num_workers_per_machine):
        first = machine * num_workers_per_machine
        group = dist.new_group(list(range(first, first + num_workers_per_machine)))
        if machine == mine:
            _LOCAL_PROCESS_GROUP = group


def get_local_process_group() -> Any:
    assert _LOCAL_PROCESS_GROUP is not None, _NO_LOCAL_GROUP
    return _LOCAL_PROCESS_GROUP


def get_local_rank() -> int:
    if not _initialized():
        return 0
    assert _LOCAL_PROCESS_GROUP is not None, _NO_LOCAL_GROUP
    return dist.get_rank(group=_LOCAL_PROCESS_GROUP)


def get_local_size() -> int:
    if not _initialized():
        return 1
    assert _LOCAL_PROCESS_GROUP is not None, _NO_LOCAL_GROUP
    return dist.get_world_size(group=_LOCAL_PROCESS_GROUP)


def is_main_process() -> bool:
    return get_rank() == 0


def synchronize() -> None:
    if get_world_size() > 1:
        dist.barrier()


@functools.lru_cache
def _gloo_world() -> Any:
    """Every rank, on gloo (objects stay off the GPU)."""
    return dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else dist.group.WORLD


def all_gather(data: Any, group: Any = None) -> list[Any]:
    if get_world_size() == 1:
        return [data]
    group = _gloo_world() if group is None else group
    size = dist.get_world_size(group)
    if size == 1:
        return [data]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, data, group=group)
    return out


def gather(data: Any, dst: int = 0, group: Any = None) -> list[Any]:
    if get_world_size() == 1:
        return [data]
    group = _gloo_world() if group is None else group
    size = dist.get_world_size(group=group)
    if size == 1:
        return [data]
    if dist.get_rank(group=group) == dst:
        out: list[Any] = [None] * size
        dist.gather_object(data, out, dst=dst, group=group)
        return out
    dist.gather_object(data, None, dst=dst, group=group)
    return []


def shared_random_seed() -> int:
    """Rank 0's numpy draw, on every rank."""
    return int(all_gather(np.random.randint(2**31))[0])


def reduce_dict(input_dict: dict[str, Any], average: bool = True) -> dict[str, Any]:
    """Scalar tensors summed (or averaged) onto rank 0, keys sorted."""
    world = get_world_size()
    if world < 2:
        return input_dict
    with torch.no_grad():
        names = sorted(input_dict)
        values = torch.stack([input_dict[k] for k in names])
        dist.reduce(values, dst=0)
        if dist.get_rank() == 0 and average:
            values /= world
        return dict(zip(names, values, strict=True))
