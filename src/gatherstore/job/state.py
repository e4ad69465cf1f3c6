"""Everything gatherstore keeps per job, in one typed home, each piece for as long as it must live.

- :class:`GroupState` lives exactly as long as the default process group: the control
  plane's store and step counter, gatherstore's own gloo group and why it broke, the
  layout.  It is keyed weakly by the group, so a group the program destroys takes its
  state along: held longer, it would keep gloo's threads alive until the interpreter
  exits, where tearing them down can abort the process ("terminate called without an
  active exception").  A new group starts with fresh state.
- :class:`JobStores` outlives such a group: the job's store sessions, whose areas are
  still removed at ``shutdown`` or at exit after the program destroyed its group, and the
  timeout of the latest call (``shutdown`` waits no longer).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from gatherstore.stores.base import Store

__all__ = ["GroupState", "JobStores", "forget_groups", "group_state"]

#: A store session (``gatherstore.job.session.JobSession``), which this module only keeps.
S = TypeVar("S")


@dataclass
class GroupState:
    """What gatherstore keeps beside one default process group."""

    control_store: Any = None  # the rendezvous store, under gatherstore's prefix
    step: int = 0  # the control plane's exchanges so far (the same on every rank)
    gloo_group: Any = None  # gatherstore's own gloo group
    gloo_broken: str = ""  # why that group is unusable, once a transfer did not finish
    layout: Any = None  # the job's layout (nodes, local ranks)
    handover: bytes = b""  # the socket this rank takes handed-over parts on, as published
    handover_peers: dict[int, bytes] = field(default_factory=dict)  # the others', once read


_by_group: weakref.WeakKeyDictionary[Any, GroupState] = weakref.WeakKeyDictionary()


def group_state() -> GroupState:
    """The state of the current default group: fresh for a new group.

    Raises:
        RuntimeError: there is no default process group.
    """
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("no default process group: gatherstore's job state needs one")
    return _by_group.setdefault(world, GroupState())


def forget_groups() -> None:
    """Drop every group's state now (``shutdown`` calls it after destroying the groups)."""
    _by_group.clear()


@dataclass
class JobStores(Generic[S]):
    """The job's use of stores, which outlives the process group it began in."""

    group: weakref.ref[Any] | None = None  # the default group the sessions belong to
    sessions: dict[Store, S] = field(default_factory=dict)
    last_timeout: float | None = None

    def for_group(self, world: Any) -> dict[Store, S]:
        """The sessions of ``world``'s job: none yet for a new group."""
        if self.group is None or self.group() is not world:
            self.group, self.sessions = weakref.ref(world), {}
        return self.sessions

    def forget_sessions(self) -> dict[Store, S]:
        """Forget the job's sessions (and its last timeout); returns them."""
        sessions = self.sessions
        self.group, self.sessions, self.last_timeout = None, {}, None
        return sessions
