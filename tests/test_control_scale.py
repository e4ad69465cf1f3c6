"""The control exchange: one gather per call, one verdict everywhere, no key left behind."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import gatherstore as gs
from gatherstore.cli.bench import scale
from gatherstore.job.exchange import Outcome, _pack, _unpack, exchange_on, wait_for_readers
from gatherstore.testing.services import free_ports


def test_simulated_ranks_agree_and_leave_no_key() -> None:
    world = 24

    def body(store: Any, rank: int) -> list[Any]:
        out = []
        for step in range(3):
            out.append(exchange_on(store, f"{step}/", rank, world, b"r%d" % rank, timeout=30))
        return out

    results, server = scale.simulate(world, body)
    expected = Outcome(values=[b"r%d" % r for r in range(world)])
    assert all(result == [expected] * 3 for result in results), results
    assert server.num_keys() == 0


@pytest.mark.timeout(60)
def test_a_rank_0_that_hosts_the_store_returns_once_every_rank_read() -> None:
    world = 5

    def body(store: Any, rank: int) -> Any:
        return exchange_on(store, "h/", rank, world, b"r%d" % rank, timeout=30, rank0_hosts=True)

    results, server = scale.simulate(world, body)
    assert results == [Outcome(values=[b"r%d" % r for r in range(world)])] * world
    assert server.num_keys() == 0


def test_equal_values_are_sent_once() -> None:
    values = [b"same"] * 1000 + [b"other"] + [b"same"] * 23
    packed = _pack(values)
    assert len(packed) < 64
    assert _unpack(packed) == values
    assert _unpack(_pack([])) == []
    assert _unpack(_pack([b"", b"a", b""])) == [b"", b"a", b""]


def test_a_summary_reaches_every_rank_and_the_values_only_the_full_ranks() -> None:
    """The last arriver summarises once; rank 3 alone gets every value; nothing remains."""
    world, calls = 16, []

    def summarize(values: list[bytes]) -> bytes:
        calls.append(len(values))
        return b"%d" % sum(int(v) for v in values)

    def body(store: Any, rank: int) -> Any:
        return exchange_on(
            store, "s/", rank, world, b"%d" % rank, timeout=30, summarize=summarize, full=[3]
        )

    results, server = scale.simulate(world, body)
    total = b"%d" % sum(range(world))
    values = [b"%d" % r for r in range(world)]
    assert results == [
        Outcome(values=values if rank == 3 else None, summary=total) for rank in range(world)
    ]
    assert calls == [world]
    assert server.num_keys() == 0


def test_a_summary_that_declines_or_fails_sends_every_value() -> None:
    world = 6

    def body(store: Any, rank: int) -> Any:
        def summarize(values: list[bytes]) -> bytes | None:
            if rank % 2:
                raise ValueError("a bug in the summary")
            return None

        return exchange_on(
            store, "n/", rank, world, b"v%d" % rank, timeout=30, summarize=summarize, full=[]
        )

    results, server = scale.simulate(world, body)
    assert results == [Outcome(values=[b"v%d" % r for r in range(world)])] * world
    assert server.num_keys() == 0


@pytest.mark.timeout(60)
def test_simulated_late_ranks_get_the_verdict_of_the_first_timeout() -> None:
    """Ranks time out after 1 s, and ranks 5 and 9 arrive only once one of them has its
    verdict: everyone, the late ranks too, names [5, 9]; rank 0, which would wait an hour,
    adopts the verdict (else the test times out); nothing remains."""
    world, late = 12, (5, 9)
    on_time = threading.Barrier(world - len(late))  # they arrive together, well within 1 s
    judged = threading.Event()

    def body(store: Any, rank: int) -> Any:
        if rank in late:
            judged.wait(50)
            return exchange_on(store, "x/", rank, world, b"v", timeout=1)
        on_time.wait(50)
        try:
            return exchange_on(store, "x/", rank, world, b"v", timeout=3600 if rank == 0 else 1)
        finally:
            judged.set()

    results, server = scale.simulate(world, body)
    assert results == [Outcome(late=[5, 9])] * world
    assert server.num_keys() == 0


class _Stalls:
    """A rank's real store client that, having published its value, stalls before it
    counts itself in until ``until`` is set (a rank descheduled between the two)."""

    def __init__(self, store: Any, until: threading.Event) -> None:
        self.store, self.until = store, until

    def add(self, key: str, amount: int) -> int:
        if key.endswith("arrived"):
            self.until.wait(50)
        return int(self.store.add(key, amount))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@pytest.mark.timeout(60)
def test_a_last_arriver_that_stalls_past_the_judge_still_gets_the_verdict() -> None:
    """Every key is in, but the last arriver stalls before it gathers until the others
    have their verdict: the judge (timeouts of 1 s) gathers and publishes them itself;
    the stalled rank's own gathering must still find every key, every rank gets the
    values, and nothing remains."""
    world = 6
    judged = threading.Event()

    def body(store: Any, rank: int) -> Any:
        if rank == 5:
            return exchange_on(_Stalls(store, judged), "j/", rank, world, b"5", timeout=1, full=[0])
        try:
            return exchange_on(store, "j/", rank, world, b"%d" % rank, timeout=1, full=[0])
        finally:
            judged.set()

    results, server = scale.simulate(world, body, timeout=30)
    assert results == [Outcome(values=[b"%d" % r for r in range(world)])] * world
    assert server.num_keys() == 0


@pytest.mark.parametrize("algorithm", list(scale.ALGORITHMS))
def test_scale_bench_runs(algorithm: str) -> None:
    assert scale.run_exchange(algorithm, 8, repeats=1) > 0


# --- real gloo groups -------------------------------------------------------------------------


def _exchange_job(signals: str) -> dict[str, Any]:
    from gatherstore.job import control

    rank, out = gs.get_rank(), {}
    out["values"] = control.exchange(b"%d" % rank, timeout=30, what="values")
    out["summary"] = control.exchange_summary(
        b"%d" % rank,
        timeout=30,
        what="summary",
        summarize=lambda values: b"%d" % sum(map(int, values)),
        full=[1],
    )
    # rank 2 arrives once rank 1 gave up (after 5 s); rank 0 would wait 60 s
    gave_up = Path(signals, "rank-1-gave-up")
    end = time.monotonic() + 60
    while rank == 2 and not gave_up.exists() and time.monotonic() < end:
        time.sleep(0.02)
    try:
        control.exchange(b"", timeout={0: 60, 1: 5, 2: 60}[rank], what="late")
    except gs.GatherTimeout as exc:
        out["late"] = exc.ranks
    if rank == 1:
        gave_up.touch()
    try:
        control.exchange(b"", timeout=30, what="other" if rank == 1 else "mine")
    except gs.GatherError as exc:
        out["mismatch"] = type(exc).__name__
    out["after"] = control.exchange(b"%d" % rank, timeout=30, what="after")
    control.exchange(b"", timeout=30, what="sync")  # every earlier call has been tidied
    steps, store = control.step(), control.store()
    names = ["arrived", "all", "full", "read", "judge", "done"]
    names += [str(r) for r in range(gs.get_world_size())]
    out["left"] = [
        f"{step}/{name}"
        for step in range(1, steps - 1)
        for name in names
        if store.check([f"{step}/{name}"])
    ]
    return out


@pytest.mark.timeout(120)
def test_exchange_in_a_gloo_group_hosted_by_rank_0(tmp_path: Path) -> None:
    results = gs.launch(
        _exchange_job,
        nproc_per_node=3,
        backend="gloo",
        master_port=free_ports()[0],
        args=(str(tmp_path),),
    )
    for rank, out in enumerate(results):
        assert out["values"] == [b"0", b"1", b"2"]
        assert out["summary"] == ([b"0", b"1", b"2"] if rank == 1 else None, b"3")
        assert out["late"] == [2]
        assert out["mismatch"] == "MismatchError"
        assert out["after"] == [b"0", b"1", b"2"]
        assert out["left"] == []


@pytest.mark.timeout(60)
def test_a_rank_0_that_hosts_the_store_does_not_wait_for_a_reader_that_died() -> None:
    """Rank 2 counts itself in and dies before it reads: rank 0 (the store's host) waits
    for the readers a second at most, not the exchange's timeout, and gets the values
    with the key that says when all have read; only its exit waits for that key."""
    world = 3

    def body(store: Any, rank: int) -> Any:
        if rank == 2:  # arrives, never reads
            store.set("x/2", b"r2")
            store.add("x/arrived", 1)
            return None
        time.sleep(0.2)  # after rank 2
        return exchange_on(store, "x/", rank, world, b"r%d" % rank, timeout=600, rank0_hosts=True)

    results, server = scale.simulate(world, body, timeout=60)
    values = [b"r0", b"r1", b"r2"]
    assert results[:2] == [Outcome(values=values, unread="x/done"), Outcome(values=values)]
    wait_for_readers(server, "x/done", 0.2)  # never set: gives up after its timeout
    server.set("x/done", b"")  # the last reader's mark: taken, and removed
    wait_for_readers(server, "x/done", 600)
    assert not server.check(["x/done"])
