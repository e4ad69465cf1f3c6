"""The store route: parts as keys of the job's area in a store, written by each sender
and read back (verified, and deleted once read) by the readers."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from gatherstore import codec
from gatherstore._errors import GatherError
from gatherstore._time import deadline
from gatherstore.job.session import JobSession, session_for
from gatherstore.routes.base import Plan, Route, confirmed, send_confirmed
from gatherstore.routes.context import Context
from gatherstore.routes.parts import Parts, binding, fetch, part_key
from gatherstore.stores.base import Store

__all__ = ["StoreRoute"]

#: Seconds a part's deletion may take once the call no longer needs it (see StoreRoute.tidy).
_TIDY_TIME = 5.0
_log = logging.getLogger("gatherstore")


class StoreRoute(Route):
    """Parts as keys of the job's area in ``store``: written by each sender, read back
    (verified, and deleted once read) by the readers."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.need = "shm" if store.shares_memory_with_host else "store"

    def __str__(self) -> str:
        return str(self.store)

    def all_gather(self, ctx: Context, plan: Plan) -> list[Any]:
        everyone = list(range(ctx.world))
        session, prefix = self._write(ctx, everyone)

        def read() -> list[Any]:
            # every part is returned: reading them all at once takes no more memory
            budget = plan.total
            return list(Parts(ctx, plan, session, prefix, ctx.rank, budget=budget, delete=False))

        try:
            return confirmed(ctx, read, "all_gather_object (read)")
        finally:
            self._tidy(ctx, session, part_key(prefix, ctx.rank))

    def gather(self, ctx: Context, plan: Plan, dst: int, *, lazy: bool) -> Iterator[Any] | None:
        session, prefix = self._write(ctx, [r for r in range(ctx.world) if r != dst])
        if ctx.rank != dst:
            ctx.finish()
            return None
        # a gather_object returns every part: it may read them all at once; a gather_iter
        # keeps what its consumer holds plus the read-ahead budget
        budget = plan.budget if lazy else plan.total
        parts = Parts(ctx, plan, session, prefix, dst, budget=budget, lazy=lazy)
        if lazy:
            ctx.reading = True  # its consumer's reading ends the call
            return parts
        return iter(list(parts))

    def broadcast(self, ctx: Context, plan: Plan, src: int) -> Any:
        session, prefix = self._write(ctx, [src])

        def read() -> Any:
            if ctx.rank == src:
                return plan.own
            return codec.load(fetch(ctx, session, prefix, src))

        try:
            out = confirmed(ctx, read, "broadcast_object (read)")
        finally:
            if ctx.rank == src:
                self._tidy(ctx, session, part_key(prefix, src))
        ctx.finish()
        return out

    def _write(self, ctx: Context, writers: Sequence[int]) -> tuple[JobSession, str]:
        """Write this rank's part (if it is a writer); confirm every write."""
        session = ctx.absorbing(lambda: session_for(self.store, ctx.deadline.timeout))
        prefix = session.next_call()

        def put(frame: codec.Frame) -> bool:
            if ctx.rank not in writers:
                return False
            with ctx.deadline.for_store():
                sealed = frame.seal(session.key, binding(session, prefix, ctx.rank))
                session.store.put(part_key(prefix, ctx.rank), sealed.segments)
            return True

        def undo(wrote: bool) -> None:
            if wrote:
                self._tidy(ctx, session, part_key(prefix, ctx.rank))

        send_confirmed(ctx, put, undo)
        return session, prefix

    @staticmethod
    def _tidy(ctx: Context, session: JobSession, key: str) -> None:
        """Delete this rank's part ``key`` once nobody needs it, best effort: within a few
        seconds of its own (the call's time may be over, and the call's own outcome is
        what to report); what is left goes with the job's area."""
        try:
            with deadline(min(ctx.deadline.timeout, _TIDY_TIME)):
                session.store.discard(key)
        except GatherError as exc:
            _log.debug("gatherstore: %s: part %s left for the job's end: %s", ctx.what, key, exc)
