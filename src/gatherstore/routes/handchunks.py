"""A gather's parts handed over in chunks: the destination rebuilds while the senders encode.

With ``tmpdir`` handed over in RAM (see ``gatherstore.routes.handover``), a sender whose
object is a long list or dict (see ``gatherstore.codec.chunks``) opens one connection to the
destination and hands each chunk over as a sealed memfd as soon as it is encoded.
The destination takes the chunks of every sender as they come, verifies each and
rebuilds it onto that sender's list or dict; then every rank confirms.

- Each chunk is sealed with its call, its rank, its place in the run, and whether
  it is the last one, or a whole part (a sender whose run broke sends its object
  whole instead): a chunk replayed, reordered or cut short fails its checksum.
- The destination acknowledges each chunk it took, and a sender keeps at most
  ``WINDOW`` of them unacknowledged: at most ``WINDOW`` descriptors in flight per
  sender, and a sender never runs far ahead of a destination that is busy.
- A sender that fails says so on its connection (connecting to say it, if need
  be), and the confirmation exchange raises its error on every rank.  A destination
  that stops (a sender failed, or a chunk it cannot rebuild) says so on the
  rendezvous store and closes its connections: a sender waiting for an
  acknowledgement, or one that connects later, stops handing over.  Every rank then
  confirms, and the confirmation says why.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import select
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from gatherstore import codec
from gatherstore._errors import (
    GatherError,
    GatherTimeout,
    IntegrityError,
    RemoteRankError,
    ranks_named,
)
from gatherstore.codec import Assembly, Chunks, Unchunkable
from gatherstore.job import control
from gatherstore.job import state as job
from gatherstore.routes import handover
from gatherstore.routes.base import Plan, confirmed, send_confirmed
from gatherstore.routes.context import Context
from gatherstore.routes.progress import Progress, wanted

__all__ = ["WINDOW", "ChunkedRoute"]

#: Chunks a sender may have handed over that the destination has not taken yet.
WINDOW = 16
_ACK = b"\x01"
#: Threads of a sender that seal chunks, each into its own memfd, while every rank can
#: have a core (see ``_sealers``).  A thread that comes back from a system call waits
#: for the GIL while the encoder holds it (up to the switch interval), and sealing a
#: chunk of many small arrays takes a few dozen calls: two threads seal two chunks
#: while each waits in turn.
_SEALERS = 2
#: Chunks encoded that wait for a thread to seal them.
_WAITING = 1
#: Seconds between a sender's checks, while it waits for an acknowledgement, of whether
#: the destination stopped.
_CHECK = 0.2
#: What a chunk is: one of a run, its last one, or a part sent whole after a run broke.
_KINDS = ("chunk", "last", "whole")


def _bind(call_id: str, rank: int, index: int, kind: str) -> bytes:
    return handover.binding(call_id, rank) + f"\0{index}\0{kind}".encode()


class _Stopped(Exception):
    """The destination stopped taking chunks."""


def _halt_key(call_id: str) -> str:
    """Where a destination that stopped says so, on the rendezvous store."""
    return f"chunks/{call_id}/stopped"


class _Sender:
    """This rank's side of its connection to the destination, made once the first
    chunk is sealed (so that its message follows the connect at once).  Chunks are
    sealed on several threads at once, and handed over in their order."""

    def __init__(self, ctx: Context, call_id: str, dst: int) -> None:
        self.ctx, self.call_id, self.dst = ctx, call_id, dst
        self.conn: socket.socket | None = None
        self.sent = self.acked = 0
        self.turn = threading.Condition()
        self.broken = False  # a chunk was not handed over: none after it is

    def put(self, frame: codec.Frame, kind: str, index: int) -> None:
        """Seal ``frame`` into a memfd as chunk ``index``, and hand it over once the
        chunks before it are; nothing when one of those was not.  A chunk that cannot
        be sealed or handed over stops the chunks after it."""
        try:
            fd = handover.sealed(frame, _bind(self.call_id, self.ctx.rank, index, kind))
            try:
                self._hand(fd, index, kind, frame.nbytes)
            finally:
                os.close(fd)
        except BaseException:
            self.stop()
            raise

    def _hand(self, fd: int, index: int, kind: str, size: int) -> None:
        """Hand the sealed chunk ``fd`` over in its turn (after an acknowledgement when
        ``WINDOW`` chunks are in flight)."""
        with self.turn:
            self.turn.wait_for(lambda: self.sent == index or self.broken)
        if self.broken:
            return
        while self.sent - self.acked >= WINDOW:
            self._ack()
        head = {"call": self.call_id, "rank": self.ctx.rank, "chunk": index, "kind": kind}
        head["size"] = size
        conn = self._connected()
        self._io(lambda: socket.send_fds(conn, [json.dumps(head).encode()], [fd]))
        with self.turn:
            self.sent += 1
            self.turn.notify_all()

    def stop(self) -> None:
        """Hand over no more chunks (chunks waiting for their turn are dropped)."""
        with self.turn:
            self.broken = True
            self.turn.notify_all()

    def _connected(self) -> socket.socket:
        if self.conn is None:
            self.conn = handover.connect(self.dst, self.ctx.deadline)
        return self.conn

    def drain(self) -> None:
        """Wait until the destination took every chunk: closing a connection with
        acknowledgements unread would reset it, chunks still on their way with it."""
        while self.acked < self.sent:
            self._ack()

    def _ack(self) -> None:
        """Take one acknowledgement; check now and then whether the destination stopped
        (it may never accept this connection)."""
        deadline = self.ctx.deadline
        while True:
            left = deadline.left()
            if left <= 0:
                raise self._late()
            try:
                got = self._io(lambda: self._connected().recv(len(_ACK)), min(left, _CHECK))
            except TimeoutError:
                if self._halted():
                    raise _Stopped from None
                continue
            if not got:
                raise _Stopped
            self.acked += 1
            return

    def _io(self, run: Any, timeout: float | None = None) -> Any:
        """``run()`` on the connection, within ``timeout`` (raised as TimeoutError) or
        else the call's deadline (raised as GatherTimeout)."""
        conn = self._connected()
        conn.settimeout(max(self.ctx.deadline.left() if timeout is None else timeout, 0.001))
        try:
            return run()
        except (BrokenPipeError, ConnectionResetError):
            raise _Stopped from None
        except TimeoutError:
            if timeout is not None:
                raise
            raise self._late() from None
        except OSError as exc:
            raise handover.unsent(self.dst, exc) from exc

    def _late(self) -> GatherTimeout:
        return GatherTimeout(
            f"{self.ctx.what}: rank {self.dst} took no chunk of this rank's part within "
            "the call's timeout",
            ranks=[self.dst],
        )

    def _halted(self) -> bool:
        """Whether the destination said it stopped."""
        key = _halt_key(self.call_id)
        left = max(self.ctx.deadline.left(), 0.001)
        return bool(control.bounded(lambda: control.store().check([key]), left, self.ctx.what))

    def stopped(self) -> None:
        """The destination stopped taking chunks: fine when it said so (the confirmation
        exchange says why).

        Raises:
            RemoteRankError: it closed its end without a word: its process ended.
        """
        if not self._halted():
            raise RemoteRankError(
                self.dst,
                "its connection closed before it took every chunk: its process ended",
                context=self.ctx.what,
            )

    def fail(self) -> None:
        """Tell the destination that this rank stopped (best effort: it may be gone)."""
        head = {"call": self.call_id, "rank": self.ctx.rank, "failed": True}
        try:
            conn = self._connected()
            conn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while conn.recv(len(_ACK)):  # acknowledgements left unread reset the
                    pass  # connection, and the message with it
            conn.setblocking(True)
            conn.send(json.dumps(head).encode())
        except (OSError, GatherError):
            pass

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def _sealers(world: int) -> int:
    """Threads to seal a sender's chunks: :data:`_SEALERS` while the ranks (all on this
    machine: parts are handed over) are no more than the CPUs this process may run on
    (its affinity; a container's CPU quota is not seen), else one (a second thread
    would take a core from another rank)."""
    return _SEALERS if world <= len(os.sched_getaffinity(0)) else 1


def _send(ctx: Context, chunks: Chunks, dst: int, call_id: str) -> None:
    """Hand this rank's chunks to ``dst``, the first one already encoded, the others as
    they are encoded; the whole object instead when the run breaks.  Threads of the
    call seal and hand the chunks over while the next ones are encoded.

    Raises:
        GatherTimeout / GatherError: as ``gatherstore.routes.handover.hand``; whatever
            encoding a chunk raises. A destination that stopped and said so is not an error
            here (the confirmation exchange says why it stopped).
    """
    sender = _Sender(ctx, call_id, dst)
    queued: list[Future[None]] = []
    indices, sealers = itertools.count(), _sealers(ctx.world)
    # its threads hand chunks over to the call's group (see gatherstore.job.state.inherited)
    pool = ThreadPoolExecutor(sealers, "gatherstore-chunks", initializer=job.inherited())
    with pool as threads:

        def take() -> None:
            """The oldest chunk's outcome; taken off once it is done, so that a failure
            meanwhile waits for it below."""
            queued[0].result()
            queued.pop(0)

        def put(frame: codec.Frame, kind: str) -> None:
            queued.append(threads.submit(sender.put, frame, kind, next(indices)))
            while len(queued) > sealers + _WAITING or (queued and queued[0].done()):
                take()

        try:
            try:
                put(chunks.head, "chunk")
                for frame in chunks.rest():
                    put(frame, "last" if chunks.finished else "chunk")
            except Unchunkable:
                chunks.close()
                # chunks still queued hold their arrays: encoding whole may count those as
                # held elsewhere too, which costs a little time, never a wrong result
                put(codec.encode(chunks.items), "whole")
            while queued:
                take()
            sender.drain()
        except BaseException as exc:
            for waiting in queued:
                waiting.cancel()
            sender.stop()
            wait(queued)  # no thread uses the connection any more
            if not isinstance(exc, _Stopped):
                sender.fail()
                raise
            sender.stopped()
        finally:
            sender.close()


class _Inbox:
    """The destination's side: every sender's connection, and what each one sent so far."""

    def __init__(self, ctx: Context, plan: Plan, call_id: str, senders: list[int]) -> None:
        self.ctx, self.plan, self.call_id = ctx, plan, call_id
        self.listener = handover.listening()
        self.waiting = select.poll()
        self.waiting.register(self.listener.sock, select.POLLIN)
        #: fileno: (connection, its sender's rank, None until its first message)
        self.conns: dict[int, tuple[socket.socket, int | None]] = {}
        self.due = dict.fromkeys(senders, 0)  # rank: the next chunk's index
        self.runs: dict[int, Assembly] = {}
        self.done: dict[int, Any] = {}
        self.stopped = False
        incoming = sum(plan.sizes[r] for r in senders)
        enabled = wanted(ctx.progress, incoming)
        self.progress = Progress(ctx.what, len(senders), incoming, enabled=enabled)

    def run(self) -> dict[int, Any] | None:
        """Every sender's object by rank; None when a sender stopped (its failure is in
        the confirmation exchange).

        Raises:
            GatherTimeout: senders whose chunks did not all come within the call's time.
            IntegrityError / GatherError: a chunk that fails its check or cannot be rebuilt.
        """
        listening = self.listener.sock.fileno()
        while len(self.done) < len(self.due) and not self.stopped:
            left = self.ctx.deadline.left()
            events = self.waiting.poll(math.ceil(max(left, 0.0) * 1000)) if left > 0 else []
            if not events:
                missing = [r for r in self.due if r not in self.done]
                raise GatherTimeout(
                    f"{self.ctx.what}: the parts of {ranks_named(missing)} were not all handed "
                    "over within the call's timeout",
                    ranks=missing,
                    timeout=self.ctx.deadline.timeout,
                )
            for fileno, _ in events:
                if fileno == listening:
                    conn = self.listener.connection(None)
                    if conn is not None:  # its first message is read once it is in
                        self.conns[conn.fileno()] = (conn, None)
                        self.waiting.register(conn, select.POLLIN)
                elif fileno in self.conns:
                    self._take(*self.conns[fileno])
        return None if self.stopped else self.done

    def _take(self, conn: socket.socket, rank: int | None) -> None:
        """Take the next message on ``conn`` (from ``rank``; None: its first one)."""
        try:
            head, fds = handover.received(conn)
        except OSError:
            head, fds = b"", []
        found = _header(head)
        if found is None or found["call"] != self.call_id or found["rank"] not in self.due:
            self._close(conn, fds)
            if rank is not None:  # an end without a word: the sender's process ended
                self.stopped = True
            return
        sender: int = found["rank"]
        if rank is not None and sender != rank:  # not what its sender would send
            self._close(conn, fds)
            self.stopped = True
            return
        if rank is None and (sender in self.done or self._has(sender)):
            self._close(conn, fds)  # a second connection for one rank: not a sender's
            return
        if found.get("failed"):
            self.stopped = True
            self._close(conn, fds)
            return
        self.conns[conn.fileno()] = (conn, sender)
        try:
            self._chunk(sender, found, fds)
        finally:
            for fd in fds:
                os.close(fd)
        if "chunk" in found:  # not a part whole, by ``gatherstore.routes.handover.hand``
            with contextlib.suppress(OSError):  # the sender is gone: its confirmation says so
                conn.send(_ACK)
        if sender in self.done:
            self._close(conn, [])

    def _has(self, rank: int) -> bool:
        return any(r == rank for _, r in self.conns.values())

    def _chunk(self, rank: int, found: dict[str, Any], fds: list[int]) -> None:
        """Verify a chunk of ``rank`` and rebuild it onto its list (its descriptor is
        taken out of ``fds``)."""
        what = self.ctx.what
        index: Any
        kind: Any
        size: Any
        if "chunk" not in found:  # whole, sealed by ``gatherstore.routes.handover.hand``
            index, kind, size = self.due[rank], "whole", self.plan.sizes[rank]
            bind = handover.binding(self.call_id, rank)
        else:
            index, kind, size = found["chunk"], found.get("kind"), found.get("size")
            bind = _bind(self.call_id, rank, index, str(kind))
        if len(fds) != 1 or index != self.due[rank] or kind not in _KINDS or type(size) is not int:
            raise IntegrityError(
                f"{what}: rank {rank} handed over chunk {index} ({kind}) where chunk "
                f"{self.due[rank]} was due",
                rank=rank,
            )
        view = handover.mapped(fds.pop(), size, rank, what)
        verified = codec.verify(view, bind=bind, rank=rank, where=f"{what}, handed over")
        if kind == "whole":
            self.runs.pop(rank, None)
            self.done[rank] = codec.load(verified)
        else:
            self.runs.setdefault(rank, Assembly()).add(verified)
            if kind == "last":
                self.done[rank] = self.runs.pop(rank).value
        self.due[rank] += 1
        self.progress.update(size, parts=int(rank in self.done))

    def _close(self, conn: socket.socket, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        fds.clear()
        if self.conns.pop(conn.fileno(), None) is not None:
            self.waiting.unregister(conn)
        conn.close()

    def close(self) -> bool:
        """Close every connection.  When not every part is in, say on the rendezvous
        store that this rank stopped, first: the senders still handing over stop, also
        those whose connection was never taken (dropped here).  Returns whether it
        said so."""
        stopping = len(self.done) < len(self.due)
        if stopping:
            key, left = _halt_key(self.call_id), max(self.ctx.deadline.left(), 0.001)
            with contextlib.suppress(GatherError):
                control.bounded(lambda: control.store().set(key, b"1"), left, self.ctx.what)
        for conn, _ in list(self.conns.values()):
            self._close(conn, [])
        if stopping:
            self.listener.drop()
        self.progress.close()
        return stopping


def _header(head: bytes) -> dict[str, Any] | None:
    """A message's header, None when it is not one of ours."""
    try:
        found = json.loads(head)
        if not isinstance(found, dict) or not isinstance(found.get("rank"), int):
            return None
        found["call"] = str(found["call"])
        return found
    except (ValueError, KeyError, TypeError):
        return None


class ChunkedRoute(handover.HandoverRoute):
    """``tmpdir`` in RAM for a gather in which some parts come in chunks: the destination
    takes and rebuilds them while they come, then every rank confirms."""

    def __str__(self) -> str:
        return f"{super().__str__()} in chunks"

    def gather(self, ctx: Context, plan: Plan, dst: int, *, lazy: bool) -> Iterator[Any] | None:
        call_id = control.call_id()
        if ctx.rank != dst:

            def send(frame: codec.Frame) -> bool:
                chunks = ctx.take_chunks()
                if chunks is None:
                    bind = handover.binding(call_id, ctx.rank)
                    handover.hand(frame, bind, [dst], call_id, ctx.deadline)
                else:
                    _send(ctx, chunks, dst, call_id)
                return True

            send_confirmed(ctx, send, lambda sent: None)
            ctx.finish()
            return None
        inbox = _Inbox(ctx, plan, call_id, [r for r in range(ctx.world) if r != dst])
        halted = False

        def read() -> dict[int, Any] | None:
            nonlocal halted
            try:
                # paused from the first chunk to the last, not chunk by chunk: between
                # chunks it would walk the records rebuilt so far, again and again
                with codec.collection_paused():
                    return inbox.run()
            finally:
                halted = inbox.close()

        try:
            got = confirmed(ctx, read, ctx.what)
        finally:
            if halted:  # every sender is past its last look at the key
                _forget(ctx, call_id)
            ctx.finish()
        if got is None:  # a sender stopped, yet no rank reported a failure
            raise GatherError(f"{ctx.what}: a rank stopped handing over its part")
        return iter([plan.own if r == dst else got[r] for r in range(ctx.world)])


def _forget(ctx: Context, call_id: str) -> None:
    """Delete the key that said the destination stopped (best effort: a key left goes
    with the job)."""
    key = _halt_key(call_id)
    with contextlib.suppress(GatherError):
        control.bounded(lambda: control.store().delete_key(key), 5.0, ctx.what)
