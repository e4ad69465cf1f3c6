"""``tmpdir`` between the processes of one machine: parts handed over as sealed memfds.

When ``tmpdir`` keeps its folders in this machine's RAM (/dev/shm, the base gatherstore
chooses) and every rank runs here, as one user and in one network namespace, a part
need not be a file that each reader copies into memory of its own (the copy that keeps
a verified part from changing under its reader, see ``stores._fileio``).  The sender
writes its part into a ``memfd`` and seals it (``F_SEAL_WRITE``, ``SHRINK``, ``GROW``:
nobody, the sender included, can change, truncate or grow it again), then hands the
descriptor to each reader over the reader's Unix socket (``SCM_RIGHTS``).  The reader
maps it privately and verifies it: arrays decoded from it are views of the memfd's
pages, writable (copied on write), and a part several readers hold
(``all_gather_object``) is in RAM once; once nothing views it, threads of the reader
unmap it (``gatherstore.host.mappings``).

- Each process listens on an abstract Unix socket of a random name, one per process
  group, published on the job's rendezvous store; both ends check that the other runs
  as this user (``SO_PEERCRED``).
- Linux counts descriptors in flight per user against the open-file limit: a call is
  handed over only while its own (one per sender and reader) stay within half of it.
- A descriptor in flight outlives its sender: a sender may exit once its send
  returned.  The call's confirmation exchange follows every send, so once it is
  over every part waits on its reader's socket.  A call that fails closes what was
  handed over for it; a part sent too late is closed before the reader's next call
  that may hand parts over agrees on its plan (or at ``gs.shutdown``).
- A gather's long list or dict goes in chunks, each a sealed memfd of its own, so that the
  reader rebuilds while the sender still encodes (see ``gatherstore.routes.handchunks``).
- ``GATHERSTORE_HANDOVER=0`` turns it off: parts are then files in the job's folder.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import logging
import math
import os
import resource
import secrets
import select
import socket
import struct
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gatherstore import _config as config
from gatherstore import codec
from gatherstore._errors import GatherError, GatherTimeout, IntegrityError, ranks_named
from gatherstore._time import Deadline
from gatherstore.host import mappings
from gatherstore.job import control, hooks
from gatherstore.job import state as job
from gatherstore.routes.base import Plan, Route, confirmed, send_confirmed
from gatherstore.routes.context import Context
from gatherstore.routes.progress import Progress, wanted
from gatherstore.stores.base import Store

__all__ = [
    "HandoverRoute",
    "binding",
    "close",
    "connect",
    "hand",
    "in_flight",
    "listening",
    "mapped",
    "received",
    "sealed",
    "token",
    "unsent",
]

#: Whether parts can be handed over here: Linux's sealed memfds and descriptor passing.
_POSSIBLE = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
_SEALS = sum(getattr(fcntl, f"F_SEAL_{seal}", 0) for seal in ("WRITE", "SHRINK", "GROW"))
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_KEY = "handover/"  # + rank: where a rank's socket is named on the rendezvous store
_HEAD = 1024  # bytes a handover's header may take
_MEMFD = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING if _POSSIBLE else 0
_FD = array.array("i")  # a descriptor in a control message
_log = logging.getLogger("gatherstore")


class _Listener:
    """The socket on which this process takes the parts other ranks hand it: one per
    process, published in each group it gathers in (a new default group gets a new
    socket: nothing sent to an earlier one's reaches it)."""

    def __init__(self) -> None:
        self.name = f"\0gatherstore-{os.getpid()}-{secrets.token_hex(8)}".encode()
        netns = os.stat("/proc/self/ns/net").st_ino  # abstract sockets are per namespace
        #: Where it takes parts: ranks that report the same can hand each other parts.
        self.token = f"{socket.gethostname()}:{netns}:{os.getuid()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.sock.bind(self.name)
            self.sock.listen(socket.SOMAXCONN)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self.waiting = select.poll()  # not select(): descriptors past 1024 are fine
        self.waiting.register(self.sock, select.POLLIN)

    def accept(self, until: Deadline | None) -> tuple[bytes, list[int]] | None:
        """The next handover (its header and descriptors) from a process of this user; None
        when none is waiting (``until`` None) or none came before ``until``.

        Raises:
            GatherError: this process has no descriptor left to take one.
        """
        while (conn := self.connection(until)) is not None:
            with conn:
                try:
                    return received(conn)
                except OSError:
                    continue  # a sender that gave up: its call fails on its own
        return None

    def connection(self, until: Deadline | None) -> socket.socket | None:
        """The next connection from a process of this user (a sender connects once its
        first message is ready: reading it blocks for 1 s at most); None as ``accept``.

        Raises:
            GatherError: as ``accept``.
        """
        while True:
            left = 0.0 if until is None else max(until.left(), 0.0)
            if not self.waiting.poll(math.ceil(left * 1000)):
                return None
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, ConnectionAbortedError):
                continue
            except OSError as exc:  # EMFILE, ENFILE
                raise GatherError(
                    f"no descriptor left to take a part handed over ({exc}): raise the limit "
                    "of open files (ulimit -n), or set GATHERSTORE_HANDOVER=0"
                ) from exc
            conn.settimeout(1.0)
            try:
                if _peer_uid(conn) == os.getuid():
                    return conn
                _log.warning("gatherstore: a part handed over by another user refused")
            except OSError:
                pass  # a sender that gave up
            conn.close()

    def drop(self) -> None:
        """Close every handover waiting here (parts of calls that failed or came late)."""
        while (handed := self.accept(None)) is not None:
            _close_all(handed[1])

    def close(self) -> None:
        """Stop listening: what waits here is dropped."""
        self.drop()
        self.sock.close()


def received(conn: socket.socket) -> tuple[bytes, list[int]]:
    """A handover's header and its descriptors, close-on-exec (a child this process
    starts later inherits none of them)."""
    head, ancillary, _, _ = conn.recvmsg(
        _HEAD, socket.CMSG_SPACE(_FD.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    fds = array.array(_FD.typecode)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return head, fds.tolist()


_listener: _Listener | None = None
_lock = threading.Lock()


def token(timeout: float) -> str:
    """Where this rank can take parts handed over: ``host:netns:uid`` (ranks that report
    the same token can hand each other parts), or "" when it cannot (turned off, not
    Linux, or no socket here).  Called before a call's plan is agreed, when nothing of
    this call can have been handed over yet: what waits on the socket is dropped.

    Raises:
        GatherTimeout: the rendezvous store did not answer within ``timeout``.
    """
    global _listener
    if not (_POSSIBLE and config.handover()):
        return ""
    with _lock:
        state = job.group_state()
        if _listener is not None and state.is_default and state.handover != _listener.name:
            _listener.close()  # a new default group: nothing sent to the earlier one's
            _listener = None
        if _listener is not None:
            _listener.drop()
        else:
            try:
                _listener = _Listener()
            except OSError as exc:
                _log.debug("gatherstore: parts are not handed over here: %s", exc)
                return ""
        listener = _listener
        if state.handover != listener.name:  # a group it is not published in yet
            key = f"{_KEY}{state.rank}"
            control.bounded(lambda: control.store().set(key, listener.name), timeout, "handover")
            state.handover = listener.name
        return listener.token


def in_flight() -> int:
    """How many descriptors this process's user may have in flight: Linux counts them
    per user against the sender's limit of open files (its soft ``RLIMIT_NOFILE``)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def listening() -> _Listener:
    """This process's listener (its rank reported a token for the current call)."""
    if _listener is None:
        raise GatherError("gatherstore was shut down during a call that hands parts over")
    return _listener


def close() -> None:
    """Close this process's listener (``gs.shutdown``): what waits there is dropped."""
    global _listener
    with _lock:
        if _listener is not None:
            _listener.close()
            _listener = None


def _forget_in_child() -> None:
    """A forked child does not take its parent's parts (its copy of the socket is closed)."""
    global _listener
    if _listener is not None:
        _listener.sock.close()  # the parent's: only this copy of it
        _listener = None


os.register_at_fork(after_in_child=_forget_in_child)
hooks.at_shutdown(close)


def _peer_uid(conn: socket.socket) -> int:
    """The user the process at the other end of ``conn`` runs as (from the kernel)."""
    _, uid, _ = _CREDS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
    return int(uid)


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def binding(call_id: str, rank: int) -> bytes:
    """What a handed-over part is sealed with: its call and rank (a part handed to the
    wrong call or as another rank's fails its checksum)."""
    return f"handover\0{call_id}\0{rank}".encode()


def hand(
    frame: codec.Frame, bind: bytes, readers: Sequence[int], call_id: str, deadline: Deadline
) -> None:
    """Seal this rank's part into a memfd (see :func:`sealed`) and hand it to each of
    ``readers``.

    Raises:
        GatherTimeout: a reader's socket took no connection before ``deadline``.
        GatherError: a reader's socket is gone (its process ended) or belongs to another
            user; the memfd could not be made (e.g. out of memory).
    """
    head = json.dumps({"call": call_id, "rank": job.group_state().rank}).encode()
    fd = sealed(frame, bind)
    try:
        for reader in readers:
            with connect(reader, deadline) as conn:
                _sent(reader, lambda: socket.send_fds(conn, [head], [fd]))
    finally:
        os.close(fd)


def sealed(frame: codec.Frame, bind: bytes) -> int:
    """A memfd holding ``frame`` with its digest over ``bind`` (see ``Frame.seal_into``),
    sealed: nobody can change it any more.

    Raises:
        GatherError: the memfd could not be made or filled (e.g. out of memory).
    """
    try:
        fd = os.memfd_create(f"gatherstore-part-{os.getpid()}", _MEMFD)
    except OSError as exc:
        raise _unwritten(frame, exc) from exc
    try:
        frame.seal_into(fd, None, bind)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError):
            raise _unwritten(frame, exc) from exc
        raise
    return fd


def _unwritten(frame: codec.Frame, exc: OSError) -> GatherError:
    """The error of a part that could not be put into memory to hand over."""
    return GatherError(
        f"this rank's part ({frame.nbytes} bytes) could not be put in memory to hand over: "
        f"{exc}; free memory on this machine, or gather through a store on disk "
        "(store='tmpdir:///var/tmp')"
    )


def connect(reader: int, deadline: Deadline) -> socket.socket:
    """A connection to ``reader``'s listener, checked to be this user's.

    Raises:
        GatherTimeout / GatherError: as ``hand``.
    """
    peers, key = job.group_state().handover_peers, f"{_KEY}{reader}"
    if reader not in peers:  # published before its plan's status: there already
        peers[reader] = control.bounded(lambda: control.store().get(key), deadline.left(), key)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(max(deadline.left(), 0.001))
    try:
        _sent(reader, lambda: conn.connect(peers[reader]))
        if _peer_uid(conn) != os.getuid():
            raise GatherError(
                f"the socket rank {reader} takes parts on belongs to another user: "
                "run every rank as one user, or set GATHERSTORE_HANDOVER=0"
            )
    except BaseException:
        conn.close()
        raise
    return conn


def _sent(reader: int, run: Callable[[], Any]) -> None:
    """``run()`` (a connect or send to ``reader``), its errors as ``hand`` raises them."""
    try:
        run()
    except TimeoutError:
        raise GatherTimeout(
            f"rank {reader} took no part within the call's timeout", ranks=[reader]
        ) from None
    except OSError as exc:
        raise unsent(reader, exc) from exc


def unsent(reader: int, exc: OSError) -> GatherError:
    """The error of a connect or send to ``reader`` that failed with ``exc``."""
    if exc.errno == errno.ETOOMANYREFS:
        return GatherError(
            f"could not hand this rank's part to rank {reader}: this user has more "
            "descriptors in flight than its limit of open files allows: raise it "
            "(ulimit -n) or set GATHERSTORE_HANDOVER=0"
        )
    return GatherError(
        f"could not hand this rank's part to rank {reader} ({exc}): its process "
        "ended, or it left the job"
    )


def take(call_id: str, ranks: Sequence[int], deadline: Deadline, what: str) -> dict[int, int]:
    """The descriptors of ``ranks``' parts of the call ``call_id``, off this process's
    socket; handovers of earlier calls that failed are closed on the way.

    Raises:
        GatherTimeout: parts still missing at ``deadline`` (every sender's send ended
            before the call's confirmation exchange, so this is not a wait).
    """
    listener = listening()
    got: dict[int, int] = {}
    try:
        while len(got) < len(ranks):
            handed = listener.accept(deadline)
            if handed is None:
                missing = [r for r in ranks if r not in got]
                raise GatherTimeout(
                    f"{what}: the parts of {ranks_named(missing)} were never handed over",
                    ranks=missing,
                    timeout=deadline.timeout,
                )
            head, fds = handed
            found = _header(head)
            ours = found is not None and found[0] == call_id and found[1] in ranks
            if ours and len(fds) == 1 and found is not None and found[1] not in got:
                got[found[1]] = fds[0]
            else:  # another call's, or one this call already has
                _close_all(fds)
    except BaseException:
        _close_left(got)
        raise
    return got


def _header(head: bytes) -> tuple[str, int] | None:
    """A handover's (call, rank), None when it is not one of ours."""
    try:
        found = json.loads(head)
        return str(found["call"]), int(found["rank"])
    except (ValueError, KeyError, TypeError):
        return None


def mapped(fd: int, size: int, rank: int, what: str) -> memoryview:
    """The sealed part in ``fd``, mapped privately (writable, copied on write); closes ``fd``.

    Raises:
        IntegrityError: the memfd is not sealed, or not of the size its sender agreed.
        GatherError: it cannot be mapped (no address space or memory left).
    """
    try:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        actual = os.fstat(fd).st_size
        if seals & _SEALS != _SEALS or actual != size:
            raise IntegrityError(
                f"{what}: the part of rank {rank} was handed over unsealed or of {actual} "
                f"bytes (agreed: {size})",
                rank=rank,
            )
        try:
            return mappings.map_private(fd, size)
        except OSError as exc:
            error = f"{what}: the part of rank {rank} cannot be mapped: {exc.strerror}"
            raise GatherError(error) from None
    finally:
        os.close(fd)


class HandoverRoute(Route):
    """``tmpdir`` in RAM between the ranks of this machine: parts as sealed memfds,
    handed over a Unix socket (see the module's docstring)."""

    need = "memfd"

    def __init__(self, store: Store) -> None:
        self.store = store

    def __str__(self) -> str:
        return f"{self.store} (handed over)"

    def all_gather(self, ctx: Context, plan: Plan) -> list[Any]:
        others = [r for r in range(ctx.world) if r != ctx.rank]
        call_id = self._hand(ctx, others)
        # every rank reads: one progress bar, on rank 0
        shown = ctx.rank == 0
        return _read_confirmed(ctx, plan, call_id, others, "all_gather_object (read)", shown=shown)

    def gather(self, ctx: Context, plan: Plan, dst: int, *, lazy: bool) -> Iterator[Any] | None:
        call_id = self._hand(ctx, [dst] if ctx.rank != dst else [])
        if ctx.rank != dst:
            ctx.finish()
            return None
        fds = take(call_id, [r for r in range(ctx.world) if r != dst], ctx.deadline, ctx.what)
        parts = _decoded(ctx, plan, call_id, fds, own=True, shown=True)
        if lazy:
            ctx.reading = True  # its consumer's reading ends the call
            return parts
        return iter(list(parts))

    def broadcast(self, ctx: Context, plan: Plan, src: int) -> Any:
        readers = [r for r in range(ctx.world) if r != src] if ctx.rank == src else []
        call_id = self._hand(ctx, readers)
        senders = [src] if ctx.rank != src else []
        got = _read_confirmed(ctx, plan, call_id, senders, "broadcast_object (read)", own=False)
        return got[0] if ctx.rank != src else plan.own

    def _hand(self, ctx: Context, readers: Sequence[int]) -> str:
        """Hand this rank's part to ``readers``; confirm every rank's handover.  The call's
        id: the control plane's step, the same on every rank after the plan's exchange."""
        call_id = control.call_id()

        def send(frame: codec.Frame) -> bool:
            if not readers:
                return False
            hand(frame, binding(call_id, ctx.rank), readers, call_id, ctx.deadline)
            return True

        # after a failure: what others handed this rank for the call goes at once
        send_confirmed(ctx, send, lambda sent: listening().drop())
        return call_id


def _read_confirmed(
    ctx: Context,
    plan: Plan,
    call_id: str,
    senders: list[int],
    what: str,
    *,
    own: bool = True,
    shown: bool = False,
) -> list[Any]:
    """Every part of ``senders`` (see ``_decoded``), then every rank's outcome (see
    ``confirmed``)."""

    def read() -> list[Any]:
        fds = take(call_id, senders, ctx.deadline, ctx.what)
        return list(_decoded(ctx, plan, call_id, fds, own=own, shown=shown))

    return confirmed(ctx, read, what)


def _decoded(
    ctx: Context, plan: Plan, call_id: str, fds: dict[int, int], *, own: bool, shown: bool
) -> Iterator[Any]:
    """Map, verify and decode each part of ``fds`` in rank order, this rank's own object in
    its place with ``own``, with a progress bar where ``shown``; the call ends with the
    last.  The parts not decoded are closed when the iterator is closed or dropped, even
    one never started."""
    parts = _decoding(ctx, plan, call_id, fds, own, shown)
    weakref.finalize(parts, _close_left, fds).atexit = False
    return parts


def _decoding(
    ctx: Context, plan: Plan, call_id: str, fds: dict[int, int], own: bool, shown: bool
) -> Iterator[Any]:
    incoming = sum(plan.sizes[r] for r in fds)
    enabled = shown and wanted(ctx.progress, incoming)
    progress = Progress(ctx.what, len(fds), incoming, enabled=enabled)
    try:
        for rank in range(ctx.world):
            if rank == ctx.rank and own:
                yield plan.own
            elif rank in fds:
                # no local keeps the part yielded: once its consumer drops it, it is
                # unmapped before the next one is mapped (nothing is read ahead here)
                yield _loaded(ctx, call_id, rank, fds.pop(rank), plan.sizes[rank], progress)
    finally:
        _close_left(fds)
        progress.close()
        ctx.finish()


def _loaded(ctx: Context, call_id: str, rank: int, fd: int, size: int, progress: Progress) -> Any:
    """``rank``'s part in ``fd``: mapped (see ``mapped``), verified and decoded, then
    counted in ``progress``."""
    view = mapped(fd, size, rank, ctx.what)
    where = f"{ctx.what}, handed over"
    value = codec.load(codec.verify(view, bind=binding(call_id, rank), rank=rank, where=where))
    progress.update(size)
    return value


def _close_left(fds: dict[int, int]) -> None:
    """Close the descriptors in ``fds`` and forget them (each is closed once)."""
    while fds:
        os.close(fds.popitem()[1])
