"""``gatherstore gc`` against real jobs: a live job keeps its areas, a dead one loses them.

A job of two gloo processes (``gs.launch``) gathers through a ``file://`` base and a
real Redis, then waits between two gathers while ``gatherstore gc --older-than 2s``
runs against both stores; it beats every second (``GATHERSTORE_HEARTBEAT=1``).  Then
a job is SIGKILLed whole (launcher and ranks at once: nobody sweeps) and gc removes
its areas once its heartbeat is stale.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import OtherUser, empty_redis_db

import gatherstore as gs

TESTS = str(Path(__file__).resolve().parent)
SRC = str(Path(__file__).resolve().parents[1] / "src")
LAUNCH = (
    "import sys, json; sys.path.insert(0, sys.argv[1]); import gatherstore as gs, _jobs; "
    "print(gs.launch(_jobs.wait_between_gathers, nproc_per_node=2, backend='gloo', "
    "args=(json.loads(sys.argv[2]), sys.argv[3]), timeout=400))"
)


@pytest.fixture
def redis_db(gatherstore_redis_url: str) -> Iterator[str]:
    """A Redis database of this test's own (db 11), empty before and after."""
    yield from empty_redis_db(gatherstore_redis_url, 11)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GATHERSTORE_HEARTBEAT"}
    return {**env, "PYTHONPATH": os.pathsep.join([SRC, env.get("PYTHONPATH", "")]), **extra}


def _start(base: Path, redis_url: str, flags: Path) -> subprocess.Popen[str]:
    urls = json.dumps([f"file://{base}", redis_url])
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, TESTS, urls, str(flags)],
        env=_env(GATHERSTORE_HEARTBEAT="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_ready(job: subprocess.Popen[str], flags: Path) -> list[int]:
    deadline = time.monotonic() + 180
    while not all((flags / f"ready-{r}").exists() for r in (0, 1)):
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            out, err = job.communicate()
            raise AssertionError(f"the job did not get ready: {out}\n{err}")
        time.sleep(0.05)
    return [int((flags / f"ready-{r}").read_text()) for r in (0, 1)]


def _gc(store: str, older_than: str = "2s") -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gatherstore.cli.main",
            "gc",
            "--store",
            store,
            "--older-than",
            older_than,
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result


def _areas(base: Path, redis_url: str) -> tuple[list[str], list[str]]:
    with redis.Redis.from_url(redis_url) as client:
        keys = sorted(k.decode() for k in client.keys("*"))
    return sorted(p.name for p in base.glob("gatherstore-*")), keys


#: The job's launcher process, its base and flags folders, and its ranks' PIDs.
Job = tuple[subprocess.Popen[str], Path, Path, list[int]]


@pytest.fixture
def job(tmp_path: Path, redis_db: str) -> Iterator[Job]:
    """The job, once both ranks wait between their gathers; killed after the test if on."""
    base, flags = tmp_path / "shared", tmp_path / "flags"
    base.mkdir()
    flags.mkdir()
    process = _start(base, redis_db, flags)
    try:
        yield process, base, flags, _wait_ready(process, flags)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.timeout(400)
def test_gc_keeps_a_live_job_between_calls(job: Job, redis_db: str) -> None:
    process, base, flags, pids = job
    time.sleep(3)  # the areas are older than --older-than
    dirs, keys = _areas(base, redis_db)
    assert len(dirs) == 1 and any(k.endswith("/heartbeat") for k in keys), (dirs, keys)
    for store in (f"file://{base}", redis_db):
        assert "removed 0 job area(s)" in _gc(store).stdout
    assert _areas(base, redis_db) == (dirs, keys)

    # frozen, the ranks miss many beats, but on this host their PIDs prove them alive
    for pid in (process.pid, *pids):
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(6)
        for store in (f"file://{base}", redis_db):
            assert "removed 0 job area(s)" in _gc(store).stdout
    finally:
        for pid in (process.pid, *pids):
            os.kill(pid, signal.SIGCONT)
    assert _areas(base, redis_db)[0] == dirs

    (flags / "go").touch()  # the second gather goes through the same areas
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err
    assert "['done', 'done']" in out
    assert _areas(base, redis_db) == ([], [])  # and the job's end removed them


@pytest.mark.timeout(400)
def test_gc_removes_a_killed_job_once_its_heartbeat_is_stale(job: Job, redis_db: str) -> None:
    process, base, _, pids = job
    for pid in (process.pid, *pids):  # all at once: no rank and no launcher sweeps
        os.kill(pid, signal.SIGKILL)
    process.communicate(timeout=60)
    dirs, keys = _areas(base, redis_db)
    assert len(dirs) == 1 and keys, (dirs, keys)
    killed = time.time()

    deadline = time.monotonic() + 120
    while _areas(base, redis_db) != ([], []):
        assert time.monotonic() < deadline, _areas(base, redis_db)
        for store in (f"file://{base}", redis_db):
            _gc(store)
    # a beat every second: gone after 4 silent seconds (a gc started earlier kept them)
    assert time.time() - killed >= 2
    assert list(base.iterdir()) == []


def _dead_area(store: Any, job: str) -> None:
    """A job area as a dead job leaves it: marker, an old heartbeat, a part."""
    old = time.time() - 7200
    area = store.join_job(store.prepare_job(job))
    area.put("marker", json.dumps({"job": job, "created": old}).encode())
    beat = {"job": job, "at": old, "every": 1.0, "host": "elsewhere", "pid": 1}
    area.replace("heartbeat", json.dumps(beat).encode())
    area.put("call-1/0", b"part")


@pytest.mark.timeout(180)
def test_gc_never_follows_a_symlink_nor_touches_what_it_did_not_create(
    tmp_path: Path, redis_db: str, other_user: OtherUser
) -> None:
    base, elsewhere = tmp_path / "base", tmp_path / "elsewhere"
    base.mkdir()
    elsewhere.mkdir()
    store = gs.open_store(f"file://{base}")
    _dead_area(store, "0123456789abcdef")
    # a dead job's folder seen through a symlink, and one that is another user's
    victim = gs.open_store(f"file://{elsewhere}")
    _dead_area(victim, "fedcba9876543210")
    (target,) = elsewhere.iterdir()
    (base / target.name).symlink_to(target)
    _dead_area(store, "00112233445566aa")
    (theirs,) = base.glob("gatherstore-00112233445566aa-*")
    for path in (theirs, *theirs.rglob("*")):
        os.chown(path, other_user.uid, other_user.gid)
    kept = sorted(base.iterdir())

    keys = gs.open_store(redis_db)
    _dead_area(keys, "0123456789abcdef")
    with redis.Redis.from_url(redis_db) as client:
        client.set("user/precious", b"x")
        client.set("gatherstore-0123456789abcdef", b"a key beside the prefix")
        client.sadd("gatherstore/0123456789abcdef.keys", b"user/precious")  # planted

    assert "removed 1 job area(s)" in _gc(f"file://{base}", "1s").stdout
    assert "removed 1 job area(s)" in _gc(redis_db, "1s").stdout
    assert sorted(base.iterdir()) == [p for p in kept if "0123456789abcdef" not in p.name]
    assert [p.name for p in target.iterdir()] != []  # nothing behind the symlink went
    with redis.Redis.from_url(redis_db) as client:
        left = sorted(k.decode() for k in client.keys("*"))
    assert left == ["gatherstore-0123456789abcdef", "user/precious"]
