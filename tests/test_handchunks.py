"""A gather's long lists handed over in chunks: real gloo groups of real processes, real
sockets and memfds.  Chunks are made small (``GATHERSTORE_PART_CHUNK``) so that parts
of a few MB span many of them."""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from test_handover import _areas, _logged

import gatherstore as gs

CHUNK = 64 << 10
#: Two threads seal a sender's chunks only where the process may run on two CPUs.
_TWO_SEALERS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one thread seals")


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATHERSTORE_PART_CHUNK", str(CHUNK))
    monkeypatch.delenv("GATHERSTORE_TMPDIR", raising=False)
    monkeypatch.delenv("GATHERSTORE_HANDOVER", raising=False)


def _records(rank: int, count: int = 3000) -> list[dict[str, Any]]:
    """Per-image records of views of batch arrays and tensors, one ``meta`` dict for all."""
    boxes = np.arange(count * 40, dtype=np.float32).reshape(count, 10, 4) + rank
    logits = torch.arange(count * 16, dtype=torch.float32).view(count, 16) * (rank + 1)
    meta = {"rank": rank, "classes": ["cat", "dog"]}
    return [
        {"image_id": rank * count + i, "boxes": boxes[i], "logits": logits[i], "meta": meta}
        for i in range(count)
    ]


def _same(got: list[dict[str, Any]], rank: int) -> bool:
    expected = _records(rank)
    return (
        len(got) == len(expected)
        and all(item["meta"] is got[0]["meta"] for item in got)
        and all(
            a["image_id"] == b["image_id"]
            and np.array_equal(a["boxes"], b["boxes"])
            and torch.equal(a["logits"], b["logits"])
            for a, b in zip(got, expected, strict=True)
        )
    )


def _routes(run: Any) -> tuple[Any, list[str]]:
    """``run()``'s result and the routes of the calls it made (their DEBUG lines)."""
    out, log = _logged(run)
    return out, [
        line.split(": route ")[1].split(", ")[0] for line in log.splitlines() if ": route " in line
    ]


def _gathers() -> dict[str, Any]:
    rank, world = gs.get_rank(), gs.get_world_size()
    areas = _areas()

    def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        got = gs.gather_object(_records(rank), store="tmpdir", timeout=60)
        out["to 0"] = got is not None and all(_same(got[r], r) for r in range(world))
        # to another rank, with one sender whose part is small: it goes whole
        mine = {"small": rank} if rank == 1 else _records(rank)
        got = gs.gather_object(mine, dst=2, store="tmpdir", timeout=60)
        if got is not None:
            out["to 2"] = got[1] == {"small": 1} and _same(got[0], 0) and _same(got[2], 2)
        keyed = {record["image_id"]: record for record in _records(rank)}  # a dict by id
        got = gs.gather_object(keyed, store="tmpdir", timeout=60)
        out["keyed"] = got is not None and all(
            type(got[r]) is dict and _same(list(got[r].values()), r) for r in range(world)
        )
        out["after"] = gs.all_gather_object(rank, timeout=60)
        return out

    out, out_routes = _routes(run)
    return {**out, "routes": out_routes, "new_areas": sorted(_areas() - areas)}


@pytest.mark.timeout(180)
def test_long_lists_are_handed_over_in_chunks_and_rebuilt_whole() -> None:
    results = gs.launch(_gathers, nproc_per_node=3, backend="gloo", timeout=120)
    assert results[0]["to 0"] and results[2]["to 2"] and results[0]["keyed"], results
    for out in results:
        assert out["after"] == [0, 1, 2]
        assert out["routes"][:3] == ["tmpdir (handed over) in chunks"] * 3, out["routes"]
        assert out["new_areas"] == []  # nothing went through files


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise ValueError("item 2900 cannot be pickled")


def _refuse() -> Any:
    raise ValueError("this item cannot be rebuilt")


class _Fussy:
    """Pickles fine; rebuilding it raises."""

    def __reduce__(self) -> Any:
        return (_refuse, ())


def _outcome(run: Any) -> dict[str, Any]:
    try:
        run()
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "rank": getattr(exc, "rank", None),
            "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
        }
    return {"error": None}


def _failing(bad: str) -> dict[str, Any]:
    rank = gs.get_rank()
    gs.gather_object(_records(rank), store="tmpdir", timeout=60)  # every lazy resource made
    fds = len(os.listdir("/proc/self/fd"))
    mine: list[Any] = _records(rank)
    if rank == 1:  # late in the list: in a chunk well after the plan was agreed
        mine[2900] = _Unpicklable() if bad == "sender" else _Fussy()
    if bad == "late":  # the first chunk fails on the destination; rank 2 connects late
        if rank == 1:
            mine[0] = _Fussy()
        if rank == 2:  # its first chunk is sealed 2 s late, and it connects only then
            made, calls = os.memfd_create, itertools.count()
            os.memfd_create = lambda *a: (next(calls) or time.sleep(2.0), made(*a))[1]  # type: ignore[assignment]
    start = time.monotonic()
    out = _outcome(lambda: gs.gather_object(mine, store="tmpdir", timeout=60))
    out["seconds"] = time.monotonic() - start
    out["after"] = gs.gather_object(_records(rank), store="tmpdir", timeout=60) is not None
    out["fds"] = len(os.listdir("/proc/self/fd")) - fds
    return out


@pytest.mark.timeout(180)
def test_a_sender_that_fails_in_a_late_chunk_fails_the_call_on_every_rank() -> None:
    dst, sender, other = gs.launch(
        _failing, nproc_per_node=3, backend="gloo", args=("sender",), timeout=120
    )
    assert sender["error"] == "ValueError" and "2900" in sender["message"], sender
    for out in (dst, other):
        assert out["error"] == "RemoteRankError" and out["rank"] == 1, out
        assert "2900" in out["message"], out
    assert dst["after"] and not sender["after"]  # the next gather works
    assert all(out["fds"] <= 0 for out in (dst, sender, other))  # no descriptor left


@pytest.mark.timeout(180)
def test_a_chunk_the_destination_cannot_rebuild_stops_the_senders() -> None:
    dst, *senders = gs.launch(
        _failing, nproc_per_node=3, backend="gloo", args=("reader",), timeout=120
    )
    assert dst["error"] == "GatherError" and dst["cause"] == "ValueError", dst
    assert "part of rank 1" in dst["message"] and "cannot be rebuilt" in dst["message"], dst
    for out in senders:
        assert out["error"] == "RemoteRankError" and out["rank"] == 0, out
    assert dst["after"]
    assert all(out["fds"] <= 0 for out in (dst, *senders))


@pytest.mark.timeout(180)
def test_a_sender_that_connects_after_the_destination_stopped_stops_too() -> None:
    dst, *senders = gs.launch(
        _failing, nproc_per_node=3, backend="gloo", args=("late",), timeout=120
    )
    assert dst["error"] == "GatherError" and "part of rank 1" in dst["message"], dst
    for out in senders:
        assert out["error"] == "RemoteRankError" and out["rank"] == 0, out
        assert out["seconds"] < 30  # not the call's timeout of 60 s
    assert all(out["fds"] <= 0 for out in (dst, *senders))


def _first_chunk_sealed_last(fails: bool) -> dict[str, Any]:
    """Rank 1's memfd of its first chunk is made only once the one of its second chunk is,
    on the other thread (and then cannot be, with ``fails``): the first chunk is sealed
    last, and the second must wait its turn.  The first chunk asks for its memfd first:
    the second is still being encoded."""
    rank = gs.get_rank()
    gs.gather_object(_records(rank), store="tmpdir", timeout=60)  # every lazy resource made
    fds = len(os.listdir("/proc/self/fd"))
    made, asked, order, second = os.memfd_create, itertools.count(), [], threading.Event()

    def first_last(name: str, flags: int = os.MFD_CLOEXEC) -> int:
        index = next(asked)  # one at a time, whatever the threads
        if index == 0:
            assert second.wait(30), "the second chunk was not sealed beside the first"
            if fails:
                raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        fd = made(name, flags)
        order.append(index)
        second.set()
        return fd

    os.memfd_create = first_last  # type: ignore[assignment]
    got: list[Any] = []
    out = _outcome(lambda: got.append(gs.gather_object(_records(rank), store="tmpdir", timeout=60)))
    os.memfd_create = made
    out["same"] = bool(got) and (got[0] is None or all(_same(got[0][r], r) for r in range(2)))
    after = gs.gather_object(_records(rank), store="tmpdir", timeout=60)
    out["after"] = after is None or all(_same(after[r], r) for r in range(2))
    out["order"], out["fds"] = order, len(os.listdir("/proc/self/fd")) - fds
    return out


@_TWO_SEALERS
@pytest.mark.timeout(180)
def test_chunks_sealed_out_of_order_are_handed_over_in_order() -> None:
    dst, sender = gs.launch(
        _first_chunk_sealed_last, nproc_per_node=2, backend="gloo", args=(False,), timeout=120
    )
    assert dst["error"] is None and sender["error"] is None, (dst, sender)
    assert sender["order"][:2] == [1, 0], sender["order"]  # its second chunk went first
    assert dst["same"] and dst["after"] and dst["fds"] <= 0 and sender["fds"] <= 0


@_TWO_SEALERS
@pytest.mark.timeout(180)
def test_a_chunk_that_cannot_be_sealed_drops_the_chunks_sealed_after_it() -> None:
    dst, sender = gs.launch(
        _first_chunk_sealed_last, nproc_per_node=2, backend="gloo", args=(True,), timeout=120
    )
    refused = "could not be put in memory to hand over"
    assert sender["error"] == "GatherError" and refused in sender["message"], sender
    assert dst["error"] == "RemoteRankError" and dst["rank"] == 1, dst
    assert refused in dst["message"], dst
    assert sender["order"][:1] == [1]  # sealed, then dropped: its descriptor is closed
    assert dst["after"] and dst["fds"] <= 0 and sender["fds"] <= 0


def _one_rank_without_handover() -> dict[str, Any]:
    rank = gs.get_rank()
    if rank == 2:
        os.environ["GATHERSTORE_HANDOVER"] = "0"
    got, routes = _routes(lambda: gs.gather_object(_records(rank), store="tmpdir", timeout=60))
    return {
        "same": got is None or all(_same(got[r], r) for r in range(3)),
        "routes": routes,
    }


@pytest.mark.timeout(180)
def test_parts_that_cannot_be_handed_over_are_agreed_again_whole() -> None:
    results = gs.launch(_one_rank_without_handover, nproc_per_node=3, backend="gloo", timeout=120)
    for out in results:
        assert out["same"], out
        assert out["routes"] == ["tmpdir"], out  # files, every part whole
