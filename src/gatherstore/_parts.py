"""Reading a stored gather back: parts in rank order, read ahead within a byte budget.

The reader keeps up to :data:`IN_FLIGHT` reads going at once in threads (small
parts: their latency overlaps, so a thousand of them do not wait in line), as
long as the parts read ahead of the consumer fit the call's read-ahead budget
in bytes.  A part larger than the budget is read when the consumer asks for
it, so the destination holds what the consumer keeps plus at most the budget.
Parts are verified in the reading threads (checksums release the GIL), and
deleted once read, also in the background.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from . import _serialize as serialize
from ._errors import GatherError, IntegrityError
from ._progress import Progress, wanted
from ._session import JobSession
from .stores.base import Store
from .stores.deadline import END_JOB_TIMEOUT, deadline

__all__ = ["IN_FLIGHT", "Parts", "Reading", "binding", "fetch", "part_key"]

#: Reads (and deletes) a reader keeps going at once.
IN_FLIGHT = 32


class Reading(Protocol):
    """What a reader needs of its call (:class:`gatherstore._call.Call` is one)."""

    what: str
    rank: int
    sizes: list[int]
    progress: bool | None

    def deadline(self, *, fresh: bool = False) -> contextlib.AbstractContextManager[None]: ...

    def finish(self) -> None: ...


def part_key(prefix: str, rank: int) -> str:
    """The key of ``rank``'s part in the call whose keys start with ``prefix``."""
    return f"{prefix}/{rank}"


def binding(session: JobSession, prefix: str, rank: int) -> bytes:
    """What a part is signed together with: its job area, call and rank."""
    return f"{session.locator}\0{prefix}\0{rank}".encode()


def fetch(
    call: Reading, session: JobSession, prefix: str, rank: int, *, fresh: bool = False
) -> serialize.Verified:
    """Read and verify one part (checksums release the GIL: this runs ahead in a thread);
    ``fresh`` as in the call's ``deadline``.

    Raises:
        IntegrityError: the part is damaged, planted or replayed; names ``rank``.
        GatherError: the part is gone (deleted, or its TTL ran out).
    """
    key = part_key(prefix, rank)
    where = f"{session.store} {key}"
    try:
        with call.deadline(fresh=fresh):
            raw = session.store.get(key)
    except IntegrityError as exc:
        raise IntegrityError(
            f"{call.what}: part of rank {rank}: {exc}", rank=rank, key=where
        ) from None
    if raw is None:
        raise GatherError(
            f"{call.what}: the part of rank {rank} is gone from {session.store} (deleted, "
            "or it expired: raise the store's ttl)"
        )
    bind = binding(session, prefix, rank)
    return serialize.verify(raw, key=session.key, bind=bind, rank=rank, where=where)


class Parts(Iterator[Any]):
    """A reader's view of a stored gather, in rank order, ``own`` in place of its own part.

    ``budget`` bounds the bytes of the parts read ahead of the one the consumer
    asks for, ``in_flight`` the reads and deletes going at once.  With ``delete``
    each part is deleted once read, and closing early deletes the rest.  Reads
    share the call's deadline, or with ``lazy`` (a ``gather_iter``, paced by its
    consumer) each part has the call's whole timeout.
    """

    def __init__(
        self,
        call: Reading,
        session: JobSession,
        prefix: str,
        own_rank: int,
        own: Any,
        *,
        budget: int,
        delete: bool = True,
        lazy: bool = False,
        in_flight: int = IN_FLIGHT,
    ) -> None:
        self.call, self.session, self.prefix = call, session, prefix
        self.own_rank, self.own, self.delete, self.lazy = own_rank, own, delete, lazy
        self.budget, self.sizes, self.in_flight = budget, call.sizes, in_flight
        self.todo = [r for r in range(len(self.sizes)) if r != own_rank]
        self.next_rank = 0
        self.closed = False
        self.pool = ThreadPoolExecutor(in_flight, thread_name_prefix="gatherstore-read")
        self.ahead: dict[int, Future[serialize.Verified]] = {}
        self.deletes: list[Future[None]] = []
        incoming = sum(self.sizes) - self.sizes[own_rank]
        self.progress = Progress(
            call.what,
            len(self.todo),
            incoming,
            # all_gather_object reads on every rank: one bar, on rank 0
            enabled=(delete or call.rank == 0) and wanted(call.progress, incoming),
        )
        try:
            self._read_ahead()
        except BaseException:
            # e.g. Ctrl-C inside submit(): a reader thread may have started without its
            # pool knowing it; only shutdown() wakes it, and the traceback keeps this
            # object (and its finaliser) alive past the interpreter's wait for threads
            self._close(wait=False)
            raise

    def _read_ahead(self, asked: int | None = None) -> None:
        """Start the reads of the part the consumer ``asked`` for (whatever its size) and of
        the parts after it, in rank order, while they fit the budget and IN_FLIGHT."""
        window = sum(self.sizes[r] for r in self.ahead if r != asked)
        for rank in self.todo:
            if rank in self.ahead:
                continue
            if len(self.ahead) >= self.in_flight:
                return
            if rank != asked:
                if window + self.sizes[rank] > self.budget:
                    return
                window += self.sizes[rank]
            self.ahead[rank] = self.pool.submit(
                fetch, self.call, self.session, self.prefix, rank, fresh=self.lazy
            )

    def __iter__(self) -> Parts:
        return self

    def __next__(self) -> Any:
        rank = self.next_rank
        if rank >= len(self.sizes):
            self.close()
            raise StopIteration
        self.next_rank += 1
        if rank == self.own_rank:
            return self.own
        with self.call.deadline(fresh=self.lazy):  # the clean-up after a failure too
            try:
                self._read_ahead(asked=rank)
                future = self.ahead.pop(rank)
                self.todo.remove(rank)
                try:
                    verified = future.result()
                finally:
                    if self.delete:
                        self.deletes.append(self.pool.submit(self._discard, rank))
                self._read_ahead()  # the window has room again
                value = serialize.load(verified)
                self.progress.update(self.sizes[rank])
                return value
            except BaseException:
                self._close(wait=True, check=False)  # the first error is the one to report
                raise

    def _discard(self, rank: int) -> None:
        with self.call.deadline(fresh=self.lazy):
            self.session.store.discard(part_key(self.prefix, rank))

    def close(self) -> None:
        """Stop reading ahead; with ``delete``, delete the parts not read yet.

        Raises:
            GatherError: a part read could not be deleted (the store failed).
        """
        self._close(wait=True)

    def _close(self, *, wait: bool, check: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        self.next_rank = len(self.sizes)
        self.progress.close()
        self.call.finish()
        for future in self.ahead.values():  # reads not started are dropped, deletes are not
            future.cancel()
        self.pool.shutdown(wait=wait)
        self.ahead.clear()
        deletes, self.deletes = self.deletes, []
        if self.delete and self.todo:
            keys = [part_key(self.prefix, rank) for rank in self.todo]
            if wait:
                _discard(self.session.store, keys)
            else:  # a finaliser runs wherever the garbage collector does: never block there
                threading.Thread(
                    target=_discard, args=(self.session.store, keys), daemon=True
                ).start()
        if wait and check:  # a read part that could not be deleted: the store failed
            for done in deletes:
                if not done.cancelled() and done.exception() is not None:
                    raise done.exception()  # type: ignore[misc]

    def __del__(self) -> None:
        try:
            self._close(wait=False)
        except Exception:
            return


def _discard(store: Store, keys: list[str]) -> None:
    with deadline(END_JOB_TIMEOUT):
        for key in keys:
            try:
                store.discard(key)
            except GatherError:  # best effort: the job area goes at shutdown
                continue
