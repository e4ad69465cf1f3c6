"""``vis4d.common.distributed`` with objects gathered through gatherstore.

Same names, signatures and answers as vis4d's; ``all_gather_object_cpu``,
``all_gather_object_gpu`` and ``broadcast`` go through gatherstore's routes
and stores (never GPU memory).  Topology is read from the launcher's
variables first, as vis4d reads it, so code that runs before the process
group exists knows its rank.
"""

from __future__ import annotations

import functools
import os
import pickle
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

import gatherstore as gs
from gatherstore.compat._common import NO_PROCESS_GROUP, dir_store, own_copies
from gatherstore.compat._patching import Patch, patch_module

__all__ = [
    "all_gather_object_cpu",
    "all_gather_object_gpu",
    "all_reduce_dict",
    "broadcast",
    "create_tmpdir",
    "distributed_available",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_module_wrapper",
    "obj2tensor",
    "pad_to_largest_tensor",
    "patch",
    "rank_zero_only",
    "reduce_mean",
    "serialize_to_tensor",
    "synchronize",
    "tensor2obj",
]

_CUDA = torch.device("cuda")
GenericFunc = TypeVar("GenericFunc", bound=Callable[..., Any])


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _slurm_tasks() -> bool:
    """Whether SLURM's task variables describe this job (not an interactive ``bash`` shell)."""
    return os.environ.get("SLURM_JOB_NAME") != "bash"


def distributed_available() -> bool:
    """Whether a torch.distributed process group is initialised."""
    return gs.is_distributed()


def get_world_size() -> int:
    """Number of processes: WORLD_SIZE, else SLURM_NTASKS, else the process group's (else 1)."""
    size = _env_int("WORLD_SIZE")
    if size is None and _slurm_tasks():
        size = _env_int("SLURM_NTASKS")
    return gs.get_world_size() if size is None else size


def get_rank() -> int:
    """This process's global rank: RANK, else SLURM_PROCID, else the process group's.

    Without any of them (or in an interactive SLURM shell) the local rank.
    """
    rank = _env_int("RANK")
    if rank is None and _slurm_tasks():
        rank = _env_int("SLURM_PROCID")
    if rank is None and _slurm_tasks() and gs.is_distributed():
        rank = gs.get_rank()
    return get_local_rank() if rank is None else rank


def get_local_rank() -> int:
    """This process's rank on its node: LOCAL_RANK, else SLURM_LOCALID, else the group's (0)."""
    rank = _env_int("LOCAL_RANK")
    if rank is None:
        rank = _env_int("SLURM_LOCALID")
    return gs.get_local_rank() if rank is None else rank


def synchronize() -> None:
    """Barrier among all processes (nothing in a single process)."""
    gs.barrier()


def rank_zero_only(func: GenericFunc) -> GenericFunc:
    """Run ``func`` on global rank 0 only (None elsewhere); the rank as ``get_rank`` says."""

    @functools.wraps(func)
    def on_rank_zero(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs) if get_rank() == 0 else None

    return on_rank_zero  # type: ignore[return-value]


def is_module_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` or any module inside it is a DataParallel or DistributedDataParallel."""
    wrappers = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    return any(isinstance(m, wrappers) for m in module.modules())


def broadcast(obj: Any, src: int = 0) -> Any:
    """``src``'s object on every rank, through gatherstore."""
    return gs.broadcast_object(obj, src)


def obj2tensor(pyobj: Any, device: torch.device = _CUDA) -> torch.Tensor:
    """``pyobj`` pickled into a uint8 tensor on ``device`` (CPU where CUDA is absent)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        device = torch.device("cpu")
    return torch.frombuffer(bytearray(pickle.dumps(pyobj)), dtype=torch.uint8).to(device)


def tensor2obj(tensor: torch.Tensor) -> Any:
    """The object a uint8 tensor from ``obj2tensor`` holds."""
    return pickle.loads(tensor.cpu().numpy().tobytes())


def serialize_to_tensor(data: Any) -> torch.Tensor:
    """``data`` pickled into a uint8 tensor on the process group's device.

    Raises:
        ValueError: no process group.
        AssertionError: the backend is neither gloo nor nccl.
    """
    name = gs.backend()
    if name is None:
        raise ValueError(NO_PROCESS_GROUP)
    assert name in ("gloo", "nccl"), "_serialize_to_tensor only supports gloo and nccl backends."
    return obj2tensor(data, torch.device("cuda" if name == "nccl" else "cpu"))


def pad_to_largest_tensor(tensor: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Every rank's element count, and ``tensor`` zero-padded to the largest.

    Raises:
        ValueError: no process group.
    """
    if not gs.is_distributed():
        raise ValueError(NO_PROCESS_GROUP)
    local = tensor.numel()
    sizes = [int(n) for n in gs.all_gather_tensor(torch.tensor([local])).tolist()]
    largest = max(sizes)
    if local != largest:
        padding = torch.zeros(largest - local, dtype=tensor.dtype, device=tensor.device)
        tensor = torch.cat((tensor, padding), dim=0)
    return sizes, tensor


def create_tmpdir(rank: int, tmpdir: str | None = None, use_system_tmp: bool = True) -> str:
    """A folder every rank shares: ``tmpdir`` (created), else one rank 0 makes and sends.

    Rank 0 makes it in ``<system tmp>/.dist_tmp`` with ``use_system_tmp``, else in
    ``vis4d-workspace/.dist_tmp`` under the working directory, as vis4d does.
    """
    if tmpdir is not None:
        os.makedirs(tmpdir, exist_ok=True)
        return tmpdir
    made = None
    if rank == 0:
        base = tempfile.gettempdir() if use_system_tmp else "vis4d-workspace"
        parent = os.path.join(base, ".dist_tmp")
        os.makedirs(parent, exist_ok=True)
        made = tempfile.mkdtemp(dir=parent)
    return str(gs.broadcast_object(made, 0))


def _gather(data: Any, store: str | None, rank_zero_return_only: bool) -> list[Any] | None:
    if gs.get_world_size() == 1:
        return [data]
    if rank_zero_return_only:
        with own_copies():  # vis4d unpickles every entry, rank 0's own too
            return gs.gather_object(data, 0, store=store)
    with own_copies():
        return gs.all_gather_object(data, store=store)


def all_gather_object_cpu(
    data: Any,
    tmpdir: str | None = None,
    rank_zero_return_only: bool = True,
    use_system_tmp: bool = False,
) -> list[Any] | None:
    """Every rank's ``data`` (None off rank 0 with ``rank_zero_return_only``) via a filesystem.

    ``tmpdir`` becomes a ``file://`` store (only gatherstore's own job folder
    inside it is removed); ``use_system_tmp`` a node-local ``tmpdir`` store;
    otherwise the default store.
    """
    store = dir_store(tmpdir) if tmpdir is not None else ("tmpdir" if use_system_tmp else None)
    return _gather(data, store, rank_zero_return_only)


def all_gather_object_gpu(data: Any, rank_zero_return_only: bool = True) -> list[Any] | None:
    """Every rank's ``data`` (None off rank 0 with ``rank_zero_return_only``), never via GPU."""
    return _gather(data, None, rank_zero_return_only)


def reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of ``tensor`` over ranks, as a new tensor.

    Raises:
        RuntimeError: an integer tensor (its mean cannot keep the dtype).
    """
    if not gs.is_distributed():
        return tensor
    if not tensor.is_floating_point():
        raise RuntimeError(f"reduce_mean of a {tensor.dtype} tensor: use a float tensor")
    return gs.all_reduce(tensor, "mean")  # type: ignore[no-any-return]


def all_reduce_dict(
    py_dict: dict[str, Any], reduce_op: str = "sum", to_float: bool = True
) -> dict[str, Any]:
    """Sum or average every tensor of ``py_dict`` in one collective.

    A plain dict is reduced in rank 0's key order, which travels through
    gatherstore's control plane, not a CUDA tensor (so this works on gloo too);
    an OrderedDict in its own order, and comes back as an OrderedDict.
    Tensors keep their shapes and devices.
    """
    world = gs.get_world_size()
    if world == 1:
        return py_dict
    ordered = isinstance(py_dict, OrderedDict)
    keys = list(py_dict) if ordered else gs.broadcast_object(list(py_dict), 0)
    values = [py_dict[k] for k in keys]
    flat = torch.cat([v.flatten().float() if to_float else v.flatten() for v in values])
    flat = gs.all_reduce(flat, "sum")
    if reduce_op == "mean":
        flat /= world
    pieces = torch.split(flat, [v.numel() for v in values])
    reduced = {
        k: p.reshape(v.shape).to(v.device) for k, p, v in zip(keys, pieces, values, strict=True)
    }
    return OrderedDict(reduced) if ordered else reduced


def patch() -> Patch:
    """Make the installed ``vis4d.common.distributed`` gather objects through gatherstore.

    Raises:
        ImportError: vis4d is not installed.
    """
    names = ("all_gather_object_cpu", "all_gather_object_gpu", "broadcast")
    return patch_module("vis4d.common.distributed", "vis4d", {n: globals()[n] for n in names})
