"""The object collectives: every rank's object, routed over the process group or a store.

Each public call goes through the one entry (``gatherstore.calls.entry``: its
arguments checked the same way in one process as in many, one deadline, its log
line), agrees on a plan with every rank (``gatherstore.calls.agreement``: each rank's
object is built and encoded, a failure on any rank raises on every rank, sizes and
free memory are exchanged, the route is settled and checked to fit), then hands the
plan and the call's context to its route (``gatherstore.routes``), which moves the
parts.
"""

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from gatherstore._config import AUTO_THRESHOLD, Timeout
from gatherstore.calls.agreement import Agreement, Shape
from gatherstore.calls.entry import check, group_rank, run
from gatherstore.routes.context import Context
from gatherstore.stores.base import Store

__all__ = [
    "AUTO_THRESHOLD",
    "all_gather_object",
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


def all_gather_object(
    obj: Any,
    *,
    group: Any = None,
    store: str | Store | None = None,
    timeout: Timeout = None,
    progress: bool | None = None,
) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank.

    This rank's own entry is ``obj`` itself, not a copy (unlike
    ``torch.distributed.all_gather_object``): a caller that reuses ``obj``'s memory
    afterwards changes it; the others are decoded copies (arrays as views into the
    part they were read from).

    In one process, without a process group, this is ``[obj]``, never pickled: a world
    of one sends nothing, and only what travels is pickled (in a job too, ``dst`` never
    pickles its own object in a ``gather_object``); accelerate's and mmengine's gathers
    answer so too.  An object that cannot be pickled thus passes in one process and
    fails under a launcher; two processes check it (``gs.launch(fn, nproc_per_node=2,
    backend="gloo")``).

    Args:
        obj: this rank's object: anything pickle can encode.
        group: the process group to gather over (None: the default group), however it
            was made (``new_group``, ``new_subgroups``, ``split_group``, a ``DeviceMesh``
            dimension); see "Process groups".
        store: where the parts go: a store URL (``"file:///shared/dir"``,
            ``"redis://host:6379/0"``, ...), an open ``Store``, or a route (``"auto"``,
            ``"collective"``, ``"stream"``); None: the default store
            (``set_default_store``, else ``GATHERSTORE_STORE``, else ``"auto"``).
        timeout: how long the whole call may take: seconds or a ``timedelta``; None:
            ``GATHERSTORE_TIMEOUT``.
        progress: show parts and bytes as they arrive; None: when stderr is a terminal
            and the gather is long, or as ``GATHERSTORE_PROGRESS=0/1`` says.  See also
            the ``gatherstore`` logger.

    Returns:
        Every rank's object, in rank order (the members' objects in group-rank order on
        a ``group``).  On a rank outside ``group``, None at once, as torch does.

    Raises:
        ValueError: a bad argument (an unknown store scheme or malformed URL, a timeout
            that is not a positive, finite number of seconds, a ``dst`` outside the job),
            raised in one process as in many, before anything is sent.
        TypeError: this rank's object cannot be pickled (what pickle raises, e.g.
            ``cannot pickle '_thread.lock' object``, its message saying where in ``obj``
            the culprit is: ``— at obj['results'][2]['mask']: a <class '_thread.lock'>``);
            or ``group`` is not a process group.
        RemoteRankError: another rank failed (e.g. its object cannot be pickled: its
            message says where, as above).
        GatherTimeout: ranks that did not arrive in time (named).
        StoreNotSharedError / StoreUnavailableError / IntegrityError: store problems.

    Examples:
        >>> stats = gs.all_gather_object({"rank": gs.get_rank(), "seen": len(shard)})
        >>> total = sum(s["seen"] for s in stats)  # the same on every rank
    """
    check("all_gather_object", timeout=timeout, store=store, progress=progress, group=group)

    def body(ctx: Context) -> list[Any]:
        shape = Shape(range(ctx.world), copy_own=_own_copies.get(), inline=True)
        plan = Agreement(ctx, store).agree(lambda: obj, shape)
        return plan.route.all_gather(ctx, plan)

    return run(
        "all_gather_object", body, lambda: [obj], timeout=timeout, progress=progress, group=group
    )


def gather_object(
    obj: Any,
    dst: int | None = None,
    *,
    group: Any = None,
    group_dst: int | None = None,
    store: str | Store | None = None,
    timeout: Timeout = None,
    progress: bool | None = None,
) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on ``dst``; None on the other ranks.

    ``dst``'s own entry is ``obj`` itself, as in ``all_gather_object``.  In one
    process, ``[obj]``, never pickled (as there).

    Args:
        obj: this rank's object: anything pickle can encode.
        dst: the global rank that gets the list.
        group: the process group to gather over (None: the default group); see
            ``all_gather_object``.
        group_dst: the rank within ``group`` that gets the list.  As in torch, give
            ``dst`` or ``group_dst``, not both; neither: the group's first rank (rank 0
            of the default group).
        store: where the parts go (None: the default store); see ``all_gather_object``.
        timeout: how long the whole call may take: seconds or a ``timedelta``; None:
            ``GATHERSTORE_TIMEOUT``.
        progress: as in ``all_gather_object``, shown on ``dst``.

    Returns:
        On ``dst``, every rank's object, in group-rank order (rank order on the default
        group); None on the other ranks, and at once on a rank outside ``group``.

    Raises:
        ValueError: ``dst`` and ``group_dst`` both given, or a root that is not a rank
            of the group; and the bad arguments of ``all_gather_object``.
        InsufficientMemoryError: the parts would not fit in ``dst``'s available
            memory (raised on every rank before any data moves).
        GatherError: the errors of ``all_gather_object``.

    Examples:
        >>> parts = gs.gather_object(preds)  # on rank 0; None elsewhere
        >>> if parts is not None:
        ...     merged = [p for part in parts for p in part]
    """
    what = "gather_object"
    check(what, timeout=timeout, store=store, progress=progress, group=group)
    root = group_rank(what, group, ("dst", dst), ("group_dst", group_dst))
    parts = gather_prepared(lambda: obj, root, store, timeout, what, progress=progress, group=group)
    return None if parts is None else list(parts)


def gather_iter(
    obj: Any,
    dst: int | None = None,
    *,
    group: Any = None,
    group_dst: int | None = None,
    store: str | Store | None = None,
    timeout: Timeout = None,
    progress: bool | None = None,
    read_ahead: int | None = None,
) -> Iterator[Any]:
    """Every rank's ``obj`` on ``dst`` as an iterator in rank order, one part in memory at a time.

    The collective part runs when this is called (every rank must call it), within
    ``timeout``; ``dst`` then reads and deletes one part per step, each read
    within ``timeout`` of its own (the consumer sets the pace; on the ``stream``
    route the senders wait for it, within the call's timeout).  Closing the iterator
    early deletes the parts not read.  In one process, an iterator over ``[obj]``,
    never pickled (as in ``all_gather_object``).

    Args:
        obj: this rank's object: anything pickle can encode.
        dst: the global rank that reads the parts.
        group: the process group to gather over (None: the default group); see
            ``all_gather_object``.
        group_dst: the rank within ``group`` that reads the parts; give ``dst`` or
            ``group_dst``, as in ``gather_object``.
        store: where the parts go (None: the default store); see ``all_gather_object``.
        timeout: how long the collective part may take, and each read: seconds or a
            ``timedelta``; None: ``GATHERSTORE_TIMEOUT``.
        progress: as in ``all_gather_object``, shown on ``dst``.
        read_ahead: the bytes of the parts after the one its consumer keeps that
            ``dst`` may hold (default: ``GATHERSTORE_READ_AHEAD``, 32 MiB, at most 1/8
            of the free memory); a part larger than that is read when it is asked for.

    Returns:
        On ``dst``, an iterator over every rank's object, in group-rank order; an empty
        iterator on the other ranks and on a rank outside ``group``.

    Raises:
        ValueError: a negative ``read_ahead``, and the bad arguments of
            ``gather_object``.
        GatherError: the errors of ``gather_object``.

    Examples:
        >>> for part in gs.gather_iter(preds):  # on rank 0, one part at a time
        ...     writer.write(part)
    """
    what = "gather_iter"
    check(what, timeout=timeout, store=store, progress=progress, read_ahead=read_ahead, group=group)
    parts = gather_prepared(
        lambda: obj,
        group_rank(what, group, ("dst", dst), ("group_dst", group_dst)),
        store,
        timeout,
        what,
        lazy=True,
        progress=progress,
        read_ahead=read_ahead,
        group=group,
    )
    return iter(()) if parts is None else parts


def gather_prepared(
    prepare: Callable[[], Any],
    dst: int,
    store: str | Store | None,
    timeout: Timeout,
    what: str,
    lazy: bool = False,
    progress: bool | None = None,
    read_ahead: int | None = None,
    group: Any = None,
) -> Iterator[Any] | None:
    """The gather behind the public calls (their arguments checked, ``dst`` a rank of
    ``group``): ``prepare()`` builds each rank's object, and its exceptions are reported
    to every rank instead of raised alone; serially, the one object ``prepare()`` builds;
    None on a rank outside ``group``."""

    def body(ctx: Context) -> Iterator[Any] | None:
        agreement = Agreement(ctx, store, root=dst, read_ahead=read_ahead, iterated=lazy)
        copy_own = _own_copies.get() and ctx.rank == dst
        shape = Shape(
            [dst],
            send=ctx.rank != dst,
            full=[dst],
            copy_own=copy_own,
            inline=True,
            chunk=not lazy,
        )
        plan = agreement.agree(prepare, shape)
        return plan.route.gather(ctx, plan, dst, lazy=lazy)

    return run(
        what, body, lambda: iter([prepare()]), timeout=timeout, progress=progress, group=group
    )


def broadcast_object(
    obj: Any = None,
    src: int | None = None,
    *,
    group: Any = None,
    group_src: int | None = None,
    store: str | Store | None = None,
    timeout: Timeout = None,
) -> Any:
    """``src``'s ``obj`` on every rank (``src`` gets its own object back).

    In one process, ``obj`` itself, never pickled (as in ``all_gather_object``).

    Args:
        obj: on ``src``, the object to send: anything pickle can encode; ignored on
            the other ranks.
        src: the global rank whose ``obj`` is sent.
        group: the process group to broadcast over (None: the default group); see
            ``all_gather_object``.
        group_src: the rank within ``group`` whose ``obj`` is sent.  As in torch, give
            ``src`` or ``group_src``, not both; neither: the group's first rank.
        store: where the object goes (None: the default store); see
            ``all_gather_object``.
        timeout: how long the whole call may take: seconds or a ``timedelta``; None:
            ``GATHERSTORE_TIMEOUT``.

    Returns:
        ``src``'s object, on every rank of ``group``.  On a rank outside ``group``,
        ``obj`` at once, untouched, as torch leaves its list.

    Raises:
        ValueError: a ``src`` outside the job (or the group), ``src`` and ``group_src``
            both given, or a bad ``timeout`` or store URL.
        InsufficientMemoryError: the object would not fit in a receiving rank's
            available memory (raised on every rank before any data moves).
        GatherError: the errors of ``all_gather_object``.

    Examples:
        >>> config = gs.broadcast_object(load_config() if gs.is_main_process() else None)
    """
    what = "broadcast_object"
    check(what, timeout=timeout, store=store, group=group)
    root = group_rank(what, group, ("src", src), ("group_src", group_src))

    def body(ctx: Context) -> Any:
        receivers = [r for r in range(ctx.world) if r != root]
        shape = Shape(receivers, send=ctx.rank == root, full=())
        plan = Agreement(ctx, store, root=root).agree(lambda: obj, shape)
        return plan.route.broadcast(ctx, plan, root)

    return run(what, body, lambda: obj, timeout=timeout, group=group, apart=lambda: obj)
