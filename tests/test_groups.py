"""Any process group: two disjoint groups of 2 in a 4-rank job gathering at once through
tmpdir, Redis and S3, a 2x2 DeviceMesh, ranks outside a group, a member that dies.

Real gloo process groups, real stores; leftovers are checked by listing the real
directories, Redis keys and S3 objects.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import empty_redis_db

import gatherstore as gs
from gatherstore.testing.plugin import S3Endpoint
from gatherstore.testing.services import free_ports

sys.path.insert(0, str(Path(__file__).parent))
import _group_jobs

SRC = str(Path(__file__).resolve().parents[1] / "src")
RESULTS = "gatherstore-results"  # where result sets live in a store (they outlive the job)


def _launch(fn: Any, *args: Any) -> list[Any]:
    return gs.launch(fn, nproc_per_node=4, backend="gloo", args=args, timeout=120)


def _check_every_call(results: list[dict[str, Any]]) -> None:
    """What ``every_call_on_a_group`` must return on each rank of groups {0, 1} and {2, 3}."""
    for rank, out in enumerate(results):
        first = rank - rank % 2
        pair = [(r, 300_000 + r, bytes([r])) for r in (first, first + 1)]
        assert out["all"] == pair
        assert out["group_dst"] == (pair if rank % 2 == 1 else None)
        assert out["dst"] == (pair if rank == first else None)
        assert out["bcast"] == f"from {first + 1}"
        assert out["iter"] == ([first, first + 1] if rank == first else [])
        assert out["collect"] == ([f"item-{i}" for i in range(5)] if rank == first else None)
        group = rank // 2
        assert out["set"] == ([k * 10 + group for k in range(6)] if rank == first else None)
        assert out["reduce"] == 2 * first + 1
        assert out["tensor"] == [first, first + 1]
        assert out["btensor"] == [first + 1]
        assert out["dict"] == {"x": 2 * first + 1.0}
        assert out["rdict"] == {"x": 2 * first + 1.0 if rank == first else float(rank)}
        assert out["rank"] == (rank % 2, 2)
        assert out["at_once"] == [first, first + 1]
    assert results[0]["seed"] == results[1]["seed"] and results[2]["seed"] == results[3]["seed"]


@pytest.mark.timeout(240)
def test_two_groups_gather_at_once_through_tmpdir(tmp_path: Path) -> None:
    base, sets, flags = (tmp_path / name for name in ("tmp", "sets", "flags"))
    for folder in (base, sets, flags):
        folder.mkdir()
    url = f"tmpdir://{base}"
    _check_every_call(
        _launch(_group_jobs.every_call_on_a_group, url, {}, f"file://{sets}", str(flags))
    )
    assert list(base.iterdir()) == []  # each group's area removed
    assert sorted(p.name for p in (sets / RESULTS).iterdir()) == ["set-0", "set-1"]


@pytest.fixture
def redis_db(gatherstore_redis_url: str) -> Iterator[str]:
    """A Redis database of its own (db 10), empty before and after the test."""
    yield from empty_redis_db(gatherstore_redis_url, 10)


@pytest.mark.timeout(240)
def test_two_groups_gather_at_once_through_redis(redis_db: str, tmp_path: Path) -> None:
    import redis

    _check_every_call(
        _launch(_group_jobs.every_call_on_a_group, redis_db, {}, redis_db, str(tmp_path))
    )
    with redis.Redis.from_url(redis_db) as client:
        keys = [k.decode() for k in client.keys("*")]
    assert keys and all(k.startswith(RESULTS) for k in keys), keys  # no job key left


@pytest.mark.timeout(240)
def test_two_groups_gather_at_once_through_s3(gatherstore_s3: S3Endpoint, tmp_path: Path) -> None:
    s3fs = pytest.importorskip("s3fs")
    pytest.importorskip("botocore.session")
    fs = s3fs.S3FileSystem(**gatherstore_s3.storage_options, skip_instance_cache=True)
    bucket = f"gatherstore-groups-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    try:
        url, options = f"s3://{bucket}/job", gatherstore_s3.storage_options
        sets = gs.open_store(f"s3://{bucket}/sets", **options)
        results = _launch(_group_jobs.every_call_on_a_group, url, options, sets, str(tmp_path))
        _check_every_call(results)
        client = gatherstore_s3.client()
        listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
        client.close()
        keys = [item["Key"] for item in listed]
        assert keys and all(k.startswith(f"sets/{RESULTS}/") for k in keys), keys  # no job object
    finally:
        fs.rm(bucket, recursive=True)


@pytest.mark.timeout(240)
def test_device_mesh_dimensions_outsiders_and_refused_arguments(tmp_path: Path) -> None:
    results = _launch(_group_jobs.meshes_and_outsiders, f"file://{tmp_path}")
    for rank, out in enumerate(results):
        tp, dp = divmod(rank, 2)  # mesh rank = tp * 2 + dp: "dp" varies fastest
        dp_group = [tp * 2, tp * 2 + 1]
        assert out["dp"] == (dp_group if dp == 0 else None)
        assert out["tp"] == [dp, dp + 2]
        assert out["local"] == [0, 1, 2, 3]  # one machine
        assert out["subgroups"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert out["outside"] == (None, None, [], "mine", None, 5, -1, -1)
        assert out["untouched"]
        both, not_member, src_outside, not_group = out["errors"]
        assert both.startswith("ValueError") and "give one or the other" in both
        assert not_member.startswith("ValueError") and "is not in the group" in not_member
        assert src_outside.startswith("ValueError") and "group_src=2" in src_outside
        assert not_group.startswith("TypeError") and "not a process group" in not_group
        assert out["after"] == [rank - rank % 2, rank - rank % 2 + 1]


def test_group_arguments_are_checked_in_one_process() -> None:
    with pytest.raises(ValueError, match="give one or the other"):
        gs.gather_object(1, dst=0, group_dst=0)
    with pytest.raises(ValueError, match="group_src=1 is not a rank of this job"):
        gs.broadcast_object(1, group_src=1)
    with pytest.raises(TypeError, match="not a process group"):
        gs.all_gather_object(1, group="dp")
    assert gs.gather_object(1, group_dst=0) == [1]
    assert gs.get_rank(None) == 0 and gs.get_world_size(None) == 1
    assert gs.local_group() is None


# --- a member that dies ---------------------------------------------------------------------


def _dies_in_one_group(out: str, url: str) -> None:
    """One rank of an independent 4-rank job: rank 1 dies after a first gather of its group;
    rank 0 then gathers with it; group {2, 3} goes on gathering meanwhile."""
    import torch.distributed as dist

    gs.init_from_env(backend="gloo")
    rank = gs.get_rank()
    mine, _, _ = _group_jobs.pairs()
    gs.all_gather_object(rank, group=mine, store=url, timeout=30)
    Path(out, f"ready-{rank}").touch()
    outcome: dict[str, Any] = {}
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        start = time.monotonic()
        try:
            gs.all_gather_object(rank, group=mine, store=url, timeout=5)
        except gs.GatherError as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc)}
            outcome["ranks"] = list(getattr(exc, "ranks", []) or [getattr(exc, "rank", None)])
        outcome["after"] = time.monotonic() - start
    else:
        outcome["gathers"] = [
            gs.all_gather_object(i, group=mine, store=url, timeout=30) for i in range(5)
        ]
    Path(out, f"{rank}.json").write_text(json.dumps(outcome))
    gs.shutdown(wait=False)
    del dist


@pytest.mark.timeout(180)
def test_a_member_that_dies_is_named_to_its_group_and_the_other_goes_on(tmp_path: Path) -> None:
    base = tmp_path / "tmp"
    base.mkdir()
    port = free_ports()[0]
    procs = []
    for rank in range(4):
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
        env.update(
            RANK=str(rank),
            WORLD_SIZE="4",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="4",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=os.pathsep.join([SRC, str(Path(__file__).parent)]),
        )
        code = (
            "import sys, test_groups; "
            f"test_groups._dies_in_one_group({str(tmp_path)!r}, {f'tmpdir://{base}'!r})"
        )
        with open(tmp_path / f"stderr-{rank}", "w") as stderr:
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stderr=stderr))
    try:
        for rank in (0, 2, 3):
            assert procs[rank].wait(timeout=120) == 0, (tmp_path / f"stderr-{rank}").read_text()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    outcomes = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 2, 3)}
    assert outcomes[0]["error"] in ("GatherTimeout", "RemoteRankError"), outcomes[0]
    assert outcomes[0]["ranks"] == [1], outcomes[0]
    assert outcomes[0]["after"] < 5 + 20  # the call's timeout, with a margin for a loaded machine
    for rank in (2, 3):
        assert outcomes[rank]["gathers"] == [[i, i] for i in range(5)]
    assert list(base.iterdir()) == []  # each group's area removed by its survivors


@pytest.mark.timeout(180)
def test_two_groups_hand_parts_over_in_chunks_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The threads that hand a part's chunks over work in the call's group."""
    monkeypatch.setenv("GATHERSTORE_PART_CHUNK", str(64 << 10))
    monkeypatch.delenv("GATHERSTORE_TMPDIR", raising=False)
    monkeypatch.delenv("GATHERSTORE_HANDOVER", raising=False)
    results = gs.launch(
        _group_jobs.chunked_on_two_groups, nproc_per_node=4, backend="gloo", timeout=120
    )
    assert [right for right, _ in results] == [True] * 4
    assert all("(handed over) in chunks" in log for _, log in results), results[0][1]
