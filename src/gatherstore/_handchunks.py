"""A gather's parts handed over in chunks: the destination rebuilds while the senders encode.

With ``tmpdir`` handed over in RAM (see ``gatherstore._handover``), a sender whose
object is a long list (see ``gatherstore._chunks``) opens one connection to the
destination and hands each chunk over as a sealed memfd as soon as it is encoded.
The destination takes the chunks of every sender as they come, verifies each and
rebuilds it onto that sender's list; then every rank confirms.

- Each chunk is sealed with its call, its rank, its place in the run, and whether
  it is the last one, or a whole part (a sender whose run broke sends its object
  whole instead): a chunk replayed, reordered or cut short fails its checksum.
- The destination acknowledges each chunk it took, and a sender keeps at most
  ``WINDOW`` of them unacknowledged: at most ``WINDOW`` descriptors in flight per
  sender, and a sender never runs far ahead of a destination that is busy.
- A sender that fails says so on its connection, and the confirmation exchange
  raises its error on every rank.  A destination that stops (a chunk it cannot
  rebuild) closes its connections: the senders stop handing over, and the
  confirmation raises the destination's error.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import socket
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from . import _control as control
from . import _handover as handover
from . import _serialize as serialize
from ._chunks import Assembly, Chunks, Unchunkable
from ._errors import GatherError, GatherTimeout, IntegrityError
from ._progress import Progress, wanted
from ._routes import confirmed, send_confirmed

if TYPE_CHECKING:
    from ._call import Call
    from ._plan import Plan

__all__ = ["WINDOW", "ChunkedRoute"]

#: Chunks a sender may have handed over that the destination has not taken yet.
WINDOW = 16
_ACK = b"\x01"
#: Chunks encoded that wait for the thread that hands them over.
_QUEUED = 2
#: What a chunk is: one of a run, its last one, or a part sent whole after a run broke.
_KINDS = ("chunk", "last", "whole")


def _bind(call_id: str, rank: int, index: int, kind: str) -> bytes:
    return handover.binding(call_id, rank) + f"\0{index}\0{kind}".encode()


class _Stopped(Exception):
    """The destination closed its end: it stopped taking chunks."""


class _Sender:
    """This rank's side of one connection to the destination."""

    def __init__(self, conn: socket.socket, call: Call, call_id: str, dst: int) -> None:
        self.conn, self.call, self.call_id, self.dst = conn, call, call_id, dst
        self.sent = self.acked = 0

    def put(self, frame: serialize.Frame, kind: str) -> None:
        """Seal ``frame`` into a memfd and hand it over (after an acknowledgement when
        ``WINDOW`` chunks are in flight)."""
        while self.sent - self.acked >= WINDOW:
            self._ack()
        rank, index = self.call.rank, self.sent
        head = {"call": self.call_id, "rank": rank, "chunk": index, "kind": kind}
        head["size"] = frame.nbytes
        fd = handover.sealed(frame.seal(None, _bind(self.call_id, rank, index, kind)).segments)
        try:
            self._io(lambda: socket.send_fds(self.conn, [json.dumps(head).encode()], [fd]))
        finally:
            os.close(fd)
        self.sent += 1

    def drain(self) -> None:
        """Wait until the destination took every chunk: closing a connection with
        acknowledgements unread would reset it, chunks still on their way with it."""
        while self.acked < self.sent:
            self._ack()

    def _ack(self) -> None:
        if not self._io(lambda: self.conn.recv(len(_ACK))):
            raise _Stopped
        self.acked += 1

    def _io(self, run: Any) -> Any:
        """``run()`` on the connection within the call's deadline."""
        self.conn.settimeout(max(self.call.deadline.left(), 0.001))
        try:
            return run()
        except (BrokenPipeError, ConnectionResetError):
            raise _Stopped from None
        except TimeoutError:
            raise GatherTimeout(
                f"{self.call.what}: rank {self.dst} took no chunk of this rank's part within "
                "the call's timeout",
                ranks=[self.dst],
            ) from None

    def fail(self) -> None:
        """Tell the destination that this rank stopped (best effort: it may be gone)."""
        try:
            head = {"call": self.call_id, "rank": self.call.rank, "failed": True}
            self.conn.send(json.dumps(head).encode())
        except OSError:
            pass


def _send(call: Call, chunks: Chunks, dst: int, call_id: str) -> None:
    """Hand this rank's chunks to ``dst``, the first one already encoded, the others as
    they are encoded; the whole object instead when the run breaks.  A thread of the
    call seals and hands each chunk over while the next one is encoded.

    Raises:
        GatherTimeout / GatherError: as ``_handover.hand``; whatever encoding a chunk
            raises.  A destination that stopped is not an error here (the confirmation
            exchange says why it stopped).
    """
    with (
        handover.connect(dst, call.deadline) as conn,
        ThreadPoolExecutor(1, "gatherstore-chunks") as thread,
    ):
        sender = _Sender(conn, call, call_id, dst)
        queued: list[Future[None]] = []

        def put(frame: serialize.Frame, kind: str) -> None:
            queued.append(thread.submit(sender.put, frame, kind))
            while len(queued) > _QUEUED or (queued and queued[0].done()):
                queued.pop(0).result()

        try:
            try:
                put(chunks.head, "chunk")
                for frame in chunks.rest():
                    put(frame, "last" if chunks.finished else "chunk")
            except Unchunkable:
                put(serialize.encode(chunks.items), "whole")
            while queued:
                queued.pop(0).result()
            sender.drain()
        except _Stopped:
            return
        except BaseException:
            for waiting in queued:
                waiting.cancel()
            wait(queued)
            sender.fail()
            raise


class _Inbox:
    """The destination's side: every sender's connection, and what each one sent so far."""

    def __init__(self, call: Call, plan: Plan, call_id: str, senders: list[int]) -> None:
        self.call, self.plan, self.call_id = call, plan, call_id
        self.listener = handover.listening()
        self.waiting = select.poll()
        self.waiting.register(self.listener.sock, select.POLLIN)
        self.conns: dict[int, tuple[socket.socket, int]] = {}  # fileno: (conn, rank)
        self.due = dict.fromkeys(senders, 0)  # rank: the next chunk's index
        self.runs: dict[int, Assembly] = {}
        self.done: dict[int, Any] = {}
        self.stopped = False
        incoming = sum(plan.sizes[r] for r in senders)
        enabled = wanted(call.progress, incoming)
        self.progress = Progress(call.what, len(senders), incoming, enabled=enabled)

    def run(self) -> dict[int, Any] | None:
        """Every sender's object by rank; None when a sender stopped (its failure is in
        the confirmation exchange).

        Raises:
            GatherTimeout: senders whose chunks did not all come within the call's time.
            IntegrityError / GatherError: a chunk that fails its check or cannot be rebuilt.
        """
        listening = self.listener.sock.fileno()
        while len(self.done) < len(self.due) and not self.stopped:
            left = self.call.deadline.left()
            events = self.waiting.poll(math.ceil(max(left, 0.0) * 1000)) if left > 0 else []
            if not events:
                missing = [r for r in self.due if r not in self.done]
                raise GatherTimeout(
                    f"{self.call.what}: the parts of ranks {missing} were not all handed over "
                    "within the call's timeout",
                    ranks=missing,
                    timeout=self.call.deadline.timeout,
                )
            for fileno, _ in events:
                if fileno == listening:
                    conn = self.listener.connection(None)
                    if conn is not None:
                        self._take(conn, None)
                elif fileno in self.conns:
                    self._take(*self.conns[fileno])
        return None if self.stopped else self.done

    def _take(self, conn: socket.socket, rank: int | None) -> None:
        """Take the next message on ``conn`` (from ``rank``; None: a new connection)."""
        try:
            head, fds = handover.received(conn)
        except OSError:
            head, fds = b"", []
        found = _header(head)
        ours = found is not None and found["call"] == self.call_id and found["rank"] in self.due
        if found is None or not ours or (rank is not None and found["rank"] != rank):
            self._close(conn, fds)
            if rank is not None:  # an end without a word: the sender's process ended
                self.stopped = True
            return
        sender: int = found["rank"]
        if rank is None and (sender in self.done or self._has(sender)):
            self._close(conn, fds)  # a second connection for one rank: not a sender's
            return
        if found.get("failed"):
            self.stopped = True
            self._close(conn, fds)
            return
        try:
            self._chunk(sender, found, fds)
        except BaseException:
            self._close(conn, [])
            raise
        if "chunk" not in found:  # a part handed over whole, by ``_handover.hand``
            conn.close()
            return
        if rank is None:
            self.conns[conn.fileno()] = (conn, sender)
            self.waiting.register(conn, select.POLLIN)
        with contextlib.suppress(OSError):  # the sender is done, or gone: its confirmation
            conn.send(_ACK)  # says which
        if sender in self.done:
            self._close(conn, [])

    def _has(self, rank: int) -> bool:
        return any(r == rank for _, r in self.conns.values())

    def _chunk(self, rank: int, found: dict[str, Any], fds: list[int]) -> None:
        """Verify a chunk of ``rank`` and rebuild it onto its list (``fds`` are closed)."""
        what = self.call.what
        if "chunk" not in found:  # whole, sealed by ``_handover.hand``
            index, kind, size = self.due[rank], "whole", self.plan.sizes[rank]
            bind = handover.binding(self.call_id, rank)
        else:
            index, kind, size = found["chunk"], found["kind"], found["size"]
            bind = _bind(self.call_id, rank, index, kind)
        if len(fds) != 1 or index != self.due[rank] or kind not in _KINDS:
            for fd in fds:
                os.close(fd)
            raise IntegrityError(
                f"{what}: rank {rank} handed over chunk {index} ({kind}) where chunk "
                f"{self.due[rank]} was due",
                rank=rank,
            )
        view = handover.mapped(fds[0], size, rank, what)
        verified = serialize.verify(view, bind=bind, rank=rank, where=f"{what}, handed over")
        if kind == "whole":
            self.runs.pop(rank, None)
            self.done[rank] = serialize.load(verified)
        else:
            self.runs.setdefault(rank, Assembly()).add(verified)
            if kind == "last":
                self.done[rank] = self.runs.pop(rank).items
        self.due[rank] += 1
        self.progress.update(size, parts=int(rank in self.done))

    def _close(self, conn: socket.socket, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        fds.clear()
        if self.conns.pop(conn.fileno(), None) is not None:
            self.waiting.unregister(conn)
        conn.close()

    def close(self) -> None:
        """Close every connection: senders still handing over stop."""
        for conn, _ in list(self.conns.values()):
            self._close(conn, [])
        self.progress.close()


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

    def gather(self, call: Call, plan: Plan, dst: int, *, stream: bool) -> Iterator[Any] | None:
        call_id = str(control.step())
        if call.rank != dst:

            def send(frame: serialize.Frame) -> bool:
                chunks = call.take_chunks()
                if chunks is None:
                    bind = handover.binding(call_id, call.rank)
                    handover.hand(frame.seal(None, bind).segments, [dst], call_id, call.deadline)
                else:
                    _send(call, chunks, dst, call_id)
                return True

            send_confirmed(call, send, lambda sent: None)
            call.finish()
            return None
        senders = [r for r in range(call.world) if r != dst]
        try:
            got = confirmed(call, lambda: _receive(call, plan, call_id, senders), call.what)
        finally:
            call.finish()
        if got is None:  # a sender stopped, yet no rank reported a failure
            raise GatherError(f"{call.what}: a rank stopped handing over its part")
        return iter([plan.own if r == dst else got[r] for r in range(call.world)])


def _receive(call: Call, plan: Plan, call_id: str, senders: list[int]) -> dict[int, Any] | None:
    """Every sender's object, rebuilt chunk by chunk as the chunks come (see ``_Inbox``);
    None when a sender stopped.

    Raises:
        GatherTimeout / IntegrityError / GatherError: see ``_Inbox.run``.
    """
    inbox = _Inbox(call, plan, call_id, senders)
    try:
        return inbox.run()
    finally:
        inbox.close()
