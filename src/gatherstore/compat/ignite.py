"""``ignite.distributed`` with objects and strings gathered through gatherstore.

Same names, signatures, return values and serial answers as
``ignite.distributed.utils`` (plus ``auto_*`` and ``Parallel``).  Every answer
reads torch.distributed live, so there is no computation-model state to
sync; only the native (torch.distributed) model exists here.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from numbers import Number
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gatherstore as gs

from ._common import gather_all, is_default_group
from ._ignite_launch import (
    DistributedProxySampler,
    Parallel,
    auto_dataloader,
    auto_model,
    auto_optim,
    finalize,
    initialize,
    spawn,
)
from ._patching import Patch, patch_module

__all__ = [
    "backend",
    "broadcast",
    "device",
    "available_backends",
    "model_name",
    "get_world_size",
    "get_rank",
    "get_local_rank",
    "get_nproc_per_node",
    "get_node_rank",
    "get_nnodes",
    "spawn",
    "initialize",
    "finalize",
    "show_config",
    "set_local_rank",
    "all_reduce",
    "all_gather",
    "barrier",
    "hostname",
    "has_xla_support",
    "has_native_dist_support",
    "has_hvd_support",
    "sync",
    "registered_computation_models",
    "one_rank_only",
    "new_group",
    "one_rank_first",
    "all_gather_tensors_with_shapes",
    "DistributedProxySampler",
    "Parallel",
    "auto_dataloader",
    "auto_model",
    "auto_optim",
    "patch",
]

has_native_dist_support = dist.is_available()
#: Only torch.distributed is driven here: no XLA, no Horovod.
has_xla_support = False
has_hvd_support = False


class _SerialModel:
    """No process group."""

    name = "serial"
    available_backends: tuple[str, ...] = ()


class _NativeDistModel:
    """A torch.distributed process group."""

    name = "native-dist"
    available_backends = tuple(
        b for b in ("nccl", "gloo", "mpi") if getattr(dist, f"is_{b}_available")()
    )


registered_computation_models = (_SerialModel, _NativeDistModel)
_OPS = {
    "SUM": dist.ReduceOp.SUM,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "AND": dist.ReduceOp.BAND,
    "OR": dist.ReduceOp.BOR,
}
_state: dict[str, Any] = {"local_rank": None}


# --- topology -----------------------------------------------------------------------
def sync(temporary: bool = False) -> None:
    """Nothing to do: every function here reads torch.distributed when called."""


def available_backends() -> tuple[str, ...]:
    """Backends :func:`initialize` and :func:`spawn` accept."""
    return tuple(b for m in registered_computation_models for b in m.available_backends)


def model_name() -> str:
    """ "native-dist" with a process group, "serial" without."""
    return (_NativeDistModel if gs.is_distributed() else _SerialModel).name


def backend() -> str | None:
    """The process group's backend, None without one."""
    return gs.backend()


def device() -> torch.device:
    """The current CUDA device (else cpu); serially cuda, mps or cpu, whichever exists."""
    if torch.cuda.is_available():
        if gs.is_distributed():
            return torch.device(f"cuda:{torch.cuda.current_device()}")
        return torch.device("cuda")
    if not gs.is_distributed() and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return gs.get_world_size()


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return gs.get_rank()


def get_local_rank() -> int:
    """Rank on this node: LOCAL_RANK, else the :func:`set_local_rank` hint, else by hostname."""
    if gs.is_distributed() and "LOCAL_RANK" not in os.environ and _state["local_rank"] is not None:
        return int(_state["local_rank"])
    return gs.get_local_rank()


def get_nproc_per_node() -> int:
    """Processes on this node (1 without a process group)."""
    return gs.get_local_size()


def get_nnodes() -> int:
    """Number of nodes (1 without a process group)."""
    return gs.get_nnodes()


def get_node_rank() -> int:
    """This node's index (0 without a process group)."""
    return gs.get_node_rank()


def hostname() -> str:
    """This host's name."""
    return socket.gethostname()


def set_local_rank(index: int) -> None:
    """Hint the local rank of a process group created by hand (LOCAL_RANK wins)."""
    _state["local_rank"] = index


def show_config() -> None:
    """Log the distributed configuration at INFO level."""
    logger = logging.getLogger(__name__)
    for label, value in (
        ("distributed configuration", model_name()),
        ("backend", backend()),
        ("device", device().type),
        ("hostname", hostname()),
        ("world size", get_world_size()),
        ("rank", get_rank()),
        ("local rank", get_local_rank()),
        ("num processes per_node", get_nproc_per_node()),
        ("num nodes", get_nnodes()),
        ("node rank", get_node_rank()),
    ):
        logger.info(f"{label}: {value}")


# --- collectives ----------------------------------------------------------------------
def _as_group(group: Any | list[int] | None) -> Any:
    if isinstance(group, list) and all(isinstance(r, int) for r in group):
        return new_group(group)
    return group


def _not_member(group: Any) -> bool:
    return group is not None and bool(dist.distributed_c10d._rank_not_in_group(group))


def _as_tensor(value: Any) -> torch.Tensor:
    """A number as a tensor (floats in float64), as ignite's collectives send it."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(value, dtype=torch.double if isinstance(value, float) else None)


def new_group(ranks: list[int], **kwargs: Any) -> Any:
    """A process group of ``ranks`` (the list itself without a process group).

    Raises:
        ValueError: ``ranks`` is not a list of int.
    """
    if not (isinstance(ranks, list) and all(isinstance(r, int) for r in ranks)):
        raise ValueError("Argument ranks should be list of int")
    return dist.new_group(ranks=ranks, **kwargs) if gs.is_distributed() else ranks


def all_reduce(
    tensor: torch.Tensor | float, op: str = "SUM", group: Any | list[int] | None = None
) -> torch.Tensor | float:
    """Reduce a tensor (in place on the comm device) or a number over all ranks.

    Raises:
        TypeError: neither a tensor nor a number.  ValueError: unknown ``op``.
    """
    if not gs.is_distributed():
        return tensor
    if not isinstance(tensor, (torch.Tensor, Number)):
        raise TypeError(f"Unhandled input type {type(tensor)}")
    if op not in _OPS:
        raise ValueError(f"Unsupported reduction operation: {op!r}; use one of {sorted(_OPS)}")
    group = _as_group(group)
    number = not isinstance(tensor, torch.Tensor)
    value = _as_tensor(tensor)
    on_device = value.to(device())
    dist.all_reduce(on_device, _OPS[op], group=group)
    result = on_device.to(value.device)
    return result.tolist() if number else result  # type: ignore[return-value]


def all_gather(
    tensor: torch.Tensor | float | str | Any, group: Any | list[int] | None = None
) -> torch.Tensor | float | list[float] | list[str] | list[Any]:
    """Tensors concatenated along dim 0; numbers, strings and objects as rank-ordered lists.

    Strings and objects go through gatherstore's store.
    """
    if not gs.is_distributed():
        return tensor if isinstance(tensor, torch.Tensor) else [tensor]
    pg = _as_group(group)
    if _not_member(pg):
        return tensor  # type: ignore[return-value]
    if not isinstance(tensor, (torch.Tensor, Number)):
        return gather_all(tensor, pg)
    number = not isinstance(tensor, torch.Tensor)
    value = _as_tensor(tensor)
    if is_default_group(pg):
        out = gs.all_gather_tensor(value)
    else:
        flat = value.reshape(1) if value.dim() == 0 else value
        slots = [torch.zeros_like(flat) for _ in range(pg.size())]
        dist.all_gather(slots, flat, group=pg)
        out = torch.cat(slots)
    return out.tolist() if number else out


def all_gather_tensors_with_shapes(
    tensor: torch.Tensor, shapes: Sequence[Sequence[int]], group: Any | list[int] | None = None
) -> list[torch.Tensor]:
    """Every rank's tensor of its own shape (``shapes[r]`` for rank r), padded for the transfer."""
    group = _as_group(group)
    if gs.is_distributed() and _not_member(group):
        return [tensor]
    largest = torch.tensor(shapes).amax(dim=0)
    missing = (largest - torch.tensor(tensor.shape)).tolist()
    padding = tuple(itertools.chain.from_iterable((0, n) for n in reversed(missing)))
    gathered = all_gather(torch.nn.functional.pad(tensor, padding), group=group)
    assert isinstance(gathered, torch.Tensor)
    rows = int(largest[0])
    return [
        gathered[
            tuple(
                slice(r * rows, r * rows + n) if d == 0 else slice(0, n)
                for d, n in enumerate(shape)
            )
        ]
        for r, shape in enumerate(shapes)
    ]


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, Number):
        return "number"
    return "path" if isinstance(value, Path) else "str"


def broadcast(
    tensor: torch.Tensor | float | str | Path | None, src: int = 0, safe_mode: bool = False
) -> torch.Tensor | float | str | Path:
    """``src``'s tensor, number (as float32), string or Path on every rank.

    With ``safe_mode`` other ranks may pass None.  Strings and paths go
    through gatherstore.

    Raises:
        TypeError: unsupported type.  ValueError: None where it is not allowed.
    """
    if not gs.is_distributed():
        if tensor is None:
            raise ValueError("Argument tensor should not be None")
        return tensor
    if not (tensor is None or isinstance(tensor, (torch.Tensor, Number, str, Path))):
        raise TypeError(f"Unhandled input type {type(tensor)}")
    is_src = gs.get_rank() == src
    if tensor is None and (is_src or not safe_mode):
        raise ValueError(
            "Source data can not be None"
            if is_src
            else "Argument safe_mode should be True if None is passed for non src rank"
        )
    kind = (
        gs.broadcast_object(_kind(tensor) if is_src else None, src) if safe_mode else _kind(tensor)
    )
    if kind == "tensor":
        if safe_mode:  # other ranks learn the shape and dtype from src
            mine = tensor if is_src and isinstance(tensor, torch.Tensor) else None
            return gs.broadcast_tensor(mine, src).to(device() if mine is None else mine.device)
        assert isinstance(tensor, torch.Tensor)
        on_device = tensor.to(device())
        dist.broadcast(on_device, src=src)
        return on_device.to(tensor.device)
    if kind == "number":
        value = torch.tensor([tensor if is_src else 0], dtype=torch.float)
        dist.broadcast(value, src=src)
        return value.item()
    text = gs.broadcast_object(str(tensor) if is_src else None, src)
    return Path(text) if kind == "path" else text


def barrier() -> None:
    """Wait for every rank."""
    gs.barrier()


def one_rank_only(rank: int = 0, with_barrier: bool = False) -> Callable[..., Any]:
    """Decorator: run on ``rank`` only (None elsewhere), optionally followed by a barrier."""
    return gs.one_rank_only(rank, with_barrier)


@contextlib.contextmanager
def one_rank_first(rank: int = 0, local: bool = False) -> Iterator[None]:
    """Let ``rank`` (on this node with ``local``) run the block before the others.

    Raises:
        ValueError: ``rank`` outside the job (or node).
    """
    current = get_local_rank() if local else get_rank()
    size = get_nproc_per_node() if local else get_world_size()
    if not 0 <= rank < size:
        raise ValueError(f"rank should be between 0 and {size - 1}, but given {rank}")
    if current != rank:
        barrier()
    yield
    if current == rank:
        barrier()


def patch() -> Patch:
    """Make the installed ``ignite.distributed`` gather objects and strings through gatherstore.

    Replaces ``all_gather`` and ``broadcast`` wherever ignite bound them;
    the rest of ignite is untouched.

    Raises:
        ImportError: pytorch-ignite is not installed.
    """
    replacements: dict[str, Callable[..., Any]] = {"all_gather": all_gather, "broadcast": broadcast}
    return patch_module("ignite.distributed.utils", "pytorch-ignite", replacements)
