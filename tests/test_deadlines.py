"""One deadline per call: every phase of a call shares its ``timeout``; a store's set-up
happens at init (the default store) or is absorbed by the first call; a timeout longer than
any wait below can take is clamped to ``MAX_WAIT``, in one process as in many."""

from __future__ import annotations

import datetime as dt
import math
import re
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import gatherstore as gs
from gatherstore._config import MAX_WAIT, to_seconds
from gatherstore._errors import seconds as gs_seconds
from gatherstore.stores.base import Buffer
from gatherstore.stores.file import FileStore

MARGIN = 15.0  # seconds past a timeout that count as "in time" on a loaded machine


class SlowReads(FileStore):
    """A live but slow shared folder: every read of a part takes 1 s."""

    def _read(self, key: str) -> Buffer | None:
        if key.rsplit("/", 1)[-1].isdigit():  # a part, not the job marker
            time.sleep(1.0)
        return super()._read(key)

    def join_job(self, locator: str) -> FileStore:
        return SlowReads(locator)


class SlowSetUp(FileStore):
    """A shared folder whose job area takes 2 s to set up and whose parts take 0.8 s to
    write."""

    def prepare_job(self, job_id: str) -> str:
        locator = super().prepare_job(job_id)
        time.sleep(2.0)
        return locator

    def _write(self, key: str, buffers: Sequence[Buffer]) -> bool:
        if key.rsplit("/", 1)[-1].isdigit():
            time.sleep(0.8)
        return super()._write(key, buffers)

    def join_job(self, locator: str) -> FileStore:
        return SlowSetUp(locator)


def _slow_store_calls(root: str) -> dict[str, Any]:
    store = SlowReads(root)
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
    return gs.gather_object(gs.get_rank(), store=SlowSetUp(root), timeout=3)


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
    assert [gs_seconds(x) for x in (9.99904, 1800.0, 2.54, 0.25, 59.6)] == [
        "10",
        "1800",
        "2.5",
        "0.25",
        "60",
    ]


# --- timeouts longer than the platform waits: "as long as it takes" -------------------------
FOREVER = 1e12  # seconds: 31,700 years


def test_a_timeout_past_what_the_platform_waits_is_clamped() -> None:
    assert to_seconds(FOREVER) == MAX_WAIT == 24 * 86400
    assert to_seconds(dt.timedelta(days=10**6)) == MAX_WAIT
    assert to_seconds(10**400) == MAX_WAIT  # an int too large for a float is still finite
    assert to_seconds(600) == 600.0 and to_seconds(dt.timedelta(minutes=1)) == 60.0
    for refused in (math.inf, math.nan, 0, -FOREVER):
        with pytest.raises(ValueError, match="timeout="):
            to_seconds(refused)


def test_every_wait_below_takes_the_ceiling() -> None:
    """Python's waits, a socket's timeout, and a c10d store client's connect and wait (whose
    poll takes an int of milliseconds) all take MAX_WAIT, with the call's grace on top."""
    import torch.distributed as dist

    assert (MAX_WAIT + 3600) * 1000 < 2**31 - 1 and MAX_WAIT < threading.TIMEOUT_MAX
    done = threading.Event()
    done.set()
    assert done.wait(MAX_WAIT)
    with socket.socket() as sock:
        sock.settimeout(MAX_WAIT)
    span = dt.timedelta(seconds=MAX_WAIT)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=span, wait_for_workers=False)  # type: ignore[attr-defined]
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=span)  # type: ignore[attr-defined]
    threading.Timer(0.2, server.set, args=("key", "1")).start()
    client.wait(["key"], span)
    assert client.get("key") == b"1"


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
