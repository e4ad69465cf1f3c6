"""``gatherstore bench --latency [WORLDS]``: the per-call latency of small gathers.

One gloo job of W real processes on this machine (``gs.launch``,
``nproc_per_node=W``), every rank holding ``size`` random bytes (a numpy array).
For each size, every operation is called ``warmup`` times, then ``calls`` times,
the operations taking turns call by call (so that the machine's load falls on
each alike).  A barrier precedes every call; each rank times its own call, and
the call's latency is the slowest rank's time.  Prints the median and the 90th
percentile per operation and size: gatherstore's ``gather_object`` and
``all_gather_object`` (default store, ``auto``) next to torch.distributed's.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from gatherstore.cli.bench.measure import format_bytes
from gatherstore.job.launch import launch

__all__ = ["OPS", "SIZES", "main", "measure"]

OPS = (
    "gs.gather_object",
    "torch.gather_object",
    "gs.all_gather_object",
    "torch.all_gather_object",
)
SIZES = (1 << 10, 1 << 20)


def _operations() -> dict[str, Callable[[Any], Any]]:
    from gatherstore.calls import objects
    from gatherstore.cli.bench import baselines

    return {
        "gs.gather_object": objects.gather_object,
        "torch.gather_object": baselines.torch_gather_object,
        "gs.all_gather_object": objects.all_gather_object,
        "torch.all_gather_object": baselines.torch_all_gather_object,
    }


def _rank(sizes: Sequence[int], warmup: int, calls: int) -> dict[str, list[float]]:
    """One rank (run by ``gs.launch``): its seconds per call, keyed ``"op size"``."""
    import numpy as np
    import torch.distributed as dist

    from gatherstore.job import topology

    rank, world = topology.get_rank(), topology.get_world_size()
    ops = _operations()
    times: dict[str, list[float]] = {}
    for size in sizes:
        obj = np.random.default_rng(rank).integers(0, 256, size, dtype=np.uint8)
        for step in range(warmup + calls):
            for name in OPS:
                dist.barrier()
                began = time.perf_counter()
                out = ops[name](obj)
                seconds = time.perf_counter() - began
                if out is not None and [len(o) for o in out] != [size] * world:
                    raise RuntimeError(f"{name}: rank {rank} got a wrong result")
                if step >= warmup:
                    times.setdefault(f"{name} {size}", []).append(seconds)
    return times


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def measure(
    world: int, sizes: Sequence[int] = SIZES, *, warmup: int = 3, calls: int = 20
) -> dict[str, tuple[float, float]]:
    """``{"op size": (median, p90)}`` seconds of the slowest rank per call, in one job
    of ``world`` processes.

    Raises:
        RemoteRankError: a rank failed (e.g. a wrong result).
    """
    ranks = launch(
        _rank, nproc_per_node=world, backend="gloo", args=(sizes, warmup, calls), timeout=900
    )
    found = {}
    for key in ranks[0]:
        slowest = [max(r[key][i] for r in ranks) for i in range(calls)]
        found[key] = (statistics.median(slowest), _p90(slowest))
    return found


def main(
    worlds: Sequence[int] = (32,),
    sizes: Sequence[int] = SIZES,
    *,
    warmup: int = 3,
    calls: int = 20,
    out: TextIO = sys.stdout,
) -> int:
    """Print each operation's median and p90 latency per world size and size; 0."""
    for world in worlds:
        out.write(
            f"W = {world} gloo processes on this machine, median / p90 of {calls} calls "
            f"after {warmup} (the slowest rank's time per call)\n"
        )
        found = measure(world, sizes, warmup=warmup, calls=calls)
        out.write(f"{'operation':<26}" + "".join(f"{format_bytes(s):>22}" for s in sizes) + "\n")
        for name in OPS:
            cells = [found[f"{name} {size}"] for size in sizes]
            row = "".join(f"{m * 1e3:>11.1f} / {p * 1e3:>6.1f} ms" for m, p in cells)
            out.write(f"{name:<26}{row}\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
