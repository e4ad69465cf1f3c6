"""How an object collective moves parts: a route implements every collective.

A route receives the call (this rank's side: its deadline, its encoded part) and
the ``gatherstore.calls.plan.Plan`` every rank agreed on, and implements
``Route.all_gather``, ``Route.gather`` (whole or streamed) and
``Route.broadcast``:

- ``CollectiveRoute`` sends the pickled parts over gatherstore's gloo group,
  padded to the largest;
- ``StoreRoute`` writes each part under a key of the job's area in a store, and
  the readers read them back (see ``gatherstore.routes.parts``);
- ``StreamRoute`` (``gatherstore.routes.stream``) sends parts point to point in chunks.

A new route is one class here: ``gatherstore.calls.plan.settle`` picks it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from gatherstore._errors import GatherError
from gatherstore._time import deadline
from gatherstore.codec import frames as serialize
from gatherstore.job import gloo
from gatherstore.job.report import failure, status
from gatherstore.job.session import JobSession, after_failure, session_for
from gatherstore.routes.parts import Parts, binding, fetch, part_key
from gatherstore.stores.base import Store

if TYPE_CHECKING:
    from gatherstore.calls.call import Call
    from gatherstore.calls.plan import Plan

__all__ = [
    "INLINE_TOTAL",
    "CollectiveRoute",
    "InlineRoute",
    "Route",
    "StoreRoute",
    "confirmed",
    "send_confirmed",
]

T = TypeVar("T")

#: Bytes of all parts together up to which ``"auto"`` sends them inside the call's status
#: exchange (each rank inlines a part of at most this over the world size).
INLINE_TOTAL = 64 << 10

#: Seconds a part's deletion may take once the call no longer needs it (see StoreRoute.tidy).
_TIDY_TIME = 5.0
_log = logging.getLogger("gatherstore")


class Route(ABC):
    """A way to move one call's parts; every object collective, on every rank."""

    #: Its kind of memory need (one of ``gatherstore.calls.fit.NEEDS``).
    need: str = "store"

    @abstractmethod
    def all_gather(self, call: Call, plan: Plan) -> list[Any]:
        """Every rank's object in rank order (this rank's own: ``plan.own``)."""

    @abstractmethod
    def gather(self, call: Call, plan: Plan, dst: int, *, stream: bool) -> Iterator[Any] | None:
        """On ``dst`` every rank's object in rank order, as an iterator that reads them as it
        goes when ``stream``; None on the other ranks."""

    @abstractmethod
    def broadcast(self, call: Call, plan: Plan, src: int) -> Any:
        """``src``'s object on every rank (``src``: its own)."""

    def __str__(self) -> str:
        return type(self).__name__


class CollectiveRoute(Route):
    """Pickled parts over gatherstore's gloo group, padded to the largest part."""

    need = "collective"

    def __str__(self) -> str:
        return "collective"

    def all_gather(self, call: Call, plan: Plan) -> list[Any]:
        slots = [torch.empty(plan.longest, dtype=torch.uint8) for _ in plan.sizes]
        _transfer(call, gloo.all_gather_op(slots, _packed(call, plan.longest)))
        return _decoded(call, plan, slots)

    def gather(self, call: Call, plan: Plan, dst: int, *, stream: bool) -> Iterator[Any] | None:
        if call.rank != dst:
            _transfer(call, gloo.gather_op(None, _packed(call, plan.longest), dst))
            call.finish()
            return None
        slots = [torch.empty(plan.longest, dtype=torch.uint8) for _ in plan.sizes]
        _transfer(call, gloo.gather_op(slots, slots[dst], dst))
        return iter(_decoded(call, plan, slots))

    def broadcast(self, call: Call, plan: Plan, src: int) -> Any:
        buf = _packed(call, plan.sizes[src])
        _transfer(call, gloo.broadcast_op(buf, src))
        try:
            if call.rank == src:
                return plan.own
            return serialize.decode(buf.numpy().data[: plan.sizes[src]], rank=src, where=call.what)
        finally:
            call.finish()


class InlineRoute(Route):
    """Parts that rode on the call's status exchange: ``"auto"``'s tiny gathers (every
    part at most :data:`INLINE_TOTAL` over the world size), which then take one
    exchange of the control plane instead of an exchange, a gloo op and a second
    exchange.  ``parts``: every rank's sealed part (on the ranks that receive)."""

    need = "collective"

    def __init__(self, parts: Sequence[memoryview] | None) -> None:
        self.parts = parts

    def __str__(self) -> str:
        return "auto (inline)"

    def all_gather(self, call: Call, plan: Plan) -> list[Any]:
        return self._decoded(call, plan)

    def gather(self, call: Call, plan: Plan, dst: int, *, stream: bool) -> Iterator[Any] | None:
        if call.rank != dst:
            call.finish()
            return None
        return iter(self._decoded(call, plan))

    def broadcast(self, call: Call, plan: Plan, src: int) -> Any:
        raise AssertionError("a broadcast's parts do not ride on its status exchange")

    def _decoded(self, call: Call, plan: Plan) -> list[Any]:
        """Every part's object, this rank's own in place; then the call ends."""
        assert self.parts is not None
        try:
            return [
                plan.own if r == call.rank else serialize.decode(part, rank=r, where=call.what)
                for r, part in enumerate(self.parts)
            ]
        finally:
            call.finish()


def _transfer(call: Call, start: gloo.Start) -> None:
    """Run one gloo op on gatherstore's group within the call's deadline."""
    try:
        gloo.transfer(start, what=call.what, deadline=call.deadline)
    except GatherError as exc:
        after_failure(exc)
        raise
    call.lap("transfer")


def send_confirmed(
    call: Call, send: Callable[[serialize.Frame], bool], undo: Callable[[bool], None]
) -> None:
    """Send this rank's part with ``send`` (its frame; whether it sent anything), then
    confirm (see ``confirmed``), each rank after its own ``undo(sent)`` when one failed.
    The frame is freed once sent, before the exchange waits for the others."""
    frame = call.take_frame()
    sent = False

    def run() -> None:
        nonlocal frame, sent
        try:
            sent = frame is not None and send(frame)
        finally:
            frame = None

    try:
        confirmed(call, run, call.what)
    except BaseException:
        undo(sent)
        raise
    call.lap("write")


def confirmed(call: Call, run: Callable[[], T], what: str) -> T:
    """``run()`` (this rank's side of a step: sending its part, reading what it receives),
    then an exchange of every rank's outcome: a rank that failed raises on every rank, its
    own error on itself."""
    error: BaseException | None = None
    mine = status(True)
    out: T | None = None
    try:
        out = run()
    except Exception as exc:
        error, mine = exc, failure(exc)
    call.confirm(mine, what=what, error=error)
    return cast(T, out)


def _packed(call: Call, size: int) -> torch.Tensor:
    """This rank's sealed frame in a ``size``-byte tensor (the padding is never read)."""
    out = torch.empty(size, dtype=torch.uint8)
    frame = call.take_frame()
    if frame is not None:
        frame.seal(None).copy_into(out.numpy().data)
    return out


def _decoded(call: Call, plan: Plan, slots: list[torch.Tensor]) -> list[Any]:
    """Every slot's object, this rank's own in place; then the call ends (its DEBUG line
    counts the decoding as reading)."""
    try:
        return [
            plan.own
            if r == call.rank
            else serialize.decode(slot.numpy().data[: plan.sizes[r]], rank=r, where=call.what)
            for r, slot in enumerate(slots)
        ]
    finally:
        call.finish()


class StoreRoute(Route):
    """Parts as keys of the job's area in ``store``: written by each sender, read back
    (verified, and deleted once read) by the readers."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.need = "shm" if store.shares_memory_with_host else "store"

    def __str__(self) -> str:
        return str(self.store)

    def all_gather(self, call: Call, plan: Plan) -> list[Any]:
        everyone = list(range(call.world))
        session, prefix = self._write(call, everyone)

        def read() -> list[Any]:
            # every part is returned: reading them all at once takes no more memory
            budget = plan.total
            return list(Parts(call, plan, session, prefix, call.rank, budget=budget, delete=False))

        try:
            return confirmed(call, read, "all_gather_object (read)")
        finally:
            self._tidy(call, session, part_key(prefix, call.rank))

    def gather(self, call: Call, plan: Plan, dst: int, *, stream: bool) -> Iterator[Any] | None:
        session, prefix = self._write(call, [r for r in range(call.world) if r != dst])
        if call.rank != dst:
            call.finish()
            return None
        # a gather_object returns every part: it may read them all at once; a gather_iter
        # keeps what its consumer holds plus the read-ahead budget
        budget = plan.budget if stream else plan.total
        parts = Parts(call, plan, session, prefix, dst, budget=budget, lazy=stream)
        return parts if stream else iter(list(parts))

    def broadcast(self, call: Call, plan: Plan, src: int) -> Any:
        session, prefix = self._write(call, [src])

        def read() -> Any:
            if call.rank == src:
                return plan.own
            return serialize.load(fetch(call, session, prefix, src))

        try:
            out = confirmed(call, read, "broadcast_object (read)")
        finally:
            if call.rank == src:
                self._tidy(call, session, part_key(prefix, src))
        call.finish()
        return out

    def _write(self, call: Call, writers: Sequence[int]) -> tuple[JobSession, str]:
        """Write this rank's part (if it is a writer); confirm every write."""
        session = call.absorbing(lambda: session_for(self.store, call.deadline.timeout))
        prefix = session.next_call()

        def put(frame: serialize.Frame) -> bool:
            if call.rank not in writers:
                return False
            with call.deadline.for_store():
                sealed = frame.seal(session.key, binding(session, prefix, call.rank))
                session.store.put(part_key(prefix, call.rank), sealed.segments)
            return True

        def undo(wrote: bool) -> None:
            if wrote:
                self._tidy(call, session, part_key(prefix, call.rank))

        send_confirmed(call, put, undo)
        return session, prefix

    @staticmethod
    def _tidy(call: Call, session: JobSession, key: str) -> None:
        """Delete this rank's part ``key`` once nobody needs it, best effort: within a few
        seconds of its own (the call's time may be over, and the call's own outcome is
        what to report); what is left goes with the job's area."""
        try:
            with deadline(min(call.deadline.timeout, _TIDY_TIME)):
                session.store.discard(key)
        except GatherError as exc:
            _log.debug("gatherstore: %s: part %s left for the job's end: %s", call.what, key, exc)
