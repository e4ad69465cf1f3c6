"""ignite's collectives: tensors over the process group, strings and objects through gatherstore.

Serially every collective returns what ignite's serial model returns, without
looking at its arguments.  In a process group ``group`` is checked before
anything is sent, with ignite's messages.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from numbers import Number
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gatherstore as gs
from gatherstore.compat._common import gather_all
from gatherstore.compat._ignite_model import (
    device,
    get_local_rank,
    get_nproc_per_node,
    get_rank,
    get_world_size,
)

__all__ = [
    "all_gather",
    "all_gather_tensors_with_shapes",
    "all_reduce",
    "barrier",
    "broadcast",
    "new_group",
    "one_rank_first",
    "one_rank_only",
]

_OPS = {
    "SUM": dist.ReduceOp.SUM,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "AND": dist.ReduceOp.BAND,
    "OR": dist.ReduceOp.BOR,
}


def _ranks(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(r, int) for r in value)


def _setup_group(group: Any) -> Any:
    """``group`` as a process group (None: the default one), a list of ranks made into one.

    Raises:
        ValueError: neither a list of int nor a process group.
    """
    if group is None:
        return None
    if _ranks(group):
        group = dist.new_group(ranks=group)
    if not (isinstance(group, dist.ProcessGroup) or group == dist.GroupMember.NON_GROUP_MEMBER):
        raise ValueError(
            "Argument group should be list of int or ProcessGroup, "
            f"got {type(group)}, group={group}"
        )
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
    if not _ranks(ranks):
        raise ValueError("Argument ranks should be list of int")
    return dist.new_group(ranks=ranks, **kwargs) if gs.is_distributed() else ranks


def all_reduce(
    tensor: torch.Tensor | float, op: str = "SUM", group: Any | list[int] | None = None
) -> torch.Tensor | float:
    """Reduce a tensor (in place on the comm device) or a number over the group's ranks.

    Raises:
        TypeError: neither a tensor nor a number.
        ValueError: unknown ``op``, or ``group`` neither a list of int nor a process group.
    """
    if not gs.is_distributed():
        return tensor
    if not isinstance(tensor, (torch.Tensor, Number)):
        raise TypeError(f"Unhandled input type {type(tensor)}")
    if op not in _OPS:
        raise ValueError(f"Unsupported reduction operation: '{op}'")
    group = _setup_group(group)
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

    Strings and objects go through gatherstore's store, on any group.  A rank outside
    ``group`` gets its own value back (a string in a list).

    Raises:
        ValueError: ``group`` is neither a list of int nor a process group.
    """
    if not gs.is_distributed():
        return tensor if isinstance(tensor, torch.Tensor) else [tensor]
    pg = _setup_group(group)
    if _not_member(pg):
        return [tensor] if isinstance(tensor, str) else tensor
    if not isinstance(tensor, (torch.Tensor, Number)):
        return gather_all(tensor, pg)
    number = not isinstance(tensor, torch.Tensor)
    out = gs.all_gather_tensor(_as_tensor(tensor), group=pg)
    return out.tolist() if number else out


def all_gather_tensors_with_shapes(
    tensor: torch.Tensor, shapes: Sequence[Sequence[int]], group: Any | list[int] | None = None
) -> list[torch.Tensor]:
    """Every rank's tensor of its own shape (``shapes[r]`` for rank r), padded for the transfer.

    Raises:
        ValueError: ``group`` is neither a list of int nor a process group.
    """
    if gs.is_distributed():
        group = _setup_group(group)
        if _not_member(group):
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
