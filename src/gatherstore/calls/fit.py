"""What a route needs of each node's memory, and whether it fits: checked before any data moves.

Before any data moves every rank reports its node's headroom and the free space
of /dev/shm (see ``gatherstore.host.memory``); one rank computes each kind of
route's per-node shortfalls (``shortfalls``) for all, and every rank raises
``gatherstore.InsufficientMemoryError`` together (``check``) when the
chosen route does not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gatherstore._config import SHM
from gatherstore._errors import InsufficientMemoryError, ranks_named

if TYPE_CHECKING:
    from gatherstore.routes.base import Route

__all__ = ["NEEDS", "NodeNeed", "check", "route_need", "shortfalls"]

#: The kinds of memory need a route has (see ``route_need``): how each moves parts
#: (a route's ``need``), not the routes a user picks.
NEEDS = ("collective", "shm", "memfd", "store")


@dataclass(frozen=True)
class NodeNeed:
    """What one route needs on one node: RAM (``shm`` included) and /dev/shm space."""

    ram: int
    shm: int


def route_need(
    route: str,
    sizes: Sequence[int],
    receivers: Sequence[int],
    ranks: Sequence[int],
    *,
    all_receive: bool,
    rebuilt: Sequence[int] = (),
    windows: Sequence[int] = (),
    iterated: bool = False,
) -> NodeNeed:
    """Bytes the ``ranks`` of one node allocate for a gather of parts ``sizes``.

    ``route`` is ``"collective"``, ``"shm"`` (a store whose files live in this
    node's RAM), ``"memfd"`` (parts handed over in RAM, see ``gatherstore.routes.handover``)
    or ``"store"`` (any other store).  ``receivers`` read parts;
    ``all_receive`` marks an all-gather (parts stay until every rank has read
    them); ``iterated`` a ``gather_iter``, whose receiver holds one part at a time.
    ``rebuilt`` is what unpickling each rank's part allocates besides the part
    (see ``gatherstore.codec.sizing``): every receiver rebuilds every other part.
    ``windows`` is each rank's read-ahead budget in bytes.

    The collective route gives every receiver ``W`` slots of the largest part
    (plus a send buffer in an all-gather) and every sender one padded part.  A
    store route gives each receiver a private copy of what it reads (a ``gather_iter``: one
    part at a time, plus its read-ahead budget); on /dev/shm the written parts
    take RAM too, which a gather frees as it reads (the copies replace them) and an
    all-gather does not.  Parts handed over are in RAM once, however many ranks map
    them, and take no room in /dev/shm.
    """
    world, largest, total = len(sizes), max(sizes, default=0), sum(sizes)
    built = list(rebuilt) or [0] * world
    window = list(windows) or [0] * world
    receiving = set(receivers)
    mine = [r for r in ranks if r in receiving]
    objects = sum(sum(built) - built[r] for r in mine)
    if route == "collective":
        ram = sum(largest * (world + all_receive) for _ in mine) + objects
        ram += sum(largest for r in ranks if r not in receiving and sizes[r])
        return NodeNeed(ram, 0)
    if route == "memfd":  # every part written once, read in place: only the objects add
        written = sum(sizes[r] for r in ranks)
        return NodeNeed(written + (sum(max(built) for _ in mine) if iterated else objects), 0)
    if iterated:  # the consumer's part, rebuilt, and the read-ahead budget
        reads = sum(largest + max(built) + window[r] for r in mine)
    else:  # every part is returned: what is read ahead is part of that
        reads = sum(total - sizes[r] for r in mine) + objects
    if route != "shm":
        return NodeNeed(reads, 0)
    written = sum(sizes[r] for r in ranks)
    return NodeNeed(written + reads if all_receive else max(written, reads), written)


def shortfalls(
    route: str,
    statuses: Sequence[Any],
    sizes: Sequence[int],
    receivers: Sequence[int],
    *,
    iterated: bool = False,
) -> list[str]:
    """Per node that lacks room for ``route``: what it needs there and what it has.

    ``statuses`` are every rank's reports (``avail``, ``shm``, ``node``, ``rebuilt``,
    ``window``); the ranks of one node share its memory, so their needs add up.
    """
    nodes: dict[str, list[int]] = {}
    for rank, status in enumerate(statuses):
        nodes.setdefault(status["node"], []).append(rank)
    rebuilt = [int(status.get("rebuilt", 0)) for status in statuses]
    windows = [int(status.get("window", 0)) for status in statuses]
    out = []
    for node, ranks in nodes.items():
        need = route_need(
            route,
            sizes,
            receivers,
            ranks,
            all_receive=len(receivers) > 1,
            rebuilt=rebuilt,
            windows=windows,
            iterated=iterated,
        )
        room = min(int(statuses[r]["avail"]) for r in ranks)
        shm = min(int(statuses[r]["shm"]) for r in ranks)
        if need.ram > room or need.shm > shm:
            out.append(
                f"node {node} ({ranks_named(ranks)}) needs {need.ram / 2**30:.2f} GiB of memory"
                + (f" ({need.shm / 2**30:.2f} GiB in {SHM})" if need.shm else "")
                + f" and has {room / 2**30:.2f} GiB"
                + (f" ({shm / 2**30:.2f} GiB free in {SHM})" if need.shm else "")
            )
    return out


def check(what: str, route: Route, total: int, short: dict[str, list[str]]) -> None:
    """Raise on every rank alike when ``route`` would outgrow a node's memory.

    ``short`` maps each of ``NEEDS`` to its ``shortfalls`` (computed once,
    on one rank, and the same everywhere); ``total`` is the bytes gathered.

    Raises:
        InsufficientMemoryError: names the nodes, what they need and what they have.
    """
    found = short[route.need]
    if found:
        raise InsufficientMemoryError(
            f"{what} of {total / 2**30:.2f} GiB over {route} would not fit: "
            f"{'; '.join(found)} (free memory, capped by the memory cgroup; the need counts "
            "what unpickling the parts allocates, not only their bytes). Use "
            "gs.gather_iter (one part in memory at a time), gather less per call, or raise "
            "the job's memory limit"
        )
