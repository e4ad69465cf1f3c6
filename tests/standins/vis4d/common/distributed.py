"""Stand-in for ``vis4d.common.distributed``: topology from the launcher's variables, objects
pickled into tensors or files, as vis4d documents and does."""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def get_world_size() -> int:
    """WORLD_SIZE, else SLURM_NTASKS (not in an interactive ``bash`` job), else 1."""
    size = _env("WORLD_SIZE")
    if size is None and os.environ.get("SLURM_JOB_NAME") != "bash":
        size = _env("SLURM_NTASKS")
    return 1 if size is None else size


def get_rank() -> int:
    """RANK, else SLURM_PROCID (not in an interactive job), else the local rank."""
    rank = _env("RANK")
    if rank is None and os.environ.get("SLURM_JOB_NAME") != "bash":
        rank = _env("SLURM_PROCID")
    return get_local_rank() if rank is None else rank


def get_local_rank() -> int:
    """LOCAL_RANK, else SLURM_LOCALID, else 0."""
    rank = _env("LOCAL_RANK")
    if rank is None:
        rank = _env("SLURM_LOCALID")
    return 0 if rank is None else rank


def distributed_available() -> bool:
    return dist.is_available() and dist.is_initialized()


def synchronize() -> None:
    if distributed_available() and get_world_size() > 1:
        dist.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    if not distributed_available():
        return obj
    box = [obj if get_rank() == src else None]
    dist.broadcast_object_list(box, src)
    return box[0]


def obj2tensor(pyobj: Any, device: torch.device = torch.device("cuda")) -> torch.Tensor:  # noqa: B008
    return torch.tensor(bytearray(pickle.dumps(pyobj)), dtype=torch.uint8).to(device)


def tensor2obj(tensor: torch.Tensor) -> Any:
    return pickle.loads(tensor.cpu().numpy().tobytes())


def serialize_to_tensor(data: Any) -> torch.Tensor:
    backend = dist.get_backend()
    assert backend in ("gloo", "nccl"), "_serialize_to_tensor only supports gloo and nccl backends."
    return obj2tensor(data, torch.device("cpu" if backend == "gloo" else "cuda"))


def rank_zero_only(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs) if get_rank() == 0 else None

    return wrapped


def pad_to_largest_tensor(tensor: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    counts: list[Any] = [None] * get_world_size()
    dist.all_gather_object(counts, tensor.numel())
    largest = max(counts)
    if tensor.numel() < largest:
        padding = torch.zeros(largest - tensor.numel(), dtype=torch.uint8, device=tensor.device)
        tensor = torch.cat((tensor, padding))
    return counts, tensor


def all_gather_object_gpu(data: Any, rank_zero_return_only: bool = True) -> list[Any] | None:
    world = get_world_size()
    if world == 1:
        return [data]
    sizes, padded = pad_to_largest_tensor(serialize_to_tensor(data))
    tensors: list[Any] = [None] * world
    dist.all_gather_object(tensors, padded)
    if rank_zero_return_only and get_rank() != 0:
        return None
    return [tensor2obj(t[:n]) for t, n in zip(tensors, sizes, strict=True)]


def create_tmpdir(rank, tmpdir=None, use_system_tmp=True):
    """``tmpdir`` if given, else a fresh folder rank 0 makes under a ``.dist_tmp`` and sends."""
    if tmpdir is None:
        root = Path(tempfile.gettempdir() if use_system_tmp else "vis4d-workspace", ".dist_tmp")
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
        return broadcast(tempfile.mkdtemp(dir=root) if rank == 0 else None)
    Path(tmpdir).mkdir(parents=True, exist_ok=True)
    return tmpdir


def all_gather_object_cpu(data, tmpdir=None, rank_zero_return_only=True, use_system_tmp=False):
    """Every rank pickles into a shared folder; rank 0 reads all, then removes the folder."""
    rank, world = get_rank(), get_world_size()
    if world == 1:
        return [data]
    folder = create_tmpdir(rank, tmpdir, use_system_tmp)
    with open(os.path.join(folder, f"part_{rank}.pkl"), "wb") as f:
        pickle.dump(data, f)
    synchronize()
    if rank_zero_return_only and rank != 0:
        return None
    parts = []
    for i in range(world):
        with open(os.path.join(folder, f"part_{i}.pkl"), "rb") as f:
            parts.append(pickle.load(f))
    if not rank_zero_return_only:
        synchronize()
    if rank == 0:
        shutil.rmtree(folder)
    return parts


def reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    if not distributed_available():
        return tensor
    tensor = tensor.clone()
    dist.all_reduce(tensor.div_(get_world_size()))
    return tensor


def all_reduce_dict(
    py_dict: dict[str, Any], reduce_op: str = "sum", to_float: bool = True
) -> dict[str, Any]:
    """A plain dict's keys come from rank 0 (through a CUDA tensor); an OrderedDict keeps its."""
    world = get_world_size()
    if world == 1:
        return py_dict
    keys = list(py_dict)
    if not isinstance(py_dict, OrderedDict):
        key_tensor = obj2tensor(keys)
        dist.broadcast(key_tensor, src=0)
        keys = tensor2obj(key_tensor)
    values = [py_dict[k] for k in keys]
    flat = torch.cat([v.flatten().float() if to_float else v.flatten() for v in values])
    dist.all_reduce(flat)
    if reduce_op == "mean":
        flat /= world
    pieces = torch.split(flat, [v.numel() for v in values])
    out = {k: p.reshape(v.shape) for k, p, v in zip(keys, pieces, values, strict=True)}
    return OrderedDict(out) if isinstance(py_dict, OrderedDict) else out


def is_module_wrapper(module: nn.Module) -> bool:
    """Checks recursively: the module or any child is DataParallel or DistributedDataParallel."""
    if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return True
    return any(is_module_wrapper(child) for child in module.children())
