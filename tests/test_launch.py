"""gs.launch: results in rank order, shipped callables, failures and clean-up."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import gatherstore as gs


def pid_is_running(pid: int) -> bool:
    """Whether ``pid`` names a live (not zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def assert_children_gone(pid_dir: Path, expected: int) -> None:
    pids = [int(p.read_text()) for p in sorted(pid_dir.iterdir())]
    assert len(pids) == expected
    assert not [pid for pid in pids if pid_is_running(pid)]
    assert not [c for c in multiprocessing.active_children() if c.pid in pids]


def _record_pid(pid_dir: str) -> int:
    rank = gs.get_rank()
    Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    return rank


# --- results -------------------------------------------------------------------------------


def _identify(tag: str, *, scale: int) -> dict[str, Any]:
    return {
        "rank": gs.get_rank(),
        "tag": tag,
        "scaled": scale * gs.get_rank(),
        "pid": os.getpid(),
        "distributed": gs.is_distributed(),
    }


@pytest.mark.timeout(120)
def test_results_come_back_in_rank_order_with_args_and_kwargs() -> None:
    results = gs.launch(
        _identify, nproc_per_node=3, backend="gloo", args=("x",), kwargs={"scale": 10}
    )
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["scaled"] for r in results] == [0, 10, 20]
    assert {r["tag"] for r in results} == {"x"}
    assert all(r["distributed"] for r in results)
    assert len({r["pid"] for r in results} | {os.getpid()}) == 4  # one new process per rank
    assert not gs.is_distributed()


@pytest.mark.timeout(120)
def test_lambdas_and_closures_are_shipped_with_cloudpickle() -> None:
    offset = 100
    data = {"label": "closure"}

    def closure(extra: int) -> tuple[str, int]:
        return data["label"], offset + extra + gs.get_rank()

    assert gs.launch(closure, nproc_per_node=2, backend="gloo", args=(5,)) == [
        ("closure", 105),
        ("closure", 106),
    ]
    assert gs.launch(lambda: gs.get_world_size() * 7, backend="gloo") == [7]


@pytest.mark.timeout(120)
def test_a_single_process_job() -> None:
    (described,) = gs.launch(gs.describe, nproc_per_node=1, backend="gloo")
    assert described["world_size"] == 1
    assert described["is_distributed"] is True
    assert described["backend"] == "gloo"


# --- bad arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"nproc_per_node": 0}, "nproc_per_node=0"),
        ({"nproc_per_node": -1}, "nproc_per_node=-1"),
        ({"nnodes": 0}, "nnodes=0"),
        ({"nnodes": 2, "node_rank": 2, "master_port": 29500}, "node_rank=2"),
        ({"node_rank": -1}, "node_rank=-1"),
        ({"nnodes": 2}, "master_port"),
        ({"timeout": -1}, "timeout"),
        ({"timeout": "soon"}, "timeout"),
    ],
)
def test_bad_arguments_raise_value_error_before_starting_anything(
    options: dict[str, Any], match: str
) -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=match):
        gs.launch(_identify, backend="gloo", args=("x",), kwargs={"scale": 1}, **options)
    assert set(multiprocessing.active_children()) == before


# --- failures --------------------------------------------------------------------------------


def _rank_one_raises(pid_dir: str) -> None:
    rank = _record_pid(pid_dir)
    gs.barrier()  # every pid is on disk before anyone fails
    if rank == 1:
        raise ValueError("boom")
    if rank == 0:
        time.sleep(600)
    gs.barrier()  # the others wait here for rank 1, who never comes


@pytest.mark.timeout(180)
def test_a_child_exception_is_raised_in_the_parent_and_the_others_are_stopped(
    tmp_path: Path,
) -> None:
    start = time.monotonic()
    with pytest.raises(gs.RemoteRankError) as caught:
        gs.launch(_rank_one_raises, nproc_per_node=3, backend="gloo", args=(str(tmp_path),))
    error = caught.value
    assert time.monotonic() - start < 150  # nobody waited for the sleeper
    assert error.rank == 1
    assert error.ranks == [1]
    assert "boom" in str(error)
    assert "ValueError: boom" in error.remote_message
    assert "Traceback (most recent call last)" in error.remote_traceback
    assert 'raise ValueError("boom")' in error.remote_traceback
    assert "_rank_one_raises" in error.remote_traceback
    assert isinstance(error, gs.GatherError) and isinstance(error, RuntimeError)
    assert_children_gone(tmp_path, 3)


def _stuck_before_a_gather(pid_dir: str, called: str) -> Any:
    rank = _record_pid(pid_dir)
    if rank == 1:
        time.sleep(3600)  # stuck: never reaches the gather
    if rank == 0:
        Path(called).write_text(repr(time.time()))
    return gs.gather_object(rank)


@pytest.mark.timeout(180)
def test_a_stuck_rank_ends_launch_at_its_timeout_named_and_quietly(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """launch's timeout is its ranks' default: their gather gives up on the stuck rank
    after 5 s, not GATHERSTORE_TIMEOUT's 30 min, and names it; launch raises that, with
    nothing of torch's (c10d's warnings, tracebacks) on stderr."""
    pids, called = tmp_path / "pids", tmp_path / "called"
    pids.mkdir()
    with pytest.raises(gs.GatherTimeout) as caught:
        gs.launch(
            _stuck_before_a_gather,
            nproc_per_node=3,
            backend="gloo",
            args=(str(pids), str(called)),
            timeout=5,
        )
    after_call = time.time() - float(called.read_text())
    error = caught.value
    assert error.ranks == [1] and error.timeout == 5
    assert str(error).startswith("gather_object: rank 1 did not arrive within 5 s: ")
    assert "\n" not in str(error)
    # 5 s, its collective's grace and STOP_GRACE (15 s at most), and room for a busy machine
    assert after_call < 60
    noise = [
        line
        for line in capfd.readouterr().err.splitlines()
        if "c10d" in line or "[W" in line or "Traceback" in line
    ]
    assert noise == []
    assert_children_gone(pids, 3)


def _rank_one_exits(pid_dir: str, how: str) -> None:
    rank = _record_pid(pid_dir)
    gs.barrier()
    if rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does
    time.sleep(60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("how", "said"),
    [("exit", "exited with code 3"), ("kill", "was killed by SIGKILL")],
)
def test_a_child_that_dies_is_named_with_how(tmp_path: Path, how: str, said: str) -> None:
    with pytest.raises(gs.RemoteRankError) as caught:
        gs.launch(_rank_one_exits, nproc_per_node=2, backend="gloo", args=(str(tmp_path), how))
    assert caught.value.rank == 1
    assert said in str(caught.value)
    assert_children_gone(tmp_path, 2)


@pytest.mark.timeout(120)
def test_an_unpicklable_result_is_a_remote_error() -> None:
    with pytest.raises(gs.RemoteRankError, match="lock") as caught:
        gs.launch(threading.Lock, backend="gloo")
    assert caught.value.rank == 0


def _exit_cleanly_with_system_exit() -> None:
    raise SystemExit(5)


@pytest.mark.timeout(120)
def test_system_exit_in_a_child_is_reported() -> None:
    with pytest.raises(gs.RemoteRankError, match="SystemExit: 5"):
        gs.launch(_exit_cleanly_with_system_exit, backend="gloo")


def run_script(path: Path, text: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Write ``text`` to ``path`` and run it as a main script, in its folder."""
    path.write_text(text)
    command = [sys.executable, str(path), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=path.parent)


def _rank_one_cannot_ship_and_reports_late() -> Any:
    mine: Any = threading.Lock() if gs.get_rank() == 1 else gs.get_rank()
    try:
        return gs.gather_object(mine, store="tmpdir", timeout=60)
    except TypeError:
        time.sleep(2)  # rank 0's RemoteRankError, which relays this one, reaches launch first
        raise


@pytest.mark.timeout(120)
def test_a_failure_relayed_by_rank_0_is_reported_as_the_failing_rank_s() -> None:
    with pytest.raises(gs.RemoteRankError) as caught:
        gs.launch(_rank_one_cannot_ship_and_reports_late, nproc_per_node=2, backend="gloo")
    error = caught.value
    assert error.rank == 1
    assert str(error).startswith("rank 1 failed in launch: TypeError: cannot pickle")
    assert str(error).count("--- traceback of rank") == 1
    assert error.remote_traceback.count("Traceback (most recent call last)") == 1
    assert "_rank_one_cannot_ship_and_reports_late" in error.remote_traceback


SCRIPT_FAILING_ON_RANK_1 = """
import threading
import gatherstore as gs

def evaluate(what):
    if gs.get_rank() == 1:
        if what == "raise":
            raise ValueError("bad sample")
        return gs.gather_object(threading.Lock(), store="tmpdir", timeout=60)
    return gs.gather_object(0, store="tmpdir", timeout=60)

if __name__ == "__main__":
    import sys
    gs.launch(evaluate, nproc_per_node=2, backend="gloo", args=(sys.argv[1],))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("what", "line", "said"),
    [
        ("raise", 8, "ValueError: bad sample"),
        ("unpicklable", 9, "TypeError: cannot pickle '_thread.lock' object"),
    ],
)
def test_a_script_s_traceback_names_its_file_line_and_failing_rank_once(
    tmp_path: Path, what: str, line: int, said: str
) -> None:
    script = tmp_path / "evaluate.py"
    done = run_script(script, SCRIPT_FAILING_ON_RANK_1, what)
    assert done.returncode == 1
    assert f"gatherstore.RemoteRankError: rank 1 failed in launch: {said}\n" in done.stderr
    assert done.stderr.count("--- traceback of rank") == 1
    assert f'File "{script}", line {line}, in evaluate' in done.stderr
    assert "<dynamic-code>" not in done.stderr


SCRIPT_DEFINING_UNDER_THE_GUARD = """
import gatherstore as gs

if __name__ == "__main__":
    def evaluate():
        return gs.get_rank() * 10

    print(gs.launch(evaluate, nproc_per_node=2, backend="gloo"))
"""


@pytest.mark.timeout(120)
def test_a_function_the_ranks_cannot_import_goes_by_value(tmp_path: Path) -> None:
    done = run_script(tmp_path / "guarded.py", SCRIPT_DEFINING_UNDER_THE_GUARD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 10]"
    code = "import gatherstore as gs\ndef f(): return gs.get_rank()\n"
    code += "print(gs.launch(f, nproc_per_node=2))"  # python -c: the ranks run no main script
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 1]"


UNGUARDED_SCRIPT = """
import gatherstore as gs
print(gs.launch(lambda: 1, nproc_per_node=2, backend="gloo"))
"""


@pytest.mark.timeout(120)
def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path: Path) -> None:
    done = run_script(tmp_path / "unguarded.py", UNGUARDED_SCRIPT)
    assert done.returncode == 1
    assert "RemoteRankError" in done.stderr and "its stderr says why" in done.stderr
    assert 'call launch() under `if __name__ == "__main__":`' in done.stderr  # from the ranks


def _gloo_threads() -> list[str]:
    """The threads of this process that gloo runs (each group's event loops)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        names += [name] if "gloo" in name else []
    return sorted(names)


def _gloo_threads_left_after(destroy: str) -> list[str]:
    """Use every cached piece of job state, destroy the groups the way ``destroy`` says,
    and name the gloo threads still running: a group kept alive is freed only at
    interpreter exit, where gloo's threads can abort the process."""
    import gc

    import torch.distributed as dist

    gs.all_reduce(1)
    gs.gather_object(gs.get_rank(), store="tmpdir", timeout=60)
    gs.describe()
    assert _gloo_threads(), "the job's groups run gloo threads"
    if destroy == "shutdown":
        gs.shutdown()
    else:
        dist.destroy_process_group()
    gc.collect()
    return _gloo_threads()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("destroy", ["shutdown", "the program's own destroy_process_group"])
def test_destroyed_groups_are_not_kept_alive(destroy: str) -> None:
    left = gs.launch(_gloo_threads_left_after, nproc_per_node=2, args=(destroy,), timeout=60)
    assert left == [[], []]
