"""One object collective on one rank: encode, agree, route, move, clean up.

:class:`Call` carries a call through the steps every object collective shares
(see :mod:`gatherstore._objects` for the shape): the status exchange that
makes every rank raise together, the route decision ("auto" by total size and
node count), the memory check, and the moves of the collective and store
routes.  The stream route lives in :mod:`gatherstore._stream`, the reader of
stored parts in :mod:`gatherstore._parts`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _config as config
from . import _control as control
from . import _gloo as gloo
from . import _memory as memory
from . import _serialize as serialize
from . import _topology as topology
from ._config import Timeout, to_seconds
from ._errors import (
    GatherError,
    MismatchError,
    RemoteRankError,
    StoreUnavailableError,
)
from ._parts import binding, part_key
from ._progress import log_call
from ._session import JobSession, after_failure, note_timeout, session_for
from .stores.base import Store
from .stores.deadline import deadline
from .stores.registry import ROUTES, default_store, open_store
from .stores.tmpdir import TmpdirStore

__all__ = ["AUTO_THRESHOLD", "Call", "confirm", "facts", "failure", "resolve", "status"]

AUTO_THRESHOLD = config.AUTO_THRESHOLD

#: Seconds of a call's timeout kept for telling the other ranks that the store failed.
_REPORT_TIME = 2.0
#: Seconds a part's deletion may take once the call no longer needs it (see Call.tidy).
_TIDY_TIME = 5.0
#: Shortest wait an exchange gets once the call's time is (nearly) up: the others may be
#: there already (a c10d wait of 0 would mean "forever").
_MIN_WAIT = 0.05

_opened: dict[str, Store] = {}
_log = logging.getLogger("gatherstore")


def resolve(store: str | Store | None) -> str | Store:
    """A route ("auto", "collective", "stream") or an open Store (reused per URL)."""
    spec = default_store(store)
    if isinstance(spec, Store) or spec in ROUTES:
        return spec
    if spec not in _opened:
        _opened[spec] = open_store(spec)
    return _opened[spec]


def status(ok: bool, **fields: Any) -> bytes:
    return json.dumps({"ok": ok, **fields}).encode()


def failure(exc: BaseException) -> bytes:
    return status(
        False,
        error=f"{type(exc).__name__}: {exc}",
        kind=type(exc).__name__,
        tb=traceback.format_exc(),
        store=str(getattr(exc, "store", "")),
    )


def confirm(mine: bytes, *, timeout: float, what: str, error: BaseException | None) -> list[Any]:
    """Exchange statuses; if any rank failed, raise on every rank."""
    try:
        raw = control.exchange(mine, timeout=timeout, what=what)
    except GatherError as exc:
        after_failure(exc)
        raise
    statuses = [json.loads(s) for s in raw]
    _raise_failures(statuses, what, error)
    return statuses


def _raise_failures(statuses: list[Any], what: str, error: BaseException | None) -> None:
    """Raise when a rank reported a failure: ``error`` on the rank that had it, on the
    others the first failed rank's error."""
    failed = [r for r, s in enumerate(statuses) if not s["ok"]]
    if not failed:
        return
    if error is not None:
        raise error
    first = statuses[failed[0]]
    if first.get("kind") == "StoreUnavailableError":
        raise StoreUnavailableError(
            f"{what}: rank {failed[0]} cannot use the store: {first['error']}",
            store=first.get("store", ""),
        )
    raise RemoteRankError(
        failed[0], first["error"], remote_traceback=first.get("tb", ""), ranks=failed, context=what
    )


def facts(
    statuses: list[Any], receivers: Sequence[int], root: int | None, streamed: bool = False
) -> dict[str, Any] | None:
    """What every rank decides a call's route and memory check from, computed once
    from every rank's status: ``total`` and ``longest`` part, the ``root``'s part
    size, a ``broken`` gloo group, and each route's per-node memory shortfalls
    (``streamed``: the receivers read with ``gather_iter``).  None when a rank failed
    or ranks are in different calls (every rank then needs every status, to raise
    the same error)."""
    if not all(s["ok"] for s in statuses) or any(
        s["call"] != statuses[0]["call"] for s in statuses
    ):
        return None
    sizes = [int(s["size"]) for s in statuses]
    return {
        "total": sum(sizes),
        "longest": max(sizes),
        "root": 0 if root is None else sizes[root],
        "broken": next((s["broken"] for s in statuses if s["broken"]), ""),
        "short": {
            r: memory.shortfalls(r, statuses, sizes, receivers, streamed=streamed)
            for r in memory.NEEDS
        },
    }


class Call:
    """One object collective on this rank: encode, agree, route, move, clean up."""

    def __init__(
        self,
        what: str,
        store: str | Store | None,
        timeout: Timeout,
        progress: bool | None = None,
        root: int | None = None,
        read_ahead: int | None = None,
        streamed: bool = False,
    ) -> None:
        self.started = time.perf_counter()
        self.read_ahead, self.streamed = read_ahead, streamed
        self.what = what
        self.progress = progress
        self.timeout = to_seconds(timeout)
        self.ends_at = time.monotonic() + self.timeout
        note_timeout(self.timeout)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.target = resolve(store)
        # what every rank must agree on before any data moves: the route and the dst/src
        self.root = root
        self.shape = {"route": str(self.target), "root": root}

    def agree(
        self,
        prepare: Callable[[], Any],
        receivers: Sequence[int],
        *,
        send: bool = True,
        full: Sequence[int] | None = None,
        copy_own: bool = False,
    ) -> list[int]:
        """Build this rank's object (``self.own``), encode it when it is sent, exchange sizes.

        ``copy_own``: ``self.own`` becomes a copy of the object (see ``own_copies``).

        ``receivers`` read parts (their memory is checked); ``full`` (default: every
        rank) need every rank's part size: only they get every rank's status, the
        others a summary (O(W) bytes in all for a gather, not W²).  Returns the part
        sizes (0 for ranks that send nothing; outside ``full`` only this rank's and
        the root's are known, the others read as 0).
        """
        self.frame: serialize.Frame | None = None
        self.own: Any = None
        error: BaseException | None = None
        root, streamed = self.root, self.streamed
        try:
            self.own = prepare()
            if send:
                self.frame = serialize.encode(self.own)
            if copy_own:
                self.own = serialize.duplicate(self.frame or serialize.encode(self.own))
            avail = memory.headroom()
            self.budget = config.read_ahead(self.read_ahead, avail)
            mine = status(
                True,
                size=self.frame.nbytes if self.frame else 0,
                rebuilt=self.frame.rebuilt if self.frame else 0,
                avail=avail,
                window=self.budget,
                shm=memory.shm_free(),
                node=socket.gethostname(),
                call=self.shape,
                broken=gloo.broken(),
            )
        except Exception as exc:
            error, mine = exc, failure(exc)

        def summarize(raw: list[bytes]) -> bytes | None:
            found = facts([json.loads(s) for s in raw], receivers, root, streamed)
            return None if found is None else json.dumps(found).encode()

        try:
            raw, summary = control.exchange_summary(
                mine, timeout=self.left(), what=self.what, summarize=summarize, full=full
            )
        except GatherError as exc:
            after_failure(exc)
            raise
        statuses = None if raw is None else [json.loads(s) for s in raw]
        if summary is None:  # every rank has every status: a failure or mismatch raises here
            assert statuses is not None
            _raise_failures(statuses, self.what, error)
            self._same_call(statuses)
        found = json.loads(summary) if summary else facts(statuses or [], receivers, root, streamed)
        assert found is not None
        if statuses is not None:
            self.sizes = [int(s["size"]) for s in statuses]
        else:
            self.sizes = [0] * self.world
            if root is not None:
                self.sizes[root] = found["root"]
            self.sizes[self.rank] = self.frame.nbytes if self.frame else 0
        self.total, self.longest = int(found["total"]), int(found["longest"])
        self._route(found["broken"], found["short"])
        return self.sizes

    def _route(self, broken: str, short: dict[str, list[str]]) -> None:
        """Settle ``self.target`` ("auto" by total size and node count; off /dev/shm when
        it lacks room) and check that it fits in memory, the same way on every rank."""
        if self.target == "auto":
            small = self.total <= AUTO_THRESHOLD and not broken
            # tmpdir is node-local: across nodes "auto" streams over the process group
            across = topology.get_nnodes() > 1
            self.target = "collective" if small else "stream" if across else resolve("tmpdir")
        if self.target in ("collective", "stream") and broken:
            raise gloo.refuse(self.what, broken)
        if (
            isinstance(self.target, TmpdirStore)
            and self.target.url == "tmpdir"  # the base is gatherstore's choice: /dev/shm if it fits
            and not config.tmpdir_base()
            and memory.in_ram(self.target)
            and short["shm"]
        ):
            self.target = resolve(f"tmpdir://{tempfile.gettempdir()}")
        memory.check(self.what, self.target, self.total, short)

    def finish(self) -> None:
        """Log this call's one DEBUG line: route, bytes, seconds."""
        route = self.target if isinstance(self.target, str) else str(self.target)
        log_call(self.what, route, self.total, self.started)

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

    # --- the collective route ---------------------------------------------------
    def transfer(self, start: gloo.Start) -> None:
        """Run one gloo op on gatherstore's group within this call's timeout."""
        try:
            gloo.transfer(start, what=self.what, deadline=self.ends_at, timeout=self.timeout)
        except GatherError as exc:
            after_failure(exc)
            raise

    def packed(self, size: int) -> torch.Tensor:
        """This rank's sealed frame in a ``size``-byte tensor (the padding is never read)."""
        out = torch.empty(size, dtype=torch.uint8)
        if self.frame is not None:
            self.frame.seal(None).copy_into(out.numpy().data)
        return out

    def collective_all(self, sizes: list[int]) -> list[torch.Tensor]:
        slots = [torch.empty(self.longest, dtype=torch.uint8) for _ in sizes]
        packed = self.packed(self.longest)
        self.transfer(gloo.all_gather_op(slots, packed))
        return slots

    def collective_to(self, dst: int, sizes: list[int]) -> list[torch.Tensor] | None:
        if self.rank != dst:
            packed = self.packed(self.longest)
            self.transfer(gloo.gather_op(None, packed, dst))
            return None
        slots = [torch.empty(self.longest, dtype=torch.uint8) for _ in sizes]
        self.transfer(gloo.gather_op(slots, slots[dst], dst))
        return slots

    def decode_slot(self, slot: torch.Tensor, size: int, rank: int) -> Any:
        return serialize.decode(slot.numpy().data[:size], rank=rank, where=self.what)

    # --- the store route -----------------------------------------------------------
    def write(self, writers: Sequence[int]) -> tuple[JobSession, str]:
        """Write this rank's part (if it is a writer); confirm every write."""
        assert isinstance(self.target, Store)
        error: BaseException | None = None
        mine = status(True)
        # a store's set-up at its first use in the job has a deadline of its own: the call
        # absorbs it (gs.launch and init_from_env set up the default store before any call)
        started = time.monotonic()
        session = session_for(self.target, self.timeout)
        self.ends_at += time.monotonic() - started
        prefix = session.next_call()
        wrote = False
        try:
            if self.rank in writers and self.frame is not None:
                with self.deadline():
                    sealed = self.frame.seal(session.key, binding(session, prefix, self.rank))
                    session.store.put(part_key(prefix, self.rank), sealed.segments)
                wrote = True
        except Exception as exc:
            error, mine = exc, failure(exc)
        self.frame = None
        try:
            confirm(mine, timeout=self.left(), what=self.what, error=error)
        except BaseException:
            if wrote:
                self.tidy(session, part_key(prefix, self.rank))
            raise
        return session, prefix

    def tidy(self, session: JobSession, key: str) -> None:
        """Delete this rank's part ``key`` once nobody needs it, best effort: within a few
        seconds of its own (the call's time may be over, and the call's own outcome is
        what to report); what is left goes with the job's area."""
        try:
            with deadline(min(self.timeout, _TIDY_TIME)):
                session.store.discard(key)
        except GatherError as exc:
            _log.debug("gatherstore: %s: part %s left for the job's end: %s", self.what, key, exc)

    def left(self) -> float:
        """Seconds left of this call's one deadline, for its next phase (every phase of
        every route shares it: a slow but live store cannot stretch the call)."""
        return max(self.ends_at - time.monotonic(), _MIN_WAIT)

    def deadline(self, *, fresh: bool = False) -> contextlib.AbstractContextManager[None]:
        """Bound the store operations inside to this call's deadline, less the time kept
        to report a store failure before the other ranks stop waiting for this one.

        ``fresh`` gives them the call's whole timeout instead: for the reads of a
        ``gather_iter``, paced by its consumer after the call has returned.
        """
        keep = min(self.timeout / 4, _REPORT_TIME)
        return deadline(self.timeout - keep if fresh else self.left() - keep)
