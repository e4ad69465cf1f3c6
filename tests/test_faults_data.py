"""Faults of stores and data: every promise holds with a frozen or dead server, tampered
parts, too little memory and bad store specs (real servers, real files, real cgroups)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from cgroups import limit_to_room, run_in_memory_cgroup

import gatherstore as gs
from gatherstore.testing import services

TIMEOUT = 3.0  # the calls' timeout in the outage job
SLACK = 3.0  # "a few seconds" beyond it
SRC = str(Path(gs.__file__).resolve().parents[1])


# --- 1. a frozen or killed store ends every call within its timeout ------------------------
def _wait_for(signals: str, name: str, limit: float = 60.0) -> None:
    path = Path(signals, name)
    end = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"no signal {name!r}")
        time.sleep(0.02)


def _attempt(what: str, fn: Any) -> tuple[str, str, float, str]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return (what, type(exc).__name__, time.monotonic() - start, str(exc))
    return (what, "none", time.monotonic() - start, "")


def _outage_job(
    url: str, options: dict[str, Any], signals: str
) -> list[tuple[str, str, float, str]]:
    """dst streams from a store frozen under it, then every rank calls again (frozen, killed)."""
    store = gs.open_store(url, **options)
    rank = gs.get_rank()
    obj = np.full(200_000, rank, dtype=np.int64)
    # the job's area is set up, and the server has made its first volume, before the fault:
    # on a loaded machine that alone can outlast TIMEOUT
    gs.gather_object(obj, store=store, timeout=120)
    # no read-ahead: dst reads each part when it is asked for, from the frozen store (parts
    # read before the fault are delivered, and only their deletes would fail)
    parts = gs.gather_iter(obj, store=store, timeout=TIMEOUT, read_ahead=0)
    gs.barrier()
    if rank == 0:
        Path(signals, "written").touch()
    _wait_for(signals, "frozen")
    out = [_attempt("stream from a frozen store", lambda: list(parts))]
    out.append(
        _attempt("next call, frozen", lambda: gs.gather_object(obj, store=store, timeout=TIMEOUT))
    )
    gs.barrier()
    if rank == 0:
        Path(signals, "called").touch()
    _wait_for(signals, "killed")
    out.append(
        _attempt("next call, killed", lambda: gs.gather_object(obj, store=store, timeout=TIMEOUT))
    )
    return out


def _run_outage(pid: int, url: str, options: dict[str, Any], tmp_path: Path) -> list[Any]:
    signals = str(tmp_path)

    def fault() -> None:
        _wait_for(signals, "written", 120)
        os.kill(pid, signal.SIGSTOP)
        Path(signals, "frozen").touch()
        _wait_for(signals, "called", 120)
        os.kill(pid, signal.SIGKILL)
        Path(signals, "killed").touch()

    thread = threading.Thread(target=fault, daemon=True)
    thread.start()
    results = gs.launch(_outage_job, nproc_per_node=3, backend="gloo", args=(url, options, signals))
    thread.join(5)
    return results


def _check_outage(results: list[Any], shown: str) -> None:
    for rank, outcomes in enumerate(results):
        for what, kind, seconds, message in outcomes:
            if what.startswith("stream") and rank != 0:
                assert kind == "none"  # only dst reads in gather_iter
                continue
            assert kind == "StoreUnavailableError", (rank, what, kind, message)
            assert shown in message, (rank, what, message)
            assert seconds <= TIMEOUT + SLACK, (rank, what, seconds)


@pytest.mark.timeout(120)
def test_frozen_then_killed_redis_ends_every_call_within_its_timeout(tmp_path: Path) -> None:
    with services.start_redis() as server:
        results = _run_outage(server.process.pid, server.url, {}, tmp_path)
    _check_outage(results, server.url)


@pytest.mark.timeout(180)
def test_frozen_then_killed_s3_ends_every_call_within_its_timeout(tmp_path: Path) -> None:
    s3fs = pytest.importorskip("s3fs")
    with services.start_s3() as server:
        bucket = f"faults-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**server.storage_options).mkdir(bucket)
        url = f"s3://{bucket}/job"
        results = _run_outage(server.process.pid, url, server.storage_options, tmp_path)
    _check_outage(results, url)


# --- 2. tampered parts: replayed, swapped, truncated, planted ------------------------------
#: The tampering sender: the first rank past dst's read-ahead window (two parts), whose
#: part dst reads only after the tampering (the ranks before it are read ahead at once).
TAMPERER = 3


def _tamper_job(url: str, options: dict[str, Any]) -> list[tuple[str, Any]]:
    """Each call: every rank writes, a sender alters the stored bytes, then dst reads."""
    store = gs.open_store(url, **options)
    unsigned = gs.open_store(url, sign=False, **options)  # as anyone could write a part
    rank = gs.get_rank()
    obj = {"rank": rank, "data": np.full(100_000, rank, dtype=np.int64)}
    window = (TAMPERER - 1) * obj["data"].nbytes  # dst reads ahead some ranks before it
    saved: dict[str, Any] = {}

    def part(of: int) -> str:
        """The key of rank ``of``'s part of the call under way (the earlier ones are gone)."""
        keys = [k for k in store.list() if re.search(rf"(^|/)call-\d+/{of}$", k)]
        assert len(keys) == 1, keys
        return keys[0]

    def value(key: str) -> bytes:
        found = store.get(key)
        assert found is not None
        return bytes(found)

    # TAMPERER alters its own part after dst started reading ahead the ranks before it
    t = TAMPERER
    steps: dict[str, tuple[gs.Store, Any]] = {
        "clean": (store, lambda: saved.update(old=value(part(t)))),
        "unsigned": (unsigned, lambda: saved.update(unsigned=value(part(t)))),
        "replayed": (store, lambda: store.replace(part(t), saved["old"])),  # the call before
        "swapped": (store, lambda: store.replace(part(t), value(part(1)))),  # rank 1's
        "truncated": (store, lambda: store.replace(part(t), value(part(t))[:5000])),
        "planted": (store, lambda: store.replace(part(t), saved["unsigned"])),  # no key
    }
    out: list[tuple[str, Any]] = []
    for name, (through, tamper) in steps.items():
        parts = gs.gather_iter(obj, store=through, timeout=30, read_ahead=window)
        if rank == TAMPERER:
            tamper()
        gs.barrier()
        start = time.monotonic()
        try:
            got = [(o["rank"], int(np.asarray(o["data"]).sum())) for o in parts]
            out.append((name, got))
        except gs.IntegrityError as exc:
            out.append((name, ("IntegrityError", exc.rank, str(exc), time.monotonic() - start)))
        gs.barrier()
    after = gs.gather_object(rank, store=store, timeout=30)
    out.append(("after", after))
    return out


def _check_tampering(results: list[Any]) -> None:
    dst = dict(results[0])
    clean = [(r, 100_000 * r) for r in range(TAMPERER + 1)]
    assert dst["clean"] == dst["unsigned"] == clean
    for name in ("replayed", "swapped", "truncated", "planted"):
        kind, named, message, _ = dst[name]
        assert (kind, named) == ("IntegrityError", TAMPERER), (name, dst[name])
        assert f"rank {TAMPERER}" in message, message
    assert dst["after"] == list(range(TAMPERER + 1))


@pytest.mark.timeout(120)
def test_tampered_parts_in_a_file_store_fail_naming_the_rank(tmp_path: Path) -> None:
    results = gs.launch(
        _tamper_job, nproc_per_node=TAMPERER + 1, backend="gloo", args=(f"file://{tmp_path}", {})
    )
    _check_tampering(results)
    assert list(tmp_path.iterdir()) == []  # the job area is gone


@pytest.mark.timeout(120)
def test_tampered_parts_in_redis_fail_naming_the_rank() -> None:
    with services.start_redis() as server:
        results = gs.launch(
            _tamper_job, nproc_per_node=TAMPERER + 1, backend="gloo", args=(server.url, {})
        )
        _check_tampering(results)
        with redis.Redis.from_url(server.url) as client:
            assert client.dbsize() == 0  # no key left


_FLIP = """
import sys
for path in sys.argv[1:]:
    with open(path, "r+b") as f:  # one byte in the middle of the part, in place
        f.seek(-(1 << 20), 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
"""


def _flip_waiting_parts(base: str, ranks: list[int]) -> None:
    """Another process of the same user flips a byte in the stored parts of ``ranks``."""
    paths = sorted(str(p) for p in Path(base).glob("gatherstore-*/call-*/*"))
    paths = [p for p in paths if int(Path(p).name) in ranks]
    assert len(paths) == len(ranks), paths
    subprocess.run([sys.executable, "-c", _FLIP, *paths], check=True, timeout=30)


def _changed_while_waiting_job(base: str) -> dict[str, Any]:
    """dst streams a gather through ``tmpdir:///<base>`` while another process flips a
    byte in each part still waiting: once before any part is read, once after the
    reader has read and verified them ahead of the consumer."""
    rank = gs.get_rank()
    obj = {"rank": rank, "data": np.full(1 << 20, rank, dtype=np.int64)}  # 8 MiB
    store, out = f"tmpdir://{base}", {}
    for case, read_ahead in (("before", 0), ("after", 64 << 20)):
        parts = gs.gather_iter(obj, store=store, timeout=60, read_ahead=read_ahead)
        if rank == 0:
            first = next(parts)
            if case == "after":  # the reader holds ranks 1 and 2, verified, not yet taken
                requested = [parts.requested[r][0] for r in (1, 2)]  # type: ignore[attr-defined]
                futures_wait(requested, timeout=30)
            _flip_waiting_parts(base, [1, 2])
            got: list[Any] = [(first["rank"], int(first["data"].sum()))]
            try:
                got += [(o["rank"], int(o["data"].sum())) for o in parts]
            except gs.IntegrityError as exc:
                got.append(("IntegrityError", exc.rank, str(exc)))
            out[case] = got
        gs.barrier()
    return out


@pytest.mark.timeout(120)
def test_a_part_changed_while_it_waits_fails_before_and_is_delivered_as_verified_after(
    tmp_path: Path,
) -> None:
    base = tmp_path / "shm"
    base.mkdir(mode=0o700)
    results = gs.launch(_changed_while_waiting_job, nproc_per_node=3, args=(str(base),))
    dst = results[0]
    kind, rank, message = dst["before"][1]
    assert (kind, rank) == ("IntegrityError", 1), dst["before"]
    assert "rank 1" in message and "checksum" in message, message
    assert dst["after"] == [(r, r * (1 << 20)) for r in range(3)]
    assert list(base.iterdir()) == []  # the job area is gone


def _undeletable_job(url: str, prefix: str) -> dict[str, Any]:
    """Gather through a Redis user that may read and write but not delete; what dst got,
    and the warnings gatherstore logged."""
    import logging

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("gatherstore").addHandler(Keep())
    store = gs.open_store(url, key_prefix=prefix)
    rank = gs.get_rank()
    obj = {"rank": rank, "data": np.full(1 << 17, rank, dtype=np.int64)}
    got: dict[str, Any] = {}
    for name, call in (("gather_object", gs.gather_object), ("gather_iter", gs.gather_iter)):
        parts = call(obj, store=store, timeout=30)
        got[name] = None if parts is None else [(o["rank"], int(o["data"].sum())) for o in parts]
    return {"got": got, "warnings": warnings}


@pytest.mark.timeout(120)
def test_a_finished_gather_is_delivered_when_its_parts_cannot_be_deleted(
    gatherstore_redis_url: str,
) -> None:
    import urllib.parse

    import redis

    admin = redis.Redis.from_url(gatherstore_redis_url)
    user, password, prefix = "no-deletes", uuid.uuid4().hex, f"test-{uuid.uuid4().hex}/"
    admin.acl_setuser(
        user,
        enabled=True,
        passwords=[f"+{password}"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-unlink", "-del"],
    )
    parts = urllib.parse.urlsplit(gatherstore_redis_url)
    url = urllib.parse.urlunsplit(
        parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}")
    )
    try:
        results = gs.launch(_undeletable_job, nproc_per_node=3, args=(url, prefix))
    finally:
        left = list(admin.scan_iter(match=f"{prefix}*"))
        if left:
            admin.unlink(*left)
        admin.acl_deluser(user)
        admin.close()
    expected = [(r, r * (1 << 17)) for r in range(3)]
    dst = results[0]
    assert dst["got"] == {"gather_object": expected, "gather_iter": expected}
    for call in (1, 2):  # each call's warning names the parts it left
        (warning,) = [w for w in dst["warnings"] if f"call-{call}/1" in w]
        assert f"call-{call}/2" in warning and "not deleted" in warning, warning
        assert "gatherstore gc" in warning, warning
    assert left  # the parts really stayed (deletes were refused)


# --- 3. too little memory: InsufficientMemoryError everywhere, no OOM kill -----------------
PART = 200 << 20  # bytes each sender holds
MARGIN = 300 << 20  # what the cgroup allows beyond what the job holds once its parts exist


def _memory_job(limit_file: str, usage_file: str) -> list[str]:
    """Senders hold PART bytes; the cgroup then allows MARGIN more; every big gather must fail."""
    rank = gs.get_rank()
    obj = np.ones(PART // 8) if rank else np.zeros(1)
    small = gs.gather_object(rank, timeout=60)  # a gather that fits still works
    gs.barrier()
    if rank == 0:  # the limit: what the job holds (page cache aside) + MARGIN
        limit_to_room(limit_file, usage_file, MARGIN)
    gs.barrier()
    out = [f"small {small}"]
    for store in ("collective", "tmpdir", "auto"):
        try:
            gs.gather_object(obj, store=store, timeout=60)
            out.append(f"{store}: no error")
        except gs.InsufficientMemoryError as exc:
            out.append(f"{store}: {type(exc).__name__}: {exc}")
    try:
        gs.all_gather_object(obj, timeout=60)
        out.append("all: no error")
    except gs.InsufficientMemoryError as exc:
        out.append(f"all: {type(exc).__name__}")
    return out


_IN_CGROUP = """
import os, sys
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
import gatherstore as gs, test_faults_data as t
for line in gs.launch(t._memory_job, nproc_per_node=3, backend="gloo", args=tuple(sys.argv[2:4])):
    print(repr(line))
"""


@pytest.mark.timeout(240)
def test_gathers_that_outgrow_the_memory_cgroup_fail_on_every_rank_before_moving_data() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    done, oom = run_in_memory_cgroup(_IN_CGROUP, [], timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [eval(line) for line in done.stdout.splitlines()]
    assert len(lines) == 3
    for out in lines:
        assert out[0] == "small [0, 1, 2]" or out[0] == "small None", out
        assert out[1].startswith("collective: InsufficientMemoryError"), out
        assert out[2].startswith("tmpdir: InsufficientMemoryError"), out
        assert out[3].startswith("auto: InsufficientMemoryError"), out
        assert out[4] == "all: InsufficientMemoryError", out
    assert "gather_iter" in lines[0][1] and "cgroup" in lines[0][1]
    assert "gather_iter" in lines[0][2]
    assert "oom_kill 0" in oom, oom
    for base, before in (("/dev/shm", shm_before), (tempfile.gettempdir(), tmp_before)):
        assert not [n for n in set(os.listdir(base)) - before if n.startswith("gatherstore-")]


# --- 4. bad specs: ValueError / ImportError / TypeError naming the spec and the fix ----------
BAD_SPECS = [
    ("redis://localhost:notaport/0", ValueError, "'notaport'"),
    ("redis://localhost:99999/0", ValueError, "'99999'"),
    ("redis://localhost:0/0", ValueError, "'0'"),
    ("redis://localhost:6379/zero", ValueError, "'zero'"),
    ("redis://u:secret@[::1/0", ValueError, "redis://"),
    ("unix://", ValueError, "unix:///path"),
    ("redis://localhost:6379/0?ttl=soon", ValueError, "ttl='soon'"),
    ("file://relative/dir", ValueError, "file:///shared/dir"),
    ("file:///x?y=1", ValueError, "file:///shared/dir"),
    ("tmpdir://relative", ValueError, "tmpdir:///shared/dir"),
    ("s3://", ValueError, "s3://bucket/prefix"),
    ("nosuchscheme://x", ValueError, "register_store"),
    ("oss://bucket/prefix", ImportError, "needs ossfs, which is not installed: pip install ossfs"),
]


def _foreign_frames(exc: BaseException) -> list[str]:
    """Frames outside gatherstore (and this test) in the traceback a user sees."""
    seen: list[str] = []
    while exc is not None:
        frames = traceback.extract_tb(exc.__traceback__)
        seen += [
            f.filename for f in frames if "gatherstore" not in f.filename and f.filename != __file__
        ]
        exc = None if exc.__suppress_context__ else (exc.__cause__ or exc.__context__)  # type: ignore[assignment]
    return seen


@pytest.mark.parametrize(("spec", "error", "fix"), BAD_SPECS)
def test_bad_specs_name_the_spec_and_the_fix(spec: str, error: type[Exception], fix: str) -> None:
    if spec.startswith("oss://") and importlib.util.find_spec("ossfs"):
        pytest.skip("ossfs is installed here")
    with pytest.raises(error) as info:
        gs.open_store(spec)
    message = str(info.value)
    assert fix in message, message
    assert "secret" not in message
    assert _foreign_frames(info.value) == []


def test_unreachable_redis_is_unavailable_naming_it() -> None:
    store = gs.open_store("redis://127.0.0.1:1/0")
    with pytest.raises(gs.StoreUnavailableError) as info:
        store.exists("x")
    assert "redis://127.0.0.1:1/0" in str(info.value)


def test_percent_encoded_and_chained_urls() -> None:
    store = gs.open_store("file:///my%20dir/x")
    assert str(store.root) == "/my dir/x" and gs.open_store(store.url).root == store.root
    chained = gs.open_store("simplecache::memory://faults-chain")  # fsspec's chaining
    chained.put("k", b"v")
    assert chained.get("k") == b"v"
    chained.delete("")


def test_registry_refuses_non_stores_and_hints_missing_packages() -> None:
    """Registered for the rest of the session (the same registration again is allowed)."""
    gs.register_store("faults-not-a-store", "json:JSONDecoder")
    gs.register_store("faults-missing", "no_such_module_xyz:Store", hint="pip install xyz-store")
    with pytest.raises(TypeError, match=r"not a gatherstore\.stores\.Store subclass"):
        gs.open_store("faults-not-a-store://x")
    with pytest.raises(ImportError, match="pip install xyz-store"):
        gs.open_store("faults-missing://x")


@pytest.mark.timeout(60)
def test_missing_s3fs_raises_import_error_with_the_hint() -> None:
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "import gatherstore as gs\n"
        "try:\n    gs.open_store('s3://bucket/prefix')\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert "pip install 'gatherstore[s3]'" in done.stdout, done.stdout + done.stderr


# --- 5. Redis: deletes by name, TTLs renewed while reading, expiry is not tampering --------
def _scans(server: redis.Redis) -> int:
    stats = server.info("commandstats")
    return int(stats.get("cmdstat_scan", {}).get("calls", 0))


@pytest.mark.timeout(60)
def test_redis_job_end_deletes_its_keys_by_name_without_scan() -> None:
    with services.start_redis() as server, redis.Redis.from_url(server.url) as client:
        store = gs.open_store(server.url, chunk_size=1024)
        other = store.scoped("someone-else")
        other.put("keep", b"x")
        locator = store.prepare_job(uuid.uuid4().hex[:16])
        job = store.join_job(locator)
        job.put("marker", b"{}")
        job.put("call-1/1", os.urandom(10_000))  # 10 chunks
        before = _scans(client)
        store.end_job(locator)
        assert _scans(client) == before
        names = sorted(k.decode() for k in client.keys("*"))
        assert names == ["someone-else/keep"]


@pytest.mark.timeout(60)
def test_redis_parts_outlive_their_ttl_while_read_and_expiry_is_not_tampering() -> None:
    with services.start_redis() as server, redis.Redis.from_url(server.url) as client:
        ttl = 2.0  # reading renews every ttl / 4: a read may come up to 1.5 s late
        store = gs.open_store(server.url, ttl=ttl, chunk_size=1024)
        job = store.join_job(store.prepare_job(uuid.uuid4().hex[:16]))
        job.put("read", b"r")
        job.put("waiting", os.urandom(5000))
        end = time.monotonic() + 2 * ttl  # the job reads other parts for two TTLs
        while time.monotonic() < end:
            assert job.get("read") is not None
            time.sleep(0.02)
        assert job.get("waiting") is not None  # outlived its TTL twice over
        chunks = client.keys("*waiting.chunks/*")
        client.unlink(chunks[0])  # one chunk expires
        with pytest.raises(gs.GatherError, match="expired") as info:
            job.get("waiting")
        assert not isinstance(info.value, gs.IntegrityError)


def test_fsspec_store_maps_every_http_stack_error() -> None:
    pytest.importorskip("s3fs")
    import aiohttp
    import botocore.exceptions

    store = gs.open_store("memory://faults-errors")
    for error in (aiohttp.ClientError, botocore.exceptions.BotoCoreError, TimeoutError, OSError):
        assert issubclass(error, store.unavailable_errors), error
