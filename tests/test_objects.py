"""Object collectives in real gloo groups, over every route and local store."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gatherstore as gs

SPECS = ["auto", "collective", "tmpdir", "file"]


def _spec(name: str, tmp_path: Path) -> str:
    return f"file://{tmp_path}/shared" if name == "file" else name


def _leftovers(path: Path) -> list[str]:
    return [str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()]


def test_serial_answers() -> None:
    obj = {"a": np.arange(3)}
    assert gs.all_gather_object(obj) == [obj]
    assert gs.gather_object(obj) == [obj]
    assert list(gs.gather_iter(obj)) == [obj]
    assert gs.broadcast_object(obj) is obj
    assert gs.collect_results([1, None, 3], size=2) == [1, None]
    assert gs.collect_results(["b", "a"], indices=[1, 0]) == ["a", "b"]
    with pytest.raises(ValueError, match="dst=1"):
        gs.gather_object(obj, dst=1)


def _round_trip(spec: str) -> dict[str, Any]:
    rank = gs.get_rank()
    world = gs.get_world_size()
    obj = {
        "rank": rank,
        "array": np.full((rank + 1, 3), rank, dtype=np.float32),
        "tensor": torch.arange(50_000) * rank,
        "none": None,
        "text": "x" * rank,
    }
    out: dict[str, Any] = {}
    everyone = gs.all_gather_object(obj, store=spec)
    out["all"] = [(o["rank"], o["array"].shape, int(o["tensor"][-1]), o["none"]) for o in everyone]
    gathered = gs.gather_object(obj, dst=world - 1, store=spec)
    out["gather"] = None if gathered is None else [o["rank"] for o in gathered]
    out["iter"] = [o["text"] for o in gs.gather_iter(obj, store=spec)]
    out["bcast"] = gs.broadcast_object({"from": rank} if rank == 1 else None, src=1, store=spec)
    # back-to-back and interleaved calls on two routes never collide
    a = gs.all_gather_object(rank, store=spec)
    b = gs.all_gather_object(-rank, store="collective")
    c = gs.all_gather_object(rank * 10, store=spec)
    out["interleaved"] = (a, b, c)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", SPECS)
def test_round_trip_in_rank_order(name: str, tmp_path: Path) -> None:
    spec = _spec(name, tmp_path)
    results = gs.launch(_round_trip, nproc_per_node=3, backend="gloo", args=(spec,))
    for rank, out in enumerate(results):
        assert out["all"] == [(r, (r + 1, 3), 49_999 * r, None) for r in range(3)]
        assert out["gather"] == ([0, 1, 2] if rank == 2 else None)
        assert out["iter"] == (["", "x", "xx"] if rank == 0 else [])
        assert out["bcast"] == {"from": 1}
        assert out["interleaved"] == ([0, 1, 2], [0, -1, -2], [0, 10, 20])
    if name == "file":
        assert (tmp_path / "shared").is_dir(), "the user's directory is never removed"
        assert _leftovers(tmp_path) == []


def _tmpdir_job(base: str) -> list[str]:
    gs.gather_object(np.zeros(1000) + gs.get_rank(), store=f"tmpdir://{base}")
    return sorted(os.listdir(base))


@pytest.mark.timeout(120)
def test_tmpdir_job_directory_is_private_and_removed(tmp_path: Path) -> None:
    during = gs.launch(_tmpdir_job, nproc_per_node=2, backend="gloo", args=(str(tmp_path),))
    assert len(during[0]) == 1 and during[0][0].startswith("gatherstore-")
    assert list(tmp_path.iterdir()) == [], "the job directory is gone when the job ends"


def _check_mode(base: str) -> int:
    gs.all_gather_object(1, store=f"tmpdir://{base}")
    (job,) = os.listdir(base)
    return os.stat(os.path.join(base, job)).st_mode & 0o777


@pytest.mark.timeout(120)
def test_tmpdir_job_directory_mode(tmp_path: Path) -> None:
    assert gs.launch(_check_mode, nproc_per_node=2, backend="gloo", args=(str(tmp_path),)) == [
        0o700,
        0o700,
    ]


def _fails_on_rank(spec: str, bad: int) -> tuple[str, int, str]:
    obj: Any = threading.Lock() if gs.get_rank() == bad else [1, 2, 3]
    try:
        gs.all_gather_object(obj, store=spec)
    except gs.RemoteRankError as exc:
        return type(exc).__name__, exc.rank, exc.remote_message
    except TypeError as exc:  # the failing rank raises its own error
        return type(exc).__name__, gs.get_rank(), str(exc)
    return "no error", -1, ""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", SPECS)
def test_remote_rank_error_on_every_rank(name: str, tmp_path: Path) -> None:
    spec = _spec(name, tmp_path)
    results = gs.launch(_fails_on_rank, nproc_per_node=3, backend="gloo", args=(spec, 2))
    for rank, (kind, failing, message) in enumerate(results):
        assert failing == 2
        assert "lock" in message.lower()
        assert kind == ("TypeError" if rank == 2 else "RemoteRankError")
    if name == "file":
        assert _leftovers(tmp_path) == []


def _deep_culprit() -> list[str]:
    rank = gs.get_rank()
    obj = {"results": [1, 2, {"mask": threading.Lock() if rank == 1 else 0}]}
    said = []
    for call in (gs.all_gather_object, gs.gather_object):
        try:
            call(obj, timeout=60)
            said.append("no error")
        except gs.RemoteRankError as exc:
            said.append(f"{exc.rank}: {exc.remote_message}")
        except TypeError as exc:  # the failing rank raises its own error
            said.append(f"{rank}: TypeError: {exc}")
    return said


@pytest.mark.timeout(120)
def test_every_rank_s_error_names_where_the_culprit_is() -> None:
    for said in gs.launch(_deep_culprit, nproc_per_node=2, backend="gloo"):
        for message in said:
            assert message.startswith("1: TypeError: cannot pickle '_thread.lock' object — at ")
            assert "obj['results'][2]['mask']: a <class '_thread.lock'>" in message


def _late_rank(spec: str, signals: str) -> tuple[str, list[int]]:
    gs.barrier()  # start together, so that only rank 1 can be late
    deadline = time.monotonic() + 100
    while gs.get_rank() == 1 and time.monotonic() < deadline:  # arrive once the others gave up
        if Path(signals, "0").exists() and Path(signals, "2").exists():
            break
        time.sleep(0.05)
    try:
        gs.gather_object(gs.get_rank(), store=spec, timeout=4)
    except gs.GatherTimeout as exc:
        return "GatherTimeout", exc.ranks
    finally:
        Path(signals, str(gs.get_rank())).touch()
    return "no error", []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["auto", "tmpdir"])
def test_gather_timeout_names_late_ranks(name: str, tmp_path: Path) -> None:
    results = gs.launch(_late_rank, nproc_per_node=3, backend="gloo", args=(name, str(tmp_path)))
    assert results == [("GatherTimeout", [1])] * 3


def _memory_store() -> str:
    try:
        gs.all_gather_object(gs.get_rank(), store="memory://gatherstore-test")
    except gs.StoreNotSharedError as exc:
        return f"{exc.ranks}|{exc.store}|{exc}"
    return "no error"


@pytest.mark.timeout(120)
def test_memory_store_across_processes_is_not_shared() -> None:
    results = gs.launch(_memory_store, nproc_per_node=3, backend="gloo")
    for text in results:
        ranks, store, message = text.split("|", 2)
        assert ranks == "[1, 2]"
        assert store.startswith("memory://")
        assert "redis://" in message and "file:///" in message
        assert re.search(r"\(rank 1: no job marker within \d+ s; rank 2: no job marker", message)


def _collect(spec: str) -> dict[str, Any]:
    rank, world = gs.get_rank(), gs.get_world_size()
    size = 10
    # DistributedSampler: pads 10 to 12, rank r holds r, r+3, r+6, r+9 (index 10, 11 are 0, 1)
    mine = [i % size for i in range(rank, 12, world)]
    results = [None if i == 4 else f"r{i}" for i in mine]
    out: dict[str, Any] = {}
    out["interleaved"] = gs.collect_results(results, size, store=spec)
    per = [list(range(0, 4)), list(range(4, 8)), list(range(8, 10))][rank]
    out["contiguous"] = gs.collect_results(per, size, order="contiguous", store=spec)
    out["indices"] = gs.collect_results(results, indices=mine, store=spec)
    try:
        gs.collect_results(["x"], size=5, indices=[rank], store=spec)
    except ValueError as exc:
        out["missing"] = str(exc)
    try:
        gs.collect_results([1, 2], indices=[0] if rank == 1 else [0, 1], store=spec)
    except (gs.RemoteRankError, ValueError) as exc:
        out["bad_args"] = type(exc).__name__
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["collective", "tmpdir"])
def test_collect_results_order_and_truncation(name: str) -> None:
    results = gs.launch(_collect, nproc_per_node=3, backend="gloo", args=(name,))
    expected = [None if i == 4 else f"r{i}" for i in range(10)]
    assert results[0]["interleaved"] == expected
    assert results[0]["contiguous"] == list(range(10))
    assert results[0]["indices"] == expected
    assert "3, 4" in results[0]["missing"]
    for rank, out in enumerate(results):
        assert out["bad_args"] == ("ValueError" if rank == 1 else "RemoteRankError")
        if rank:
            assert out["interleaved"] is None and out["contiguous"] is None


def _peak_growth(part_mb: int) -> dict[str, float]:
    """Peak RSS growth (VmHWM after a reset) of one 4 x part_mb gather, in MB."""
    part = {f"a{i}": np.random.default_rng(i).random(part_mb * 2**17 // 10) for i in range(10)}
    nbytes = sum(a.nbytes for a in part.values()) / 2**20
    gs.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    checksum = 0.0
    for other in gs.gather_iter(part, store="tmpdir"):
        checksum += float(sum(a[-1] for a in other.values()))
        del other
    growth = _status("VmHWM") - before
    gs.barrier()
    return {"growth": growth, "part": nbytes, "checksum": checksum}


@pytest.mark.timeout(300)
def test_peak_memory_of_a_4_by_100mb_gather() -> None:
    results = gs.launch(_peak_growth, nproc_per_node=4, backend="gloo", args=(100,))
    dst, others = results[0], results[1:]
    print("4 x 100 MB gather_iter, peak RSS growth (MB):", results)
    assert dst["checksum"] != 0
    assert dst["growth"] < 1.5 * dst["part"], dst  # one part at a time, not the one before
    for out in others:
        assert out["growth"] < 1.5 * out["part"], out


def _detections_peak(part_mb: int) -> dict[str, float]:
    """Peak RSS growth of gathering detection-style records on rank 0, in MB."""
    rank = gs.get_rank()
    rng = np.random.default_rng(rank)
    count = part_mb * 2**20 // 2800
    preds = [
        {
            "image_id": i * 4 + rank,
            "boxes": rng.random((100, 4), dtype=np.float32),
            "scores": rng.random(100, dtype=np.float32),
            "labels": rng.integers(0, 80, 100),
            "file_name": f"{i * 4 + rank:012d}.jpg",
        }
        for i in range(count)
    ]
    nbytes = sum(p["boxes"].nbytes + p["scores"].nbytes + p["labels"].nbytes for p in preds)
    gs.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    gathered = gs.gather_object(preds, store="tmpdir")
    growth = _status("VmHWM") - before
    received = 0.0
    if gathered is not None:
        assert [p[0]["image_id"] for p in gathered] == [0, 1, 2, 3]
        received = sum(
            p["boxes"].nbytes + p["scores"].nbytes + p["labels"].nbytes
            for part in gathered[1:]
            for p in part
        )
    gs.barrier()
    return {"growth": growth, "part": nbytes / 2**20, "received": received / 2**20}


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise AssertionError(field)


@pytest.mark.timeout(300)
def test_peak_memory_of_a_records_gather() -> None:
    """Record batches: dst <= 1.4x the payload it receives, others <= 1.2x their part."""
    results = gs.launch(_detections_peak, nproc_per_node=4, backend="gloo", args=(60,))
    dst, others = results[0], results[1:]
    print("records gather, peak RSS growth (MB):", results)
    assert dst["growth"] < 1.4 * dst["received"], dst
    for out in others:
        assert out["growth"] < 1.2 * out["part"], out


def _different_calls() -> dict[int, str] | None:
    try:
        if gs.get_rank() == 0:
            gs.barrier(timeout=30)
        else:
            gs.all_gather_object(1)
    except gs.MismatchError as exc:
        return exc.details
    return None


def _routes_taken() -> dict[str, Any]:
    """Tiny auto gathers ride on the status exchange; one rank's larger part sends every
    part another way (the small ones included); the routes each call logged."""
    import logging

    routes: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            routes.append(str(record.args[1]))  # type: ignore[index]

    logger = logging.getLogger("gatherstore")
    logger.addHandler(Keep())
    logger.setLevel(logging.DEBUG)
    rank = gs.get_rank()
    tiny = {"rank": rank, "small": np.full(4, rank)}
    mixed = np.full(60_000 if rank == 1 else 10, rank, dtype=np.int64)  # 480 kB on rank 1
    everyone = gs.all_gather_object(tiny)
    for got in everyone:
        got["small"] += 1  # arrays that rode on the exchange are writable, as elsewhere
    gathered = gs.gather_object(tiny, dst=2)
    out = {
        "all": [{"rank": g["rank"], "small": int(g["small"].sum())} for g in everyone],
        "gather": gathered and [g["rank"] for g in gathered],
        "mixed": [int(a.sum()) for a in gs.all_gather_object(mixed)],
        "mixed gather": gs.gather_object(mixed, dst=0),  # rank 1 sends its larger part
    }
    out["mixed gather"] = out["mixed gather"] and [int(a.sum()) for a in out["mixed gather"]]
    out["routes"] = routes
    return out


@pytest.mark.timeout(120)
def test_tiny_auto_gathers_ride_on_the_status_exchange() -> None:
    results = gs.launch(_routes_taken, nproc_per_node=3, backend="gloo")
    sums = [10 * 0, 60_000 * 1, 10 * 2]
    for rank, out in enumerate(results):
        # rank's own entry is its object, which the loop above changed too
        assert out["all"] == [{"rank": r, "small": 4 * (r + 1)} for r in range(3)]
        assert out["gather"] == ([0, 1, 2] if rank == 2 else None)
        assert out["mixed"] == sums
        assert out["mixed gather"] == (sums if rank == 0 else None)
        assert out["routes"][:2] == ["auto (inline)", "auto (inline)"], out["routes"]
        assert "inline" not in out["routes"][2] and "inline" not in out["routes"][3]


@pytest.mark.timeout(120)
def test_ranks_in_different_calls_fail_together() -> None:
    expected = {0: "barrier", 1: "all_gather_object"}
    assert gs.launch(_different_calls, nproc_per_node=2, backend="gloo") == [expected] * 2


def _rank_one_fails() -> str:
    @gs.one_rank_only(rank=1, with_barrier=True)
    def evaluate() -> int:
        raise ValueError("evaluation broke")

    try:
        evaluate()
    except gs.RemoteRankError as exc:
        return f"remote {exc.rank}: {exc.remote_message}"
    except ValueError as exc:
        return f"own: {exc}"
    return "no error"


@pytest.mark.timeout(120)
def test_one_rank_only_failure_reaches_the_waiting_ranks() -> None:
    results = gs.launch(_rank_one_fails, nproc_per_node=3, backend="gloo")
    assert results == [
        "remote 1: ValueError: evaluation broke",
        "own: evaluation broke",
        "remote 1: ValueError: evaluation broke",
    ]
