"""Helpers every compat module shares: process groups, subgroup fallbacks, user folders."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

import gatherstore as gs
from gatherstore.calls.objects import own_copies

__all__ = [
    "NO_PROCESS_GROUP",
    "dir_store",
    "gather_all",
    "gather_to",
    "group_rank",
    "group_size",
    "is_default_group",
    "own_copies",
]

#: torch's words where a process group is needed and there is none (the originals say them)
NO_PROCESS_GROUP = (
    "Default process group has not been initialized, please make sure to call init_process_group."
)


def is_default_group(group: Any) -> bool:
    """Whether ``group`` means every rank (None, ``group.WORLD`` or the default group)."""
    if group is None or group is dist.group.WORLD:
        return True
    return bool(dist.is_initialized() and group == dist.distributed_c10d._get_default_group())


def group_size(group: Any) -> int:
    """Ranks in ``group`` (1 without a process group)."""
    if not gs.is_distributed():
        return 1
    return gs.get_world_size() if is_default_group(group) else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    if not gs.is_distributed():
        return 0
    return gs.get_rank() if is_default_group(group) else dist.get_rank(group)


def gather_all(data: Any, group: Any = None, *, copies: bool = True) -> list[Any]:
    """Every rank's ``data`` in rank order, through the store for the default group.

    This rank's entry is a copy of ``data``, as torch's ``all_gather_object`` returns
    (``copies=False``: ``data`` itself, for a caller that puts its own object there).
    gatherstore's routes span every rank; a subgroup takes torch.distributed's
    object path on that group.
    """
    if is_default_group(group):
        with own_copies(copies):
            return gs.all_gather_object(data)
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, data, group=group)
    return out


def gather_to(data: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
    """Every rank's ``data`` on global rank ``dst`` (None elsewhere); copies and subgroups as
    in gather_all."""
    if is_default_group(group):
        with own_copies():
            return gs.gather_object(data, dst)
    mine = dist.get_rank() == dst
    out: list[Any] | None = [None] * dist.get_world_size(group) if mine else None
    dist.gather_object(data, out, dst=dst, group=group)
    return out


def dir_store(path: str | os.PathLike[str]) -> str:
    """A ``file://`` store URL for a folder the user named (created if missing).

    gatherstore works in a private job folder inside it and removes only that,
    never the user's folder.
    """
    os.makedirs(path, exist_ok=True)
    return "file://" + os.path.abspath(path)
