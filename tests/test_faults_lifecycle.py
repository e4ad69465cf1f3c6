"""Every promise holds under faults: stopped jobs leave nothing, every rank is named in time.

Real faults only: SIGKILL/SIGSTOP/SIGTERM/SIGINT of real rank processes under
``gs.launch``, torchrun and independent processes joined with ``init_from_env``
(as under srun).  Leftovers are checked by listing the real directories and
the real Redis keys.  Run as a script, this module is one rank of an
independent job (``python test_faults_lifecycle.py <scenario> <dir> <redis url>``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import empty_redis_db

import gatherstore as gs
from gatherstore.testing.services import free_ports

SRC = str(Path(__file__).resolve().parents[1] / "src")
MARGIN = 20.0  # seconds past a timeout that count as "in time" on a loaded machine


# --- helpers -------------------------------------------------------------------------------


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh base directory on /dev/shm (where tmpdir puts job areas), removed after."""
    base = Path("/dev/shm") / f"gstest-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def sigint_default() -> Iterator[None]:
    """Children that SIGINT can interrupt: a shell's background job (``cmd &``) starts
    with SIGINT ignored, and a child would inherit that and never see Ctrl-C."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def redis_url(gatherstore_redis_url: str) -> Iterator[str]:
    """A Redis database of its own (db 9), empty before and after the test."""
    yield from empty_redis_db(gatherstore_redis_url, 9)


def urls_for(shm: Path, redis_url: str) -> list[str]:
    (shm / "tmp").mkdir(exist_ok=True)
    (shm / "shared").mkdir(exist_ok=True)
    return [f"tmpdir://{shm / 'tmp'}", f"file://{shm / 'shared'}", redis_url]


def leftovers(shm: Path, redis_url: str) -> list[str]:
    """Every job area left in the test's tmpdir/file bases and Redis database."""
    import redis

    found = [str(p) for base in ("tmp", "shared") for p in (shm / base).glob("gatherstore-*")]
    with redis.Redis.from_url(redis_url) as client:
        found += [k.decode() for k in client.keys("*")]
    return found


def note(test: str, **facts: Any) -> None:
    """Print what a fault did (shown with ``pytest -s``): the numbers behind the guarantees."""
    print(f"\n[{test}] " + json.dumps(facts, default=str))


def wait_for(what: str, check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def use_stores(urls: list[str]) -> None:
    """One gather through each store, so that each has a job area."""
    for url in urls:
        assert gs.all_gather_object(gs.get_rank(), store=gs.open_store(url), timeout=30) == list(
            range(gs.get_world_size())
        )


def report(exc: BaseException, start: float) -> dict[str, Any]:
    return {
        "error": type(exc).__name__,
        "gather_error": isinstance(exc, gs.GatherError),
        "ranks": getattr(exc, "ranks", None),
        "rank": getattr(exc, "rank", None),
        "message": str(exc),
        "at": time.time(),
        "seconds": time.monotonic() - start,
    }


# --- independent processes (as under srun): one rank per process -----------------------------


#: Calls after which a looping rank says so (``looping-<rank>``): the test faults it then.
LOOPING = 5


def rank_main(scenario: str, out: str, redis_url: str) -> None:
    """One rank of an independent job; writes ``<out>/<rank>.json`` when its call fails."""
    rank = int(os.environ["RANK"])
    if scenario == "late-handler":
        late_handler_rank(out, redis_url, rank)
        return
    if scenario == "stream-killed-sender":
        killed_sender_rank(out, rank)
        return
    if scenario == "chunks-killed-sender":
        killed_chunk_sender_rank(out, rank)
        return
    if scenario == "slow-reader":
        slow_reader_rank(out, rank)
        return
    if scenario == "own-handler" and rank == 1:

        def mine(signum: int, frame: Any) -> None:
            Path(out, "own-handler-ran").write_text("yes")
            os._exit(3)

        signal.signal(signal.SIGTERM, mine)
    gs.init_from_env(backend="gloo")
    urls = urls_for(Path(out), redis_url)
    use_stores(urls)
    route = ["collective"] if scenario.startswith("collective") else [*urls, "collective"]
    Path(out, f"ready-{rank}").write_text(str(os.getpid()))
    start, calls = time.monotonic(), 0
    size = 2 << 20 if scenario == "collective-resume" else 60_000  # mostly in the transfer
    try:
        while True:
            start = time.monotonic()
            store = route[calls % len(route)]
            gs.all_gather_object(bytes(size), store=store, timeout=5)
            calls += 1
            if calls == LOOPING:
                Path(out, f"looping-{rank}").write_text("")
    except gs.GatherError as exc:
        outcome = report(exc, start)
    Path(out, f"failed-{rank}").write_text("")
    if scenario == "collective-resume":  # the frozen rank is back: how do later calls fare?
        start = time.monotonic()
        try:
            gs.all_gather_object(rank, store="collective", timeout=30)
            outcome["later"] = "ok"
        except gs.GatherError as exc:
            outcome["later"] = report(exc, start)
        outcome["auto"] = gs.all_gather_object(rank, store="auto", timeout=30)
    began = time.monotonic()
    gs.shutdown()
    outcome["shutdown_seconds"] = time.monotonic() - began
    Path(out, f"{rank}.json").write_text(json.dumps(outcome))


def late_handler_rank(out: str, redis_url: str, rank: int) -> None:
    """Gathers in a loop; rank 1 installs a SIGTERM handler after its first gathers, and
    the loop ends when rank 0 sees ``<out>/stop``."""
    gs.init_from_env(backend="gloo")
    at_init = signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
    urls = urls_for(Path(out), redis_url)
    use_stores(urls)
    if rank == 1:

        def mine(signum: int, frame: Any) -> None:
            Path(out, "late-handler-ran").write_text(str(signum))

        signal.signal(signal.SIGTERM, mine)
    Path(out, f"ready-{rank}").write_text(str(os.getpid()))
    calls = 0
    while True:
        stop = rank == 0 and Path(out, "stop").exists()
        flags = gs.all_gather_object((stop, bytes(60_000)), store=urls[calls % 3], timeout=30)
        calls += 1
        if flags[0][0]:
            break
    gs.shutdown()
    Path(out, f"{rank}.json").write_text(json.dumps({"calls": calls, "at_init": at_init}))


def slow_reader_rank(out: str, rank: int) -> None:
    """One gather, then every rank leaves at once, without ``shutdown``; rank 2, in the
    gather before the others, is stopped there (SIGSTOP) until long after rank 0 is done:
    it reads the gather's outcome from rank 0's store only then."""
    gs.init_from_env(backend="gloo")
    gs.all_gather_object(rank, timeout=30)  # every lazy resource made
    Path(out, f"ready-{rank}").write_text(str(os.getpid()))
    if rank != 2:
        wait_for("rank 2 stopped in the gather", Path(out, "stopped").exists)
    got = gs.all_gather_object(rank, timeout=30)
    Path(out, f"{rank}.json").write_text(json.dumps(got))


def killed_sender_rank(out: str, rank: int) -> None:
    """A streamed gather to rank 0 in which rank 2 dies (SIGKILL) as it sends its part."""
    import torch.distributed as dist

    gs.init_from_env(backend="gloo")
    Path(out, f"ready-{rank}").write_text(str(os.getpid()))
    if rank == 2:  # dies as it sends its first chunk (on gatherstore's gloo group)
        dist.ProcessGroup.send = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        gathered = gs.gather_object(bytes(4 << 20), store="stream", timeout=10)
        outcome: dict[str, Any] = {"error": None, "parts": None if gathered is None else 3}
    except Exception as exc:
        outcome = report(exc, start)
    Path(out, f"{rank}.json").write_text(json.dumps(outcome))
    os._exit(0)  # the group lost a rank: leave without a shutdown that would wait for it


class _Dies:
    """Kills its process (SIGKILL) as it is pickled."""

    def __reduce__(self) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)


def killed_chunk_sender_rank(out: str, rank: int) -> None:
    """A gather to rank 0 handed over in chunks, in which rank 2 dies (SIGKILL) as it
    encodes a late chunk."""
    gs.init_from_env(backend="gloo")
    Path(out, f"ready-{rank}").write_text(str(os.getpid()))
    mine: list[Any] = [{"id": i, "x": np.full(1000, i, np.float32)} for i in range(3000)]
    if rank == 2:
        mine[2900] = _Dies()
    start = time.monotonic()
    try:
        gathered = gs.gather_object(mine, store="tmpdir", timeout=10)
        outcome: dict[str, Any] = {"error": None, "parts": None if gathered is None else 3}
    except Exception as exc:
        outcome = report(exc, start)
    Path(out, f"{rank}.json").write_text(json.dumps(outcome))
    os._exit(0)  # the group lost a rank: leave without a shutdown that would wait for it


@contextlib.contextmanager
def running_job(
    world: int, scenario: str, out: Path, redis_url: str
) -> Iterator[list[subprocess.Popen[str]]]:
    """``world`` ranks joined with ``init_from_env`` (stderr in ``out/stderr-<rank>``), once
    every rank is ready; whatever the test does, every rank is killed and reaped after."""
    port = free_ports()[0]
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=SRC,
        )
        args = [sys.executable, __file__, scenario, str(out), redis_url]
        with open(out / f"stderr-{rank}", "w") as stderr:
            procs.append(subprocess.Popen(args, env=env, text=True, stderr=stderr))
    try:
        wait_for(
            "every rank ready", lambda: all((out / f"ready-{r}").exists() for r in range(world))
        )
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def wait_looping(out: Path, ranks: range | list[int]) -> None:
    """Until ``ranks`` have each made :data:`LOOPING` calls of their loop."""
    wait_for("the ranks looping", lambda: all((out / f"looping-{r}").exists() for r in ranks))


def stderr_of(out: Path, rank: int) -> str:
    return (out / f"stderr-{rank}").read_text()


def outcomes(out: Path, ranks: list[int]) -> dict[int, dict[str, Any]]:
    return {r: json.loads((out / f"{r}.json").read_text()) for r in ranks}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=lambda s: s.name)
def test_collective_route_names_a_killed_or_frozen_rank_in_time(
    shm: Path, redis_url: str, sig: signal.Signals
) -> None:
    with running_job(3, "collective", shm, redis_url) as procs:
        wait_looping(shm, range(3))  # the ranks loop over the collective route
        fault = time.time()
        os.kill(procs[2].pid, sig)
        for proc in procs[:2]:
            assert proc.wait(timeout=5 + MARGIN + 30) == 0, stderr_of(shm, procs.index(proc))
        seen = outcomes(shm, [0, 1])
        for rank, outcome in seen.items():
            via = "transfer" if "(transfer)" in outcome["message"] else "status exchange"
            note(
                f"collective {sig.name}",
                rank=rank,
                error=outcome["error"],
                named=outcome["ranks"],
                after=round(outcome["at"] - fault, 1),
                via=via,
                shutdown=round(outcome["shutdown_seconds"], 1),
            )
            assert outcome["error"] == "GatherTimeout", outcome["message"]
            assert 2 in outcome["ranks"]
            assert outcome["at"] - fault < 5 + MARGIN
            assert outcome["shutdown_seconds"] < 5 + MARGIN
            assert "Traceback" not in outcome["message"]
    assert leftovers(shm, redis_url) == []


@pytest.mark.timeout(120)
def test_rank_0_leaves_only_once_every_rank_read_the_last_exchange(
    shm: Path, redis_url: str
) -> None:
    """Rank 0 hosts the rendezvous store; no exchange waits for readers, its exit does."""
    with running_job(3, "slow-reader", shm, redis_url) as procs:
        time.sleep(1.0)  # rank 2 is in the gather, waiting for the others
        os.kill(procs[2].pid, signal.SIGSTOP)
        (shm / "stopped").touch()
        wait_for("ranks 0 and 1 done", lambda: all((shm / f"{r}.json").exists() for r in (0, 1)))
        time.sleep(3.0)
        assert procs[0].poll() is None, "rank 0 left before rank 2 read the outcome"
        os.kill(procs[2].pid, signal.SIGCONT)
        for proc in procs:
            assert proc.wait(timeout=60) == 0, stderr_of(shm, procs.index(proc))
        assert outcomes(shm, [0, 1, 2]) == {r: [0, 1, 2] for r in range(3)}


@pytest.mark.timeout(180)
def test_after_a_frozen_rank_resumes_later_calls_fail_fast_or_work(
    shm: Path, redis_url: str
) -> None:
    with running_job(3, "collective-resume", shm, redis_url) as procs:
        wait_looping(shm, range(3))
        os.kill(procs[2].pid, signal.SIGSTOP)
        wait_for("the others' errors", lambda: all((shm / f"failed-{r}").exists() for r in (0, 1)))
        os.kill(procs[2].pid, signal.SIGCONT)
        for proc in procs:
            assert proc.wait(timeout=120) == 0, stderr_of(shm, procs.index(proc))
        seen = outcomes(shm, [0, 1, 2])
    broken = [outcome["later"] != "ok" for outcome in seen.values()]
    note(
        "frozen rank 2 resumed",
        first=[(o["error"], o["ranks"], round(o["seconds"], 1)) for o in seen.values()],
        via=["transfer" if "(transfer)" in o["message"] else "status" for o in seen.values()],
        later=[o["later"] if o["later"] == "ok" else o["later"]["error"] for o in seen.values()],
        auto=seen[0]["auto"],
    )
    assert all(broken) or not any(broken)  # the same answer on every rank
    for outcome in seen.values():
        assert outcome["error"] == "GatherTimeout" and 2 in outcome["ranks"]
        assert outcome["auto"] == [0, 1, 2]  # "auto" goes on, through tmpdir if need be
        if outcome["later"] != "ok":
            assert outcome["later"]["error"] == "GatherError"
            assert "cannot be used again" in outcome["later"]["message"]
            assert "store='tmpdir'" in outcome["later"]["message"]
            assert outcome["later"]["seconds"] < MARGIN
    assert leftovers(shm, redis_url) == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=lambda s: s.name)
def test_when_rank0_dies_the_survivors_name_it_and_sweep_its_areas(
    shm: Path, redis_url: str, sig: signal.Signals
) -> None:
    with running_job(3, "stores", shm, redis_url) as procs:
        wait_looping(shm, range(3))
        fault = time.time()
        os.kill(procs[0].pid, sig)
        for proc in procs[1:]:
            assert proc.wait(timeout=5 + MARGIN + 30) == 0, stderr_of(shm, procs.index(proc))
        for rank, outcome in outcomes(shm, [1, 2]).items():
            note(
                f"rank 0 {sig.name}",
                rank=rank,
                error=outcome["error"],
                named=outcome["ranks"],
                after=round(outcome["at"] - fault, 1),
            )
            assert outcome["gather_error"], outcome["message"]
            assert outcome["error"] in ("RemoteRankError", "GatherTimeout"), outcome["message"]
            assert 0 in (outcome["ranks"] or [outcome["rank"]])
            assert outcome["at"] - fault < 5 + MARGIN
    assert leftovers(shm, redis_url) == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_every_rank_leaves_nothing_and_a_users_handler_is_kept(
    shm: Path, redis_url: str, sig: signal.Signals, sigint_default: None
) -> None:
    with running_job(3, "own-handler", shm, redis_url) as procs:
        for proc in procs:
            os.kill(proc.pid, sig)
        codes = [proc.wait(timeout=60) for proc in procs]
        errors = [stderr_of(shm, rank) for rank in range(3)]
    note(f"{sig.name} to every rank", exit_codes=codes)
    assert leftovers(shm, redis_url) == []
    if sig == signal.SIGTERM:  # rank 1 has a SIGTERM handler of its own: it is kept
        assert codes == [-signal.SIGTERM, 3, -signal.SIGTERM]
        assert (shm / "own-handler-ran").exists()
    else:  # KeyboardInterrupt, as without gatherstore
        assert all("KeyboardInterrupt" in text for text in errors), errors
    # a store wait the signal interrupted ends before the interpreter does: no C++ abort
    assert -signal.SIGABRT not in codes
    assert not [text for text in errors if "terminate called" in text]


@pytest.mark.timeout(180)
def test_a_handler_installed_after_gathers_is_in_charge(shm: Path, redis_url: str) -> None:
    """gatherstore's handler (installed by init_from_env) steps aside for a later one: the
    rank handles SIGTERM its own way, even while blocked in a store or gloo wait, and lives."""
    with running_job(3, "late-handler", shm, redis_url) as procs:
        for _ in range(5):  # land in different places of the loop: Python, C++ waits
            time.sleep(random.uniform(0.1, 0.4))
            os.kill(procs[1].pid, signal.SIGTERM)
        wait_for("rank 1's own handler", (shm / "late-handler-ran").exists)
        (shm / "stop").write_text("")
        codes = [proc.wait(timeout=90) for proc in procs]
    assert codes == [0, 0, 0], [stderr_of(shm, r) for r in range(3)]
    done = outcomes(shm, [0, 1, 2])
    assert all(o["at_init"] for o in done.values()), "installed at init, not in a gather"
    assert done[1]["calls"] == done[0]["calls"] > 3
    assert leftovers(shm, redis_url) == []


def test_gatherstores_handler_does_nothing_when_a_later_handler_chains_to_it() -> None:
    """A program's handler that calls "the previous handler" (as Lightning's does) keeps
    the process alive: gatherstore's handler acts only while it is the installed one (acting,
    it would end the process: SIGTERM's default action, or KeyboardInterrupt)."""
    script = """
import os, signal
import gatherstore as gs
before = signal.getsignal(signal.SIGTERM)
rs = gs.ResultSet("chained", store="memory://signals")  # installs gatherstore's handlers
assert signal.getsignal(signal.SIGTERM) is not before, "gatherstore's handler is installed"
previous = signal.getsignal(signal.SIGTERM)
def mine(signum, frame):
    print("mine", flush=True)
    previous(signum, frame)
signal.signal(signal.SIGTERM, mine)
os.kill(os.getpid(), signal.SIGTERM)
signal.signal(signal.SIGINT, lambda *a: previous(signal.SIGINT, None))
os.kill(os.getpid(), signal.SIGINT)
print("alive", flush=True)
"""
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["mine", "alive"]


@pytest.mark.timeout(120)
def test_a_sender_killed_on_the_stream_route_is_named(shm: Path, redis_url: str) -> None:
    with running_job(3, "stream-killed-sender", shm, redis_url) as procs:
        codes = [proc.wait(timeout=90) for proc in procs]
    assert codes[2] == -signal.SIGKILL
    dst, sender = outcomes(shm, [0, 1]).values()
    assert dst["gather_error"], dst  # not torch's RuntimeError
    assert 2 in (dst["ranks"] or [dst["rank"]]), dst
    assert dst["seconds"] < 10 + MARGIN
    assert sender == {"error": None, "parts": None}


@pytest.mark.timeout(120)
def test_a_sender_killed_in_a_late_chunk_is_named(
    shm: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATHERSTORE_PART_CHUNK", str(64 << 10))  # parts span many chunks
    with running_job(3, "chunks-killed-sender", shm, redis_url) as procs:
        codes = [proc.wait(timeout=90) for proc in procs]
    assert codes[2] == -signal.SIGKILL
    dst, sender = outcomes(shm, [0, 1]).values()
    note("chunks-killed-sender", dst=dst, sender=sender)
    assert dst["gather_error"], dst
    assert 2 in (dst["ranks"] or [dst["rank"]]), dst
    assert dst["seconds"] < 10 + MARGIN
    assert sender["error"] is None or sender["gather_error"], sender  # rank 0 may be gone


# --- gs.launch and torchrun: the launcher stops the job ------------------------------------------


def _wait_in_a_gather(out: str, urls: list[str], victim: int) -> None:
    use_stores(urls)
    Path(out, f"ready-{gs.get_rank()}").write_text(str(os.getpid()))
    if gs.get_rank() == victim:
        while True:
            time.sleep(1)
    gs.all_gather_object(gs.get_rank(), store=gs.open_store(urls[0]), timeout=60)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", [0, 1])
def test_launch_stops_the_job_when_a_rank_is_killed_and_nothing_is_left(
    shm: Path, redis_url: str, victim: int
) -> None:
    urls = urls_for(shm, redis_url)
    pids: list[int] = []
    fault: list[float] = []

    def kill_when_ready() -> None:
        wait_for("ranks ready", lambda: all((shm / f"ready-{r}").exists() for r in (0, 1)))
        pids.extend(int((shm / f"ready-{r}").read_text()) for r in (0, 1))
        fault.append(time.time())
        os.kill(pids[victim], signal.SIGKILL)

    killer = threading.Thread(target=kill_when_ready)
    killer.start()
    with pytest.raises(gs.RemoteRankError) as info:
        gs.launch(
            _wait_in_a_gather, nproc_per_node=2, backend="gloo", args=(str(shm), urls, victim)
        )
    killer.join()
    note(f"launch, rank {victim} SIGKILL", error=info.value.rank, after=time.time() - fault[0])
    assert time.time() - fault[0] < MARGIN
    assert info.value.rank == victim
    assert "SIGKILL" in str(info.value)
    assert not [pid for pid in pids if pid_alive(pid)]
    assert leftovers(shm, redis_url) == []


def _wait_in_s3(out: str, url: str, options: dict[str, Any]) -> None:
    store = gs.open_store(url, **options)
    gs.all_gather_object(bytes(1000), store=store, timeout=60)
    Path(out, f"ready-{gs.get_rank()}").write_text(str(os.getpid()))
    if gs.get_rank() == 1:
        while True:
            time.sleep(1)
    gs.gather_object(bytes(1000), store=store, timeout=60)


@pytest.mark.timeout(180)
def test_a_killed_rank_leaves_nothing_in_s3(shm: Path, gatherstore_s3: Any) -> None:
    pytest.importorskip("botocore.session")
    client = gatherstore_s3.client()
    bucket = f"gatherstore-faults-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    killer = threading.Thread(
        target=lambda: (
            wait_for("ranks ready", lambda: (shm / "ready-1").exists()),
            os.kill(int((shm / "ready-1").read_text()), signal.SIGKILL),
        )
    )
    killer.start()
    try:
        with pytest.raises(gs.RemoteRankError) as info:
            gs.launch(
                _wait_in_s3,
                nproc_per_node=2,
                backend="gloo",
                args=(str(shm), f"s3://{bucket}/job", gatherstore_s3.storage_options),
            )
        killer.join()
        assert info.value.rank == 1
        assert client.list_objects_v2(Bucket=bucket).get("Contents", []) == []
    finally:
        for item in client.list_objects_v2(Bucket=bucket).get("Contents", []):
            client.delete_object(Bucket=bucket, Key=item["Key"])
        client.delete_bucket(Bucket=bucket)
        client.close()


def _survive_a_dead_rank(urls: list[str]) -> str:
    use_stores(urls)
    if gs.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        gs.gather_object(0, store=gs.open_store(urls[1]), timeout=5)
    except gs.GatherTimeout as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
def test_launch_returns_in_time_when_a_rank_dies_after_using_stores(
    shm: Path, redis_url: str
) -> None:
    start = time.monotonic()
    with pytest.raises(gs.RemoteRankError) as info:
        gs.launch(
            _survive_a_dead_rank, nproc_per_node=2, backend="gloo", args=(urls_for(shm, redis_url),)
        )
    note("launch, rank 1 dies after stores", named=info.value.rank, job=time.monotonic() - start)
    assert info.value.rank == 1
    assert time.monotonic() - start < 5 + MARGIN + 15  # + starting two ranks
    assert leftovers(shm, redis_url) == []


LAUNCH_SCRIPT = """
import sys
import gatherstore as gs
from gatherstore.testing.services import free_ports
sys.path.insert(0, {tests!r})
from test_faults_lifecycle import _wait_in_a_gather
if __name__ == "__main__":
    gs.launch(_wait_in_a_gather, nproc_per_node=2, backend="gloo", args=({out!r}, {urls!r}, 1))
"""


@pytest.mark.timeout(180)
def test_ctrl_c_to_the_launching_process_leaves_nothing(
    shm: Path, redis_url: str, sigint_default: None
) -> None:
    script = shm / "job.py"
    tests = str(Path(__file__).parent)
    urls = urls_for(shm, redis_url)
    script.write_text(LAUNCH_SCRIPT.format(tests=tests, out=str(shm), urls=urls))
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, text=True, stderr=subprocess.PIPE
    )
    try:
        wait_for("ranks ready", lambda: all((shm / f"ready-{r}").exists() for r in (0, 1)))
        pids = [int((shm / f"ready-{r}").read_text()) for r in (0, 1)]
        fault = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        note("launch, SIGINT", exit=proc.returncode, after=time.monotonic() - fault)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in stderr
    assert not [pid for pid in pids if pid_alive(pid)]
    assert leftovers(shm, redis_url) == []


TORCHRUN_SCRIPT = """
import sys
import gatherstore as gs
from gatherstore.testing.services import free_ports
sys.path.insert(0, {tests!r})
from test_faults_lifecycle import _wait_in_a_gather
gs.init_from_env(backend="gloo")
_wait_in_a_gather({out!r}, {urls!r}, 1)
"""


@pytest.mark.timeout(180)
def test_torchrun_stopping_the_job_leaves_nothing(shm: Path, redis_url: str) -> None:
    script = shm / "job.py"
    urls = urls_for(shm, redis_url)
    script.write_text(
        TORCHRUN_SCRIPT.format(tests=str(Path(__file__).parent), out=str(shm), urls=urls)
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.Popen([sys.executable, *args], env=env, text=True, stderr=subprocess.PIPE)
    try:
        wait_for("ranks ready", lambda: all((shm / f"ready-{r}").exists() for r in (0, 1)))
        pids = [int((shm / f"ready-{r}").read_text()) for r in (0, 1)]
        fault = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        proc.communicate(timeout=90)
        note("torchrun, rank 1 SIGKILL", exit=proc.returncode, after=time.monotonic() - fault)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert not [pid for pid in pids if pid_alive(pid)]
    assert leftovers(shm, redis_url) == []


# --- mismatched calls, one launched job ---------------------------------------------------------


def _mismatches(tmp: str) -> dict[str, Any]:
    rank = gs.get_rank()
    seen: dict[str, Any] = {}
    cases = {
        "dst": lambda: gs.gather_object(
            rank, dst=1 if rank == 1 else 0, store="collective", timeout=10
        ),
        "route": lambda: gs.gather_object(
            rank, store=f"tmpdir://{tmp}" if rank == 1 else "collective", timeout=10
        ),
        "call": lambda: (gs.all_gather_object if rank == 1 else gs.gather_object)(
            rank, store="collective", timeout=10
        ),
    }
    for name, case in cases.items():
        start = time.monotonic()
        try:
            case()
            seen[name] = None
        except Exception as exc:
            seen[name] = report(exc, start)
    seen["after"] = gs.all_gather_object(rank, store="collective", timeout=10)
    start = time.monotonic()
    try:  # rank 1 reduces tensors while the others gather objects
        if rank == 1:
            seen["reduce"] = gs.all_reduce(1)
        else:
            gs.gather_object(rank, store="collective", timeout=5)
    except Exception as exc:
        seen["other"] = report(exc, start)
        gs.all_reduce(1)  # meet rank 1, so that the job can end
    return seen


@pytest.mark.timeout(180)
def test_mismatched_calls_raise_on_every_rank_before_data_moves(tmp_path: Path) -> None:
    results = gs.launch(_mismatches, nproc_per_node=3, backend="gloo", args=(str(tmp_path),))
    for rank, seen in enumerate(results):
        note(
            "mismatches",
            rank=rank,
            **{
                k: v and v.get("error")
                for k, v in seen.items()
                if k in ("dst", "route", "call", "other")
            },
        )
        for name in ("dst", "route", "call"):
            assert seen[name] is not None and seen[name]["error"] == "MismatchError", (rank, seen)
            assert seen[name]["seconds"] < 10 + MARGIN
        assert "dst/src" in seen["dst"]["message"]
        assert seen["after"] == [0, 1, 2]
        if rank == 1:
            assert seen["reduce"] == 3
        else:
            assert seen["other"]["error"] == "GatherTimeout"
            assert seen["other"]["ranks"] == [1]
            assert seen["other"]["seconds"] < 5 + MARGIN
    assert list(tmp_path.glob("gatherstore-*")) == []


def _reduce_against_gather() -> str:
    if gs.get_rank() == 1:
        gs.all_reduce(1)  # the others gather objects, time out and leave
        return "no error"
    with pytest.raises(gs.GatherTimeout) as info:
        gs.gather_object(0, store="collective", timeout=5)
    assert info.value.ranks == [1]
    return "named rank 1"


@pytest.mark.timeout(120)
def test_a_rank_left_in_a_tensor_collective_gets_a_process_group_error() -> None:
    with pytest.raises(gs.RemoteRankError) as info:
        gs.launch(_reduce_against_gather, nproc_per_node=3, backend="gloo")
    note("all_reduce left alone", named=info.value.rank, error=info.value.remote_message[:120])
    assert info.value.rank == 1
    assert info.value.remote_message.startswith(
        "ProcessGroupError: all_reduce: the process group failed"
    )


# --- one job area per store; bounded waits ---------------------------------------------------


def _many_calls(urls: list[str], shm: str) -> list[int]:
    """200 random calls, each with a fresh store object; the most job areas seen at once."""
    import redis

    rng = random.Random(gs.shared_random_seed())
    most = 0
    with redis.Redis.from_url(urls[2]) as client:
        for i in range(200):
            store = gs.open_store(rng.choice(urls))
            kind = rng.choice(["all", "gather", "iter", "bcast"])
            obj = {"i": i, "rank": gs.get_rank()}
            if kind == "all":
                assert gs.all_gather_object(obj, store=store, timeout=30)[1]["i"] == i
            elif kind == "gather":
                gs.gather_object(obj, store=store, timeout=30)
            elif kind == "iter":
                assert len(list(gs.gather_iter(obj, store=store, timeout=30))) in (0, 2)
            else:
                assert gs.broadcast_object(obj, store=store, timeout=30)["i"] == i
            counts = [
                len(list(Path(shm, base).glob("gatherstore-*"))) for base in ("tmp", "shared")
            ]
            counts.append(len(client.keys("*marker")))
            most = max(most, *counts)
    return most


@pytest.mark.timeout(240)
def test_fresh_store_objects_share_one_job_area(shm: Path, redis_url: str) -> None:
    assert gs.open_store(redis_url) == gs.open_store(redis_url)
    assert len({gs.open_store("tmpdir"), gs.open_store("tmpdir")}) == 1
    assert gs.open_store(f"tmpdir://{shm}") != gs.open_store("tmpdir")
    urls = urls_for(shm, redis_url)
    results = gs.launch(_many_calls, nproc_per_node=2, backend="gloo", args=(urls, str(shm)))
    assert results == [1, 1]
    assert leftovers(shm, redis_url) == []


def _bounded_waits(url: str, signals: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    store = gs.open_store(url)
    # an abandoned gather_iter: the finaliser neither blocks nor leaves parts behind
    it = gs.gather_iter(bytes(1 << 20), store=store, timeout=30)
    if gs.get_rank() == 0:
        next(it)
        start = time.monotonic()
        del it
        gc.collect()
        seen["del_seconds"] = time.monotonic() - start
    gs.barrier(timeout=30)
    area = next(Path(url[9:]).glob("gatherstore-*"))
    wait_for("unread parts deleted", lambda: not list(area.glob("call-*/*")), timeout=20)

    gave_up = Path(signals, "rank-1-gave-up")

    @gs.one_rank_only(rank=0, with_barrier=True, timeout=2)
    def slow() -> None:  # done only once rank 1 stopped waiting for it
        wait_for("rank 1 to give up", gave_up.exists)

    start = time.monotonic()
    try:
        slow()
    except gs.GatherError as exc:
        seen["one_rank_only"] = report(exc, start)
    if gs.get_rank() == 1:
        gave_up.touch()
    return seen


@pytest.mark.timeout(180)
def test_abandoned_gather_iter_and_one_rank_only_timeout(shm: Path) -> None:
    (shm / "tmp").mkdir()
    results = gs.launch(
        _bounded_waits, nproc_per_node=2, backend="gloo", args=(f"tmpdir://{shm / 'tmp'}", str(shm))
    )
    assert results[0]["del_seconds"] < 2
    other = results[1]["one_rank_only"]
    assert other["error"] == "GatherTimeout" and other["ranks"] == [0]
    assert other["seconds"] < 2 + MARGIN
    assert list((shm / "tmp").glob("gatherstore-*")) == []


if __name__ == "__main__":
    rank_main(*sys.argv[1:4])
