"""``gatherstore bench`` and its parts: payloads, baselines, measurements, report."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _bench_jobs import hiredis_in_use

import gatherstore as gs
from gatherstore.cli import commands
from gatherstore.cli import main as _cli
from gatherstore.cli.bench import (
    baselines,
    clients,
    floors,
    groups,
    latency,
    payloads,
    report,
    runner,
)
from gatherstore.cli.bench.cases import BASELINE, Case, select
from gatherstore.cli.bench.measure import PeakMemory
from gatherstore.testing.plugin import S3Endpoint
from gatherstore.testing.services import start_redis

GS_CASES = [
    "gs.collective",
    "gs.tmpdir",
    "gs.tmpdir-shm",
    "gs.iter-tmpdir-shm",
    "gs.tmpdir-disk",
    "gs.file",
]
ALL_CASES = [BASELINE, "torch.gather_object", "mmengine.collect_results_cpu", *GS_CASES]


def run_bench(
    *args: str, timeout: float, services: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "gatherstore.cli.main",
        "bench",
        "--sizes",
        "4MB",
        "--world",
        "2",
    ]
    command += ["--repeats", "1", "--ceiling-size", "16MB", *args]
    # no services but ``services`` (their variables): the expected cases are known
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATHERSTORE_")}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env={**env, **(services or {})}
    )


# --- payloads ----------------------------------------------------------------------------------
def test_detections_follow_a_distributed_sampler_split() -> None:
    n, world = 7, 3
    parts = [payloads.detections(n, rank, world) for rank in range(world)]
    assert [len(p) for p in parts] == [3, 3, 3]  # padded to 9
    assert [img["image_id"] for img in parts[1]] == [1, 4, 0]  # position 7 wraps to image 0
    image = parts[0][0]
    assert image["boxes"].shape == (100, 4) and image["boxes"].dtype == np.float32
    assert image["scores"].shape == (100,) and image["scores"].dtype == np.float32
    assert image["labels"].shape == (100,) and image["labels"].dtype == np.int64
    assert isinstance(image["file_name"], str)
    assert (image["boxes"][:, 2:] > image["boxes"][:, :2]).all()
    assert (np.diff(image["scores"]) <= 0).all()
    again = payloads.detections(n, 0, world)
    assert [payloads.digest(a) for a in again] == [payloads.digest(b) for b in parts[0]]
    assert payloads.digest(parts[0][0]) != payloads.digest(parts[0][1])
    assert payloads.image_count(4 << 20) == (4 << 20) // payloads.IMAGE_BYTES


def test_tensors_payload() -> None:
    data = payloads.make("tensors", 8 << 20, 1, 2)
    assert len(data) == 4
    assert all(t.dtype == torch.float32 for t in data.values())
    assert sum(t.numel() * 4 for t in data.values()) == 4 << 20
    assert torch.equal(payloads.make("tensors", 8 << 20, 1, 2)["tensor0"], data["tensor0"])
    with pytest.raises(ValueError, match="unknown payload 'images'"):
        payloads.make("images", 1, 0, 1)


def test_keyed_payload_holds_the_detections_by_image_id() -> None:
    got = payloads.make("keyed", 4 << 20, 1, 3)
    images = payloads.make("detections", 4 << 20, 1, 3)
    assert list(got) == [image["image_id"] for image in images]
    assert [payloads.digest(v) for v in got.values()] == [payloads.digest(i) for i in images]


def test_logits_payload_is_a_tensor_per_sample() -> None:
    got = payloads.make("logits", 8 << 20, 1, 2)
    assert len(got) == (8 << 20) // 2 // (payloads.CLASSES * 4)
    assert {t.shape for t in got} == {(payloads.CLASSES,)}
    assert len({t.untyped_storage().data_ptr() for t in got}) == len(got)
    assert torch.equal(payloads.make("logits", 8 << 20, 1, 2)[5], got[5])


def test_coco_payload_is_plain_dicts_of_about_the_bytes_asked_made_on_request() -> None:
    got = payloads.make("coco", 4 << 20, 1, 2)
    assert len(got) == (4 << 20) // 2 // payloads.COCO_BYTES
    assert {tuple(d) for d in got} == {("image_id", "category_id", "bbox", "score")}
    assert [d["image_id"] for d in got[:: payloads.BOXES]][:3] == [1, 3, 5]  # as a shard's
    assert {type(v) for d in got for v in d["bbox"]} == {float}
    assert len(pickle.dumps(got, protocol=5)) == pytest.approx(2 << 20, rel=0.05)
    assert got[7] == payloads.make("coco", 4 << 20, 1, 2)[7]
    assert "coco" in payloads.available() and "coco" not in payloads.defaults()


@pytest.mark.timeout(300)
def test_bench_gathers_coco_results_when_asked() -> None:
    chosen = f"{BASELINE},gs.tmpdir"
    result = run_bench("--payloads", "coco", "--cases", chosen, "--json", "-", timeout=290)
    assert result.returncode == 0, result.stderr
    cases = [json.loads(line) for line in result.stdout.splitlines()][1:]
    assert [(c["case"], c["payload"]) for c in cases] == [(BASELINE, "coco"), ("gs.tmpdir", "coco")]
    assert all(c["error"] is None and c["seconds"] > 0 for c in cases), cases


def test_records_payload_holds_views_of_each_records_scores() -> None:
    recs = payloads.make("records", 64 << 20, 1, 2)
    assert len(recs) == 8  # 32 MiB a rank, 4 MiB a record
    assert [r["id"] for r in recs] == list(range(8, 16))
    for rec in recs:
        assert rec["scores"].nbytes == payloads.RECORD_BYTES
        assert rec["boxes"].shape == (payloads.RECORD_BYTES // 16, 2)
        assert rec["boxes"].data_ptr() == rec["scores"].data_ptr() + 4
    assert torch.equal(payloads.make("records", 64 << 20, 1, 2)[3]["scores"], recs[3]["scores"])
    assert len(payloads.make("records", 1, 0, 4)) == 1
    if not torch.cuda.is_available():
        assert "cuda-records" not in payloads.available()
        with pytest.raises(ValueError, match="needs a CUDA device"):
            payloads.make("cuda-records", 1 << 20, 0, 1)


def test_floors_of_a_payload() -> None:
    found = floors.measure("records", 16 << 20, 2, 1)
    assert found["part_bytes"] >= 8 << 20  # one rank's part, its views not counted twice
    assert found["part_bytes"] < (8 << 20) * 1.01
    assert found["floor_s"] == max(found["encode_s"], found["decode_s"]) > 0
    assert found["checksum_gbps"] > 0 and "d2h_gbps" not in found
    records = [
        {**record("gs.tmpdir-shm", 0.5, 100), "payload": p, "floors": found}
        for p in ("records", "tensors")
    ]
    lines = "\n".join(report._floor_lines(records))
    assert "gs.tmpdir-shm records 4MB W=2: 0.500 s" in lines and "digest share" in lines
    assert "gs.tmpdir-shm records / tensors, 4MB W=2: 1.00x the time" in lines


def test_peak_memory_sees_a_large_allocation() -> None:
    with PeakMemory() as mem:
        block = np.ones(64 << 20, dtype=np.uint8)
        del block
    if not mem.reset:
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert mem.growth >= 60 << 20


# --- baselines ---------------------------------------------------------------------------------
def baseline_outputs() -> dict[str, Any]:
    rank, world = gs.get_rank(), gs.get_world_size()
    part = [f"item {i}" for i in range(rank, 5, world)]  # 5 items: rank 0 has one more
    if rank == 1:
        part.append("padding")
    return {
        "mmengine": baselines.collect_results_cpu(part, 5),
        "all_gather": baselines.torch_all_gather_object(rank),
        "gather": baselines.torch_gather_object(rank),
    }


@pytest.mark.timeout(120)
def test_baselines_in_two_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the children inherit it: .dist_test goes here
    first, second = gs.launch(baseline_outputs, nproc_per_node=2, backend="gloo")
    assert first["mmengine"] == [f"item {i}" for i in range(5)]
    assert second["mmengine"] is None
    assert first["all_gather"] == second["all_gather"] == [0, 1]
    assert first["gather"] == [0, 1] and second["gather"] is None
    assert list((tmp_path / ".dist_test").iterdir()) == []  # rank 0 removed its tmpdir


# --- cases, runner, report -----------------------------------------------------------------------
def test_select_cases() -> None:
    cases = [Case(name, "gather_object") for name in ALL_CASES]
    assert select(cases, None) == cases
    opt_in = Case("torchmetrics.map", "torchmetrics", opt_in=True)
    assert select([*cases, opt_in], None) == cases  # opt-in cases run only when named
    assert select([*cases, opt_in], ["torchmetrics.*"]) == [opt_in]
    assert [c.name for c in select(cases, ["gs.tmpdir*", BASELINE])] == [
        BASELINE,
        "gs.tmpdir",
        "gs.tmpdir-shm",
        "gs.tmpdir-disk",
    ]
    with pytest.raises(ValueError, match="'nope' matches no case"):
        select(cases, ["nope"])


def record(case: str, seconds: float, peak: int, error: str | None = None) -> dict[str, Any]:
    base = {"case": case, "payload": "detections", "size": "4MB", "world": 2, "error": error}
    if error is None:
        base.update(seconds=seconds, gbps=0.1, dst_peak=peak, other_peak=peak // 2)
    return base


def test_ratios_and_table() -> None:
    records = [
        record(BASELINE, 2.0, 400),
        record("gs.tmpdir-shm", 0.5, 100),
        record("gs.redis", 0, 0, error="StoreUnavailableError: no server"),
    ]
    runner._ratios(records)
    assert records[0]["time_ratio"] == 1.0 and records[0]["mem_ratio"] == 1.0
    assert records[1]["time_ratio"] == 0.25 and records[1]["mem_ratio"] == 0.25
    assert records[2]["time_ratio"] is None
    ceilings = {"memcpy_gbps": 1.0, "shm_gbps": None, "pickle_dumps_gbps": 0.2}
    for r in records[:2]:
        runner._fractions(r, ceilings)
    assert records[1]["of_memcpy"] == pytest.approx(0.1)
    assert records[1]["of_shm"] is None
    limits = {**ceilings, "shm_write_gbps": None, "shm_read_gbps": None, "pickle_loads_gbps": 0.3}
    text = report.table(records, limits, ["gs.s3 skipped: no endpoint"])
    assert "failed: StoreUnavailableError: no server" in text
    assert "0.25" in text and "gs.s3 skipped" in text
    lines = report.json_lines(records, limits).splitlines()
    assert json.loads(lines[0])["kind"] == "ceilings" and len(lines) == 4


def test_service_shares_and_client_ceiling_lines() -> None:
    redis_case = {**record("gs.redis", 1.0, 100), "service": "redis"}
    ceilings = {"memcpy_gbps": 1.0, "redis_default_gbps": 0.05, "redis_fast_gbps": 0.2}
    runner._ratios([redis_case])  # no baseline: no ratios
    runner._fractions(redis_case, ceilings)
    assert redis_case["of_client"] == pytest.approx(2.0)
    assert redis_case["of_fast"] == pytest.approx(0.5)
    limits = {
        **ceilings,
        "shm_gbps": None,
        "shm_write_gbps": None,
        "shm_read_gbps": None,
        "pickle_dumps_gbps": 0.2,
        "pickle_loads_gbps": 0.3,
        "redis_default_write_gbps": 0.1,
        "redis_default_read_gbps": 0.1,
        "redis_fast_write_gbps": 0.4,
        "redis_fast_read_gbps": 0.4,
    }
    text = report.table([redis_case], limits, [])
    assert "redis_default: write 0.10 GB/s, read 0.10 GB/s, both 0.05 GB/s" in text
    assert "redis_fast: write 0.40 GB/s" in text and "s3_default" not in text
    assert "%client" in text and "200%" in text and "50%" in text


@pytest.mark.timeout(120)
def test_client_ceilings_on_real_services(
    gatherstore_redis_url: str, gatherstore_s3: S3Endpoint
) -> None:
    import redis

    s3fs = pytest.importorskip("s3fs")
    nbytes = 9 << 20  # 3 Redis values (the last one short), 1 S3 part
    found = clients.measure_redis(gatherstore_redis_url, nbytes, repeats=2)  # median of 2
    names = ["redis_default", "redis_pipelined", "redis_fast"]
    if importlib.util.find_spec("hiredis"):
        names += ["redis_default_hiredis", "redis_hiredis_packer"]
    for name in names:
        for what in ("write_", "read_", ""):
            assert found.pop(f"{name}_{what}gbps") > 0
    assert not found
    client = redis.Redis.from_url(gatherstore_redis_url)
    assert list(client.scan_iter(match="gatherstore-ceiling-*")) == []  # nothing left behind
    client.close()
    found = clients.measure_s3(gatherstore_s3.storage_options, nbytes, repeats=2)
    clients_run = ["default", "fast"] + (["obstore"] if importlib.util.find_spec("obstore") else [])
    assert sorted(found) == sorted(
        f"s3_{name}_{what}gbps" for name in clients_run for what in ("write_", "read_", "")
    )
    fs = s3fs.S3FileSystem(**gatherstore_s3.storage_options, skip_instance_cache=True)
    assert not [b for b in fs.ls("") if "gatherstore-ceiling-" in b]  # its bucket is gone


def test_redis_py_defaults_are_measured_without_hiredis_in_a_fresh_process() -> None:
    assert clients._fresh(hiredis_in_use) is False
    import redis  # noqa: F401  # once it is imported, hiding hiredis must refuse

    with pytest.raises(RuntimeError, match="already imported"):  # too late in this process
        clients._hide_hiredis()


def test_the_client_share_is_of_the_faster_redis_py_default() -> None:
    case = {**record("gs.redis", 1.0, 100), "service": "redis"}
    ceilings = {"redis_default_gbps": 0.05, "redis_default_hiredis_gbps": 0.08}
    runner._fractions(case, ceilings)
    assert case["of_client"] == pytest.approx(0.1 / 0.08)
    assert case["of_fast"] is None and case["of_memcpy"] is None


def test_client_ceilings_are_measured_once_per_service_and_failures_are_notes() -> None:
    chosen = [
        Case("gs.tmpdir-shm", "gather_object", "tmpdir:///dev/shm", service="shm"),
        Case("gs.redis", "gather_object", "redis://127.0.0.1:1/0", service="redis"),
    ]
    notes: list[str] = []
    assert clients.measure(chosen, 1 << 20, notes) == {}
    assert len(notes) == 1 and notes[0].startswith("redis ceiling not measured: ConnectionError")


def test_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'gatherstore\[bench\]'"):
        report.check_plot()


# --- the command ----------------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_bench_every_case_as_json_lines() -> None:
    result = run_bench("--payloads", "detections", "--json", timeout=590)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    ceilings, cases = lines[0], lines[1:]
    assert ceilings["kind"] == "ceilings"
    assert ceilings["memcpy_gbps"] > 0 and ceilings["pickle_dumps_gbps"] > 0
    assert [c["case"] for c in cases] == ALL_CASES
    for case in cases:
        assert case["error"] is None, case
        assert case["payload"] == "detections" and case["world"] == 2
        assert case["seconds"] > 0 and case["gbps"] > 0
        assert case["dst_peak"] >= 0 and case["other_peak"] >= 0
        assert case["time_ratio"] > 0 and case["mem_ratio"] is not None
        # the destination's phases, from each gatherstore call's DEBUG line
        phases = case["dst_phases"]
        assert (phases == {}) == (case["impl"] != "gatherstore"), case
        assert all(seconds >= 0 for seconds in phases.values())
    assert cases[0]["time_ratio"] == 1.0
    mmengine = cases[ALL_CASES.index("mmengine.collect_results_cpu")]["impl"]
    assert mmengine == "re-implementation" or mmengine.startswith("mmengine ")


@pytest.mark.timeout(300)
def test_bench_table_json_file_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    jsonl, png = tmp_path / "bench.jsonl", tmp_path / "bench.png"
    chosen = f"{BASELINE},gs.iter-*"
    args = ["--payloads", "tensors", "--cases", chosen, "--json", str(jsonl), "--plot", str(png)]
    result = run_bench(*args, timeout=290)
    assert result.returncode == 0, result.stderr
    assert "ceilings: memcpy" in result.stdout
    said = result.stderr + result.stdout  # what a terminal shows
    for skipped in ("gs.redis skipped: no Redis given", "gs.s3 skipped: no S3 endpoint given"):
        assert said.count(skipped) == 1, said  # before any work, not again in the table
    assert BASELINE in result.stdout and "gs.iter-tmpdir-shm" in result.stdout
    cases = [json.loads(line) for line in jsonl.read_text().splitlines()][1:]
    assert [c["case"] for c in cases] == [BASELINE, "gs.iter-tmpdir-shm"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
def test_bench_gathers_through_redis_over_tcp_and_its_unix_socket() -> None:
    import redis

    with start_redis() as server:
        result = run_bench(
            "--payloads",
            "tensors",
            "--cases",
            "gs.redis*",
            "--json",
            "-",
            timeout=290,
            services=server.environ,
        )
        assert result.returncode == 0, result.stderr
        lines = [json.loads(line) for line in result.stdout.splitlines()]
        assert lines[0]["redis_default_gbps"] > 0  # the same server's client ceilings
        cases = {c["case"]: c for c in lines[1:]}
        assert sorted(cases) == ["gs.redis", "gs.redis-unix"]
        assert cases["gs.redis-unix"]["store"] == server.unix_url.split("?")[0]
        assert server.unix_url.startswith("unix:///")
        for case in cases.values():
            assert case["error"] is None and case["of_client"] > 0, case
        client = redis.Redis.from_url(server.url)
        assert client.dbsize() == 0  # nothing left behind
        client.close()


@pytest.mark.timeout(300)
def test_bench_torchmetrics_map_unpatched_patched_and_on_rank_0() -> None:
    pytest.importorskip("torchmetrics")
    result = run_bench("--cases", "torchmetrics.*", "--map-images", "3", "--json", timeout=290)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0] == {"kind": "ceilings"}  # no gather case, no ceilings measured
    cases = {c["case"]: c for c in lines[1:]}
    assert list(cases) == ["torchmetrics.map", "torchmetrics.map-gs", "torchmetrics.map-gs-on0"]
    for case in cases.values():
        assert case["error"] is None and case["same_map"], case
        assert case["kind"] == "torchmetrics" and case["world"] == 2 and case["images"] == 3
        assert case["sync_s"] > 0 and case["compute_s"] > 0
    assert len({c["map"] for c in cases.values()}) == 1  # the same mAP three ways
    calls = [(c["torch_calls"], c["gs_calls"]) for c in cases.values()]
    assert calls[1:] == [(0, 1), (0, 2)] and calls[0][0] > 3 * 7 and calls[0][1] == 0


@pytest.mark.timeout(300)
def test_bench_quick_without_tqdm_says_what_it_skips_first_and_how_to_run_all() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATHERSTORE_")}
    code = (  # tqdm cannot be imported, as without the bench extra
        "import sys; sys.modules['tqdm'] = None; from gatherstore.cli.main import main; "
        "sys.exit(main(['bench', '--quick', '--json']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=290, env=env
    )
    assert result.returncode == 0, result.stderr
    said = result.stderr.strip().splitlines()
    assert said[0].startswith("bench: gs.redis skipped: no Redis given (--redis URL")
    assert said[1].startswith("bench: gs.s3 skipped: no S3 endpoint given (--s3 ENDPOINT")
    assert said[-1].startswith("bench: a quick run (32MB, W=2, detections, 4 cases, 1 repeat)")
    assert said[-1].endswith("gatherstore bench --services --plot bench.png")
    cases = [json.loads(line) for line in result.stdout.splitlines()][1:]
    assert [c["case"] for c in cases][:2] == [BASELINE, "gs.collective"]
    assert {c["case"] for c in cases[2:]} <= {"gs.tmpdir", "gs.tmpdir-disk"}
    for case in cases:
        assert case["error"] is None and case["size"] == "32MB" and case["world"] == 2, case
        assert case["repeats"] == 1 and case["payload"] == "detections"


@pytest.mark.timeout(120)
def test_bench_unknown_case_pattern() -> None:
    result = run_bench("--cases", "nope", timeout=50)
    assert result.returncode == 1
    assert "--cases 'nope' matches no case" in result.stderr


@pytest.mark.timeout(300)
def test_bench_latency_at_a_tiny_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--latency``: every operation at every size, in one job; the 64 KiB gathers go
    through tmpdir (3 x 64 KiB is above auto's threshold), which is left empty."""
    assert _cli._parser().parse_args(["bench", "--latency"]).latency == [32]
    monkeypatch.setenv("GATHERSTORE_TMPDIR", str(tmp_path))  # the ranks' tmpdir base
    out = io.StringIO()
    assert latency.main([3], [1 << 10, 64 << 10], warmup=1, calls=2, out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("W = 3 gloo processes") and "1.0 KiB" in lines[1]
    assert [line.split()[0] for line in lines[2:]] == list(latency.OPS)
    assert all(line.count(" ms") == 2 for line in lines[2:])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(300)
def test_bench_soak_reports_each_store_s_first_and_last_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--soak``: random calls over the mix, each store's first and last medians, and
    nothing left in the ranks' tmpdir base."""
    from gatherstore.cli.bench import soak

    assert _cli._parser().parse_args(["bench", "--soak"]).soak == 1000
    monkeypatch.setenv("GATHERSTORE_TMPDIR", str(tmp_path))
    out = io.StringIO()
    assert soak.main(24, out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("W = 3 gloo processes") and "24 random calls" in lines[0]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert sorted(rows) == ["auto", "collective", "file://<temp", "tmpdir"]
    assert all(row.endswith("x") for row in rows.values())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(400)
def test_bench_result_sets_at_tiny_sizes(tmp_path: Path) -> None:
    """``--result-sets``: every figure with its goal, in a folder that is removed after."""
    from gatherstore.cli.bench import resultsets

    parsed = _cli._parser().parse_args(["bench", "--result-sets"]).result_sets
    assert parsed == [("1GB", 1 << 30), ("4GB", 4 << 30)]
    out = io.StringIO()
    assert resultsets.main(1 << 20, 2 << 20, 1, folder=str(tmp_path), out=out) == 0
    text = out.getvalue()
    figures = ("per value: list.append", "rs.add loop", "holds the interpreter", "rs.gather")
    for figure in (*figures, "peak RSS grew"):
        assert figure in text, text
    assert text.count("goal:") == 5, text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(300)
def test_bench_group_size_compares_a_group_with_torch_and_a_default_group() -> None:
    """``--group-size 2 --world 4``: both groups gather at once and in turn, next to torch's
    gather on the same groups, and the same parts on a default group of 2 (the two jobs
    take turns, twice each); both comparisons."""
    args = ("--group-size", "2", "--world", "4", "--sizes", "256KB", "--repeats", "2")
    result = run_bench(*args, timeout=290)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("W = 4 gloo processes in 2 groups of 2"), lines
    assert "taking turns with a job of 2 (2 launches each)" in lines[0]
    assert "256KB a group (128.0 KiB per rank)" in lines[0]
    rows = [line.split(" | ") for line in lines[3:9]]
    calls = [groups.AT_ONCE, groups.TORCH, groups.ALONE, groups.TORCH_ALONE]
    calls += [groups.DEFAULT, groups.TORCH_DEFAULT]
    assert [row[0].lstrip("| ") for row in rows] == [
        c.replace("group of N", "group of 2") for c in calls
    ]
    assert all(float(row[1]) > 0 and row[2].endswith("iB") for row in rows), rows
    gatherstore = [row[3].rstrip(" |") != "-" for row in rows]
    assert gatherstore == [True, False, True, False, True, False], rows
    ratios = [line.split(": ")[0] for line in lines[9:]]
    assert ratios == [
        "gs / torch on the same groups, every group at once",
        "gs / torch on the same groups, one group at a time",
        "gs / torch on a default group of 2",
        "group / default group of 2, one group at a time",
        "group / default group of 2, every group at once",
        "peak RSS, group / default group of 2",
    ]
    assert all(line.endswith("x") for line in lines[9:]), lines


@pytest.mark.parametrize(
    ("world", "size", "fix"),
    [
        ("2,4", "2", "give --world a multiple of 2 above it, e.g. --world 4"),
        ("6", "4", "give --world a multiple of 4 above it, e.g. --world 8"),
        ("4", "1", "a group needs at least 2 ranks"),
    ],
)
def test_bench_group_size_that_does_not_split_the_world(world: str, size: str, fix: str) -> None:
    argv = ["bench", "--world", world, "--group-size", size]
    with pytest.raises(ValueError, match=re.escape(fix)):
        commands.run(_cli._parser().parse_args(argv))


def test_bench_export_at_a_tiny_size(tmp_path: Path) -> None:
    """``--export``: write_table, the disk and each export with its rates, in a folder
    that is removed after."""
    from gatherstore.cli.bench import exports

    assert _cli._parser().parse_args(["bench", "--export"]).export == 1 << 30
    assert _cli._parser().parse_args(["bench", "--export", "64MB"]).export == 64 << 20
    out = io.StringIO()
    assert exports.main(2 << 20, 1, folder=str(tmp_path), out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("export: 2.0 MiB of detections stored by 4 ranks"), lines
    assert "pq.write_table, the same rows in one Arrow table" in lines[1]
    assert "the disk, a raw sequential write" in lines[2]
    assert "export, 1 file " in lines[3] and "over write_table (goal: at most +10%)" in lines[3]
    assert "export, 2 files" in lines[4] and "x write_table's rate" in lines[4]
    assert all(" GB/s" in line and "of the disk" in line for line in lines[3:])
    assert list(tmp_path.iterdir()) == []
