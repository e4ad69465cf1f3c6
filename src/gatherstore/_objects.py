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
import json
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _control as control
from . import _gloo as gloo
from . import _memory as memory
from . import _serialize as serialize
from . import _stream as stream_route
from . import _topology as topology
from ._config import Timeout, to_seconds
from ._errors import (
    GatherError,
    IntegrityError,
    MismatchError,
    RemoteRankError,
    StoreUnavailableError,
)
from ._parts import Parts
from ._progress import Progress, log_call, wanted
from ._session import JobSession, after_failure, note_timeout, session_for
from .stores.base import Store, deadline
from .stores.file import TmpdirStore
from .stores.registry import ROUTES, default_store, open_store

__all__ = [
    "AUTO_THRESHOLD",
    "all_gather_object",
    "broadcast_object",
    "gather_iter",
    "gather_object",
]

#: Totals up to this many bytes go over the process group with ``store="auto"``
#: (``GATHERSTORE_AUTO_THRESHOLD`` overrides it).  Measured with 4 gloo ranks on
#: one 2-core machine: at 64 KiB both routes take ~10 ms; from 256 KiB on the
#: tmpdir route is 2.5-4x faster (1 MiB: 37 ms vs 10 ms; 256 MiB: 1.25 s vs 0.76 s).
AUTO_THRESHOLD = int(os.environ.get("GATHERSTORE_AUTO_THRESHOLD", str(128 << 10)))

#: Seconds of a call's timeout kept for telling the other ranks that the store failed.
_REPORT_TIME = 2.0

_opened: dict[str, Store] = {}


def _resolve(store: str | Store | None) -> str | Store:
    """A route ("auto", "collective", "stream") or an open Store (reused per URL)."""
    spec = default_store(store)
    if isinstance(spec, Store) or spec in ROUTES:
        return spec
    if spec not in _opened:
        _opened[spec] = open_store(spec)
    return _opened[spec]


def _status(ok: bool, **fields: Any) -> bytes:
    return json.dumps({"ok": ok, **fields}).encode()


def _failure(exc: BaseException) -> bytes:
    return _status(
        False,
        error=f"{type(exc).__name__}: {exc}",
        kind=type(exc).__name__,
        tb=traceback.format_exc(),
        store=str(getattr(exc, "store", "")),
    )


def _agree(mine: bytes, *, timeout: float, what: str, error: BaseException | None) -> list[Any]:
    """Exchange statuses; if any rank failed, raise on every rank."""
    try:
        raw = control.exchange(mine, timeout=timeout, what=what)
    except GatherError as exc:
        after_failure(exc)
        raise
    statuses = [json.loads(s) for s in raw]
    failed = [r for r, s in enumerate(statuses) if not s["ok"]]
    if not failed:
        return statuses
    if error is not None:
        raise error
    first = statuses[failed[0]]
    if first.get("kind") == "StoreUnavailableError":
        raise StoreUnavailableError(
            f"{what}: rank {failed[0]} cannot use the store: {first['error']}",
            store=first.get("store", ""),
        )
    raise RemoteRankError(
        failed[0], first["error"], remote_traceback=first.get("tb", ""), ranks=failed, context=what
    )


class _Call:
    """One object collective on this rank: encode, agree, route, move, clean up."""

    def __init__(
        self,
        what: str,
        store: str | Store | None,
        timeout: Timeout,
        progress: bool | None = None,
        root: int | None = None,
    ) -> None:
        self.started = time.perf_counter()
        self.what = what
        self.progress = progress
        self.timeout = to_seconds(timeout)
        self.ends_at = time.monotonic() + self.timeout
        note_timeout(self.timeout)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.target = _resolve(store)
        # what every rank must agree on before any data moves: the route and the dst/src
        self.shape = {"route": str(self.target), "root": root}

    def agree(
        self, prepare: Callable[[], Any], receivers: Sequence[int], *, send: bool = True
    ) -> list[int]:
        """Build this rank's object (``self.own``), encode it when it is sent, exchange sizes.

        Returns every rank's part size (0 for ranks that send nothing).
        """
        self.frame: serialize.Frame | None = None
        self.own: Any = None
        error: BaseException | None = None
        try:
            self.own = prepare()
            if send:
                self.frame = serialize.encode(self.own)
            mine = _status(
                True,
                size=self.frame.nbytes if self.frame else 0,
                avail=memory.headroom(),
                shm=memory.shm_free(),
                node=socket.gethostname(),
                call=self.shape,
                broken=gloo.broken(),
            )
        except Exception as exc:
            error, mine = exc, _failure(exc)
        statuses = _agree(mine, timeout=self.timeout, what=self.what, error=error)
        self._same_call(statuses)
        sizes = [int(s["size"]) for s in statuses]
        self.sizes = sizes
        self.total = sum(sizes)
        broken = next((s["broken"] for s in statuses if s["broken"]), "")
        if self.target == "auto":
            small = self.total <= AUTO_THRESHOLD and not broken
            # tmpdir is node-local: across nodes "auto" streams over the process group
            across = topology.get_nnodes() > 1
            self.target = "collective" if small else "stream" if across else _resolve("tmpdir")
        if self.target in ("collective", "stream") and broken:
            raise gloo.refuse(self.what, broken)
        if (
            isinstance(self.target, TmpdirStore)
            and self.target.url == "tmpdir"  # the base is gatherstore's choice: /dev/shm if it fits
            and not os.environ.get("GATHERSTORE_TMPDIR")
            and memory.in_ram(self.target)
            and memory.shortfalls("shm", statuses, sizes, receivers)
        ):
            self.target = _resolve(f"tmpdir://{tempfile.gettempdir()}")
        memory.check(self.what, self.target, statuses, sizes, receivers)
        return sizes

    def finish(self) -> None:
        """Log this call's one DEBUG line: route, bytes, seconds."""
        route = self.target if isinstance(self.target, str) else str(self.target)
        log_call(self.what, route, self.total, self.started)

    def _same_call(self, statuses: list[Any]) -> None:
        """Raise MismatchError on every rank when ranks disagree on the route or dst/src."""
        shapes = [s["call"] for s in statuses]
        if any(shape != shapes[0] for shape in shapes):
            details = {
                r: f"store={shape['route']!r}, dst/src={shape['root']}"
                for r, shape in enumerate(shapes)
            }
            raise MismatchError(
                f"{self.what}: ranks disagree on the store or the dst/src rank — {details}; "
                "every rank must pass the same store and dst/src",
                details=details,
            )

    # --- the collective route ---------------------------------------------------
    def transfer(self, start: gloo.Start) -> None:
        """Run one gloo op on gatherstore's group within this call's timeout."""
        try:
            gloo.transfer(start, what=self.what, deadline=self.ends_at, timeout=self.timeout)
        except GatherError as exc:
            after_failure(exc)
            raise

    def _packed(self, size: int) -> torch.Tensor:
        """This rank's sealed frame in a ``size``-byte tensor (the padding is never read)."""
        out = torch.empty(size, dtype=torch.uint8)
        if self.frame is not None:
            self.frame.seal(None).copy_into(out.numpy().data)
        return out

    def collective_all(self, sizes: list[int]) -> list[torch.Tensor]:
        longest = max(sizes)
        slots = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
        packed = self._packed(longest)
        self.transfer(gloo.all_gather(slots, packed))
        return slots

    def collective_to(self, dst: int, sizes: list[int]) -> list[torch.Tensor] | None:
        longest = max(sizes)
        if self.rank != dst:
            packed = self._packed(longest)
            self.transfer(gloo.gather(None, packed, dst))
            return None
        slots = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
        self.transfer(gloo.gather(slots, slots[dst], dst))
        return slots

    def decode_slot(self, slot: torch.Tensor, size: int, rank: int) -> Any:
        return serialize.decode(slot.numpy().data[:size], rank=rank, where=self.what)

    # --- the stream route: point to point, chunk by chunk -----------------------------
    def _limits(self) -> dict[str, Any]:
        return {"deadline": self.ends_at, "what": self.what, "timeout": self.timeout}

    def _segments(self) -> list[memoryview]:
        return [] if self.frame is None else self.frame.seal(None).segments

    def stream_to(self, dst: int) -> Iterator[Any] | None:
        """Send this rank's part to ``dst``; on ``dst``, every part in rank order as it
        arrives (its own object in place)."""
        group = control.control_group()
        if self.rank != dst:
            stream_route.send(self._segments(), self.sizes[self.rank], dst, group, **self._limits())
            self.frame = None
            self.finish()
            return None
        return self._streamed(dst, group)

    def _streamed(self, dst: int, group: Any) -> Iterator[Any]:
        incoming = self.total - self.sizes[dst]
        progress = Progress(
            self.what, self.world - 1, incoming, enabled=wanted(self.progress, incoming)
        )
        received = stream_route.receive(self.sizes, dst, group, **self._limits())
        try:
            for rank in range(self.world):
                if rank == dst:
                    yield self.own
                    continue
                _, part = next(received)
                progress.update(len(part))
                yield serialize.decode(memoryview(part), rank=rank, where=self.what)
        finally:
            progress.close()
            self.finish()

    def stream_from(self, src: int) -> Any:
        """``src``'s part on this rank, broadcast chunk by chunk (``src``: its own object)."""
        mine = self.rank == src
        part = stream_route.broadcast(
            self._segments() if mine else None,
            self.sizes[src],
            src,
            control.control_group(),
            **self._limits(),
        )
        if part is None:
            return self.own
        return serialize.decode(memoryview(part), rank=src, where=self.what)

    # --- the store route -----------------------------------------------------------
    def write(self, writers: Sequence[int]) -> tuple[JobSession, str]:
        """Write this rank's part (if it is a writer); confirm every write."""
        assert isinstance(self.target, Store)
        error: BaseException | None = None
        mine = _status(True)
        session = session_for(self.target, self.timeout)
        prefix = session.next_call()
        wrote = False
        try:
            if self.rank in writers and self.frame is not None:
                with self.deadline():
                    sealed = self.frame.seal(session.key, self.bind(session, prefix, self.rank))
                    session.store.put(self.key(prefix, self.rank), sealed.segments)
                wrote = True
        except Exception as exc:
            error, mine = exc, _failure(exc)
        self.frame = None
        try:
            _agree(mine, timeout=self.timeout, what=self.what, error=error)
        except BaseException:
            if wrote:
                with self.deadline():
                    session.store.discard(self.key(prefix, self.rank))
            raise
        return session, prefix

    def deadline(self) -> contextlib.AbstractContextManager[None]:
        """Bound the store operations inside to this call's timeout, less the time kept
        to report a store failure before the other ranks stop waiting for this one."""
        return deadline(self.timeout - min(self.timeout / 4, _REPORT_TIME))

    @staticmethod
    def key(prefix: str, rank: int) -> str:
        return f"{prefix}/{rank}"

    @staticmethod
    def bind(session: JobSession, prefix: str, rank: int) -> bytes:
        """What a part is signed together with: its job area, call and rank."""
        return f"{session.locator}\0{prefix}\0{rank}".encode()

    def fetch(self, session: JobSession, prefix: str, rank: int) -> serialize.Verified:
        """Read and verify one part (checksums release the GIL: this runs ahead in a thread).

        Raises:
            IntegrityError: the part is damaged, planted or replayed; names ``rank``.
            GatherError: the part is gone (deleted, or its TTL ran out).
        """
        key = self.key(prefix, rank)
        where = f"{session.store} {key}"
        try:
            with self.deadline():
                raw = session.store.get(key)
        except IntegrityError as exc:
            raise IntegrityError(
                f"{self.what}: part of rank {rank}: {exc}", rank=rank, key=where
            ) from None
        if raw is None:
            raise GatherError(
                f"{self.what}: the part of rank {rank} is gone from {session.store} (deleted, "
                "or it expired: raise the store's ttl)"
            )
        bind = self.bind(session, prefix, rank)
        return serialize.verify(raw, key=session.key, bind=bind, rank=rank, where=where)


def _serial_check(dst: int, what: str) -> None:
    world = topology.get_world_size()
    if not 0 <= dst < world:
        raise ValueError(f"{what}: dst={dst} is not a rank of this job (world size {world})")


def all_gather_object(
    obj: Any,
    *,
    store: str | Store | None = None,
    timeout: Timeout = None,
    progress: bool | None = None,
) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank.

    This rank's own entry is ``obj`` itself; the others are decoded copies
    (arrays as views into the part they were read from).  ``progress`` shows
    parts and bytes as they arrive (None: when stderr is a terminal and the
    gather is long, or as ``GATHERSTORE_PROGRESS=0/1`` says); see also the
    ``gatherstore`` logger.

    Raises:
        RemoteRankError: another rank failed (e.g. its object cannot be pickled).
        GatherTimeout: ranks that did not arrive in time (named).
        StoreNotSharedError / StoreUnavailableError / IntegrityError: store problems.
    """
    if not topology.is_distributed():
        return [obj]
    call = _Call("all_gather_object", store, timeout, progress)
    everyone = list(range(call.world))
    sizes = call.agree(lambda: obj, everyone)
    if call.target == "collective":
        slots = call.collective_all(sizes)
        call.finish()
        return [
            obj if r == call.rank else call.decode_slot(s, sizes[r], r) for r, s in enumerate(slots)
        ]
    if call.target == "stream":
        everything = [call.stream_from(src) for src in everyone]
        call.finish()
        return everything
    session, prefix = call.write(everyone)
    error: BaseException | None = None
    out: list[Any] = []
    mine = _status(True)
    try:
        try:
            out = list(Parts(call, session, prefix, call.rank, obj, delete=False))
        except Exception as exc:
            error, mine = exc, _failure(exc)
        _agree(mine, timeout=call.timeout, what="all_gather_object (read)", error=error)
    finally:
        with call.deadline():
            session.store.discard(call.key(prefix, call.rank))
    return out


def gather_object(
    obj: Any,
    dst: int = 0,
    *,
    store: str | Store | None = None,
    timeout: Timeout = None,
    progress: bool | None = None,
) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on ``dst``; None on the other ranks.

    ``progress``: as in :func:`all_gather_object`, shown on ``dst``.

    Raises:
        InsufficientMemoryError: the parts would not fit in ``dst``'s available
            memory (raised on every rank before any data moves).
        and the errors of :func:`all_gather_object`.
    """
    _serial_check(dst, "gather_object")
    if not topology.is_distributed():
        return [obj]
    parts = gather_prepared(lambda: obj, dst, store, timeout, "gather_object", progress=progress)
    return None if parts is None else list(parts)


def gather_iter(
    obj: Any,
    dst: int = 0,
    *,
    store: str | Store | None = None,
    timeout: Timeout = None,
    progress: bool | None = None,
) -> Iterator[Any]:
    """Every rank's ``obj`` on ``dst`` as an iterator in rank order, one part in memory at a time.

    The collective part runs when this is called (every rank must call it);
    ``dst`` then reads and deletes one part per step.  Other ranks get an empty
    iterator.  Closing the iterator early deletes the parts not read.
    """
    _serial_check(dst, "gather_iter")
    if not topology.is_distributed():
        return iter([obj])
    parts = gather_prepared(
        lambda: obj, dst, store, timeout, "gather_iter", stream=True, progress=progress
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
) -> Iterator[Any] | None:
    """The gather behind the public calls: ``prepare()`` builds each rank's object,
    and its exceptions are reported to every rank instead of raised alone."""
    call = _Call(what, store, timeout, progress, root=dst)
    others = [r for r in range(call.world) if r != dst]
    sizes = call.agree(prepare, [] if stream else [dst], send=call.rank != dst)
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
        streamed = call.stream_to(dst)
        return streamed if stream or streamed is None else iter(list(streamed))
    session, prefix = call.write(others)
    if call.rank != dst:
        call.finish()
        return None
    parts = Parts(call, session, prefix, dst, obj)
    return parts if stream else iter(list(parts))


def broadcast_object(
    obj: Any = None, src: int = 0, *, store: str | Store | None = None, timeout: Timeout = None
) -> Any:
    """``src``'s ``obj`` on every rank (``src`` gets its own object back)."""
    _serial_check(src, "broadcast_object")
    if not topology.is_distributed():
        return obj
    call = _Call("broadcast_object", store, timeout, root=src)
    receivers = [r for r in range(call.world) if r != src]
    sizes = call.agree(lambda: obj, receivers, send=call.rank == src)
    if call.target == "collective":
        buf = call._packed(sizes[src])
        call.transfer(gloo.broadcast(buf, src))
        call.finish()
        return obj if call.rank == src else call.decode_slot(buf, sizes[src], src)
    if call.target == "stream":
        out = call.stream_from(src)
        call.finish()
        return out
    session, prefix = call.write([src])
    error: BaseException | None = None
    mine = _status(True)
    out = obj
    try:
        if call.rank != src:
            out = serialize.load(call.fetch(session, prefix, src))
    except Exception as exc:
        error, mine = exc, _failure(exc)
    try:
        _agree(mine, timeout=call.timeout, what="broadcast_object (read)", error=error)
    finally:
        if call.rank == src:
            with call.deadline():
                session.store.discard(call.key(prefix, src))
    call.finish()
    return out
