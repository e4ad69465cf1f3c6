"""``mmengine.dist.utils``: topology, process-group setup and device helpers.

Re-exported by ``gatherstore.compat.mmengine``.  Serial answers without a
process group; local rank and size answered by host when mmengine's local
group was never created.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

import gatherstore as gs
from gatherstore.job import slurm

ProcessGroup = dist.ProcessGroup
_local_group: list[ProcessGroup | None] = [None]


# --- topology -----------------------------------------------------------------------
def is_distributed() -> bool:
    """Whether a process group is initialised."""
    return gs.is_distributed()


def get_default_group() -> ProcessGroup | None:
    """The default process group; None without one (mmengine raises there)."""
    return dist.distributed_c10d._get_default_group() if is_distributed() else None


def get_backend(group: ProcessGroup | None = None) -> str | None:
    """The group's backend in lower case, None without a process group."""
    if not is_distributed():
        return None
    return str(dist.get_backend(group if group is not None else get_default_group()))


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (1 without a process group, -1 on a rank outside it)."""
    return gs.get_world_size(group)


def get_rank(group: ProcessGroup | None = None) -> int:
    """This rank in ``group`` (0 without a process group, -1 on a rank outside it)."""
    return gs.get_rank(group)


def get_dist_info(group: ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``."""
    return get_rank(group), get_world_size(group)


def is_main_process(group: ProcessGroup | None = None) -> bool:
    """Whether this is rank 0 of ``group``."""
    return get_rank(group) == 0


def master_only(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func`` on the main process only (None elsewhere)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs) if is_main_process() else None

    return wrapper


def init_local_group(node_rank: int, num_gpus_per_node: int) -> None:
    """Create the group of this node's ranks (every rank must call it)."""
    assert _local_group[0] is None, "init_local_group() was already called"
    first = node_rank * num_gpus_per_node
    _local_group[0] = dist.new_group(list(range(first, first + num_gpus_per_node)))


def get_local_group() -> ProcessGroup | None:
    """The group made by ``init_local_group``; None without a process group.

    Raises:
        RuntimeError: distributed, but ``init_local_group`` was not called.
    """
    if not is_distributed():
        return None
    if _local_group[0] is None:
        raise RuntimeError(
            "the local process group is not created: call init_local_group(node_rank, "
            "num_gpus_per_node) first"
        )
    return _local_group[0]


def get_local_size() -> int:
    """Ranks on this node: the local group's size, else gatherstore's answer.

    mmengine raises before ``init_local_group``; the ranks sharing this host
    are the right answer then.
    """
    if _local_group[0] is not None and is_distributed():
        return dist.get_world_size(_local_group[0])
    return gs.get_local_size()


def get_local_rank() -> int:
    """This rank on its node: from the local group, else gatherstore's answer."""
    if _local_group[0] is not None and is_distributed():
        return dist.get_rank(_local_group[0])
    return gs.get_local_rank()


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group``; nothing without a process group."""
    if is_distributed():
        gs.barrier(group=group)


def infer_launcher() -> str:
    """ "pytorch", "slurm", "mpi" or "none", from the environment."""
    for var, name in (
        ("WORLD_SIZE", "pytorch"),
        ("SLURM_NTASKS", "slurm"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "mpi"),
    ):
        if var in os.environ:
            return name
    return "none"


def init_dist(
    launcher: Any, backend: Any = "nccl", init_backend: Any = "torch", **kwargs: Any
) -> None:
    """Join the process group a launcher ("pytorch", "mpi", "slurm") describes.

    ``kwargs`` go to ``torch.distributed.init_process_group``; ``timeout`` is in
    seconds.  The CUDA device is set only where CUDA exists.  Under slurm without
    MASTER_ADDR the master is the first node of the job step (where rank 0 runs).

    Raises:
        ValueError: unknown launcher, an ``init_backend`` other than "torch", or
            under slurm without MASTER_ADDR a missing or malformed node list.
        TypeError: ``timeout`` is not a number of seconds.
        KeyError: launcher variables missing (e.g. MASTER_ADDR under mpi).
    """
    if kwargs.get("timeout") is not None:
        try:
            kwargs["timeout"] = datetime.timedelta(seconds=kwargs["timeout"])
        except TypeError as exc:
            raise TypeError(
                f"timeout must be a number of seconds, not {type(kwargs['timeout']).__name__}: "
                "e.g. dist_cfg=dict(backend='nccl', timeout=1800)"
            ) from exc
    if launcher not in ("pytorch", "mpi", "slurm"):
        raise ValueError(f"launcher={launcher!r}: use 'pytorch', 'mpi' or 'slurm'")
    if init_backend != "torch":
        raise ValueError(
            f"init_backend={init_backend!r} is not supported here: use 'torch' (or mmengine's "
            "own init_dist for deepspeed/colossalai)"
        )
    if mp.get_start_method(allow_none=True) is None:
        mp.set_start_method("spawn")
    env = os.environ
    if launcher == "mpi":
        local_rank = int(env["OMPI_COMM_WORLD_LOCAL_RANK"])
        env.setdefault("MASTER_PORT", "29500")
        if "MASTER_ADDR" not in env:
            raise KeyError("MASTER_ADDR is not set: export it before an mpi launch")
        env["WORLD_SIZE"], env["RANK"] = env["OMPI_COMM_WORLD_SIZE"], env["OMPI_COMM_WORLD_RANK"]
    elif launcher == "slurm":
        env["MASTER_ADDR"] = env["MASTER_ADDR"] if "MASTER_ADDR" in env else slurm.master_addr(env)
        port = kwargs.pop("port", None)
        if port is not None:
            env["MASTER_PORT"] = str(port)
        env.setdefault("MASTER_PORT", "29500")
        gpus = max(torch.cuda.device_count(), 1)
        local_rank = int(env.get("SLURM_LOCALID", int(env["SLURM_PROCID"]) % gpus))
        env["WORLD_SIZE"], env["RANK"] = env["SLURM_NTASKS"], env["SLURM_PROCID"]
        env["LOCAL_RANK"] = str(local_rank)
    else:
        local_rank = int(env["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, **kwargs)


# --- tensors: torch.distributed directly ------------------------------------------------
def get_data_device(data: Tensor | Mapping[Any, Any] | Iterable[Any]) -> torch.device:
    """The one device of a tensor, or of every tensor in a dict or sequence.

    Raises:
        ValueError: devices differ, or the container is empty (mmengine's messages).
        TypeError: ``data`` holds something other than tensors.
    """
    if isinstance(data, Tensor):
        return data.device
    if isinstance(data, Mapping):
        items: Iterable[Any] = data.values()
    elif isinstance(data, Iterable) and not isinstance(data, str):
        items = data
    else:
        raise TypeError(f"data should be a Tensor, sequence of tensor or dict, but got {data}")
    found = None
    for item in items:
        device = get_data_device(item)
        if found is not None and device != found:
            raise ValueError(
                f"device type in data should be consistent, but got {device} and {found}"
            )
        found = device
    if found is None:
        raise ValueError("data should not be empty.")
    return found


def get_comm_device(group: ProcessGroup | None = None) -> torch.device:
    """Where the group's collectives need tensors: the current CUDA device under NCCL."""
    if get_backend(group) in ("nccl", "smddp"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cast_data_device(
    data: Tensor | Mapping[Any, Any] | Iterable[Any],
    device: torch.device,
    out: Tensor | Mapping[Any, Any] | Iterable[Any] | None = None,
) -> Tensor | Mapping[Any, Any] | Iterable[Any]:
    """``data`` (tensor, dict or sequence of them) on ``device``, copied into ``out`` if given.

    Raises:
        TypeError: ``out`` differs in type from ``data`` or is a set; non-tensor data.
        ValueError: empty containers, or ``out`` of another length (mmengine's messages).
    """
    if out is not None:
        if type(data) is not type(out):
            raise TypeError(
                "out should be the same type with data, but got data is "
                f"{type(data)} and out is {type(out)}"
            )
        if isinstance(out, set):
            raise TypeError("out should not be a set")
    if isinstance(data, Tensor):
        moved = data if data.device == device else data.to(device)
        if isinstance(out, Tensor):
            out.copy_(moved)
        return moved
    if isinstance(data, Mapping):
        if isinstance(out, Mapping) and len(out) != len(data):
            raise ValueError(
                f"length of data and out should be same, but got {len(data)} and {len(out)}"
            )
        cast = {
            k: cast_data_device(v, device, out[k] if isinstance(out, Mapping) else None)
            for k, v in data.items()
        }
        if not cast:
            raise ValueError("data should not be empty")
        return type(data)(cast)  # type: ignore[call-arg]
    if isinstance(data, Iterable) and not isinstance(data, (str, np.ndarray)):
        outs: Iterable[Any] = out if out is not None else iter(lambda: None, 0)
        items = [cast_data_device(v, device, o) for v, o in zip(data, outs, strict=False)]
        if not items:
            raise ValueError("data should not be empty")
        return type(data)(items)  # type: ignore[call-arg]
    raise TypeError(f"data should be a Tensor, list of tensor or dict, but got {data}")
