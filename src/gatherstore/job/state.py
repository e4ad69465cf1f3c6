"""Everything gatherstore keeps per process group, in one typed home, each piece for as
long as it must live.

- :class:`GroupState` lives exactly as long as its process group (the default one, a
  data-parallel group, a ``DeviceMesh`` dimension, a node's group): who this rank is in
  it, its control-plane keys and step counter, gatherstore's gloo twin of it and why it
  broke, the layout.  It is keyed weakly by the group, so a group the program destroys
  takes its state along: held longer, it would keep gloo's threads alive until the
  interpreter exits, where tearing them down can abort the process ("terminate called
  without an active exception").  A new group starts with fresh state.
- The group a collective runs on is this thread's *current* group while the call runs
  (``using``, entered by the one entry, ``gatherstore.calls.entry``): the control plane,
  the gloo twin, the sessions and the routes below ask for ``group_state()`` and get
  that group's, so that none of them takes the group as a parameter of its own.
- :class:`JobStores` outlives the groups: the job's store sessions, whose areas are
  still removed at ``shutdown`` or at exit after the program destroyed its groups, and
  the timeout of the latest call (``shutdown`` waits no longer).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from gatherstore.stores.base import Store

__all__ = [
    "GroupState",
    "JobStores",
    "forget_groups",
    "group_state",
    "inherited",
    "is_member",
    "using",
]

#: A store session (``gatherstore.job.session.JobSession``), which this module only keeps.
S = TypeVar("S")


@dataclass
class GroupState:
    """What gatherstore keeps beside one process group, on one of its members."""

    rank: int  # this rank's rank in the group
    size: int  # the group's size
    ranks: tuple[int, ...]  # the group's members' global ranks, in group-rank order
    name: str  # "" for the default group; else unique to the group in the job
    control_store: Any = None  # the rendezvous store, under the group's own prefix
    step: int = 0  # the control plane's exchanges so far (the same on every member)
    gloo_group: Any = None  # gatherstore's own gloo group (the default group's twin)
    gloo_broken: str = ""  # why that group is unusable, once a transfer did not finish
    layout: Any = None  # the job's layout (nodes, local ranks)
    nodes: int = 0  # how many machines the group spans (0: not counted yet)
    local: Any = None  # the default group's: the group of this machine's ranks
    handover: bytes = b""  # the socket this rank takes handed-over parts on, as published
    handover_peers: dict[int, bytes] = field(default_factory=dict)  # the others', once read

    @property
    def is_default(self) -> bool:
        """Whether this is the default group's state."""
        return not self.name

    def global_rank(self, rank: int) -> int:
        """The global rank of the member ``rank`` of this group."""
        return self.ranks[rank]


_by_group: weakref.WeakKeyDictionary[Any, GroupState] = weakref.WeakKeyDictionary()
_current: ContextVar[Any] = ContextVar("gatherstore_group", default=None)


def is_member(group: Any) -> bool:
    """Whether this rank belongs to ``group`` (a process group; None: the default one)."""
    if group is None or group is dist.group.WORLD:
        return True
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return False
    return bool(dist.get_rank(group) >= 0)


def group_state(group: Any = None) -> GroupState:
    """The state of ``group``: by default, the group of the call that runs in this thread
    (see ``using``), else the default group; fresh for a new group.

    Raises:
        RuntimeError: there is no default process group.
    """
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("no default process group: gatherstore's job state needs one")
    pg = group if group is not None else _current.get()
    pg = world if pg is None else pg
    state = _by_group.get(pg)
    if state is None:
        state = _by_group[pg] = _new_state(pg, world)
    return state


def _new_state(pg: Any, world: Any) -> GroupState:
    if pg is world:
        size = dist.get_world_size()
        return GroupState(dist.get_rank(), size, tuple(range(size)), "")
    ranks, rank = tuple(dist.get_process_group_ranks(pg)), dist.get_rank(pg)
    # torch's name for the group is the one its members rendezvoused under: the same on
    # each.  A later group may reuse it (torch names some groups by their ranks), so each
    # member counts the groups of that name it met: the count is the same on each member
    # too, since members meet a group together, and keeps the keys of two apart.
    counted = dist.distributed_c10d._get_default_store().add(
        f"gatherstore/groups/{pg.group_name}/{rank}", 1
    )
    return GroupState(rank, len(ranks), ranks, f"{pg.group_name}.{counted}")


@contextlib.contextmanager
def using(group: Any) -> Iterator[GroupState]:
    """Make ``group`` (None: the default group) this thread's current group for a block:
    one collective on it."""
    token = _current.set(group)
    try:
        yield group_state()
    finally:
        _current.reset(token)


def inherited() -> Callable[[], None]:
    """An ``initializer`` for the worker threads of a call (``ThreadPoolExecutor``): they
    see the current group of the thread that makes them (a new thread starts with none)."""
    group = _current.get()
    return functools.partial(_current.set, group)  # type: ignore[return-value]


def forget_groups() -> None:
    """Drop every group's state now (``shutdown`` calls it after destroying the groups)."""
    _by_group.clear()


@dataclass
class JobStores(Generic[S]):
    """The job's use of stores, which outlives the process groups it began in.

    Sessions are keyed by the group's name (see ``GroupState.name``) and the store: each
    group has its own area in each store it uses.
    """

    group: weakref.ref[Any] | None = None  # the default group the sessions belong to
    sessions: dict[tuple[str, Store], S] = field(default_factory=dict)
    last_timeout: float | None = None

    def for_group(self, world: Any) -> dict[tuple[str, Store], S]:
        """The sessions of ``world``'s job (its default group): none yet for a new one."""
        if self.group is None or self.group() is not world:
            self.group, self.sessions = weakref.ref(world), {}
        return self.sessions

    def forget_sessions(self, name: str | None = None) -> dict[tuple[str, Store], S]:
        """Forget the job's sessions (and its last timeout), or only those of the group
        called ``name``; returns them."""
        if name is not None:
            gone = {key: s for key, s in self.sessions.items() if key[0] == name}
            for key in gone:
                del self.sessions[key]
            return gone
        sessions = self.sessions
        self.group, self.sessions, self.last_timeout = None, {}, None
        return sessions
