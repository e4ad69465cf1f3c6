"""How an object collective moves parts: a route implements every collective.

A route receives the frozen ``Plan`` every rank agreed on and a narrow
``gatherstore.routes.context.Context`` (this rank's side of the call: its deadline,
its encoded part, its progress), never the call itself, and implements
``Route.all_gather``, ``Route.gather`` (whole or lazily read) and ``Route.broadcast``:

- ``CollectiveRoute`` sends the pickled parts over gatherstore's gloo group, padded to
  the largest, and ``InlineRoute`` takes the tiny parts that rode on the call's status
  exchange (``gatherstore.routes.collective``);
- ``StoreRoute`` writes each part under a key of the job's area in a store, and the
  readers read them back (``gatherstore.routes.store``);
- ``StreamRoute`` sends parts point to point in chunks (``gatherstore.routes.stream``);
- ``HandoverRoute`` and ``ChunkedRoute`` hand sealed memory to the processes of one
  host (``gatherstore.routes.handover``, ``gatherstore.routes.handchunks``).

A new route is one class: ``gatherstore.calls.choice`` picks it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from gatherstore import codec
from gatherstore.job.report import failure, status
from gatherstore.routes.context import Context

__all__ = ["INLINE_TOTAL", "Plan", "Route", "confirmed", "send_confirmed"]

T = TypeVar("T")

#: Bytes of all parts together up to which ``"auto"`` sends them inside the call's status
#: exchange (each rank inlines a part of at most this over the world size).
INLINE_TOTAL = 64 << 10


class Route(ABC):
    """A way to move one call's parts; every object collective, on every rank."""

    #: Its kind of memory need (one of ``gatherstore.calls.fit.NEEDS``).
    need: str = "store"

    @abstractmethod
    def all_gather(self, ctx: Context, plan: Plan) -> list[Any]:
        """Every rank's object in rank order (this rank's own: ``plan.own``)."""

    @abstractmethod
    def gather(self, ctx: Context, plan: Plan, dst: int, *, lazy: bool) -> Iterator[Any] | None:
        """On ``dst`` every rank's object in rank order, as an iterator that reads them as it
        goes when ``lazy``; None on the other ranks."""

    @abstractmethod
    def broadcast(self, ctx: Context, plan: Plan, src: int) -> Any:
        """``src``'s object on every rank (``src``: its own)."""

    def __str__(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Plan:
    """One call, as every rank agreed on it, and this rank's object.

    ``route``: how the parts travel; ``sizes``: each rank's part size (0 for ranks that
    send nothing; a rank outside the call's ``full`` ranks knows only its own and the
    root's, the others read as 0); ``budget``: this rank's read-ahead budget in bytes;
    ``own``: this rank's object (or a copy of it, see
    ``gatherstore.calls.objects.own_copies``).
    """

    route: Route
    sizes: tuple[int, ...]
    total: int
    longest: int
    budget: int
    own: Any


def send_confirmed(
    ctx: Context, send: Callable[[codec.Frame], bool], undo: Callable[[bool], None]
) -> None:
    """Send this rank's part with ``send`` (its frame; whether it sent anything), then
    confirm (see ``confirmed``), each rank after its own ``undo(sent)`` when one failed.
    The frame is freed once sent, before the exchange waits for the others."""
    frame = ctx.take_frame()
    sent = False

    def run() -> None:
        nonlocal frame, sent
        try:
            sent = frame is not None and send(frame)
        finally:
            frame = None

    try:
        confirmed(ctx, run, ctx.what)
    except BaseException:
        undo(sent)
        raise
    ctx.lap("write")


def confirmed(ctx: Context, run: Callable[[], T], what: str) -> T:
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
    ctx.confirm(mine, what=what, error=error)
    return cast(T, out)
