"""``tmpdir`` in RAM between the ranks of one machine: parts handed over as sealed memfds.

Real gloo groups of real processes, real sockets and memfds (the handover alone, in one
process: test_memfd.py).
"""

from __future__ import annotations

import errno
import gc
import io
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gatherstore as gs
from gatherstore.cli.bench.measure import PeakMemory


def _logged(run: Any) -> tuple[Any, str]:
    """``run()``'s result and the DEBUG lines gatherstore logged meanwhile."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("gatherstore")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        return run(), stream.getvalue()
    finally:
        logger.removeHandler(handler)


def _areas() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("gatherstore-*")}


def _every_collective() -> dict[str, Any]:
    rank, world = gs.get_rank(), gs.get_world_size()
    scores = torch.arange(1 << 16, dtype=torch.float32) + rank
    record = {"rank": rank, "scores": scores, "boxes": scores.view(-1, 4)[:, 1:3]}
    areas = _areas()

    def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        got = gs.gather_object(record, store="tmpdir")
        if got is not None:
            theirs = got[1]
            out["same_storage"] = (
                theirs["boxes"].untyped_storage().data_ptr()
                == theirs["scores"].untyped_storage().data_ptr()
            )
            theirs["scores"][0] = -1.0  # writable, copied on write
            out["views"] = float(theirs["boxes"][0, 0]) == float(theirs["scores"][1])
            out["gather"] = [(r["rank"], float(r["scores"][5])) for r in got]
        everyone = gs.all_gather_object(record, store="tmpdir")
        out["all"] = [(r["rank"], float(r["scores"][5])) for r in everyone]
        out["bcast"] = gs.broadcast_object(record if rank == 1 else None, src=1, store="tmpdir")
        out["bcast"] = (out["bcast"]["rank"], float(out["bcast"]["scores"][5]))
        out["iter"] = [r["rank"] for r in gs.gather_iter(record, dst=world - 1, store="tmpdir")]
        return out

    out, log = _logged(run)
    out["log"] = log
    out["new_areas"] = sorted(_areas() - areas)
    return out


@pytest.mark.timeout(180)
def test_every_collective_hands_parts_over_in_ram(monkeypatch: Any) -> None:
    monkeypatch.delenv("GATHERSTORE_TMPDIR", raising=False)
    monkeypatch.delenv("GATHERSTORE_HANDOVER", raising=False)
    ranks = gs.launch(_every_collective, nproc_per_node=3, backend="gloo")
    for rank, out in enumerate(ranks):
        lines = [line for line in out["log"].splitlines() if ": route " in line]
        assert len(lines) == 4 and all("route tmpdir (handed over)" in x for x in lines), out
        assert out["all"] == [(r, 5.0 + r) for r in range(3)]
        assert out["bcast"] == (1, 6.0)
        assert out["iter"] == ([0, 1, 2] if rank == 2 else [])
        assert out["new_areas"] == []  # no job folder: nothing went through files
    assert ranks[0]["gather"] == [(0, 5.0), (1, 6.0), (2, 7.0)]
    assert ranks[0]["same_storage"] and ranks[0]["views"]


ITER_PART = 40 << 20
ITER_READ_AHEAD = 1 << 20


def _iterated_peak() -> dict[str, Any]:
    """The destination's peak memory while it iterates 40 MiB parts, one at a time."""
    part = np.full(ITER_PART, gs.get_rank(), dtype=np.uint8)
    seen = []

    def run() -> None:
        with PeakMemory() as mem:
            parts = gs.gather_iter(part, store="tmpdir", timeout=60, read_ahead=ITER_READ_AHEAD)
            for got in parts:
                seen.append(int(got[0]) if got.min() == got.max() else -1)
                del got
        out["growth"], out["reset"] = mem.growth, mem.reset

    out: dict[str, Any] = {}
    _, log = _logged(run)
    out["seen"], out["route"] = seen, [x for x in log.splitlines() if ": route " in x]
    return out


@pytest.mark.timeout(120)
def test_gather_iter_holds_one_part_handed_over_at_a_time(monkeypatch: Any) -> None:
    """The part its loop let go is unmapped before the next one is mapped and verified:
    the destination holds one part plus at most its read-ahead budget (nothing is
    read ahead here), not two parts."""
    monkeypatch.delenv("GATHERSTORE_TMPDIR", raising=False)
    monkeypatch.delenv("GATHERSTORE_HANDOVER", raising=False)
    first, *others = gs.launch(_iterated_peak, nproc_per_node=3, backend="gloo")
    assert first["seen"] == [0, 1, 2]
    assert first["route"] and all("route tmpdir (handed over)" in x for x in first["route"])
    assert [o["seen"] for o in others] == [[], []]
    if not first["reset"]:
        pytest.skip("/proc/self/clear_refs is not writable here")
    # one part mapped at a time: about 1.0; the part before still mapped: about 2.0
    assert first["growth"] < 1.5 * ITER_PART + ITER_READ_AHEAD, first["growth"] / ITER_PART


def _gather_route() -> str:
    _, log = _logged(lambda: gs.gather_object(bytes(1 << 20), store="tmpdir"))
    return next(line for line in log.splitlines() if ": route " in line)


@pytest.mark.timeout(120)
def test_turned_off_the_parts_are_files(monkeypatch: Any) -> None:
    monkeypatch.delenv("GATHERSTORE_TMPDIR", raising=False)
    monkeypatch.setenv("GATHERSTORE_HANDOVER", "0")
    lines = gs.launch(_gather_route, nproc_per_node=2, backend="gloo")
    assert all("route tmpdir, " in line for line in lines), lines


def _two_groups_at_once() -> tuple[list[int], str]:
    """All-gather on this rank's group of 2 while the other group does on its own."""
    group, _ = torch.distributed.new_subgroups(2)
    part = np.full(1 << 17, gs.get_rank(), dtype=np.int64)
    got, log = _logged(lambda: gs.all_gather_object(part, group=group, store="tmpdir", timeout=30))
    return [int(p[0]) for p in got], log


@pytest.mark.timeout(120)
def test_two_groups_hand_parts_over_at_once_each_to_its_own(monkeypatch: Any) -> None:
    """Each group's ranks publish their sockets under the group's own keys (the exchange
    thread that writes them runs in the call's group): no part goes to the other group."""
    monkeypatch.delenv("GATHERSTORE_TMPDIR", raising=False)
    monkeypatch.delenv("GATHERSTORE_HANDOVER", raising=False)
    ranks = gs.launch(_two_groups_at_once, nproc_per_node=4, backend="gloo", timeout=60)
    assert [got for got, _ in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all("route tmpdir (handed over)" in log for _, log in ranks)


def _open_parts() -> int:
    """How many handed-over parts this process holds open."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed since
            continue
    return sum("memfd:gatherstore-part" in link for link in links)


def _connections_waiting() -> bool:
    """Whether a connection waits to be accepted on a listening Unix socket of this
    process (polled, not accepted: the socket is left as it was)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:  # the listing's own descriptor, closed since
            continue
        with sock:
            if sock.family != socket.AF_UNIX:
                continue
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            poll = select.poll()
            poll.register(sock, select.POLLIN)
            if poll.poll(0):
                return True
    return False


def _failed_call_then_another() -> dict[str, Any]:
    rank = gs.get_rank()
    gs.gather_object(0, store="tmpdir")  # the listener and the pools exist from here on
    real = os.memfd_create
    if rank == 2:  # this rank's part cannot be put in memory; rank 1's was handed over

        def no_memory(*args: Any) -> int:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

        os.memfd_create = no_memory
    try:
        gs.gather_object(torch.full((1 << 18,), 1.0 + rank), store="tmpdir")
        failure = ""
    except gs.GatherError as exc:
        failure = f"{type(exc).__name__}: {exc}"
    os.memfd_create = real
    waiting = _connections_waiting()  # what the failed call left on this process's socket
    after = gs.gather_object(torch.full((1 << 18,), 10.0 + rank), store="tmpdir")
    unread = gs.gather_iter(torch.zeros(1 << 18), store="tmpdir")
    del unread  # never started: its parts are closed all the same
    gc.collect()
    return {
        "failure": failure,
        "after": None if after is None else [float(t[0]) for t in after],
        "open": _open_parts(),
        "waiting": waiting,
    }


@pytest.mark.timeout(180)
def test_a_failed_handover_fails_every_rank_and_leaves_nothing_behind(
    monkeypatch: Any,
) -> None:
    monkeypatch.delenv("GATHERSTORE_TMPDIR", raising=False)
    monkeypatch.delenv("GATHERSTORE_HANDOVER", raising=False)
    ranks = gs.launch(_failed_call_then_another, nproc_per_node=3, backend="gloo")
    mine = ranks[2]["failure"]
    assert mine.startswith("GatherError: this rank's part (") and "Cannot allocate" in mine
    assert "free memory on this machine, or gather through a store on disk" in mine
    for other in ranks[:2]:
        assert other["failure"].startswith("RemoteRankError: rank 2 failed"), other
        assert "could not be put in memory" in other["failure"]
    # the next call has its own parts, never the failed call's part of rank 1
    assert ranks[0]["after"] == [10.0, 11.0, 12.0]
    # rank 1's memfd of the failed call is closed, not kept by rank 0's socket; so are
    # the parts of a gather_iter dropped unread
    assert [out["waiting"] for out in ranks] == [False, False, False]
    assert [out["open"] for out in ranks] == [0, 0, 0]


_GONE = """
import os, sys, time
from pathlib import Path
import torch
import gatherstore as gs

gs.init_from_env()
rank, flag = gs.get_rank(), Path(sys.argv[1])
parts = gs.gather_iter(torch.full((1 << 20,), 3.0 + rank), store="tmpdir")
if rank == 1:  # gone once its call returned: its part is in flight to rank 0 all the same
    flag.write_text(str(os.getpid()))
    os._exit(0)
if rank == 0:
    ends = time.monotonic() + 60
    while not flag.exists() or not flag.read_text():
        assert time.monotonic() < ends
        time.sleep(0.05)
    pid = int(flag.read_text())
    while Path(f"/proc/{pid}/status").exists() and "zombie" not in Path(
        f"/proc/{pid}/status"
    ).read_text():
        assert time.monotonic() < ends
        time.sleep(0.05)
    print("RESULT", [float(t[0]) for t in parts], flush=True)
os._exit(0)  # rank 1 left the job: no shutdown meeting
"""


@pytest.mark.timeout(180)
def test_a_part_outlives_its_sender(tmp_path: Path) -> None:
    """A sender that exits once its gather_iter returned: rank 0 reads its part after
    the process is gone (the memfd travels in the socket's message)."""
    script = tmp_path / "gone.py"
    script.write_text(_GONE)
    env = {**os.environ, "GATHERSTORE_HANDOVER": "1"}
    env.pop("GATHERSTORE_TMPDIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "3", str(script), str(tmp_path / "flag")],
        env=env, capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    assert "RESULT [3.0, 4.0, 5.0]" in done.stdout, done.stdout + done.stderr


_SMALL_SHM = """
import io, logging, sys
import torch
import gatherstore as gs


def job():
    stream = io.StringIO()
    logger = logging.getLogger("gatherstore")
    logger.addHandler(logging.StreamHandler(stream))
    logger.setLevel(logging.DEBUG)
    out = gs.gather_object(torch.ones(16 << 20), store="tmpdir")  # 64 MiB a rank
    route = next(line for line in stream.getvalue().splitlines() if ": route " in line)
    return route, None if out is None else [float(t.sum()) for t in out]


if __name__ == "__main__":
    route, sums = gs.launch(job, nproc_per_node=2)[0]
    print("ROUTE", route.split(": route ")[1].split(",")[0])
    print("SUMS", sums)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_small_dev_shm_no_longer_sends_the_parts_to_disk(tmp_path: Path, setting: str) -> None:
    """A container's small /dev/shm (here a 16 MiB tmpfs in a mount namespace of its
    own): parts handed over need RAM, not room there; as files they go to the temp dir."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a mount namespace of its own needs root and unshare")
    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM)
    env = {**os.environ, "GATHERSTORE_HANDOVER": setting}
    env.pop("GATHERSTORE_TMPDIR", None)
    inside = f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} {script}"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", inside],
        env=env, capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    expected = "tmpdir (handed over)" if setting == "1" else f"tmpdir://{tempfile.gettempdir()}"
    assert f"ROUTE {expected}\n" in done.stdout, done.stdout + done.stderr
    assert "SUMS [16777216.0, 16777216.0]" in done.stdout
