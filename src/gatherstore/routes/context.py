"""One collective on this rank as its steps see it: what a route receives besides its plan.

Who and what the call is, its one deadline, this rank's encoded part until a route
takes it, where its progress and timing go, and the steps every collective is made
of: meeting every rank, running work whose failure on one rank raises on every rank,
running a process-group op within the deadline.  The one entry
(``gatherstore.calls.entry``) makes it; a route never sees the call itself.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from gatherstore import codec
from gatherstore._errors import GatherError, ProcessGroupError
from gatherstore._errors import seconds as format_seconds
from gatherstore._time import Deadline
from gatherstore.codec import Chunks
from gatherstore.job import control
from gatherstore.job.report import failure, raise_failures, status
from gatherstore.job.session import after_failure
from gatherstore.routes.progress import log_call

__all__ = ["Context", "process_group"]

T = TypeVar("T")


class Context:
    """One call on this rank as its route sees it."""

    def __init__(
        self,
        what: str,
        *,
        rank: int,
        world: int,
        deadline: Deadline,
        progress: bool | None = None,
        bounded: bool = True,
        sweep: bool = True,
        group: Any = None,
    ) -> None:
        self.what, self.rank, self.world = what, rank, world
        #: The process group the call runs on (None: the default group); ``rank`` and
        #: ``world`` are this rank's rank in it and its size.
        self.group = group
        self.deadline, self.progress = deadline, progress
        #: Whether the process group's own ops end by the deadline (a tensor collective
        #: without a timeout waits for them as long as the process group does).
        self.bounded = bounded
        #: Whether a failed exchange sweeps the job's areas when rank 0 is gone (the
        #: calls that use stores; see ``gatherstore.job.session.after_failure``).
        self.sweep = sweep
        self.started = time.perf_counter()
        self.finished = False
        #: A route returned parts its consumer reads later: the reading ends the call.
        self.reading = False
        #: This rank's encoded part, until the route takes it (see ``take_frame``); its
        #: first chunk when the part is sent in ``chunks``.
        self.frame: codec.Frame | None = None
        self.chunks: Chunks | None = None
        self.route = ""  # named in the log line
        self.total = 0
        #: (phase, when it ended), in order; what follows the last one is the reading
        self.laps: list[tuple[str, float]] = []

    def take_frame(self) -> codec.Frame | None:
        """This rank's encoded part, handed to the route that sends it (the context keeps
        no reference, so it is freed once sent)."""
        frame, self.frame = self.frame, None
        return frame

    def take_chunks(self) -> Chunks | None:
        """This rank's part in chunks, when it is sent so (see ``take_frame``)."""
        chunks, self.chunks = self.chunks, None
        return chunks

    def drop_part(self) -> None:
        """Forget this rank's encoded part (its chunks closed): it is encoded again."""
        if self.chunks is not None:
            self.chunks.close()
        self.chunks = self.frame = None

    def exchanging(self, run: Callable[[], T]) -> T:
        """``run()`` (an exchange with every rank); after a failed one, the areas of a
        rank 0 that is gone are swept (see ``gatherstore.job.session.after_failure``)."""
        try:
            return run()
        except GatherError as exc:
            if self.sweep:
                after_failure(exc)
            raise

    def send(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order, within the deadline.

        Raises:
            GatherTimeout / MismatchError / RemoteRankError: as every exchange does.
        """
        return self.exchanging(
            lambda: control.exchange(
                payload, timeout=self.deadline.left(), what=self.what, named=self.deadline.timeout
            )
        )

    def arrive(self) -> None:
        """Meet every rank: a rank that is late, or in another gatherstore call, is named
        on every rank."""
        self.send(b"")

    def agree(self, work: Callable[[], T], *, root: int | None = None) -> T | None:
        """Run ``work`` on every rank (``root``: on that rank only, None elsewhere), its
        store work bounded by the deadline, then exchange how it went: where it failed on
        a rank, every rank raises (that rank its own error, the others RemoteRankError
        naming it).

        Raises:
            RemoteRankError / GatherTimeout / MismatchError: as every collective does.
        """
        out: T | None = None
        error: BaseException | None = None
        mine = status(True)
        if root is None or root == self.rank:
            try:
                with self.deadline.for_store():
                    out = work()
            except Exception as exc:
                error, mine = exc, failure(exc)
        self.confirm(mine, what=self.what, error=error)
        return out

    def from_root(self, work: Callable[[], bytes], root: int = 0) -> bytes:
        """``work()`` run on ``root``, its bytes on every rank (its failure raised on all).

        Raises:
            RemoteRankError / GatherTimeout / MismatchError: as ``agree``.
        """
        return self.send(self.agree(work, root=root) or b"")[root]

    def run_op(self, start: Callable[[], Any]) -> None:
        """Run one op of the process group: ``start()`` launches it (``async_op=True``).

        A bounded call waits for it until the deadline (after the ranks met on the
        control plane, which names the late ones), so that a rank that dies or stalls
        mid-op ends the wait in time; an unbounded one as long as the group does.

        Raises:
            ProcessGroupError: the process group failed, or the op did not finish in time.
        """
        with process_group(self.what):
            work = start()
            if not self.bounded:
                work.wait()
                return
            ends = self.deadline.ends
            try:
                done = work.wait(timeout=_dt.timedelta(seconds=self.deadline.left()))
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower() and time.monotonic() < ends:
                    raise
                done = False
            if not done:
                raise ProcessGroupError(
                    f"{self.what}: every rank arrived but the collective did not finish "
                    f"within {format_seconds(self.deadline.timeout)} s; a rank died or "
                    "stalled in it (the process group may be unusable now)"
                )

    def confirm(self, mine: bytes, *, what: str, error: BaseException | None) -> list[Any]:
        """Exchange statuses within the call's deadline; if any rank failed, raise on every
        rank (``error`` on this rank when it was this rank's)."""
        raw = self.exchanging(
            lambda: control.exchange(
                mine, timeout=self.deadline.left(), what=what, named=self.deadline.timeout
            )
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
        """Log this call's one DEBUG line (route, bytes, seconds, and its phases' seconds),
        once: where the reading ends, or where the call returns."""
        if not self.finished:
            self.finished = True
            log_call(self.what, self.route, self.total, self.started, self.laps)


@contextlib.contextmanager
def process_group(what: str) -> Iterator[None]:
    """Report the process group's own failures as a ProcessGroupError (a GatherError and
    still a RuntimeError, as torch's was), not a raw torch error."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, GatherError):
            raise
        cause = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ProcessGroupError(
            f"{what}: the process group failed: {cause}; "
            "another rank died, stopped, or called a different collective (tensor collectives "
            "wait for the process group's timeout; object collectives name the rank)"
        ) from exc
