"""The one entry every gatherstore collective goes through.

As redis-py sends every command through ``execute_command``, every collective here
(the object collectives and ``gather_iter``, the tensor collectives and ``barrier``,
the dict reductions, the steps of a result set, and what ``gatherstore.compat``
calls) goes through ``collective`` or ``run``, which own what every call shares:

- its arguments are checked (``check``) the same way in one process as in many,
  before anything is sent: a typo fails in the first run on a laptop, not hours later
  on a cluster;
- it takes the process group (None: the default one; any other however it was made:
  ``new_group``, ``new_subgroups``, ``split_group``, a ``DeviceMesh`` dimension), makes it
  the current group of its steps (``gatherstore.job.state.using``: ranks are the group's
  ranks, results come in group-rank order), answers at once on a rank outside it as
  torch does, and refuses to run alone in a process that a launcher started as one of
  several;
- its calls are made one after another within a rank (``control.serialized``);
- it has one ``Deadline``, carried by the ``Context`` its steps receive: meeting every
  rank (late ranks and ranks in another call named on every rank), work whose failure
  on one rank raises on every rank, the process group's ops, the routes;
- it logs its one DEBUG line with its phases when it returns (or, for an iterator of
  parts, when the reading ends).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from gatherstore import _config as config
from gatherstore._config import Timeout, to_seconds
from gatherstore._errors import GatherError, ProcessGroupError, as_global_ranks
from gatherstore._time import Deadline
from gatherstore.job import control, topology
from gatherstore.job import state as job
from gatherstore.job.specs import resolve
from gatherstore.routes.context import Context
from gatherstore.stores.base import Store

__all__ = ["NO_STORE", "check", "collective", "group_rank", "outside", "run"]

T = TypeVar("T")

#: A call without a ``store`` argument (``check`` leaves it alone).
NO_STORE: Any = object()


def check(
    what: str,
    *,
    timeout: Timeout = None,
    store: str | Store | None = NO_STORE,
    rank: tuple[str, int] | None = None,
    progress: bool | None = None,
    read_ahead: int | None = None,
    group: Any = None,
) -> None:
    """Check a call's arguments the same way in one process as in many.

    The store spec is opened (its scheme and syntax checked; nothing is connected).

    The settings in the environment are checked too (``config.check_environment``).

    Raises:
        ValueError: the argument (or setting) named, with what it must be.
        ImportError: the store needs a package that is not installed.
    """
    config.check_environment()
    to_seconds(timeout)
    if store is not NO_STORE:
        resolve(store)
    _check_group(what, group)
    if rank is not None:
        name, value = rank
        world = topology.get_world_size()
        if type(value) is not int or not 0 <= value < world:
            raise ValueError(
                f"{what}: {name}={value!r} is not a rank of this job (world size {world})"
            )
    if progress not in (None, True, False):
        raise ValueError(f"{what}: progress={progress!r}: give True, False or None (automatic)")
    config.read_ahead(read_ahead, 0)


def _check_group(what: str, group: Any) -> None:
    """Refuse a ``group`` that is not a process group.

    Raises:
        TypeError: ``group`` is not None nor a ``torch.distributed.ProcessGroup``.
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return
    if dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER:
        return  # what new_group returns on a rank outside the group
    raise TypeError(
        f"{what}: group={group!r} is not a process group: pass None (the default group) or "
        "a torch.distributed.ProcessGroup, e.g. from dist.new_group(ranks), "
        'dist.new_subgroups() or DeviceMesh.get_group("dp")'
    )


def group_rank(
    what: str, group: Any, given: tuple[str, int | None], in_group: tuple[str, int | None]
) -> int:
    """The root of a call on ``group`` as a rank within it, from torch's pair of arguments:
    a global rank (``dst``, ``src``) or a rank within the group (``group_dst``, ...);
    neither: the group's first rank.  On a rank outside the group, 0 (it does not take part).

    Raises:
        ValueError: both are given, or the rank is not one of the group's.
    """
    (name, value), (group_name, group_value) = given, in_group
    if value is not None and group_value is not None:
        raise ValueError(
            f"{what}: {name}={value!r} and {group_name}={group_value!r}: give one or the other "
            f"({name} is a global rank, {group_name} a rank within the group)"
        )
    if group is None or not topology.is_distributed() or group is dist.group.WORLD:
        return _job_rank(what, *(given if group_value is None else in_group))
    if not job.is_member(group):
        return 0
    state = job.group_state(group)
    if group_value is not None:
        if type(group_value) is not int or not 0 <= group_value < state.size:
            raise ValueError(
                f"{what}: {group_name}={group_value!r} is not a rank of the group "
                f"(its size is {state.size})"
            )
        return group_value
    if value is None:
        return 0
    if value not in state.ranks:
        raise ValueError(
            f"{what}: {name}={value!r} is not in the group (its global ranks are "
            f"{list(state.ranks)}); pass one of them, or {group_name}= a rank within the group"
        )
    return state.ranks.index(value)


def _job_rank(what: str, name: str, value: int | None) -> int:
    """A root given on the default group, checked (None: rank 0)."""
    if value is None:
        return 0
    check(what, rank=(name, value))
    return value


def outside(what: str, group: Any) -> bool:
    """Whether this rank is outside ``group``: it then takes no part in the call, which
    returns at once without touching any store, as torch's collectives do (with torch's
    warning)."""
    if group is None or not topology.is_distributed() or job.is_member(group):
        return False
    warnings.warn(
        f"{what}: this rank (global rank {topology.get_rank()}) does not belong to the given "
        "group; it takes no part in the call",
        stacklevel=config.program_level(),
    )
    return True


def _not_alone(what: str) -> None:
    """Refuse a collective in a process without a process group when a launcher started
    several: each would gather alone and return only its own share, silently.

    Raises:
        ProcessGroupError: names the launcher's variable and the fix.
    """
    launched = topology.launched_as()
    if launched is None:
        return
    world, variable = launched
    raise ProcessGroupError(
        f"{what}: {variable}={world} says this job has {world} processes, but this one has "
        "no process group: alone, it would gather only its own results. Call "
        "gs.init_from_env() (or torch.distributed.init_process_group()) in every process "
        "before the first collective"
    )


@contextlib.contextmanager
def collective(
    what: str,
    *,
    timeout: Timeout = None,
    bounded: bool = True,
    sweep: bool = True,
    progress: bool | None = None,
    group: Any = None,
    route: str = "control plane",
) -> Iterator[Context]:
    """One collective on this rank, as a ``Context`` with one deadline, also in a process
    without a process group (a world of one).

    ``bounded``: the process group's ops end by the deadline (a tensor collective
    without a timeout waits for them as long as the process group does).  ``sweep``: a
    failed exchange sweeps the job's areas when rank 0 is gone (calls that use stores).
    ``route``: how the call moves its data, as its log line says (an object call names its
    route once it is agreed).  The call's
    DEBUG line is logged when the block ends, unless a route still reads its parts
    (it logs it when the reading ends).
    """
    _check_group(what, group)
    config.check_environment()
    if not topology.is_distributed():
        _not_alone(what)
    with control.calls_in_turn(), _members(group) as state:
        ctx = Context(
            what,
            rank=state.rank if state else 0,
            world=state.size if state else 1,
            group=group,
            deadline=Deadline.start(to_seconds(timeout)),
            progress=progress,
            bounded=bounded or timeout is not None,
            sweep=sweep,
        )
        ctx.route = route
        try:
            yield ctx
        except GatherError as exc:
            if state and not state.is_default:
                as_global_ranks(exc, state.ranks)
            raise
        finally:
            if not ctx.reading:
                ctx.finish()


@contextlib.contextmanager
def _members(group: Any) -> Iterator[job.GroupState | None]:
    """``group``'s state, current while the call runs; None in a world of one (no group)."""
    if not topology.is_distributed():
        yield None
        return
    with job.using(group) as state:
        yield state


def run(
    what: str,
    body: Callable[[Context], T],
    serial: Callable[[], T],
    *,
    timeout: Timeout = None,
    bounded: bool = True,
    sweep: bool = True,
    progress: bool | None = None,
    group: Any = None,
    route: str = "control plane",
    apart: Callable[[], Any] = lambda: None,
) -> T:
    """``body(ctx)`` of a collective (see ``collective``) on a job of several processes;
    ``serial()``, what a world of one returns, in a process without a process group;
    ``apart()`` (None unless given) on a rank outside ``group`` (see ``outside``)."""
    if not topology.is_distributed():
        _not_alone(what)
        return serial()
    if outside(what, group):
        answer: T = apart()
        return answer
    with collective(
        what,
        timeout=timeout,
        bounded=bounded,
        sweep=sweep,
        progress=progress,
        group=group,
        route=route,
    ) as ctx:
        return body(ctx)
