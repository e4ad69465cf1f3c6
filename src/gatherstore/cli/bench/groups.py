"""``gatherstore bench --group-size N``: gathers on disjoint process groups.

With ``--world W``, one job of W processes (``gs.launch``) splits into W/N groups of N
consecutive ranks (``dist.new_subgroups``), each rank holding its group-rank's share
of ``size`` (the total a group gathers, as ``--sizes`` is the total a gather moves in
the default bench).  Every round, its ranks take turns at four calls, in an order
that alternates round by round:

- gatherstore's ``all_gather_object(obj, group=g)``, every group at once;
- torch's ``all_gather_object`` on the same groups, every group at once;
- gatherstore's and torch's again, one group at a time (the others wait at a
  barrier), so that as many processes work as in a job of N.

The other phase is a job of N processes (its default group), which gathers the same
parts with gatherstore's and torch's ``all_gather_object``, in turn: that is the
gather a group's is compared with.  The two phases take turns, ``PHASES`` times each,
the rounds shared between them, so that a shared machine's changing load falls on
both alike.  A barrier precedes each call, a call's time is its slowest rank's, times
are medians over every round; peak RSS growth is the largest of any rank in any round
(``PeakMemory``).
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch.distributed as dist

from gatherstore._errors import GatherError
from gatherstore.calls import objects
from gatherstore.cli.bench import baselines, payloads
from gatherstore.cli.bench.measure import PeakMemory, format_bytes
from gatherstore.job.launch import launch

__all__ = [
    "ALONE",
    "AT_ONCE",
    "DEFAULT",
    "PHASES",
    "TORCH",
    "TORCH_ALONE",
    "TORCH_DEFAULT",
    "check",
    "main",
    "measure",
]

#: The calls measured: on the groups of the W-process job, and on the default group of N.
AT_ONCE = "gs.all_gather_object(group=g), every group at once"
TORCH = "torch.all_gather_object(group=g), every group at once"
ALONE = "gs.all_gather_object(group=g), one group at a time"
TORCH_ALONE = "torch.all_gather_object(group=g), one group at a time"
DEFAULT = "gs.all_gather_object, default group of N"
TORCH_DEFAULT = "torch.all_gather_object, default group of N"
#: How many times each phase (the job split into groups, the job of N) runs.
PHASES = 3
_WARMUP_BYTES = 1 << 16
#: A call on this rank: the seconds of its own gather (the payload bound in).
Timed = Callable[[Any], float]


def check(worlds: Sequence[int], group_size: int) -> None:
    """Refuse a ``--group-size`` that does not split every ``--world`` into several groups.

    Raises:
        ValueError: names the world and the fix.
    """
    if group_size < 2:
        raise ValueError(f"--group-size {group_size}: a group needs at least 2 ranks")
    for world in worlds:
        if world <= group_size or world % group_size:
            raise ValueError(
                f"--group-size {group_size} does not split --world {world} into several "
                f"groups: give --world a multiple of {group_size} above it, "
                f"e.g. --world {2 * group_size}"
            )


class _Routes(logging.Handler):
    """The routes of the gatherstore calls this rank makes (from their DEBUG line)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if "gatherstore_phases" in record.__dict__ and isinstance(record.args, tuple):
            self.seen.add(str(record.args[1]))


def _gather(call: Callable[[Any], list[Any] | None], size: int) -> Timed:
    """``call(obj)`` timed on this rank, its result checked (``size`` parts)."""

    def timed(obj: Any) -> float:
        started = time.perf_counter()
        out = call(obj)
        seconds = time.perf_counter() - started
        if out is None or len(out) != size:
            raise GatherError(f"a gather returned {out and len(out)} parts, expected {size}")
        return seconds

    return timed


def _in_turn(gather: Timed, index: int, groups: int) -> Timed:
    """``gather`` by one group at a time, the others waiting (also once their turn is
    over: nothing of theirs runs beside a gather): this rank's own time."""

    def timed(obj: Any) -> float:
        seconds = 0.0
        for turn in range(groups):
            dist.barrier()
            if turn == index:
                seconds = gather(obj)
        dist.barrier()
        return seconds

    return timed


def _rounds(calls: dict[str, Timed], obj: Any, warm: Any, rounds: int) -> dict[str, Any]:
    """Each call warmed up once, then ``rounds`` times in an order alternating by round:
    this rank's seconds, peak RSS growth and gatherstore's routes per call."""
    for call in calls.values():
        call(warm)
    found: dict[str, dict[str, Any]] = {
        name: {"times": [], "peaks": [], "routes": set()} for name in calls
    }
    routes = _Routes()
    logger = logging.getLogger("gatherstore")
    level = logger.level
    logger.setLevel(logging.DEBUG)  # no handler prints DEBUG in a bench process
    logger.addHandler(routes)
    try:
        for i in range(rounds):
            for name in list(calls) if i % 2 == 0 else list(calls)[::-1]:
                gc.collect()
                dist.barrier()
                routes.seen.clear()
                with PeakMemory() as mem:
                    found[name]["times"].append(calls[name](obj))
                found[name]["peaks"].append(mem.growth)
                found[name]["routes"].update(routes.seen)
    finally:
        logger.removeHandler(routes)
        logger.setLevel(level)
    return found


def _split_rank(kind: str, nbytes: int, group_size: int, rounds: int, timeout: float) -> Any:
    """One rank of the job of W processes split into groups of ``group_size``."""
    group, _ = dist.new_subgroups(group_size)  # type: ignore[no-untyped-call]
    index, groups = dist.get_rank() // group_size, dist.get_world_size() // group_size
    gs = _gather(lambda o: objects.all_gather_object(o, group=group, timeout=timeout), group_size)
    theirs = _gather(lambda o: baselines.torch_all_gather_object(o, group), group_size)
    calls = {
        AT_ONCE: gs,
        TORCH: theirs,
        ALONE: _in_turn(gs, index, groups),
        TORCH_ALONE: _in_turn(theirs, index, groups),
    }
    rank = dist.get_rank(group)
    obj = payloads.make(kind, nbytes, rank, group_size)
    warm = payloads.make(kind, _WARMUP_BYTES, rank, group_size)
    return _rounds(calls, obj, warm, rounds)


def _default_rank(kind: str, nbytes: int, rounds: int, timeout: float) -> Any:
    """One rank of the job of N processes, gathering the same parts on its default group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    calls = {
        DEFAULT: _gather(lambda o: objects.all_gather_object(o, timeout=timeout), world),
        TORCH_DEFAULT: _gather(baselines.torch_all_gather_object, world),
    }
    obj = payloads.make(kind, nbytes, rank, world)
    return _rounds(calls, obj, payloads.make(kind, _WARMUP_BYTES, rank, world), rounds)


def _slowest(ranks: list[dict[str, Any]], name: str) -> list[float]:
    """The slowest rank's seconds of each round of the call ``name`` in one job."""
    rounds = len(ranks[0][name]["times"])
    return [max(r[name]["times"][i] for r in ranks) for i in range(rounds)]


def _summarise(jobs: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per call of ``jobs`` (the ranks' returns of each launch of one phase): the median
    over every round of the slowest rank's seconds, the largest peak RSS growth of any
    rank, and gatherstore's routes."""
    out = {}
    for name in jobs[0][0]:
        ranks = [r[name] for job in jobs for r in job]
        out[name] = {
            "seconds": statistics.median(t for job in jobs for t in _slowest(job, name)),
            "peak": max(max(r["peaks"]) for r in ranks),
            "routes": sorted({route for r in ranks for route in r["routes"]}),
        }
    return out


def measure(
    world: int, group_size: int, kind: str, nbytes: int, rounds: int, timeout: float
) -> dict[str, dict[str, Any]]:
    """Both phases, taking turns (the job of ``world`` split into groups, then the job of
    ``group_size``) over ``rounds`` in all; each call's ``seconds``, ``peak`` and
    ``routes``.

    Raises:
        RemoteRankError: a rank failed (e.g. a wrong result).
    """
    turns = min(PHASES, rounds)
    split: list[list[Any]] = []
    alone: list[list[Any]] = []
    for turn in range(turns):
        share = rounds // turns + (turn < rounds % turns)
        split.append(
            launch(
                _split_rank,
                nproc_per_node=world,
                backend="gloo",
                args=(kind, nbytes, group_size, share, timeout),
                timeout=timeout,
            )
        )
        alone.append(
            launch(
                _default_rank,
                nproc_per_node=group_size,
                backend="gloo",
                args=(kind, nbytes, share, timeout),
                timeout=timeout,
            )
        )
    return {**_summarise(split), **_summarise(alone)}


def _ratio(found: dict[str, dict[str, Any]], top: str, bottom: str, figure: str) -> float:
    """``top``'s ``figure`` over ``bottom``'s (nan where ``bottom``'s is 0)."""
    below = found[bottom][figure]
    return found[top][figure] / below if below else math.nan


def _report(found: dict[str, dict[str, Any]], group_size: int, out: TextIO) -> None:
    """The table of every call, then the comparisons the groups are held to: with torch
    on the same groups, and with a default group of the same size."""
    out.write("| call | time s | peak RSS growth per rank | gatherstore's route |\n")
    out.write("| --- | ---: | ---: | --- |\n")
    for name, figures in found.items():
        routes = ", ".join(figures["routes"]) or "-"
        label = name.replace("group of N", f"group of {group_size}")
        peak = format_bytes(figures["peak"])
        out.write(f"| {label} | {figures['seconds']:.3f} | {peak} | {routes} |\n")
    default = f"default group of {group_size}"
    lines = [
        ("gs / torch on the same groups, every group at once", AT_ONCE, TORCH, "seconds"),
        ("gs / torch on the same groups, one group at a time", ALONE, TORCH_ALONE, "seconds"),
        (f"gs / torch on a {default}", DEFAULT, TORCH_DEFAULT, "seconds"),
        (f"group / {default}, one group at a time", ALONE, DEFAULT, "seconds"),
        (f"group / {default}, every group at once", AT_ONCE, DEFAULT, "seconds"),
        (f"peak RSS, group / {default}", AT_ONCE, DEFAULT, "peak"),
    ]
    for label, top, bottom, figure in lines:
        out.write(f"{label}: {_ratio(found, top, bottom, figure):.2f}x\n")


def main(
    worlds: Sequence[int],
    group_size: int,
    sizes: Sequence[tuple[str, int]],
    kinds: Sequence[str],
    rounds: int,
    timeout: float,
    out: TextIO = sys.stdout,
) -> int:
    """Measure and print each world, size and payload; 0.

    Raises:
        ValueError: ``group_size`` does not split a world (see ``check``).
    """
    check(worlds, group_size)
    for world in worlds:
        for label, nbytes in sizes:
            for kind in kinds:
                out.write(
                    f"W = {world} gloo processes in {world // group_size} groups of "
                    f"{group_size} (dist.new_subgroups), taking turns with a job of "
                    f"{group_size} ({min(PHASES, rounds)} launches each); {kind}, {label} a "
                    f"group ({format_bytes(nbytes / group_size)} per rank); median of "
                    f"{rounds} rounds, the slowest rank's time per call\n"
                )
                found = measure(world, group_size, kind, nbytes, rounds, timeout)
                _report(found, group_size, out)
                out.flush()
    return 0
