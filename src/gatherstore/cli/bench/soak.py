"""``gatherstore bench --soak [N]``: whether small calls stay as fast over a long, mixed job.

One gloo job of W real processes on this machine makes N calls of 1 KiB, each a
random object collective (``gather_object``, ``all_gather_object``, ``gather_iter``,
``broadcast_object``) through a random store of the mix (``auto``, ``collective``,
``tmpdir``, a ``file://`` folder, and Redis and S3 when given), the same sequence on
every rank.  A call's latency is the slowest rank's.  Prints, per store, the median of
its first and of its last 100 calls (or a third of its calls, when fewer) and their
ratio: a job that leaves something running or growing shows as a ratio over 1.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, TextIO

from gatherstore.job.launch import launch

__all__ = ["main", "measure"]

OPS = ("gather_object", "all_gather_object", "gather_iter", "broadcast_object")
WINDOW = 100


def _rank(stores: Sequence[str], calls: int, seed: int) -> list[tuple[str, float]]:
    """One rank (run by ``gs.launch``): (store, seconds) of each call, in order."""
    import numpy as np
    import torch.distributed as dist

    from gatherstore.calls import objects

    obj = np.random.default_rng(dist.get_rank()).integers(0, 256, 1 << 10, dtype=np.uint8)
    ops = {name: getattr(objects, name) for name in OPS}
    order = random.Random(seed)
    out = []
    for _ in range(calls):
        store, name = order.choice(stores), order.choice(OPS)
        dist.barrier()
        began = time.perf_counter()
        got = ops[name](obj, store=store)
        if name == "gather_iter":
            got = list(got)
        out.append((store, time.perf_counter() - began))
    return out


def measure(
    world: int, calls: int, stores: Sequence[str], seed: int = 0
) -> dict[str, tuple[float, float, int]]:
    """``{store: (median of its first calls, median of its last calls, calls)}`` seconds of
    the slowest rank per call, over ``calls`` random calls in one job of ``world``."""
    ranks = launch(
        _rank, nproc_per_node=world, backend="gloo", args=(stores, calls, seed), timeout=1800
    )
    slowest = [(ranks[0][i][0], max(r[i][1] for r in ranks)) for i in range(calls)]
    found = {}
    for store in stores:
        times = [seconds for name, seconds in slowest if name == store]
        window = min(WINDOW, max(len(times) // 3, 1))
        if times:
            first, last = times[:window], times[-window:]
            found[store] = (statistics.median(first), statistics.median(last), len(times))
    return found


def main(
    calls: int = 1000,
    world: int = 3,
    *,
    redis: str | None = None,
    s3: dict[str, Any] | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Print each store's first and last medians and their ratio; 0."""
    with tempfile.TemporaryDirectory(prefix="gatherstore-soak-") as folder:
        stores = ["auto", "collective", "tmpdir", f"file://{folder}"]
        stores += [redis] if redis else []
        out.write(
            f"W = {world} gloo processes on this machine, {calls} random calls of 1 KiB "
            f"({', '.join(OPS)}) over {len(stores)} stores; median of each store's first and "
            f"last {WINDOW} calls (the slowest rank's time per call)\n"
        )
        found = measure(world, calls, stores)
    out.write(f"{'store':<36}{'calls':>7}{'first':>11}{'last':>11}{'last/first':>12}\n")
    for store, (first, last, count) in found.items():
        shown = "file://<temp dir>" if store.startswith("file://") else store
        out.write(
            f"{shown:<36}{count:>7}{first * 1e3:>8.2f} ms{last * 1e3:>8.2f} ms"
            f"{last / first:>11.2f}x\n"
        )
    out.flush()
    return 0
