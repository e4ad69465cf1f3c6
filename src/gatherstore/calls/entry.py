"""The one entry every gatherstore collective goes through.

As redis-py sends every command through ``execute_command``, every collective here
(the object collectives and ``gather_iter``, the tensor collectives and ``barrier``,
the dict reductions, the steps of a result set, and what ``gatherstore.compat``
calls) goes through ``collective`` or ``run``, which own what every call shares:

- its arguments are checked (``check``) the same way in one process as in many,
  before anything is sent: a typo fails in the first run on a laptop, not hours later
  on a cluster;
- it takes the process group (only the default group for now), and refuses to run
  alone in a process that a launcher started as one of several;
- its calls are made one after another within a rank (``control.serialized``);
- it has one ``Deadline``, carried by the ``Context`` its steps receive: meeting every
  rank (late ranks and ranks in another call named on every rank), work whose failure
  on one rank raises on every rank, the process group's ops, the routes;
- it logs its one DEBUG line with its phases when it returns (or, for an iterator of
  parts, when the reading ends).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from gatherstore import _config as config
from gatherstore._config import Timeout, to_seconds
from gatherstore._errors import ProcessGroupError
from gatherstore._time import Deadline
from gatherstore.job import control, topology
from gatherstore.job.specs import resolve
from gatherstore.routes.context import Context
from gatherstore.stores.base import Store

__all__ = ["NO_STORE", "check", "collective", "run"]

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
    _default_group(what, group)


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


def _default_group(what: str, group: Any) -> None:
    """Refuse a process group other than the default one (None).

    Raises:
        ValueError: ``group`` is another group.
    """
    if group is None or (control.is_initialized() and group is dist.group.WORLD):
        return
    raise ValueError(
        f"{what}: group={group!r}: gatherstore's collectives run on the default process "
        "group; pass group=None"
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
    _default_group(what, group)
    config.check_environment()
    if not topology.is_distributed():
        _not_alone(what)
    with control.calls_in_turn():
        ctx = Context(
            what,
            rank=topology.get_rank(),
            world=topology.get_world_size(),
            deadline=Deadline.start(to_seconds(timeout)),
            progress=progress,
            bounded=bounded or timeout is not None,
            sweep=sweep,
        )
        ctx.route = route
        try:
            yield ctx
        finally:
            if not ctx.reading:
                ctx.finish()


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
) -> T:
    """``body(ctx)`` of a collective (see ``collective``) on a job of several processes;
    ``serial()``, what a world of one returns, in a process without a process group."""
    if not topology.is_distributed():
        _not_alone(what)
        return serial()
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
