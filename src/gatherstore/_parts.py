"""Reading a stored gather back: parts in rank order, read ahead, deleted once read."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from . import _serialize as serialize
from ._errors import GatherError
from ._memory import READ_AHEAD
from ._progress import Progress, wanted
from ._session import JobSession
from .stores.base import Store
from .stores.deadline import END_JOB_TIMEOUT, deadline

if TYPE_CHECKING:
    from ._call import Call

__all__ = ["Parts"]


class Parts(Iterator[Any]):
    """A reader's view of a stored gather, in rank order, ``own`` in place of its own part.

    ``READ_AHEAD`` parts are read and verified at once in threads (the next one
    is fetched while the current one is verified, and both while the consumer
    decodes), so at most ``READ_AHEAD`` parts are held besides what the consumer
    keeps (the window the memory check counts).  With ``delete`` each part is
    deleted once read, and closing early deletes the rest.  Reads share the call's
    deadline, or with ``lazy`` (a ``gather_iter``, paced by its consumer) each part
    has the call's whole timeout.
    """

    def __init__(
        self,
        call: Call,
        session: JobSession,
        prefix: str,
        own_rank: int,
        own: Any,
        *,
        delete: bool = True,
        lazy: bool = False,
    ) -> None:
        self.call, self.session, self.prefix = call, session, prefix
        self.own_rank, self.own, self.delete, self.lazy = own_rank, own, delete, lazy
        self.todo = [r for r in range(call.world) if r != own_rank]
        self.next_rank = 0
        self.closed = False
        self.pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="gatherstore-read")
        self.ahead: dict[int, Future[serialize.Verified]] = {}
        incoming = sum(call.sizes) - call.sizes[own_rank]
        self.progress = Progress(
            call.what,
            len(self.todo),
            incoming,
            # all_gather_object reads on every rank: one bar, on rank 0
            enabled=(delete or call.rank == 0) and wanted(call.progress, incoming),
        )
        try:
            self._prefetch()
        except BaseException:
            # e.g. Ctrl-C inside submit(): a reader thread may have started without its
            # pool knowing it; only shutdown() wakes it, and the traceback keeps this
            # object (and its finaliser) alive past the interpreter's wait for threads
            self._close(wait=False)
            raise

    def _prefetch(self) -> None:
        """Keep the next ``READ_AHEAD`` parts being read."""
        for rank in self.todo[:READ_AHEAD]:
            if rank not in self.ahead:
                self.ahead[rank] = self.pool.submit(
                    self.call.fetch, self.session, self.prefix, rank, fresh=self.lazy
                )

    def __iter__(self) -> Parts:
        return self

    def __next__(self) -> Any:
        rank = self.next_rank
        if rank >= self.call.world:
            self.close()
            raise StopIteration
        self.next_rank += 1
        if rank == self.own_rank:
            return self.own
        with self.call.deadline(fresh=self.lazy):  # the clean-up after a failure too
            try:
                self._prefetch()  # this part and the next ones
                future = self.ahead.pop(rank)
                self.todo.remove(rank)
                try:
                    value = serialize.load(future.result())
                    self.progress.update(self.call.sizes[rank])
                    return value
                finally:
                    if self.delete:
                        self.session.store.discard(self.call.key(self.prefix, rank))
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Stop reading ahead; with ``delete``, delete the parts not read yet."""
        self._close(wait=True)

    def _close(self, *, wait: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self.next_rank = self.call.world
        self.progress.close()
        self.call.finish()
        self.pool.shutdown(wait=wait, cancel_futures=True)
        self.ahead.clear()
        if self.delete and self.todo:
            keys = [self.call.key(self.prefix, rank) for rank in self.todo]
            if wait:
                _discard(self.session.store, keys)
            else:  # a finaliser runs wherever the garbage collector does: never block there
                threading.Thread(
                    target=_discard, args=(self.session.store, keys), daemon=True
                ).start()

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
