"""Object collectives, routed over the process group or through a store.

The shape of every call (see DESIGN.md, "How an object gather works"):

1. each rank serialises its object; a failure is recorded, not raised;
2. one control exchange shares (status, size, free memory) of every rank: if
   any rank failed, every rank raises — nobody hangs;
3. the route: "collective" sends pickled bytes over gatherstore's gloo group,
   a store takes the parts as files/keys; "auto" picks by total size;
4. each rank writes its part under a key unique to (job, call, rank), and a
   second exchange confirms every write;
5. readers read parts in rank order, verify them, and delete them; cleanup
   runs on error paths too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from . import _config as config
from . import _control as control
from . import _gloo as gloo
from . import _serialize as serialize
from . import _stream as stream_route
from . import _topology as topology
from ._call import AUTO_THRESHOLD, Call, confirm, failure, resolve, status
from ._config import Timeout, to_seconds
from ._parts import Parts, fetch, part_key
from .stores.base import Store

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
    everyone = list(range(call.world))
    sizes = call.agree(lambda: obj, everyone, copy_own=_own_copies.get())
    if call.target == "collective":
        slots = call.collective_all(sizes)
        call.finish()
        return [
            call.own if r == call.rank else call.decode_slot(s, sizes[r], r)
            for r, s in enumerate(slots)
        ]
    if call.target == "stream":
        everything = stream_route.all_from(call)
        call.finish()
        return everything
    session, prefix = call.write(everyone)
    error: BaseException | None = None
    out: list[Any] = []
    mine = status(True)
    try:
        try:
            # every part is returned: reading them all at once takes no more memory
            reader = Parts(
                call, session, prefix, call.rank, call.own, budget=call.total, delete=False
            )
            out = list(reader)
        except Exception as exc:
            error, mine = exc, failure(exc)
        confirm(mine, timeout=call.left(), what="all_gather_object (read)", error=error)
    finally:
        call.tidy(session, part_key(prefix, call.rank))
    return out


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

    ``dst``'s own entry is ``obj`` itself, as in :func:`all_gather_object`.

    ``progress``: as in :func:`all_gather_object`, shown on ``dst``.

    Raises:
        InsufficientMemoryError: the parts would not fit in ``dst``'s available
            memory (raised on every rank before any data moves).
        and the errors of :func:`all_gather_object`.
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
            :func:`all_gather_object`.
        and the errors of :func:`gather_object`.
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
    call = Call(what, store, timeout, progress, root=dst, read_ahead=read_ahead, streamed=stream)
    others = [r for r in range(call.world) if r != dst]
    copy_own = _own_copies.get() and call.rank == dst
    sizes = call.agree(prepare, [dst], send=call.rank != dst, full=[dst], copy_own=copy_own)
    obj = call.own
    if call.target == "collective":
        slots = call.collective_to(dst, sizes)
        call.finish()
        if slots is None:
            return None
        return iter(
            [obj if r == dst else call.decode_slot(s, sizes[r], r) for r, s in enumerate(slots)]
        )
    if call.target == "stream":
        streamed = stream_route.gather_to(call, dst)
        return streamed if stream or streamed is None else iter(list(streamed))
    session, prefix = call.write(others)
    if call.rank != dst:
        call.finish()
        return None
    # a gather_object returns every part: it may read them all at once; a gather_iter keeps
    # what its consumer holds plus the read-ahead budget
    budget = call.budget if stream else call.total
    parts = Parts(call, session, prefix, dst, obj, budget=budget, lazy=stream)
    return parts if stream else iter(list(parts))


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
        and the errors of :func:`all_gather_object`.
    """
    check_arguments("broadcast_object", store, timeout, rank=("src", src))
    if not topology.is_distributed():
        return obj
    call = Call("broadcast_object", store, timeout, root=src)
    receivers = [r for r in range(call.world) if r != src]
    sizes = call.agree(lambda: obj, receivers, send=call.rank == src, full=())
    if call.target == "collective":
        buf = call.packed(sizes[src])
        call.transfer(gloo.broadcast_op(buf, src))
        call.finish()
        return obj if call.rank == src else call.decode_slot(buf, sizes[src], src)
    if call.target == "stream":
        out = stream_route.part_from(call, src)
        call.finish()
        return out
    session, prefix = call.write([src])
    error: BaseException | None = None
    mine = status(True)
    out = obj
    try:
        if call.rank != src:
            out = serialize.load(fetch(call, session, prefix, src))
    except Exception as exc:
        error, mine = exc, failure(exc)
    try:
        confirm(mine, timeout=call.left(), what="broadcast_object (read)", error=error)
    finally:
        if call.rank == src:
            call.tidy(session, part_key(prefix, src))
    call.finish()
    return out
