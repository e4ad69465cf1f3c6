"""How much memory a gather may use on this node, and how much a route needs.

The kernel kills a process that outgrows its memory cgroup, and /dev/shm
holds its files in the same RAM, so before any data moves every rank reports
its node's headroom (``MemAvailable``, capped by every enclosing cgroup's
limit minus its usage, v1 and v2) and the free space of /dev/shm; one rank
computes each route's per-node shortfalls (``shortfalls``) for all, and
every rank raises ``InsufficientMemoryError`` together
(``check``) when the chosen route does not fit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import InsufficientMemoryError
from .stores.base import Store
from .stores.tmpdir import SHM, TmpdirStore

__all__ = [
    "NEEDS",
    "NodeNeed",
    "check",
    "headroom",
    "in_ram",
    "route_need",
    "route_of",
    "shm_free",
    "shortfalls",
]

#: The kinds of memory need a route has (see ``route_need``): not the routes a
#: user picks (``stores.registry.ROUTES``), but how each moves parts.
NEEDS = ("collective", "shm", "store")
_UNLIMITED = 1 << 62
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _reclaimable(stat: Path, field: str) -> int:
    """Page cache the kernel drops before it kills (``inactive_file`` of memory.stat)."""
    with contextlib.suppress(OSError, ValueError):
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == field:
                return int(value)
    return 0


def _cgroup_dirs(proc_cgroup: str) -> Iterator[tuple[Path, str, str, str]]:
    """(directory, limit file, usage file, reclaimable field) of this process's memory cgroup
    and every ancestor, for cgroup v2 and v1."""
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            files = ("memory.max", "memory.current", "inactive_file")
            mount = _CGROUP_ROOT
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            mount = _CGROUP_ROOT / "memory"
        else:
            continue
        directory = mount / path.lstrip("/")
        while True:
            yield (directory, *files)
            if directory == mount or mount not in directory.parents:
                break
            directory = directory.parent


def cgroup_headroom(proc_cgroup: str | None = None) -> int:
    """Bytes this process's memory cgroups still allow (huge when unlimited or unknown)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return _UNLIMITED
    room = _UNLIMITED
    for directory, limit_file, usage_file, field in _cgroup_dirs(proc_cgroup):
        limit = _read_int(directory / limit_file)
        usage = _read_int(directory / usage_file)
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        used = max(usage - _reclaimable(directory / "memory.stat", field), 0)
        room = min(room, max(limit - used, 0))
    return room


def mem_available() -> int:
    """``MemAvailable`` of /proc/meminfo in bytes (huge when unknown)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return _UNLIMITED


def headroom() -> int:
    """Bytes this process may still allocate: ``MemAvailable`` capped by its cgroups."""
    return min(mem_available(), cgroup_headroom())


def shm_free() -> int:
    """Free bytes of /dev/shm when this process can write there, else 0."""
    with contextlib.suppress(OSError):
        if os.access(SHM, os.W_OK):
            stat = os.statvfs(SHM)
            return stat.f_bavail * stat.f_frsize
    return 0


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
    streamed: bool = False,
) -> NodeNeed:
    """Bytes the ``ranks`` of one node allocate for a gather of parts ``sizes``.

    ``route`` is ``"collective"``, ``"shm"`` (a store whose files live in this
    node's RAM) or ``"store"`` (any other store).  ``receivers`` read parts;
    ``all_receive`` marks an all-gather (parts stay until every rank has read
    them); ``streamed`` a ``gather_iter``, whose receiver holds one part at a time.
    ``rebuilt`` is what unpickling each rank's part allocates besides the part
    (see ``gatherstore._sizing``): every receiver rebuilds every other part.
    ``windows`` is each rank's read-ahead budget in bytes.

    The collective route gives every receiver ``W`` slots of the largest part
    (plus a send buffer in an all-gather) and every sender one padded part.  A
    store route gives each receiver a private copy of what it reads (streamed: one
    part at a time, plus its read-ahead budget); on /dev/shm the written parts
    take RAM too, which a gather frees as it reads (the copies replace them) and an
    all-gather does not.
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
    if streamed:  # the consumer's part, rebuilt, and the read-ahead budget
        reads = sum(largest + max(built) + window[r] for r in mine)
    else:  # every part is returned: what is read ahead is part of that
        reads = sum(total - sizes[r] for r in mine) + objects
    if route != "shm":
        return NodeNeed(reads, 0)
    written = sum(sizes[r] for r in ranks)
    return NodeNeed(written + reads if all_receive else max(written, reads), written)


def route_of(target: Store | str) -> str:
    """The kind of route (one of ``NEEDS``) ``target`` is, for its memory need."""
    return "collective" if target == "collective" else "shm" if in_ram(target) else "store"


def in_ram(store: Store | str) -> bool:
    """Whether ``store`` keeps its values in this node's RAM (a tmpdir on /dev/shm)."""
    shm = Path(SHM)
    return isinstance(store, TmpdirStore) and (store.root == shm or shm in store.root.parents)


def shortfalls(
    route: str,
    statuses: Sequence[Any],
    sizes: Sequence[int],
    receivers: Sequence[int],
    *,
    streamed: bool = False,
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
            streamed=streamed,
        )
        room = min(int(statuses[r]["avail"]) for r in ranks)
        shm = min(int(statuses[r]["shm"]) for r in ranks)
        if need.ram > room or need.shm > shm:
            out.append(
                f"ranks {ranks} on {node} need {need.ram / 2**30:.2f} GiB of memory"
                + (f" ({need.shm / 2**30:.2f} GiB in {SHM})" if need.shm else "")
                + f" and have {room / 2**30:.2f} GiB"
                + (f" ({shm / 2**30:.2f} GiB free in {SHM})" if need.shm else "")
            )
    return out


def check(what: str, target: Store | str, total: int, short: dict[str, list[str]]) -> None:
    """Raise on every rank alike when ``target`` would outgrow a node's memory.

    ``short`` maps each of ``NEEDS`` to its ``shortfalls`` (computed once,
    on one rank, and the same everywhere); ``total`` is the bytes gathered.

    Raises:
        InsufficientMemoryError: names the nodes, what they need and what they have.
    """
    found = short[route_of(target)]
    if found:
        raise InsufficientMemoryError(
            f"{what} of {total / 2**30:.2f} GiB over {target} would not fit: "
            f"{'; '.join(found)} (free memory, capped by the memory cgroup; the need counts "
            "what unpickling the parts allocates, not only their bytes). Use "
            "gs.gather_iter (one part in memory at a time), gather less per call, or raise "
            "the job's memory limit"
        )
