"""The object collectives: every rank's object, routed over the process group or a store.

Each public call checks its arguments (the same way in one process as in many),
agrees on a plan with every rank (``gatherstore.calls.call.Call.agree``: each rank's
object is built and encoded, a failure on any rank raises on every rank, sizes and
free memory are exchanged, the route is settled and checked to fit), then hands the
plan to its route (``gatherstore.routes.base``), which moves the parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from gatherstore import _config as config
from gatherstore._config import AUTO_THRESHOLD, Timeout, to_seconds
from gatherstore.calls.call import Call
from gatherstore.job import control, topology
from gatherstore.job.specs import resolve
from gatherstore.stores.base import Store

__all__ = [
    "AUTO_THRESHOLD",
    "all_gather_object",
    "check_arguments",
    "broadcast_object",
    "gather_iter",
    "gather_object",
    "own_copies",
]

_own_copies: ContextVar[bool] = ContextVar("gatherstore_own_copies", default=False)


@contextlib.contextmanager
def own_copies(enabled: bool = True) -> Iterator[None]:
    """Inside, a gather returns a copy of this rank's own object, not the object itself
    (unless ``enabled`` is False).

    What ``torch.distributed.all_gather_object`` and ``gather_object`` return (they
    unpickle every entry): the drop-ins and patches that stand in for them, or for
    libraries built on them, gather inside this.  A caller that reuses one buffer for
    every step's outputs then keeps each step's values.  Serially, and for the ``src``
    of a broadcast, the object itself is returned, as there.
    """
    token = _own_copies.set(enabled)
    try:
        yield
    finally:
        _own_copies.reset(token)


def check_arguments(
    what: str,
    store: str | Store | None,
    timeout: Timeout,
    *,
    rank: tuple[str, int] | None = None,
    progress: bool | None = None,
    read_ahead: int | None = None,
) -> None:
    """Check a call's arguments the same way in one process as in many, before anything
    is sent: a typo fails in the first run on a laptop, not hours later on a cluster.

    The store spec is opened (its scheme and syntax checked; nothing is connected).

    Raises:
        ValueError: the argument named, with what it must be.
        ImportError: the store needs a package that is not installed.
    """
    to_seconds(timeout)
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


@control.serialized
def all_gather_object(
    obj: Any,
    *,
    store: str | Store | None = None,
    timeout: Timeout = None,
    progress: bool | None = None,
) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank.

    This rank's own entry is ``obj`` itself, not a copy (unlike
    ``torch.distributed.all_gather_object``): a caller that reuses ``obj``'s memory
    afterwards changes it; the others are decoded copies (arrays as views into the
    part they were read from).  ``progress`` shows
    parts and bytes as they arrive (None: when stderr is a terminal and the
    gather is long, or as ``GATHERSTORE_PROGRESS=0/1`` says); see also the
    ``gatherstore`` logger.

    Raises:
        ValueError: a bad argument (an unknown store scheme or malformed URL, a timeout
            that is not a positive, finite number of seconds, a ``dst`` outside the job),
            raised in one process as in many, before anything is sent.
        RemoteRankError: another rank failed (e.g. its object cannot be pickled).
        GatherTimeout: ranks that did not arrive in time (named).
        StoreNotSharedError / StoreUnavailableError / IntegrityError: store problems.
    """
    check_arguments("all_gather_object", store, timeout, progress=progress)
    if not topology.is_distributed():
        return [obj]
    call = Call("all_gather_object", store, timeout, progress)
    plan = call.agree(lambda: obj, range(call.world), copy_own=_own_copies.get(), inline=True)
    return plan.route.all_gather(call, plan)


@control.serialized
def gather_object(
    obj: Any,
    dst: int = 0,
    *,
    store: str | Store | None = None,
    timeout: Timeout = None,
    progress: bool | None = None,
) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on ``dst``; None on the other ranks.

    ``dst``'s own entry is ``obj`` itself, as in
    [`all_gather_object`][gatherstore.all_gather_object].

    ``progress``: as in [`all_gather_object`][gatherstore.all_gather_object], shown on ``dst``.

    Raises:
        InsufficientMemoryError: the parts would not fit in ``dst``'s available
            memory (raised on every rank before any data moves).
        GatherError: the errors of [`all_gather_object`][gatherstore.all_gather_object].
    """
    check_arguments("gather_object", store, timeout, rank=("dst", dst), progress=progress)
    if not topology.is_distributed():
        return [obj]
    parts = gather_prepared(lambda: obj, dst, store, timeout, "gather_object", progress=progress)
    return None if parts is None else list(parts)


@control.serialized
def gather_iter(
    obj: Any,
    dst: int = 0,
    *,
    store: str | Store | None = None,
    timeout: Timeout = None,
    progress: bool | None = None,
    read_ahead: int | None = None,
) -> Iterator[Any]:
    """Every rank's ``obj`` on ``dst`` as an iterator in rank order, one part in memory at a time.

    The collective part runs when this is called (every rank must call it), within
    ``timeout``; ``dst`` then reads and deletes one part per step, each read
    within ``timeout`` of its own (the consumer sets the pace; on the ``stream``
    route the senders wait for it, within the call's timeout).  Other ranks get an
    empty iterator.  Closing the iterator early deletes the parts not read.

    ``dst`` holds the part its consumer keeps plus at most ``read_ahead`` bytes of
    the parts after it (default: ``GATHERSTORE_READ_AHEAD``, 32 MiB, at most 1/8
    of the free memory); a part larger than that is read when it is asked for.

    Raises:
        ValueError: a negative ``read_ahead``, and the bad arguments of
            [`all_gather_object`][gatherstore.all_gather_object].
        GatherError: the errors of [`gather_object`][gatherstore.gather_object].
    """
    check_arguments(
        "gather_iter", store, timeout, rank=("dst", dst), progress=progress, read_ahead=read_ahead
    )
    if not topology.is_distributed():
        return iter([obj])
    parts = gather_prepared(
        lambda: obj,
        dst,
        store,
        timeout,
        "gather_iter",
        stream=True,
        progress=progress,
        read_ahead=read_ahead,
    )
    return iter(()) if parts is None else parts


def gather_prepared(
    prepare: Callable[[], Any],
    dst: int,
    store: str | Store | None,
    timeout: Timeout,
    what: str,
    stream: bool = False,
    progress: bool | None = None,
    read_ahead: int | None = None,
) -> Iterator[Any] | None:
    """The gather behind the public calls: ``prepare()`` builds each rank's object,
    and its exceptions are reported to every rank instead of raised alone."""
    call = Call(what, store, timeout, progress, root=dst, read_ahead=read_ahead, iterated=stream)
    copy_own = _own_copies.get() and call.rank == dst
    plan = call.agree(
        prepare,
        [dst],
        send=call.rank != dst,
        full=[dst],
        copy_own=copy_own,
        inline=True,
        chunk=not stream,
    )
    return plan.route.gather(call, plan, dst, stream=stream)


@control.serialized
def broadcast_object(
    obj: Any = None, src: int = 0, *, store: str | Store | None = None, timeout: Timeout = None
) -> Any:
    """``src``'s ``obj`` on every rank (``src`` gets its own object back).

    Other ranks' ``obj`` is ignored.

    Raises:
        ValueError: a ``src`` outside the job, or a bad ``timeout`` or store URL.
        InsufficientMemoryError: the object would not fit in a receiving rank's
            available memory (raised on every rank before any data moves).
        GatherError: the errors of [`all_gather_object`][gatherstore.all_gather_object].
    """
    check_arguments("broadcast_object", store, timeout, rank=("src", src))
    if not topology.is_distributed():
        return obj
    call = Call("broadcast_object", store, timeout, root=src)
    receivers = [r for r in range(call.world) if r != src]
    plan = call.agree(lambda: obj, receivers, send=call.rank == src, full=())
    return plan.route.broadcast(call, plan, src)
