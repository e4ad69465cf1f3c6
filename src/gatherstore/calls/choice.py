"""The route of a call, decided once, from what every rank reported before any data moves.

Every rank reports (status, part size, free memory, node) in one exchange; one rank
summarises the reports into ``Facts`` for all, and every rank turns them into the same
route (``settle``, a pure function of the facts): ``"auto"`` settled by total size and
node count, the default ``tmpdir`` moved off ``/dev/shm`` when the gather does not fit
there, a ``tmpdir`` in RAM handed over as memfds where every rank can (which needs RAM
but no room in /dev/shm), checked to fit in every node's memory.  Parts sent in chunks
are a branch of it: their sizes are estimates, and when the route would not hand them
over (or the estimates would not fit) the answer is to encode them whole and agree
again.  ``pick`` is the spec's decision alone; both are tested as tables, without
processes (tests/test_plan.py).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gatherstore import _config as config
from gatherstore._errors import InsufficientMemoryError
from gatherstore.calls import fit
from gatherstore.job import gloo
from gatherstore.job.specs import resolve
from gatherstore.routes.base import Route
from gatherstore.routes.collective import CollectiveRoute, InlineRoute
from gatherstore.routes.handchunks import WINDOW, ChunkedRoute
from gatherstore.routes.handover import HandoverRoute
from gatherstore.routes.store import StoreRoute
from gatherstore.routes.stream import StreamRoute
from gatherstore.stores.base import Store

__all__ = ["Facts", "facts", "pick", "settle"]


@dataclass(frozen=True)
class Facts:
    """What every rank decides a call's route and memory check from: the ``total`` and
    ``longest`` part, the ``root``'s part size, why gatherstore's gloo group is
    ``broken`` (or ""), each kind of route's per-node memory ``short``-falls,
    whether every part was ``inlined`` in the statuses, whether parts can be handed
    over, and whether a rank's part is ``chunked`` (its size an estimate)."""

    total: int
    longest: int
    root: int
    broken: str
    short: dict[str, list[str]]
    inlined: bool = False  # every rank's part rode on the status exchange
    handover: bool = False  # every rank can take parts handed over (one machine, one user)
    chunked: bool = False  # a rank's part is sent in chunks when handed over


def facts(
    statuses: list[Any], receivers: Sequence[int], root: int | None, iterated: bool = False
) -> Facts | None:
    """The ``Facts`` of every rank's status (``iterated``: the receivers read with
    ``gather_iter``, one part at a time); None when a rank failed or ranks are in
    different calls (every rank then needs every status, to raise the same error)."""
    if not all(s["ok"] for s in statuses) or any(
        s["call"] != statuses[0]["call"] for s in statuses
    ):
        return None
    sizes = [int(s["size"]) for s in statuses]
    return Facts(
        total=sum(sizes),
        longest=max(sizes),
        root=0 if root is None else sizes[root],
        broken=next((s["broken"] for s in statuses if s["broken"]), ""),
        inlined=all(s.get("inline", False) for s in statuses),
        handover=_can_hand_over(statuses, receivers),
        chunked=any(s.get("chunked", False) for s in statuses),
        short={
            need: fit.shortfalls(need, statuses, sizes, receivers, iterated=iterated)
            for need in fit.NEEDS
        },
    )


def _can_hand_over(statuses: list[Any], receivers: Sequence[int]) -> bool:
    """Whether every rank reported the same place to take parts handed over (one machine,
    one network namespace, one user; none ""), and the descriptors the call puts in
    flight at once (one per sender and receiver) stay within half the smallest limit
    (the kernel counts them per user against the open-file limit; other work of the
    same user, say a DataLoader's, keeps the other half).  A part sent in chunks has up
    to ``WINDOW`` of them in flight."""
    places = {s.get("hand", "") for s in statuses}
    if len(places) != 1 or "" in places:
        return False
    senders = [r for r, s in enumerate(statuses) if int(s["size"])]
    flying = sum(
        (WINDOW if statuses[r].get("chunked") else 1) * (len(receivers) - (r in receivers))
        for r in senders
    )
    return flying <= min(int(s.get("hand_fds", 0)) for s in statuses) // 2


def pick(
    spec: str | Store,
    *,
    total: int,
    broken: str,
    nodes: int,
    tmpdir_short: bool,
    inlined: bool = False,
) -> str | Store:
    """The spec a call takes: ``"auto"`` is ``"inline"`` when every part rode on the
    status exchange (``inlined``), else ``"collective"`` up to the auto threshold
    (while gatherstore's gloo group works), else ``"stream"`` across nodes (``tmpdir``
    is node-local) or ``"tmpdir"`` on one; the default ``tmpdir`` is the temp dir
    instead when ``tmpdir_short`` (its base is gatherstore's choice, /dev/shm, and the
    gather does not fit there)."""
    if spec == "auto" and inlined:
        return "inline"
    if spec == "auto":
        small = total <= config.AUTO_THRESHOLD and not broken
        spec = "collective" if small else "stream" if nodes > 1 else "tmpdir"
    if _is_default_tmpdir(spec) and tmpdir_short:
        return f"tmpdir://{tempfile.gettempdir()}"
    return spec


def settle(
    spec: str | Store,
    found: Facts,
    *,
    what: str,
    nodes: int,
    parts: Sequence[memoryview] | None = None,
) -> Route | None:
    """The route for ``spec`` (see ``pick``), the same on every rank; ``parts``: every
    rank's part as it rode on the status exchange (on the ranks that received them).
    None when a rank's part went in chunks (``found.chunked``, sizes estimated from a
    first chunk) and the route would not hand chunks over, or the estimates would not
    fit: every rank then encodes its part whole and agrees again.

    Raises:
        GatherError: the route needs gatherstore's gloo group, which an earlier call broke.
        InsufficientMemoryError: the route would outgrow a node's memory (on every rank).
    """

    def chosen_for(short: bool) -> str | Store:
        return pick(
            spec,
            total=found.total,
            broken=found.broken,
            nodes=nodes,
            tmpdir_short=short,
            inlined=found.inlined,
        )

    chosen = chosen_for(False)
    if _is_default_tmpdir(chosen) and not config.tmpdir_base():
        tmpdir = resolve("tmpdir")  # gatherstore's choice of base: /dev/shm when it is there
        if isinstance(tmpdir, Store) and tmpdir.shares_memory_with_host:
            # handed over, parts take RAM but no room in /dev/shm (a container's 64 MiB)
            handed = found.handover and tmpdir.supports_handover
            chosen = chosen_for(bool(found.short["memfd" if handed else "shm"]))
    if chosen in ("collective", "stream") and found.broken:
        raise gloo.refuse(what, found.broken)
    if chosen == "inline":
        return InlineRoute(parts)
    target = resolve(chosen)
    route: Route
    if target == "collective":
        route = CollectiveRoute()
    elif target == "stream":
        route = StreamRoute()
    else:
        assert isinstance(target, Store)
        handing = ChunkedRoute if found.chunked else HandoverRoute
        handed = found.handover and target.supports_handover
        route = handing(target) if handed else StoreRoute(target)
    if found.chunked and not isinstance(route, HandoverRoute):
        return None  # the parts go whole on this route
    try:
        fit.check(what, route, found.total, found.short)
    except InsufficientMemoryError:
        if found.chunked:  # sizes estimated from a first chunk may be too large
            return None
        raise
    return route


def _is_default_tmpdir(spec: str | Store) -> bool:
    """Whether ``spec`` is ``tmpdir`` with the base gatherstore chooses."""
    return spec == "tmpdir" or (isinstance(spec, Store) and spec.url == "tmpdir")
