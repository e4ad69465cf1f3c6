"""Two threads of every rank calling gatherstore at once: calls are serialised per
process, a thread never receives another thread's data, and the job goes on."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import gatherstore as gs


def _two_threads(route: str, rounds: int) -> dict[str, Any]:
    rank, world = gs.get_rank(), gs.get_world_size()
    seen: dict[str, Any] = {"ok": 0, "mismatch": 0, "wrong": [], "other": []}

    def worker(tag: str) -> None:
        for i in range(rounds):
            mine = {"tag": tag, "rank": rank, "round": i, "pad": bytes(50_000 * (i % 3))}
            try:
                if i % 2:
                    got = gs.all_gather_object(mine, store=route, timeout=60)
                else:
                    got = gs.gather_object(mine, store=route, timeout=60) or [
                        {"tag": tag, "rank": r}
                        for r in range(world)  # a sender: None
                    ]
            except gs.MismatchError:
                seen["mismatch"] += 1
                continue
            except Exception as exc:
                seen["other"].append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            if [g["tag"] for g in got] != [tag] * world or [g["rank"] for g in got] != list(
                range(world)
            ):
                seen["wrong"].append([(g["tag"], g["rank"]) for g in got])
            else:
                seen["ok"] += 1

    threads = [threading.Thread(target=worker, args=(t,), name=f"evaluator-{t}") for t in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seen["after"] = gs.all_gather_object(rank, store=route, timeout=60)
    return seen


@pytest.mark.timeout(240)
@pytest.mark.parametrize("route", ["collective", "tmpdir", "auto"])
def test_two_threads_per_rank_never_swap_data(route: str, tmp_path: Path) -> None:
    spec = f"tmpdir://{tmp_path}" if route == "tmpdir" else route
    results = gs.launch(_two_threads, nproc_per_node=3, backend="gloo", args=(spec, 8))
    for rank, seen in enumerate(results):
        assert seen["wrong"] == [], (rank, seen["wrong"])
        assert seen["other"] == [], (rank, seen["other"])
        assert seen["ok"] + seen["mismatch"] == 16
        assert seen["after"] == [0, 1, 2]
    # every call either paired with the same thread's call everywhere or failed everywhere
    assert len({seen["ok"] for seen in results}) == 1
    assert list(tmp_path.iterdir()) == []
