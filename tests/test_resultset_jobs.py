"""gs.ResultSet in real jobs (gloo ranks started by gs.launch), real stores (file://,
Redis, S3 on SeaweedFS) and real signals: an evaluation whose rank is SIGKILLed is
continued at other world sizes and ends equal to an uninterrupted run; SIGTERM to every
rank keeps what they added; collect_results(resume=...) continues by dataset index; and
items() reads a set larger than its memory cgroup allows."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _rs_jobs import NAME, add_until_stopped, evaluate, redis_database, same, value
from cgroups import limit_to_room, run_in_memory_cgroup

import gatherstore as gs

N = 300  # samples of the evaluation


@pytest.fixture
def redis_url(gatherstore_redis_url: str) -> Iterator[str]:
    with redis_database(gatherstore_redis_url, 7) as url:
        yield url


@pytest.fixture
def s3_store(gatherstore_s3: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    from gatherstore.cli.bench.clients import fresh_bucket

    options = gatherstore_s3.storage_options
    with fresh_bucket(options, "results-jobs") as bucket:
        yield f"s3://{bucket}/evals", options


def store_for(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if kind == "file":
        return f"file://{tmp_path}/store"
    return request.getfixturevalue("redis_url" if kind == "redis" else "s3_store")


def logged(out: Path, rank: int) -> list[int]:
    path = out / f"added-{rank}"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def stored(store: Any) -> set[int]:
    """The keys the set holds, read by a process of its own (world size 1)."""
    opened = gs.open_store(store[0], **store[1]) if isinstance(store, tuple) else store
    rs = gs.ResultSet(NAME, store=opened)
    found = set(range(10**7)) - set(rs.pending(range(10**7)))
    rs.close()
    return found


def kill_at(out: Path, rank: int, fraction: float, killed: list[float]) -> None:
    """SIGKILL ``rank`` once it has added ``fraction`` of its share."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            done, share = map(int, (out / f"progress-{rank}").read_text().split())
        except (FileNotFoundError, ValueError):
            time.sleep(0.005)
            continue
        if done >= fraction * share:
            os.kill(int((out / f"pid-{rank}").read_text()), signal.SIGKILL)
            killed.append(done / share)
            return
        time.sleep(0.002)


def note(test: str, **facts: Any) -> None:
    print(f"\n[{test}] {facts}")


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "kind, at",
    [("file", 0.1), ("redis", 0.5), ("s3", 0.9)],  # each kill point, each store, once
    ids=lambda p: p if isinstance(p, str) else f"{int(p * 100)}%",
)
def test_a_rank_killed_mid_run_then_other_world_sizes_end_as_an_uninterrupted_run(
    kind: str, at: float, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    store = store_for(kind, request, tmp_path)
    runs = [tmp_path / f"run{i}" for i in range(3)]
    for out in runs:
        out.mkdir()
    killed: list[float] = []
    killer = threading.Thread(target=kill_at, args=(runs[0], 1, at, killed))
    killer.start()
    with pytest.raises(gs.RemoteRankError) as info:  # the launcher stops the others: SIGTERM
        gs.launch(
            evaluate, nproc_per_node=3, backend="gloo", args=(store, N, str(runs[0])),
            kwargs={"pace": 0.01}, timeout=120,
        )  # fmt: skip
    killer.join()
    assert info.value.rank == 1 and "SIGKILL" in str(info.value), info.value
    kept = stored(store)
    lost = [k for k in logged(runs[0], 1) if k not in kept]
    for rank in (0, 2):  # stopped with SIGTERM: all they added but the one under way is kept
        assert set(logged(runs[0], rank)[:-1]) <= kept
    # W=2 continues, and stops after half of its share
    second = gs.launch(
        evaluate, nproc_per_node=2, backend="gloo", args=(store, N, str(runs[1])),
        kwargs={"limit": (N - len(kept)) // 4, "gather": False}, timeout=120,
    )  # fmt: skip
    assert [todo for todo, _ in second] == [N - len(kept)] * 2
    # W=4 finishes and gathers
    third = gs.launch(
        evaluate, nproc_per_node=4, backend="gloo", args=(store, N, str(runs[2])), timeout=120
    )
    todo, merged = third[0]
    assert [r[1] for r in third[1:]] == [None, None, None]
    assert merged is not None and len(merged) == N
    assert all(same(v, value(i)) for i, v in enumerate(merged))
    note(
        f"{kind}, rank 1 SIGKILLed at {killed[0]:.0%}",
        stored_after_kill=len(kept),
        lost_by_the_killed_rank=len(lost),
        left_for_w4=todo,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["file", "redis"])
def test_sigterm_to_every_rank_keeps_every_value_added_before_it(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """No flush is due (the triggers are huge): only the signal's flush writes the values.
    Rank 2 has a SIGTERM handler of its own (SystemExit): it is kept, and flushes too."""
    store = store_for(kind, request, tmp_path)
    out = tmp_path / "out"
    out.mkdir()

    def stop_when_all_added() -> None:
        deadline = time.monotonic() + 120
        while min(len(logged(out, r)) for r in range(3)) < 30 and time.monotonic() < deadline:
            time.sleep(0.01)
        for rank in range(3):
            os.kill(int((out / f"pid-{rank}").read_text()), signal.SIGTERM)

    stopper = threading.Thread(target=stop_when_all_added)
    stopper.start()
    with pytest.raises(gs.RemoteRankError):
        gs.launch(
            add_until_stopped, nproc_per_node=3, backend="gloo", args=(store, str(out), 2),
            timeout=120,
        )  # fmt: skip
    stopper.join()
    kept = stored(store)
    for rank in range(3):
        added = logged(out, rank)
        # gatherstore's handler: all but the add under way as the signal came; rank 2's own
        # handler ends it in Python, after its last add
        assert set(added if rank == 2 else added[:-1]) <= kept, rank
    assert (out / "own-handler-2").exists()
    note("SIGTERM to every rank", added=[len(logged(out, r)) for r in range(3)], kept=len(kept))


def collect_twice(url: str) -> list[Any]:
    """Two collect_results(resume=...) calls in one job: the first leaves indices out."""
    rank, world = gs.get_rank(), gs.get_world_size()
    name = "collect/run"
    first = [i for i in range(rank, 6, world)]  # indices 0-5 only
    try:
        gs.collect_results([f"first-{i}" for i in first], 10, indices=first, resume=name, store=url)
        outcome: Any = None
    except ValueError as exc:
        outcome = str(exc)
    # interleaved, padded to 12 by a DistributedSampler: 10 and 11 repeat 0 and 1
    mine = [f"second-{i % 10}" for i in range(rank, 12, world)]
    return [outcome, gs.collect_results(mine, 10, resume=name, store=url)]


@pytest.mark.timeout(180)
def test_collect_results_resume_continues_by_dataset_index(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    results = gs.launch(collect_twice, nproc_per_node=3, backend="gloo", args=(url,), timeout=120)
    for outcome, _ in results:  # every rank names what is missing
        assert outcome is not None and "dataset indices 6, 7, 8, 9 (4 of 10 missing)" in outcome
    expected = [f"first-{i}" for i in range(6)] + [f"second-{i}" for i in range(6, 10)]
    assert [r[1] for r in results] == [expected, None, None]


def add_a_lock_on_rank_1(url: str, catch: bool) -> dict[str, Any]:
    """Rank 1 adds a value that cannot be pickled (caught, or left to end the rank),
    then every rank adds more and gathers; with ``catch``, collect_results(resume=...)
    too, where rank 1's results hold a lock."""
    rank, seen = gs.get_rank(), {}
    with gs.ResultSet("locks", store=url, timeout=600) as rs:
        rs.add(rank, value(rank))
        if rank == 1:
            try:
                rs.add(100, {"id": 100, "extra": {"mask": threading.Lock()}})
            except TypeError as exc:
                if not catch:
                    raise
                seen["add"] = str(exc)
        rs.add(10 + rank, value(10 + rank))
        got = rs.gather(keys=True)
        seen["gathered"] = None if got is None else [k for k, _ in got]
        seen["pending"] = rs.pending([0, 1, 10, 11, 100])
    mine: list[Any] = [f"r{rank}", {"mask": threading.Lock()} if rank == 1 else "fine"]
    try:
        gs.collect_results(mine, 4, resume="locks-collect", store=url, timeout=600)
    except (TypeError, gs.RemoteRankError) as exc:
        seen["collect"] = (type(exc).__name__, getattr(exc, "rank", rank), str(exc))
    return seen


@pytest.mark.timeout(180)
def test_a_value_that_cannot_be_pickled_fails_at_add_on_its_rank_and_the_job_goes_on(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}"
    zero, one = gs.launch(
        add_a_lock_on_rank_1, nproc_per_node=2, backend="gloo", args=(url, True), timeout=600
    )
    assert "add" not in zero
    assert one["add"].startswith(
        "result set 'locks': the value of key 100 cannot be pickled, so it was not added "
        "(TypeError: cannot pickle '_thread.lock' object — at value['extra']['mask']: "
    )
    assert zero["gathered"] == [0, 1, 10, 11] and one["gathered"] is None
    assert zero["pending"] == one["pending"] == [100]  # nothing of it was written
    # collect_results(resume=...) adds in a collective: rank 1 raises, rank 0 names it
    assert one["collect"][:2] == ("TypeError", 1) and "at value['mask']" in one["collect"][2]
    assert zero["collect"][:2] == ("RemoteRankError", 1)


@pytest.mark.timeout(180)
def test_a_rank_that_an_unpicklable_value_ends_is_named_by_launch_and_nobody_waits(
    tmp_path: Path,
) -> None:
    """Rank 0 waits in gather (timeout 600 s) for rank 1, which the TypeError of its add
    ends: launch names rank 1 and stops rank 0 at once."""
    with pytest.raises(gs.RemoteRankError) as caught:
        gs.launch(
            add_a_lock_on_rank_1,
            nproc_per_node=2,
            backend="gloo",
            args=(f"file://{tmp_path}", False),
            timeout=600,
        )
    assert caught.value.rank == 1
    assert caught.value.remote_message.startswith(
        "TypeError: result set 'locks': the value of key 100 cannot be pickled"
    )
    assert "rs.add(100," in caught.value.remote_traceback


def write_big(url: str, per_rank: int) -> int:
    """Each rank adds ``per_rank`` values of 64 KiB, interleaved by key."""
    import numpy as np

    rs = gs.ResultSet("big", store=url)
    rank, world = gs.get_rank(), gs.get_world_size()
    for i in range(rank, per_rank * world, world):
        rs.add(i, np.full(8192, i, dtype=np.int64))
    rs.close()
    return per_rank


def gather_big(url: str, limit_file: str, usage_file: str) -> str:
    """Every rank: gather the set once rank 0 has put the job's memory cgroup at 160 MiB
    over what its processes hold; what each raised."""
    if gs.get_rank() == 0:
        limit_to_room(limit_file, usage_file, 160 << 20)
    gs.barrier(timeout=60)
    try:
        gs.ResultSet("big", store=url).gather()
        return "no error"
    except gs.GatherError as exc:
        return type(exc).__name__


_IN_CGROUP = """
import os, sys
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
from pathlib import Path
import gatherstore as gs
import test_resultset_jobs as t
from cgroups import limit_to_room
from gatherstore.cli.bench.measure import PeakMemory
limit_file, usage_file, url, count = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
args = (url, limit_file, usage_file)
print(*gs.launch(t.gather_big, nproc_per_node=2, backend="gloo", args=args), flush=True)
rs = gs.ResultSet("big", store=url)
limit = limit_to_room(limit_file, usage_file, 160 << 20)  # this process alone now
seen = 0
with PeakMemory() as peak:
    for key, array in rs.items():
        assert key == seen and int(array[0]) == key and len(array) == 8192, key
        seen += 1
print(seen, peak.growth, limit, flush=True)
"""


@pytest.mark.timeout(400)
def test_items_reads_a_set_larger_than_its_memory_cgroup(tmp_path: Path) -> None:
    """items() reads it all without an OOM kill; gather() of it is refused on every rank
    (InsufficientMemoryError) before anything is read."""
    url = f"file://{tmp_path}"
    per_rank = 2500  # 4 ranks x 2500 x 64 KiB: 625 MiB, more than the cgroup's whole limit
    gs.launch(write_big, nproc_per_node=4, backend="gloo", args=(url, per_rank), timeout=300)
    done, oom = run_in_memory_cgroup(_IN_CGROUP, [url, str(4 * per_rank)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    refused, found = done.stdout.splitlines()
    # a gather that cannot fit is refused on every rank before anything is read
    assert refused.split() == ["InsufficientMemoryError"] * 2, done.stdout
    seen, growth, limit = map(int, found.split())
    assert seen == 4 * per_rank
    assert 4 * per_rank * 8192 * 8 > limit
    assert "oom_kill 0" in oom, oom
    note("items() in a memory cgroup", values=seen, limit_mib=limit >> 20, growth_mib=growth >> 20)
