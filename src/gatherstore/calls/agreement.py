"""What every rank of an object collective agrees on before any data moves.

Each rank builds and encodes its object, then reports (status, part size, free memory,
node, where it takes parts handed over) in one exchange of the control plane; a rank
that failed makes every rank raise, ranks in different calls raise ``MismatchError``,
and every rank turns the reports into the same frozen ``Plan``, its route chosen once
by ``gatherstore.calls.choice.settle``.  Parts sent in chunks (sizes estimated from a
first chunk) are a branch of that choice: when the route would not hand chunks over,
every rank encodes its part whole and reports again.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gatherstore import _config as config
from gatherstore import codec
from gatherstore._errors import MismatchError
from gatherstore.calls.choice import Facts, facts, settle
from gatherstore.codec import Chunks
from gatherstore.host import memory
from gatherstore.job import control, gloo, topology
from gatherstore.job.report import failure, raise_failures, status
from gatherstore.job.session import note_timeout
from gatherstore.job.specs import resolve
from gatherstore.routes import handover
from gatherstore.routes.base import INLINE_TOTAL, Plan
from gatherstore.routes.context import Context
from gatherstore.stores.base import Store

__all__ = ["Agreement", "Shape"]


@dataclass(frozen=True)
class Shape:
    """Who takes part in an object collective, and how.

    ``receivers`` read parts (their memory is checked); ``full`` (default: every rank)
    need every rank's part size: only they get every rank's status, the others a
    summary (O(W) bytes in all for a gather, not W²).  ``send``: this rank sends its
    part.  ``copy_own``: the plan holds a copy of this rank's object (see
    ``own_copies``).  ``inline``: with ``"auto"``, a small part rides on the status
    exchange (see ``InlineRoute``).  ``chunk``: a long list or dict may be sent in chunks
    (see ``gatherstore.codec.chunks``) when the parts are handed over.
    """

    receivers: Sequence[int]
    send: bool = True
    full: Sequence[int] | None = None
    copy_own: bool = False
    inline: bool = False
    chunk: bool = False


class Agreement:
    """This rank's side of an object collective until every rank agreed on its plan."""

    def __init__(
        self,
        ctx: Context,
        store: str | Store | None,
        *,
        root: int | None = None,
        read_ahead: int | None = None,
        iterated: bool = False,
    ) -> None:
        self.ctx, self.root = ctx, root
        self.read_ahead, self.iterated = read_ahead, iterated
        self.spec = resolve(store)
        ctx.route = str(self.spec)  # named in the log line; the plan's route once agreed
        note_timeout(ctx.deadline.timeout)

    def agree(self, prepare: Callable[[], Any], shape: Shape) -> Plan:
        """Build this rank's object with ``prepare()``, encode it when it is sent, and
        agree on the plan with every rank.

        Raises:
            RemoteRankError / StoreUnavailableError: a rank failed to build or encode
                its object (that rank raises its own error).
            MismatchError: ranks disagree on the store or the dst/src.
            GatherTimeout: ranks that did not arrive in time.
            InsufficientMemoryError / GatherError: see ``gatherstore.calls.choice.settle``.
        """
        built: list[Any] = []  # the object, once built: encoded again whole if need be

        def build() -> Any:
            if not built:
                built.append(prepare())
            return built[0]

        while True:
            plan = self._round(build, shape)
            if plan is not None:
                return plan
            self.ctx.drop_part()  # the plan's branch for chunks: every rank encodes whole
            shape = dataclasses.replace(shape, chunk=False)

    def _round(self, build: Callable[[], Any], shape: Shape) -> Plan | None:
        """One report of every rank and the plan it gives (None: encode whole, again)."""
        ctx = self.ctx
        mine, own, budget, error = self._report(build, shape)
        head = ctx.chunks if ctx.chunks is not None else ctx.frame
        mine_size = head.nbytes if head is not None and error is None else 0
        root, iterated, receivers = self.root, self.iterated, shape.receivers

        def summarize(raw: list[bytes]) -> bytes | None:
            found = facts([_status_of(s) for s in raw], receivers, root, iterated)
            return None if found is None else json.dumps(dataclasses.asdict(found)).encode()

        raw, summary = ctx.exchanging(
            lambda: control.exchange_summary(
                mine,
                timeout=ctx.deadline.left(),
                what=ctx.what,
                summarize=summarize,
                full=shape.full,
                named=ctx.deadline.timeout,
            )
        )
        ctx.lap("agree")
        statuses = None if raw is None else [_status_of(s) for s in raw]
        if summary is None:  # every rank has every status: a failure or mismatch raises here
            assert statuses is not None
            raise_failures(statuses, ctx.what, error)
            self._same_call(statuses)
        found = (
            Facts(**json.loads(summary))
            if summary
            else facts(statuses or [], receivers, root, iterated)
        )
        assert found is not None
        parts = None if raw is None else [_part_of(s) for s in raw]
        route = settle(self.spec, found, what=ctx.what, nodes=topology.group_nodes(), parts=parts)
        if route is None:
            return None
        ctx.route, ctx.total = str(route), found.total
        sizes = self._sizes(statuses, found, int(mine_size))
        return Plan(route, sizes, found.total, found.longest, budget, own)

    def _report(
        self, build: Callable[[], Any], shape: Shape
    ) -> tuple[bytes, Any, int, BaseException | None]:
        """This rank's report (its status, and its part when it rides along), its object
        (or a copy), its read-ahead budget, and its error (reported, not raised)."""
        ctx = self.ctx
        try:
            own = build()
            hand = self._handover()
            if shape.send:
                self._encode(own, shape.chunk and bool(hand.get("hand")))
            if shape.copy_own:
                own = codec.duplicate(ctx.frame or codec.encode(own))
            if shape.send or shape.copy_own:
                ctx.lap("encode")
            avail = memory.headroom()
            budget = config.read_ahead(self.read_ahead, avail)
            part = self._inlined() if shape.inline and self.spec == "auto" else None
            head = ctx.chunks if ctx.chunks is not None else ctx.frame
            mine = status(
                True,
                size=head.nbytes if head else 0,
                rebuilt=head.rebuilt if head else 0,
                avail=avail,
                window=budget,
                shm=memory.shm_free(),
                node=socket.gethostname(),
                call={"route": str(self.spec), "root": self.root},
                broken=gloo.broken(),
                inline=part is not None,
                chunked=ctx.chunks is not None,
                **hand,
            )
            return mine + b"\n" + (part or b""), own, budget, None
        except Exception as exc:
            return failure(exc), None, 0, exc

    def _sizes(self, statuses: list[Any] | None, found: Facts, mine: int) -> tuple[int, ...]:
        """Every rank's part size, as far as this rank knows them (see ``Plan``)."""
        if statuses is not None:
            return tuple(int(s["size"]) for s in statuses)
        sizes = [0] * self.ctx.world
        if self.root is not None:
            sizes[self.root] = found.root
        sizes[self.ctx.rank] = mine
        return tuple(sizes)

    def _encode(self, obj: Any, chunk: bool) -> None:
        """Encode this rank's part: only its first chunk when ``chunk`` (the parts may be
        handed over), ``obj`` is a list worth sending in chunks, and ``"auto"`` would not
        send them across machines."""
        ctx = self.ctx
        if chunk and not (self.spec == "auto" and topology.group_nodes() > 1):
            ctx.chunks = Chunks.first(obj)
        ctx.frame = ctx.chunks.head if ctx.chunks else codec.encode(obj)

    def _same_call(self, statuses: list[Any]) -> None:
        """Raise MismatchError on every rank when ranks disagree on the route or dst/src."""
        shapes = [s["call"] for s in statuses]
        if any(shape != shapes[0] for shape in shapes):
            details = {
                r: f"store={shape['route']!r}, dst/src={shape['root']}"
                for r, shape in enumerate(shapes)
            }
            raise MismatchError(
                f"{self.ctx.what}: ranks disagree on the store or the dst/src rank — "
                f"{details}; every rank must pass the same store and dst/src",
                details=details,
            )

    def _handover(self) -> dict[str, Any]:
        """Where this rank takes parts handed over, and how many descriptors may be in
        flight to it (see ``gatherstore.routes.handover``): a fact every rank reports for
        a store whose parts may be handed over (``auto``, or one that supports it)."""
        if self.spec != "auto" and not (
            isinstance(self.spec, Store) and self.spec.supports_handover
        ):
            return {}
        token = handover.token(self.ctx.deadline.left())
        return {"hand": token, "hand_fds": handover.in_flight()}

    def _inlined(self) -> bytes | None:
        """This rank's sealed part when it is small enough to ride on the status exchange
        (empty when this rank sends nothing); None when it is not.  The frame stays: should
        another rank's part be too large, a route of its own sends it."""
        ctx = self.ctx
        if ctx.frame is None:
            return b""
        if ctx.chunks is not None or ctx.frame.nbytes > INLINE_TOTAL // ctx.world:
            return None
        out = bytearray(ctx.frame.nbytes)
        ctx.frame.seal(None).copy_into(memoryview(out))
        return bytes(out)


def _status_of(raw: bytes) -> Any:
    """A rank's status, parsed (the JSON before the part it may carry)."""
    return json.loads(raw.partition(b"\n")[0])


def _part_of(raw: bytes) -> memoryview:
    """The part a rank's status carries (empty when none), in writable memory of its own:
    arrays decoded from it are writable, as those of every other route are."""
    return memoryview(bytearray(raw.partition(b"\n")[2]))
