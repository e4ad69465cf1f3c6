"""One object collective on one rank: its deadline, its part, and the plan every rank agrees on.

``Call`` carries this rank's side of a call: the one ``Deadline`` every
phase shares, this rank's encoded part until a route sends it, and the exchanges
that make every rank raise together.  ``Call.agree`` builds and encodes this
rank's object, exchanges (status, size, free memory) with every rank, and returns
the frozen ``gatherstore.calls.plan.Plan`` whose route then moves the parts (see
``gatherstore.routes.base``).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from gatherstore import _config as config
from gatherstore._config import Timeout, to_seconds
from gatherstore._errors import GatherError, InsufficientMemoryError, MismatchError
from gatherstore._time import Deadline
from gatherstore.calls.plan import Facts, Plan, facts, settle
from gatherstore.codec import frames as serialize
from gatherstore.codec.chunks import Chunks
from gatherstore.host import memory
from gatherstore.job import control, gloo, topology
from gatherstore.job.report import failure, raise_failures, status
from gatherstore.job.session import after_failure, note_timeout
from gatherstore.job.specs import resolve
from gatherstore.routes import handover
from gatherstore.routes.base import INLINE_TOTAL
from gatherstore.routes.progress import log_call
from gatherstore.stores.base import Store

__all__ = ["Call"]

T = TypeVar("T")


class Call:
    """One object collective on this rank: its deadline, its part, its exchanges."""

    def __init__(
        self,
        what: str,
        store: str | Store | None,
        timeout: Timeout,
        progress: bool | None = None,
        root: int | None = None,
        read_ahead: int | None = None,
        iterated: bool = False,
    ) -> None:
        self.started = time.perf_counter()
        self.what, self.progress, self.root = what, progress, root
        self.read_ahead, self.iterated = read_ahead, iterated
        self.deadline = Deadline.start(to_seconds(timeout))
        note_timeout(self.deadline.timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.spec = resolve(store)
        #: This rank's encoded part, until a route takes it (see ``take_frame``); its
        #: first chunk when the part is sent in ``chunks``.
        self.frame: serialize.Frame | None = None
        self.chunks: Chunks | None = None
        self.route = str(self.spec)  # named in the log line; the plan's route once agreed
        self.total = 0
        #: (phase, when it ended), in order; what follows the last one is the reading
        self.laps: list[tuple[str, float]] = []

    def agree(
        self,
        prepare: Callable[[], Any],
        receivers: Sequence[int],
        *,
        send: bool = True,
        full: Sequence[int] | None = None,
        copy_own: bool = False,
        inline: bool = False,
        chunk: bool = False,
    ) -> Plan:
        """Build this rank's object, encode it when it is sent, and agree on the plan.

        ``receivers`` read parts (their memory is checked); ``full`` (default: every
        rank) need every rank's part size: only they get every rank's status, the
        others a summary (O(W) bytes in all for a gather, not W²).  ``copy_own``: the
        plan holds a copy of this rank's object (see ``own_copies``).  ``inline``: with
        ``"auto"``, a small part rides on the status exchange (see ``InlineRoute``).
        ``chunk``: a long list or dict may be sent in chunks (see ``_chunks``) when the parts
        are handed over; should the plan settle on another route (or find the sizes
        estimated from first chunks too large for memory), every rank agrees again, on
        parts encoded whole.

        Raises:
            RemoteRankError / StoreUnavailableError: a rank failed to build or encode
                its object (that rank raises its own error).
            MismatchError: ranks disagree on the store or the dst/src.
            GatherTimeout: ranks that did not arrive in time.
            InsufficientMemoryError / GatherError: see ``gatherstore.calls.plan.settle``.
        """
        own: Any = None
        built: Any = None
        mine_size = 0
        error: BaseException | None = None
        budget = 0
        shape = {"route": str(self.spec), "root": self.root}
        try:
            own = built = prepare()
            hand = self._handover()
            if send:
                self._encode(own, chunk and bool(hand.get("hand")))
            if copy_own:
                own = serialize.duplicate(self.frame or serialize.encode(own))
            if send or copy_own:
                self.lap("encode")
            avail = memory.headroom()
            budget = config.read_ahead(self.read_ahead, avail)
            part = self._inlined() if inline and self.spec == "auto" else None
            chunks = self.chunks
            mine_size = chunks.nbytes if chunks else self.frame.nbytes if self.frame else 0
            mine = status(
                True,
                size=mine_size,
                rebuilt=chunks.rebuilt if chunks else self.frame.rebuilt if self.frame else 0,
                avail=avail,
                window=budget,
                shm=memory.shm_free(),
                node=socket.gethostname(),
                call=shape,
                broken=gloo.broken(),
                inline=part is not None,
                chunked=chunks is not None,
                **hand,
            )
            mine += b"\n" + (part or b"")
        except Exception as exc:
            error, mine = exc, failure(exc)
        root, iterated = self.root, self.iterated

        def summarize(raw: list[bytes]) -> bytes | None:
            found = facts([_status_of(s) for s in raw], receivers, root, iterated)
            return None if found is None else json.dumps(dataclasses.asdict(found)).encode()

        raw, summary = self.exchanging(
            lambda: control.exchange_summary(
                mine, timeout=self.deadline.left(), what=self.what, summarize=summarize, full=full
            )
        )
        self.lap("agree")
        statuses = None if raw is None else [_status_of(s) for s in raw]
        if summary is None:  # every rank has every status: a failure or mismatch raises here
            assert statuses is not None
            raise_failures(statuses, self.what, error)
            self._same_call(statuses)
        found = (
            Facts(**json.loads(summary))
            if summary
            else facts(statuses or [], receivers, root, iterated)
        )
        assert found is not None
        if statuses is not None:
            sizes = [int(s["size"]) for s in statuses]
        else:
            sizes = [0] * self.world
            if root is not None:
                sizes[root] = found.root
            sizes[self.rank] = int(mine_size)
        parts = None if raw is None else [_part_of(s) for s in raw]
        try:
            route = settle(
                self.spec, found, what=self.what, nodes=topology.get_nnodes(), parts=parts
            )
        except InsufficientMemoryError:
            if not found.chunked:  # sizes estimated from a first chunk may be too large
                raise
            route = None
        if route is None or (found.chunked and not isinstance(route, handover.HandoverRoute)):
            if self.chunks is not None:
                self.chunks.close()
            self.chunks = self.frame = None  # the parts are encoded again, whole
            return self.agree(
                lambda: built, receivers, send=send, full=full, copy_own=copy_own, inline=inline
            )
        self.route, self.total = str(route), found.total
        return Plan(route, tuple(sizes), found.total, found.longest, budget, own)

    def _encode(self, obj: Any, chunk: bool) -> None:
        """Encode this rank's part: only its first chunk when ``chunk`` (the parts may be
        handed over), ``obj`` is a list worth sending in chunks, and ``"auto"`` would not
        send them across machines."""
        if chunk and not (self.spec == "auto" and topology.get_nnodes() > 1):
            self.chunks = Chunks.first(obj)
        self.frame = self.chunks.head if self.chunks else serialize.encode(obj)

    def _same_call(self, statuses: list[Any]) -> None:
        """Raise MismatchError on every rank when ranks disagree on the route or dst/src."""
        shapes = [s["call"] for s in statuses]
        if any(shape != shapes[0] for shape in shapes):
            details = {
                r: f"store={shape['route']!r}, dst/src={shape['root']}"
                for r, shape in enumerate(shapes)
            }
            raise MismatchError(
                f"{self.what}: ranks disagree on the store or the dst/src rank — {details}; "
                "every rank must pass the same store and dst/src",
                details=details,
            )

    def _handover(self) -> dict[str, Any]:
        """Where this rank takes parts handed over, and how many descriptors may be in flight
        to it (see ``_handover``); only for a store that may become a handover (``auto`` or
        a ``tmpdir`` in RAM)."""
        if self.spec != "auto" and not (isinstance(self.spec, Store) and handover.suits(self.spec)):
            return {}
        return {"hand": handover.token(self.deadline.left()), "hand_fds": handover.in_flight()}

    def _inlined(self) -> bytes | None:
        """This rank's sealed part when it is small enough to ride on the status exchange
        (empty when this rank sends nothing); None when it is not.  The frame stays: should
        another rank's part be too large, a route of its own sends it."""
        if self.frame is None:
            return b""
        if self.chunks is not None or self.frame.nbytes > INLINE_TOTAL // self.world:
            return None
        out = bytearray(self.frame.nbytes)
        self.frame.seal(None).copy_into(memoryview(out))
        return bytes(out)

    def take_frame(self) -> serialize.Frame | None:
        """This rank's encoded part, handed to the route that sends it (the call keeps
        no reference, so it is freed once sent)."""
        frame, self.frame = self.frame, None
        return frame

    def take_chunks(self) -> Chunks | None:
        """This rank's part in chunks, when it is sent so (see ``take_frame``)."""
        chunks, self.chunks = self.chunks, None
        return chunks

    def exchanging(self, run: Callable[[], T]) -> T:
        """``run()`` (an exchange with every rank); after a failed one, the areas of a
        rank 0 that is gone are swept (see ``_session.after_failure``)."""
        try:
            return run()
        except GatherError as exc:
            after_failure(exc)
            raise

    def confirm(self, mine: bytes, *, what: str, error: BaseException | None) -> list[Any]:
        """Exchange statuses within the call's deadline; if any rank failed, raise on every
        rank (``error`` on this rank when it was this rank's)."""
        raw = self.exchanging(
            lambda: control.exchange(mine, timeout=self.deadline.left(), what=what)
        )
        statuses = [json.loads(s) for s in raw]
        raise_failures(statuses, what, error)
        return statuses

    def absorbing(self, run: Callable[[], T]) -> T:
        """``run()`` (a store's set-up at its first use in the job, which has a deadline of
        its own), with the call's deadline moved by the time it took."""
        started = time.monotonic()
        try:
            return run()
        finally:
            self.deadline = self.deadline.later(time.monotonic() - started)

    def lap(self, phase: str) -> None:
        """Note that ``phase`` of this call (say ``"encode"``, ``"write"``) ends now."""
        self.laps.append((phase, time.perf_counter()))

    def finish(self) -> None:
        """Log this call's one DEBUG line: route, bytes, seconds, and its phases' seconds."""
        log_call(self.what, self.route, self.total, self.started, self.laps)


def _status_of(raw: bytes) -> Any:
    """A rank's status, parsed (the JSON before the part it may carry)."""
    return json.loads(raw.partition(b"\n")[0])


def _part_of(raw: bytes) -> memoryview:
    """The part a rank's status carries (empty when none), in writable memory of its own:
    arrays decoded from it are writable, as those of every other route are."""
    return memoryview(bytearray(raw.partition(b"\n")[2]))
