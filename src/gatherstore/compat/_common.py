"""Helpers every compat module shares: gathers on any process group, user folders."""

from __future__ import annotations

import os
from typing import Any

import gatherstore as gs
from gatherstore.calls.objects import own_copies

__all__ = [
    "NO_PROCESS_GROUP",
    "dir_store",
    "gather_all",
    "gather_to",
    "own_copies",
]

#: torch's words where a process group is needed and there is none (the originals say them)
NO_PROCESS_GROUP = (
    "Default process group has not been initialized, please make sure to call init_process_group."
)


def gather_all(data: Any, group: Any = None, *, copies: bool = True) -> list[Any]:
    """Every rank's ``data`` in group-rank order, through gatherstore on any process group
    (None: the default one).

    This rank's entry is a copy of ``data``, as torch's ``all_gather_object`` returns
    (``copies=False``: ``data`` itself, for a caller that puts its own object there).  On
    a rank outside ``group``, ``[]``: the list torch leaves untouched there (sized by
    ``get_world_size(group)``, -1), which the originals return.
    """
    with own_copies(copies):
        parts = gs.all_gather_object(data, group=group)
    return [] if parts is None else parts


def gather_to(data: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
    """Every rank's ``data`` on global rank ``dst``, in group-rank order (None elsewhere and
    outside ``group``); copies as in gather_all.  ``dst`` is a global rank, as torch's
    ``gather_object`` takes it (the originals pass theirs on to it)."""
    with own_copies():
        return gs.gather_object(data, dst, group=group)


def dir_store(path: str | os.PathLike[str]) -> str:
    """A ``file://`` store URL for a folder the user named (created if missing).

    gatherstore works in a private job folder inside it and removes only that,
    never the user's folder.
    """
    os.makedirs(path, exist_ok=True)
    return "file://" + os.path.abspath(path)
