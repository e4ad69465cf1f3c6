"""Functions that tests run in other processes (this module imports no client library)."""

from __future__ import annotations

from typing import Any


def object_collectives_job(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Run in every rank (e.g. with ``gs.launch``): every object collective over ``url``.

    The last rank's object cannot be pickled in one call; pass the results of
    all ranks to :func:`check_object_collectives`.
    """
    import threading

    import numpy as np

    import gatherstore as gs

    store = gs.open_store(url, **options)
    rank, world = gs.get_rank(), gs.get_world_size()
    obj = {"rank": rank, "array": np.full(50_000 * (rank + 1), rank, dtype=np.int64)}
    out: dict[str, Any] = {}
    everyone = gs.all_gather_object(obj, store=store, timeout=60)
    out["all"] = [(o["rank"], int(o["array"].sum()), len(o["array"])) for o in everyone]
    gathered = gs.gather_object(obj, dst=world - 1, store=store, timeout=60)
    out["gather"] = None if gathered is None else [o["rank"] for o in gathered]
    out["iter"] = [o["rank"] for o in gs.gather_iter(obj, store=store, timeout=60)]
    out["bcast"] = gs.broadcast_object({"from": 1} if rank == 1 else None, src=1, store=store)
    results = [f"item-{i}" for i in range(rank, 10, world)]
    out["collect"] = gs.collect_results(results, size=10, store=store, timeout=60)
    unpicklable = threading.Lock() if rank == world - 1 else rank
    try:
        gs.all_gather_object(unpicklable, store=store, timeout=60)
        out["failure"] = None
    except Exception as exc:
        out["failure"] = type(exc).__name__
    out["after_failure"] = gs.all_gather_object(rank, store=store, timeout=60)
    return out


def check_object_collectives(results: list[dict[str, Any]]) -> None:
    """Assert what :func:`object_collectives_job` must return on every rank."""
    world = len(results)
    expected_all = [(r, 50_000 * (r + 1) * r, 50_000 * (r + 1)) for r in range(world)]
    for rank, out in enumerate(results):
        assert out["all"] == expected_all
        assert out["gather"] == (list(range(world)) if rank == world - 1 else None)
        assert out["iter"] == (list(range(world)) if rank == 0 else [])
        assert out["bcast"] == {"from": 1}
        assert out["collect"] == ([f"item-{i}" for i in range(10)] if rank == 0 else None)
        assert out["failure"] == ("TypeError" if rank == world - 1 else "RemoteRankError")
        assert out["after_failure"] == list(range(world))


def wait_between_gathers(urls: list[str], flags: str) -> str:
    """Run in every rank: a gather through each store, ``ready-<rank>`` (the PID) in
    ``flags``, then, once ``flags/go`` exists, another gather through each store."""
    import os
    import time
    from pathlib import Path

    import gatherstore as gs

    rank, world = gs.get_rank(), gs.get_world_size()
    stores = [gs.open_store(url) for url in urls]
    for store in stores:
        assert gs.all_gather_object(rank, store=store, timeout=60) == list(range(world))
    Path(flags, f"ready-{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 300
    while not Path(flags, "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("no go within 300 s")
        time.sleep(0.05)
    for store in stores:
        assert gs.all_gather_object(rank + 10, store=store, timeout=60) == [
            r + 10 for r in range(world)
        ]
    return "done"
