"""One deadline per call: every phase of a call shares its ``timeout``; a store's set-up
happens at init (the default store) or is absorbed by the first call; a timeout longer than
any wait below can take works, in one process as in many (test_settings.py: it is clamped)."""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from wrapping import Over

import gatherstore as gs

MARGIN = 15.0  # seconds past a timeout that count as "in time" on a loaded machine


def _part(key: str) -> bool:
    return key.rsplit("/", 1)[-1].isdigit()  # a part, not the job marker


class SlowReads(Over):
    """A live but slow shared folder: every read of a part takes 1 s."""

    def _read(self, key: str) -> Any:
        if _part(key):
            time.sleep(1.0)
        return super()._read(key)


class SlowSetUp(Over):
    """A shared folder whose job area takes 2 s to set up and whose parts take 0.8 s to
    write."""

    def prepare_job(self, job_id: str) -> str:
        locator = super().prepare_job(job_id)
        time.sleep(2.0)
        return locator

    def _write(self, key: str, buffers: Sequence[Any]) -> bool:
        if _part(key):
            time.sleep(0.8)
        return super()._write(key, buffers)


def _slow_store_calls(root: str) -> dict[str, Any]:
    store = SlowReads(gs.open_store(f"file://{root}"))
    out: dict[str, Any] = {}
    gs.all_gather_object(0, store=store, timeout=60)  # the job area exists from here on
    started = time.monotonic()
    try:
        gathered = gs.gather_object(gs.get_rank(), store=store, timeout=2)
        out["gather"] = ("ok", gathered)
    except gs.GatherError as exc:
        out["gather"] = (type(exc).__name__, str(exc))
    out["gather_seconds"] = time.monotonic() - started
    gs.barrier(timeout=60)  # the senders returned long before dst gave up
    # a gather_iter's reads are paced by its consumer: each has the whole timeout
    out["iter"] = list(gs.gather_iter(gs.get_rank(), store=store, timeout=2))
    return out


@pytest.mark.timeout(120)
def test_a_slow_store_cannot_stretch_a_call_past_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATHERSTORE_READ_AHEAD", "1")  # no read-ahead: one read after another
    dst, *senders = gs.launch(
        _slow_store_calls, nproc_per_node=5, backend="gloo", args=(str(tmp_path),)
    )
    # four reads of 1 s, one after another, do not fit one 2 s deadline (each read used to
    # get the whole timeout of its own)
    assert dst["gather"][0] == "StoreUnavailableError", dst["gather"]
    assert "no time left" in dst["gather"][1]
    assert dst["gather_seconds"] < 2 + MARGIN
    assert dst["iter"] == [0, 1, 2, 3, 4]
    assert all(s["gather"] == ("ok", None) and s["iter"] == [] for s in senders)
    assert list(tmp_path.iterdir()) == []


def _first_call_sets_up(root: str) -> Any:
    return gs.gather_object(
        gs.get_rank(), store=SlowSetUp(gs.open_store(f"file://{root}")), timeout=3
    )


@pytest.mark.timeout(120)
def test_the_first_call_absorbs_the_set_up_of_its_store(tmp_path: Path) -> None:
    """2 s of set-up, 0.8 s of writing and the reads fit a 3 s call: the set-up has a
    deadline of its own."""
    results = gs.launch(
        _first_call_sets_up, nproc_per_node=2, backend="gloo", args=(str(tmp_path),)
    )
    assert results == [[0, 1], None]
    assert list(tmp_path.iterdir()) == []


def _areas_at_init(root: str) -> list[list[str]]:
    before = sorted(p.name for p in Path(root).iterdir())
    gs.all_gather_object(bytes(1 << 20), timeout=30)
    after = sorted(p.name for p in Path(root).iterdir())
    return [before, after]


@pytest.mark.timeout(120)
def test_the_default_store_is_set_up_at_init(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATHERSTORE_STORE", f"file://{tmp_path}")
    results = gs.launch(_areas_at_init, nproc_per_node=2, backend="gloo", args=(str(tmp_path),))
    for before, after in results:
        assert len(before) == 1 and before[0].startswith("gatherstore-"), before
        assert after == before
    assert list(tmp_path.iterdir()) == []


def _late_rank_one() -> str:
    if gs.get_rank() == 1:
        time.sleep(3.0)  # arrives after rank 0's timeout, with time already spent
    try:
        gs.gather_object(gs.get_rank(), store="tmpdir", timeout=1.7)
    except gs.GatherTimeout as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(120)
def test_a_timeout_is_printed_rounded() -> None:
    said = gs.launch(_late_rank_one, nproc_per_node=2, backend="gloo")[0]
    assert "did not arrive within" in said
    numbers = re.findall(r"within ([0-9.e+-]+) s", said)
    assert numbers and all(re.fullmatch(r"\d+(\.\d\d?)?", n) for n in numbers), said


# --- timeouts longer than the platform waits: "as long as it takes" -------------------------
FOREVER = 1e12  # seconds: 31,700 years


def test_a_result_set_takes_a_timeout_past_the_platform_in_one_process() -> None:
    with gs.ResultSet("forever", store="memory://bucket", timeout=FOREVER) as rs:
        rs.add(1, "one")
        rs.flush()
        assert rs.pending([1, 2]) == [2]
        assert rs.gather(timeout=dt.timedelta(days=10**6), keys=True) == [(1, "one")]
    assert gs.all_gather_object("x", timeout=FOREVER) == ["x"]
    gs.barrier(timeout=1e30)


def _calls_without_end(root: str) -> dict[str, Any]:
    rank = gs.get_rank()
    out: dict[str, Any] = {
        "collective": gs.all_gather_object(rank, timeout=FOREVER),
        "default": gs.all_gather_object(rank),  # GATHERSTORE_TIMEOUT=1e12
        "file": gs.all_gather_object(bytes(1 << 20), store=f"file://{root}", timeout=FOREVER),
        "sum": gs.all_reduce(rank + 1, timeout=dt.timedelta(days=10**6)),
    }
    gs.barrier(timeout=FOREVER)
    with gs.ResultSet("forever", store=f"file://{root}/sets", timeout=FOREVER) as rs:
        rs.add(rank, f"v{rank}")
        out["set"] = rs.gather(keys=True)
    return out


@pytest.mark.timeout(120)
def test_every_rank_takes_a_timeout_past_the_platform(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What used to end on every rank in ``OverflowError: timestamp out of range for
    platform time_t``: the calls, the default timeout and the process group's own."""
    monkeypatch.setenv("GATHERSTORE_TIMEOUT", str(FOREVER))
    results = gs.launch(
        _calls_without_end,
        nproc_per_node=2,
        backend="gloo",
        args=(str(tmp_path),),
        timeout=FOREVER,
    )
    for out in results:
        assert out["collective"] == out["default"] == [0, 1]
        assert [len(part) for part in out["file"]] == [1 << 20] * 2
        assert out["sum"] == 3
    assert results[0]["set"] == [(0, "v0"), (1, "v1")] and results[1]["set"] is None
