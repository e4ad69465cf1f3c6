"""State kept beside the default process group, for exactly as long as it lives.

gatherstore caches per job: its control store, its own gloo group, the layout,
whether that gloo group broke.  Held in module globals, these would keep the
destroyed groups alive after a program's own ``destroy_process_group()``, until
the interpreter exits, where tearing down gloo's threads can abort the process
("terminate called without an active exception").  Here they are keyed weakly by
the default group: a new group starts with fresh state, and a destroyed one
takes its state with it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["forget", "state"]

_by_world: weakref.WeakKeyDictionary[Any, dict[str, dict[str, Any]]] = weakref.WeakKeyDictionary()


def state(owner: str) -> dict[str, Any]:
    """``owner``'s state for the current default group: empty for a new group.

    Raises:
        RuntimeError: there is no default process group.
    """
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("no default process group: gatherstore's job state needs one")
    return _by_world.setdefault(world, {}).setdefault(owner, {})


def forget() -> None:
    """Drop every group's state now (``shutdown`` calls it after destroying the groups)."""
    _by_world.clear()
