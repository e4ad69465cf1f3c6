"""Reading a stored gather back: parts in rank order, read ahead within a byte budget.

The reader requests up to ``PARTS_REQUESTED`` parts at once, in two batches, each
one ``Store.get_many`` (a Redis pipeline, concurrent S3 GETs on one event
loop), so that the latency of a thousand small parts overlaps instead of adding
up, as long as the parts read ahead of the consumer fit the call's read-ahead
budget in bytes.  A batch holds at most ``BATCH_BYTES``: a batch is handed
over whole, so large parts go one per request, and the consumer unpickles one
while the next is read and verified.  A part larger than the budget is read
when the consumer asks for it, so the destination holds what the consumer keeps
plus at most the budget.  Parts are verified in the reading threads (checksums
release the GIL), and deleted once read, in batches (``Store.discard_many``)
in the background.  Deleting is best effort: a finished gather is delivered, and
parts that could not be deleted are named in a warning and left to the job area's
removal and ``gatherstore gc``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from gatherstore import codec
from gatherstore._errors import GatherError, IntegrityError
from gatherstore._time import END_JOB_TIMEOUT, Deadline, deadline
from gatherstore.job.session import JobSession
from gatherstore.routes.progress import Progress, wanted
from gatherstore.stores.base import Store

__all__ = [
    "PARTS_REQUESTED",
    "Parts",
    "Reading",
    "Window",
    "binding",
    "fetch",
    "fetch_many",
    "part_key",
]

#: Parts a reader requests at once (in two batches of one store request each).
PARTS_REQUESTED = 32
_BATCHES = 2
_log = logging.getLogger("gatherstore")
#: A batch ends once it holds this many bytes (see the module's docstring).
BATCH_BYTES = 4 << 20


class Reading(Protocol):
    """What a reader needs of its call (``gatherstore.routes.context.Context`` is one)."""

    what: str
    rank: int
    progress: bool | None
    deadline: Deadline

    def finish(self) -> None: ...


class Planned(Protocol):
    """What a reader needs of its call's plan (``gatherstore.calls.choice.Plan`` is one)."""

    @property
    def sizes(self) -> tuple[int, ...]: ...

    @property
    def own(self) -> Any: ...


def part_key(prefix: str, rank: int) -> str:
    """The key of ``rank``'s part in the call whose keys start with ``prefix``."""
    return f"{prefix}/{rank}"


def binding(session: JobSession, prefix: str, rank: int) -> bytes:
    """What a part is signed together with: its job area, call and rank."""
    return f"{session.locator}\0{prefix}\0{rank}".encode()


def fetch(
    ctx: Reading, session: JobSession, prefix: str, rank: int, *, fresh: bool = False
) -> codec.Verified:
    """Read and verify one part; ``fresh``: within the call's whole timeout (see
    ``Deadline.for_store``).

    Raises:
        IntegrityError: the part is damaged, planted or replayed; names ``rank``.
        GatherError: the part is gone (deleted, or its TTL ran out).
    """
    outcome = fetch_many(ctx, session, prefix, [rank], fresh=fresh)[0]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def fetch_many(
    ctx: Reading, session: JobSession, prefix: str, ranks: list[int], *, fresh: bool = False
) -> list[codec.Verified | BaseException]:
    """Read the parts of ``ranks`` together and verify each (checksums release the GIL:
    this runs ahead in a thread); per rank its verified part or what went wrong.

    Raises:
        GatherError: the store failed for all of them (e.g. StoreUnavailableError).
    """
    keys = [part_key(prefix, rank) for rank in ranks]
    try:
        with ctx.deadline.for_store(whole=fresh):
            raws = session.store.get_many(keys)
    except IntegrityError as exc:
        if len(ranks) > 1:  # which one: read them one at a time
            return [fetch_many(ctx, session, prefix, [r], fresh=fresh)[0] for r in ranks]
        where = f"{session.store} {keys[0]}"
        message = f"{ctx.what}: part of rank {ranks[0]}: {exc}"
        return [IntegrityError(message, rank=ranks[0], key=where)]
    out: list[codec.Verified | BaseException] = []
    for rank, key, raw in zip(ranks, keys, raws, strict=True):
        if raw is None:
            out.append(
                GatherError(
                    f"{ctx.what}: the part of rank {rank} is gone from {session.store} "
                    "(deleted, or it expired: raise the store's ttl)"
                )
            )
            continue
        bind, where = binding(session, prefix, rank), f"{session.store} {key}"
        try:
            out.append(codec.verify(raw, key=session.key, bind=bind, rank=rank, where=where))
        except IntegrityError as exc:
            out.append(exc)
    return out


@dataclass(frozen=True)
class Window:
    """What a reader may request ahead of its consumer: parts of ``sizes`` bytes, within
    ``budget`` bytes and ``in_flight`` parts, in requests of at most ``batch`` parts
    and :data:`BATCH_BYTES` bytes."""

    sizes: Sequence[int]
    budget: int
    in_flight: int
    batch: int

    def next_requests(
        self, todo: Sequence[int], pending: Collection[int], asked: int | None = None
    ) -> list[list[int]]:
        """The requests to make now, each a list of ranks: the part the consumer ``asked``
        for (whatever its size) and the parts after it in ``todo`` (rank order) that
        are not ``pending`` already, while they fit the budget and ``in_flight``."""
        in_window = [r for r in todo if r in pending]
        window = sum(self.sizes[r] for r in in_window if r != asked)
        count = len(in_window)
        requests: list[list[int]] = []
        batch: list[int] = []
        batch_bytes = 0
        crowded = False  # stopped by the requests in flight (not by the budget or the end)
        for rank in todo:
            if rank in pending:
                continue
            if rank != asked:
                crowded = count >= self.in_flight
                if crowded or window + self.sizes[rank] > self.budget:
                    break
                window += self.sizes[rank]
            batch.append(rank)
            batch_bytes += self.sizes[rank]
            count += 1
            if len(batch) == self.batch or batch_bytes >= BATCH_BYTES:
                requests.append(batch)
                batch, batch_bytes = [], 0
        # a short batch waits until a whole batch fits: one request per slot freed would
        # leave the pool's threads each waiting on one part, a round trip per part
        if batch and (asked in batch or not crowded):
            requests.append(batch)
        return requests


class Parts(Iterator[Any]):
    """A reader's view of a stored gather, in rank order, the plan's ``own`` object in
    place of its own part.

    ``budget`` bounds the bytes of the parts read ahead of the one the consumer
    asks for, ``in_flight`` how many parts are requested at once (in two batches,
    each one store request batch).  With ``delete`` each part is deleted once read
    (in batches, in the background), and closing early deletes the rest.  Reads
    share the call's deadline, or with ``lazy`` (a ``gather_iter``, paced by its
    consumer) each part has the call's whole timeout.
    """

    def __init__(
        self,
        ctx: Reading,
        plan: Planned,
        session: JobSession,
        prefix: str,
        own_rank: int,
        *,
        budget: int,
        delete: bool = True,
        lazy: bool = False,
        in_flight: int = PARTS_REQUESTED,
    ) -> None:
        self.ctx, self.session, self.prefix = ctx, session, prefix
        self.own_rank, self.own, self.delete, self.lazy = own_rank, plan.own, delete, lazy
        self.budget, self.sizes, self.in_flight = budget, plan.sizes, in_flight
        self.batch = max(in_flight // _BATCHES, 1)
        self.todo = [r for r in range(len(self.sizes)) if r != own_rank]
        self.next_rank = 0
        self.closed = False
        self.pool = ThreadPoolExecutor(_BATCHES, thread_name_prefix="gatherstore-read")
        self.deleter = ThreadPoolExecutor(1, thread_name_prefix="gatherstore-delete")
        # rank -> (the future of its batch, its place in the batch)
        self.requested: dict[int, tuple[Future[list[Any]], int]] = {}
        self.read: list[str] = []  # keys of parts read, not yet handed to the deleter
        self.deletes: list[tuple[Future[None], list[str]]] = []  # (a delete, its keys)
        incoming = sum(self.sizes) - self.sizes[own_rank]
        self.progress = Progress(
            ctx.what,
            len(self.todo),
            incoming,
            # all_gather_object reads on every rank: one bar, on rank 0
            enabled=(delete or ctx.rank == 0) and wanted(ctx.progress, incoming),
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
        """Request the part the consumer ``asked`` for and the parts after it (see
        ``Window.next_requests``)."""
        window = Window(self.sizes, self.budget, self.in_flight, self.batch)
        for ranks in window.next_requests(self.todo, self.requested.keys(), asked):
            self._request(ranks)

    def _request(self, ranks: list[int]) -> None:
        future = self.pool.submit(
            fetch_many, self.ctx, self.session, self.prefix, ranks, fresh=self.lazy
        )
        for place, rank in enumerate(ranks):
            self.requested[rank] = (future, place)

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
        with self.ctx.deadline.for_store(whole=self.lazy):  # the clean-up after a failure too
            try:
                self._read_ahead(asked=rank)
                future, place = self.requested.pop(rank)
                self.todo.remove(rank)
                try:
                    outcome = future.result()[place]
                finally:
                    self._queue_delete(part_key(self.prefix, rank))
                if isinstance(outcome, BaseException):
                    raise outcome
                self._read_ahead()  # the window has room again
                value = codec.load(outcome)
                self.progress.update(self.sizes[rank])
                return value
            except BaseException:
                # report the first error at once: what is left to read or delete ends in
                # the background, within its own deadline (a frozen store must not hold
                # this rank up past the others' next call)
                self._close(wait=False)
                raise

    def _queue_delete(self, key: str, flush: bool = False) -> None:
        """Note a part read; with ``delete``, hand the parts read so far to the deleter once
        it is idle (a slow store gets fewer, larger deletes: one request per batch)."""
        if key:
            self.read.append(key)
        last = self.deletes[-1][0] if self.deletes else None
        if last is not None and last.done() and last.exception() is not None:
            return  # the store fails: the rest goes with the job's area (close warns)
        if self.delete and self.read and (flush or last is None or last.done()):
            keys, self.read = self.read, []
            self.deletes.append((self.deleter.submit(self._delete_read, keys), keys))

    def _delete_read(self, keys: list[str]) -> None:
        with self.ctx.deadline.for_store(whole=self.lazy):
            self.session.store.discard_many(keys)

    def close(self) -> None:
        """Stop reading ahead; with ``delete``, delete the parts not read yet.

        Never raises for a part that could not be deleted: what was read is delivered,
        and a warning names the parts left (see the module's docstring).
        """
        self._close(wait=True)

    def _close(self, *, wait: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self.next_rank = len(self.sizes)
        self.progress.close()
        self.ctx.finish()
        for future, _ in self.requested.values():  # reads not started are dropped
            future.cancel()
        self.pool.shutdown(wait=wait)
        self.requested.clear()
        if wait and self.deletes:  # a store that fails a delete gets no more of them
            futures.wait([self.deletes[-1][0]])
        self._queue_delete("", flush=True)
        if self.delete and self.todo:
            keys = [part_key(self.prefix, rank) for rank in self.todo]
            if wait:
                _discard_each(self.session.store, keys)
            else:  # a finaliser runs wherever the garbage collector does: never block there
                threading.Thread(
                    target=_discard_each, args=(self.session.store, keys), daemon=True
                ).start()
        self.deleter.shutdown(wait=wait)
        deletes, self.deletes = self.deletes, []
        if wait:
            self._warn_left(deletes)

    def _warn_left(self, deletes: list[tuple[Future[None], list[str]]]) -> None:
        """Warn of the parts read that could not be deleted: the gather is delivered all
        the same, and they go with the job's area (or ``gatherstore gc``)."""
        failed = [(done.exception(), keys) for done, keys in deletes if not done.cancelled()]
        failed = [(exc, keys) for exc, keys in failed if exc is not None]
        if not failed:
            return
        left = [key for _, keys in failed for key in keys] + self.read
        self.read = []
        _log.warning(
            "gatherstore: %s: %d part(s) read but not deleted from %s (%s): %s; they go "
            "with the job's area at its end, or run `gatherstore gc`",
            self.ctx.what,
            len(left),
            self.session.store,
            failed[0][0],
            ", ".join(left),
        )

    def __del__(self) -> None:
        try:
            self._close(wait=False)
        except Exception:
            return


def _discard_each(store: Store, keys: list[str]) -> None:
    with deadline(END_JOB_TIMEOUT):
        for key in keys:
            try:
                store.discard(key)
            except GatherError:  # best effort: the job area goes at shutdown
                continue
