"""The usual tools, as baselines: torch.distributed's object collectives, mmengine's tmpdir.

``collect_results_cpu`` re-implements ``mmengine.dist.collect_results_cpu``
(its ``tmpdir=None`` path) step for step, for machines without mmengine:
rank 0 creates a directory under ``./.dist_test`` and broadcasts its path as
a space-padded uint8 tensor of 512 bytes; every rank pickles its part
(protocol 2) to ``part_{rank}.pkl``; barrier; rank 0 loads every part, zips
them (interleaved order), truncates to ``size`` and removes the directory.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "collect_results_cpu",
    "mmengine_collect_results_cpu",
    "torch_all_gather_object",
    "torch_gather_object",
]

_MAX_LEN = 512
_SPACE = 32


def torch_all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """``torch.distributed.all_gather_object`` on ``group`` (None: the default group)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def torch_gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """``torch.distributed.gather_object`` to ``dst`` on the default group."""
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def collect_results_cpu(result_part: list[Any], size: int) -> list[Any] | None:
    """mmengine's ``collect_results_cpu(result_part, size, tmpdir=None)``, re-implemented."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        return result_part[:size]
    dir_tensor = torch.full((_MAX_LEN,), _SPACE, dtype=torch.uint8)
    if rank == 0:
        os.makedirs(".dist_test", exist_ok=True)
        encoded = tempfile.mkdtemp(dir=".dist_test").encode()
        dir_tensor[: len(encoded)] = torch.tensor(bytearray(encoded), dtype=torch.uint8)
    dist.broadcast(dir_tensor, 0)
    tmpdir = dir_tensor.numpy().tobytes().decode().rstrip()
    with open(os.path.join(tmpdir, f"part_{rank}.pkl"), "wb") as f:
        pickle.dump(result_part, f, protocol=2)
    dist.barrier()
    if rank != 0:
        return None
    part_list = []
    for i in range(world_size):
        path = os.path.join(tmpdir, f"part_{i}.pkl")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{tmpdir} is not a shared directory for rank {rank}")
        with open(path, "rb") as f:
            part_list.append(pickle.load(f))
    ordered_results = []
    for res in zip(*part_list, strict=False):
        ordered_results.extend(list(res))
    ordered_results = ordered_results[:size]
    shutil.rmtree(tmpdir)
    return ordered_results


def mmengine_collect_results_cpu() -> tuple[Callable[[list[Any], int], list[Any] | None], str]:
    """mmengine's own ``collect_results_cpu`` when importable, else the re-implementation.

    Returns:
        The function and which one it is (``"mmengine <version>"`` or ``"re-implementation"``).
    """
    try:
        import mmengine
        from mmengine.dist import collect_results_cpu as real
    except ImportError:
        return collect_results_cpu, "re-implementation"
    return real, f"mmengine {mmengine.__version__}"
