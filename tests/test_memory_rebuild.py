"""The memory check counts what unpickling allocates, and a wrong estimate still ends in
an error, not a kernel OOM kill (real memory cgroups, real processes)."""

from __future__ import annotations

import pickle
import re
from typing import Any

import pytest
from cgroups import limit_to_room, run_in_memory_cgroup

import gatherstore as gs


def _inflate(seed: bytes) -> bytes:
    return seed * 20


class Inflating:
    """Looks like its 1 KB seed; rebuilds into 20 KB."""

    def __init__(self, seed: bytes) -> None:
        self.seed = seed

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inflate, (self.seed,))


def _records(rank: int) -> list[dict[str, Any]]:
    """Small records, about 10x bigger rebuilt than pickled."""
    return [{"id": i, "score": i * 0.5, "label": f"r{rank}-{i}"} for i in range(400_000)]


def _job(case: str, limit_file: str, usage_file: str) -> str:
    rank = gs.get_rank()
    obj: Any = (
        _records(rank)
        if case == "records"
        else [Inflating(bytes([i % 256]) * 1000) for i in range(20_000)]
    )
    pickled = len(pickle.dumps(obj[:1000], protocol=5)) * len(obj) // 1000
    gs.barrier(timeout=120)
    if rank == 0:  # room for 4x the pickled parts of the job beyond what it holds now (page
        # cache aside): enough to pickle and write them, not to rebuild two parts of records
        limit_to_room(limit_file, usage_file, 4 * 3 * pickled)
    gs.barrier(timeout=120)
    try:
        gathered = gs.gather_object(obj, store="tmpdir", timeout=120)
        return "no error" if gathered is None or rank else f"gathered {len(gathered)}"
    except gs.GatherError as exc:
        return f"{type(exc).__name__}: {exc}"


_IN_CGROUP = """
import os, sys
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
import gatherstore as gs, test_memory_rebuild as t
args = (sys.argv[4], sys.argv[2], sys.argv[3])  # case, limit file, usage file
for line in gs.launch(t._job, nproc_per_node=3, backend="gloo", args=args):
    print(repr(line))
"""


def _run_in_cgroup(case: str) -> tuple[list[str], str]:
    done, oom = run_in_memory_cgroup(_IN_CGROUP, [case], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [eval(line) for line in done.stdout.splitlines()], oom


@pytest.mark.timeout(360)
def test_small_records_that_would_not_fit_rebuilt_fail_on_every_rank_before_moving() -> None:
    lines, oom = _run_in_cgroup("records")
    assert len(lines) == 3
    for line in lines:
        assert line.startswith("InsufficientMemoryError"), lines
    assert "unpickling" in lines[0], lines[0]
    assert "oom_kill 0" in oom, oom


@pytest.mark.timeout(360)
def test_a_rebuild_far_past_its_estimate_stops_before_the_kernel_kills() -> None:
    lines, oom = _run_in_cgroup("inflating")
    assert lines[0].startswith("InsufficientMemoryError"), lines
    # rank 1's part, or rank 2's where a loaded machine sends the parts in chunks (a first
    # chunk slow to encode), which are rebuilt as they come
    assert re.search(r"rebuilding the part of rank [12]\b", lines[0]), lines[0]
    assert lines[1:] == ["no error", "no error"], lines
    assert "oom_kill 0" in oom, oom
