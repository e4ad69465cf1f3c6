"""What a result set needs of the rest of gatherstore, in one place: its store, its
collectives with one deadline, the signals it flushes on, and the memory it may use.

Result sets use the core only through these few functions, so that the core's
internals (the call, its statuses, the session) can change under them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import TypeVar

from gatherstore._config import ROUTES, Timeout, to_seconds
from gatherstore._errors import GatherError
from gatherstore._time import Deadline
from gatherstore.host import memory
from gatherstore.job import control, session, signals, topology
from gatherstore.job.report import failure, raise_failures, status
from gatherstore.stores.base import Store
from gatherstore.stores.registry import default_store, open_store

__all__ = [
    "Collective",
    "forget_stop",
    "headroom",
    "on_stop",
    "open_persistent",
    "rank",
    "serialized",
    "world_size",
]

T = TypeVar("T")
_USE = (
    "a result set needs a store that outlives the job: file:///<shared dir>, "
    "redis://host:port/db, s3://bucket/prefix, gs:// or az:// (memory:// for tests in one "
    "process)"
)
serialized = control.serialized
rank = topology.get_rank
world_size = topology.get_world_size
headroom = memory.headroom


def open_persistent(store: str | Store | None) -> Store:
    """The store ``store`` names (None: the default), when it keeps values after the job.

    Raises:
        ValueError: a route (``auto``, ``collective``, ``stream``), ``tmpdir`` (removed
            when the job ends), ``memory://`` in a job of several processes, or a bad URL;
            the message names the stores to use.
        ImportError: the store needs a package that is not installed.
    """
    spec = default_store(store)
    if isinstance(spec, str) and spec in ROUTES:
        raise ValueError(f"store={spec!r} is a route, not a store: {_USE}")
    opened = open_store(spec) if isinstance(spec, str) else spec
    if opened.url.startswith("memory:"):  # not persistent, but fine for tests in one process
        if topology.get_world_size() > 1:
            raise ValueError(f"store={opened.url!r} lives inside one process: {_USE}")
    elif not opened.persistent:
        raise ValueError(f"store={opened.url!r} is removed when the job ends: {_USE}")
    return opened


def on_stop(flush: Callable[[], None]) -> None:
    """Run ``flush`` first on SIGTERM/SIGINT, whoever handles them; where the program has
    no handler, gatherstore's removes the job's areas after it, then ends as the default
    action would (the handler gs.launch and init_from_env install)."""
    signals.install(session.abandon)
    signals.on_stop(flush)


def forget_stop(flush: Callable[[], None]) -> None:
    """Stop running ``flush`` on signals."""
    signals.forget_stop(flush)


class Collective:
    """One collective of a result set on this rank: every step shares one deadline, and a
    step that fails on one rank raises on every rank."""

    def __init__(self, what: str, timeout: Timeout) -> None:
        self.what = what
        self.deadline = Deadline.start(to_seconds(timeout))
        self.timeout = self.deadline.timeout
        self.rank, self.world = topology.get_rank(), topology.get_world_size()

    def left(self) -> float:
        """Seconds left of the deadline (at least a few milliseconds)."""
        return self.deadline.left()

    def store_deadline(self) -> contextlib.AbstractContextManager[None]:
        """Bound store work to the deadline, less the time kept to report its failure."""
        return self.deadline.for_store()

    def agree(self, work: Callable[[], T], *, root: int | None = None) -> T | None:
        """Run ``work`` on every rank (``root``: on that rank only, None elsewhere), then
        exchange how it went: where it failed on a rank, every rank raises (that rank its
        own error, the others RemoteRankError naming it).

        Raises:
            RemoteRankError / GatherTimeout / MismatchError: as every collective does.
        """
        out: T | None = None
        error: BaseException | None = None
        mine = status(True)
        if root is None or root == self.rank:
            try:
                with self.store_deadline():
                    out = work()
            except Exception as exc:
                error, mine = exc, failure(exc)
        try:
            raw = control.exchange(mine, timeout=self.left(), what=self.what)
        except GatherError as exc:
            session.after_failure(exc)
            raise
        raise_failures([json.loads(s) for s in raw], self.what, error)
        return out

    def from_root(self, work: Callable[[], bytes], root: int = 0) -> bytes:
        """``work()`` run on ``root``, its bytes on every rank (its failure raised on all).

        Raises:
            RemoteRankError / GatherTimeout / MismatchError: as ``agree``.
        """
        mine = self.agree(work, root=root)
        return control.exchange(mine or b"", timeout=self.left(), what=self.what)[root]

    def send(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order.

        Raises:
            GatherTimeout / MismatchError / RemoteRankError: as every exchange does.
        """
        return control.exchange(payload, timeout=self.left(), what=self.what)
