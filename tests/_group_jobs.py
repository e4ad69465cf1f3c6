"""Functions that tests/test_groups.py runs in every rank of a 4-rank job (gs.launch)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gatherstore as gs


def pairs() -> tuple[Any, Any, Any]:
    """Two disjoint groups of 2 ({0, 1} and {2, 3}): (this rank's, the other, both)."""
    first, second = dist.new_group([0, 1]), dist.new_group([2, 3])
    mine, other = (first, second) if gs.get_rank() < 2 else (second, first)
    return mine, other, (first, second)


def every_call_on_a_group(
    url: str, options: dict[str, Any], sets: str, flags: str
) -> dict[str, Any]:
    """Every collective on this rank's group of 2, through the store ``url``; the two
    groups gather at once.  Returns what each call returned, for the test to check."""
    rank = gs.get_rank()
    mine, _, _ = pairs()
    store = gs.open_store(url, **options)
    out: dict[str, Any] = {}
    part = {"rank": rank, "payload": bytes([rank]) * (300_000 + rank)}

    def summary(got: Any) -> Any:
        if got is None:
            return None
        return [(p["rank"], len(p["payload"]), p["payload"][:1]) for p in got]

    out["all"] = summary(gs.all_gather_object(part, group=mine, store=store, timeout=60))
    out["group_dst"] = summary(gs.gather_object(part, group=mine, group_dst=1, store=store))
    out["dst"] = summary(gs.gather_object(part, dst=rank - rank % 2, group=mine, store=store))
    out["bcast"] = gs.broadcast_object(f"from {rank}", group=mine, group_src=1, store=store)
    out["iter"] = [p["rank"] for p in gs.gather_iter(part, group=mine, store=store, timeout=60)]
    shard = [f"item-{i}" for i in range(rank % 2, 5, 2)]
    out["collect"] = gs.collect_results(shard, size=5, group=mine, store=store, timeout=60)
    with gs.ResultSet(f"set-{rank // 2}", store=sets, group=mine, timeout=60) as rs:
        for key in range(rank % 2, 6, 2):
            rs.add(key, key * 10 + rank // 2)
        out["set"] = rs.gather(timeout=60)
    out["reduce"] = gs.all_reduce(rank, group=mine)
    out["tensor"] = gs.all_gather_tensor(torch.tensor([rank]), group=mine).tolist()
    out["btensor"] = gs.broadcast_tensor(torch.tensor([rank]), group=mine, group_src=1).tolist()
    out["dict"] = gs.all_reduce_dict({"x": float(rank)}, "sum", group=mine)
    out["rdict"] = gs.reduce_dict({"x": float(rank)}, average=False, group=mine)
    gs.barrier(group=mine, timeout=30)
    out["seed"] = gs.shared_random_seed(group=mine)
    out["rank"] = (gs.get_rank(mine), gs.get_world_size(mine))
    # no serialisation of one group behind the other: rank 3 enters its group's gather
    # only once group {0, 1} finished one of its own, while rank 2 waits in it already
    if rank == 3:
        while not Path(flags, "first-done").exists():
            time.sleep(0.01)
    got = gs.all_gather_object(rank, group=mine, store=store, timeout=60)
    if rank == 0:
        Path(flags, "first-done").touch()
    out["at_once"] = got
    return out


def meshes_and_outsiders(url: str) -> dict[str, Any]:
    """A 2x2 DeviceMesh (tp x dp) gathered over each dimension in turn, the ranks outside a
    group, and the arguments refused on a group."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = gs.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    out: dict[str, Any] = {}
    out["dp"] = gs.gather_object(rank, group=mesh.get_group("dp"), store=url, timeout=60)
    out["tp"] = gs.all_gather_object(rank, group=mesh.get_group("tp"), store=url, timeout=60)
    out["local"] = gs.all_gather_object(rank, group=gs.local_group(), timeout=60)
    subgroup, _ = dist.new_subgroups(group_size=2)
    out["subgroups"] = gs.all_gather_object(rank, group=subgroup, store=url, timeout=60)
    mine, other, _ = pairs()
    # a folder of this rank's own: the other ranks' groups keep their areas in ``url``
    folder = Path(url.removeprefix("file://"), f"outside-{rank}")
    folder.mkdir()
    apart = f"file://{folder}"
    out["outside"] = (
        gs.all_gather_object(rank, group=other, store=apart),
        gs.gather_object(rank, group=other, store=apart),
        list(gs.gather_iter(rank, group=other, store=apart)),
        gs.broadcast_object("mine", group=other, store=apart),
        gs.collect_results([rank], group=other, store=apart),
        gs.all_reduce(5, group=other),
        gs.get_rank(other),
        gs.get_world_size(other),
    )
    out["untouched"] = os.listdir(folder) == []
    out["errors"] = []
    for call in (
        lambda: gs.gather_object(rank, dst=0, group_dst=0, group=mine),
        lambda: gs.gather_object(rank, dst=2 if rank < 2 else 0, group=mine),
        lambda: gs.broadcast_object(rank, group_src=2, group=mine),
        lambda: gs.all_gather_object(rank, group="dp"),
    ):
        try:
            call()
            out["errors"].append(None)
        except (ValueError, TypeError) as exc:
            out["errors"].append(f"{type(exc).__name__}: {exc}")
    out["after"] = gs.all_gather_object(rank, group=mine, store=url, timeout=60)
    return out


def chunked_on_two_groups() -> tuple[bool, str]:
    """Each group of 2 gathers a list of records to its first rank, handed over in chunks
    (``GATHERSTORE_PART_CHUNK`` small), both groups at once; (right, the log)."""
    import io
    import logging

    import numpy as np

    rank = gs.get_rank()
    mine, _, _ = pairs()
    first = rank - rank % 2

    def records(r: int) -> list[dict[str, Any]]:
        return [{"id": i, "x": np.full(256, r * 10_000 + i, np.float32)} for i in range(1500)]

    stream = io.StringIO()
    logger = logging.getLogger("gatherstore")
    logger.addHandler(logging.StreamHandler(stream))
    logger.setLevel(logging.DEBUG)
    got = gs.gather_object(records(rank), group=mine, store="tmpdir", timeout=60)
    right = (
        got is None
        if rank != first
        else all(
            all(
                a["id"] == b["id"] and np.array_equal(a["x"], b["x"])
                for a, b in zip(g, records(r), strict=True)
            )
            for g, r in zip(got, (first, first + 1), strict=True)
        )
    )
    return right, stream.getvalue()
