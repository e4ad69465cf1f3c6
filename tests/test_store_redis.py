"""RedisStore against a real redis-server: conformance, TTLs, options, failures, jobs."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis
from _jobs import check_object_collectives, object_collectives_job
from peak import round_trip_growth

import gatherstore as gs
from gatherstore.cli.bench.measure import PeakMemory
from gatherstore.stores import KeyExistsError, Store, _resp
from gatherstore.stores.redis import RedisStore
from gatherstore.testing import StoreTests, services

PASSWORD = "s3cr3t-redis-pw"


def _raw(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def _raw_keys(url: str, prefix: str) -> list[str]:
    client = _raw(url)
    try:
        pattern = "".join(f"\\{c}" if c in "\\*?[]" else c for c in prefix) + "*"
        return sorted({k.decode()[len(prefix) :] for k in client.scan_iter(match=pattern)})
    finally:
        client.close()


@pytest.fixture(scope="module")
def redis_url(gatherstore_redis_url: str) -> str:
    """The session's Redis, through an ACL user with a password (so hiding it is tested)."""
    client = _raw(gatherstore_redis_url)
    try:
        client.acl_setuser(
            "gatherstore-test",
            enabled=True,
            passwords=[f"+{PASSWORD}"],
            keys=["*"],
            channels=["*"],
            commands=["+@all"],
        )
    except redis.RedisError:  # an external server that refuses ACL changes
        return gatherstore_redis_url
    finally:
        client.close()
    parts = urllib.parse.urlsplit(gatherstore_redis_url)
    netloc = f"gatherstore-test:{PASSWORD}@{parts.hostname}:{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own: it sees (and lists) only its keys."""
    return f"test-{uuid.uuid4().hex}/"


class TestRedisStore(StoreTests):
    @pytest.fixture
    def store(self, redis_url: str, prefix: str) -> Iterator[Store]:
        store = RedisStore(redis_url, key_prefix=prefix)
        yield store
        store.delete("")
        store.close()

    def raw_keys(self, store: Store) -> list[str]:
        assert isinstance(store, RedisStore)
        return _raw_keys(store.url, store.key_prefix)

    def raw_get(self, store: Store, key: str) -> bytes | None:
        assert isinstance(store, RedisStore)
        with contextlib.closing(_raw(store.url)) as client:
            return client.get(store.key_prefix + key)  # type: ignore[return-value]

    def raw_set(self, store: Store, key: str, data: bytes) -> None:
        assert isinstance(store, RedisStore)
        with contextlib.closing(_raw(store.url)) as client:
            client.set(store.key_prefix + key, data, keepttl=True)

    def raw_delete(self, store: Store, key: str) -> None:
        assert isinstance(store, RedisStore)
        with contextlib.closing(_raw(store.url)) as client:
            client.delete(store.key_prefix + key)


def test_every_key_has_a_ttl(redis_url: str, prefix: str) -> None:
    store = RedisStore(redis_url, key_prefix=prefix, ttl=120, chunk_size=4096)
    store.put("small", b"v")
    store.put("big", os.urandom(20_000))  # 5 chunks and a manifest
    client = _raw(redis_url)
    try:
        keys = set(client.scan_iter(match=f"{prefix}*"))  # SCAN may repeat a key
        assert len(keys) == 7
        ttls = [client.pttl(k) for k in keys]
        assert all(0 < t <= 120_000 for t in ttls), ttls
    finally:
        client.close()
        store.delete("")


def test_keys_expire(redis_url: str, prefix: str) -> None:
    store = RedisStore(redis_url, key_prefix=prefix, ttl=0.3)
    store.put("k", b"v")
    deadline = time.monotonic() + 10
    while store.exists("k") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not store.exists("k")


def test_options_from_url_or_keywords(redis_url: str) -> None:
    store = RedisStore(f"{redis_url}?ttl=90&chunk_size=2097152&socket_timeout=7&key_prefix=a/")
    assert (store.ttl, store.chunk_size, store.max_value_size, store.key_prefix) == (
        90.0,
        2 << 20,
        2 << 20,
        "a/",
    )
    assert store.url == redis_url  # the query moves into the options
    assert store._options() == {
        "ttl": 90.0,
        "chunk_size": 2 << 20,
        "socket_timeout": 7.0,
        "key_prefix": "a/",
    }
    # the same option both ways is fine when it agrees
    same = RedisStore(f"{redis_url}?ttl=90", ttl=90, socket_timeout=7.0)
    assert same.ttl == 90.0
    clone = pickle.loads(pickle.dumps(store))
    assert (clone.url, clone._options()) == (store.url, store._options())
    assert RedisStore(redis_url).chunk_size == 4 << 20
    assert gs.open_store(f"{redis_url}?sign=false").sign_parts is False
    assert gs.open_store(redis_url).sign_parts is True


@pytest.mark.parametrize(
    ("query", "keywords", "names"),
    [
        ("ttl=60", {"ttl": 30}, ["'ttl'", "60.0", "30"]),
        ("socket_timeout=5", {"socket_timeout": 10}, ["'socket_timeout'", "5.0", "10"]),
        ("", {"db": 3}, ["'db'", "0", "3"]),
        ("password=one", {"password": "two"}, ["'password'"]),
    ],
)
def test_conflicting_options_are_refused(
    redis_url: str, query: str, keywords: dict[str, Any], names: list[str]
) -> None:
    with pytest.raises(ValueError, match="given twice") as info:
        RedisStore(f"{redis_url}?{query}", **keywords)
    for name in names:
        assert name in str(info.value)
    assert PASSWORD not in str(info.value)
    assert "one" not in str(info.value).replace("give it once", "")


def test_bad_options_are_refused(redis_url: str) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        RedisStore(redis_url, chunk_size=600 << 20)
    with pytest.raises(ValueError, match="ttl"):
        RedisStore(redis_url, ttl=0)
    with pytest.raises(ValueError, match="unknown Redis option"):
        RedisStore(redis_url, no_such_option=1)
    with pytest.raises(ValueError, match="not a Redis URL"):
        RedisStore("http://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="socket_timeout"):
        RedisStore(f"{redis_url}?socket_timeout=soon")


def test_password_hidden_but_kept(redis_url: str, prefix: str) -> None:
    store = gs.open_store(redis_url, key_prefix=prefix)
    if PASSWORD not in redis_url:
        pytest.skip("the test server refused to create an ACL user")
    assert PASSWORD not in str(store) and PASSWORD not in repr(store)
    assert "***" in str(store)
    clone = pickle.loads(pickle.dumps(store))
    clone.put("k", b"v")  # the password survived pickling
    assert bytes(store.get("k") or b"") == b"v"
    store.delete("")
    # a password given as a keyword stays out of str() too
    plain = urllib.parse.urlsplit(redis_url)._replace(
        netloc=f"{urllib.parse.urlsplit(redis_url).hostname}:{urllib.parse.urlsplit(redis_url).port}"
    )
    keyword = RedisStore(
        urllib.parse.urlunsplit(plain), username="gatherstore-test", password=PASSWORD
    )
    assert PASSWORD not in str(keyword)
    assert pickle.loads(pickle.dumps(keyword)).exists("nothing-here") is False


def test_reads_are_writable(redis_url: str, prefix: str) -> None:
    store = RedisStore(redis_url, key_prefix=prefix)
    try:
        store.put("k", b"abc")
        value = store.get("k")
        assert value is not None and not memoryview(value).readonly
    finally:
        store.delete("")


def test_stopped_server_is_unavailable(tmp_path: Any) -> None:
    service = services.start_redis(workdir=str(tmp_path))
    url = service.url.replace("redis://", f"redis://:{PASSWORD}@")
    client = _raw(service.url)
    client.config_set("requirepass", PASSWORD)
    client.close()
    store = RedisStore(url, socket_connect_timeout=2)
    store.put("k", b"v")
    service.stop()
    for action in (lambda: store.put("k2", b"v"), lambda: store.get("k"), store.list):
        with pytest.raises(gs.StoreUnavailableError) as info:
            action()
        assert PASSWORD not in str(info.value)
        assert "***" in str(info.value) and info.value.store == str(store)
        assert "Connection refused" in str(info.value)  # the cause's message, not its chain
        assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_part_over_512_mb_round_trips(redis_url: str, prefix: str) -> None:
    store = RedisStore(redis_url, key_prefix=prefix)
    size = 600 << 20
    data = np.random.default_rng(0).integers(0, 255, size=size, dtype=np.uint8)
    crc = zlib.crc32(data.data)
    try:
        assert store.put("huge", data.data) == size
        assert len(_raw_keys(redis_url, prefix)) == 151  # 150 chunks of 4 MiB + the manifest
        del data
        value = store.get("huge")
        assert value is not None and len(value) == size and zlib.crc32(value) == crc
        del value
        assert sum(len(c) for c in store.iter_chunks("huge")) == size
    finally:
        store.delete("")
    assert _raw_keys(redis_url, prefix) == []


# --- object collectives over redis:// in real gloo groups ----------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc", [2, 3])
def test_object_collectives_over_redis(redis_url: str, prefix: str, nproc: int) -> None:
    options = {"key_prefix": prefix, "chunk_size": 256 << 10}  # parts of ~400 KB are chunked
    results = gs.launch(
        object_collectives_job, nproc_per_node=nproc, backend="gloo", args=(redis_url, options)
    )
    check_object_collectives(results)
    assert _raw_keys(redis_url, prefix) == []  # shutdown removed the job area


def _scan_count(url: str) -> int:
    client = _raw(url)
    try:
        return int(client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))
    finally:
        client.close()


def _gathers_job(url: str, options: dict[str, Any]) -> int:
    store = gs.open_store(url, **options)
    gs.broadcast_object("open the job area", store=store)
    before = _scan_count(url) if gs.get_rank() == 0 else 0
    gs.barrier()
    part = np.full(100_000, gs.get_rank())  # 800 KB: chunked
    for _ in range(3):
        gs.all_gather_object(part, store=store)
        gs.gather_object(part, store=store)
        list(gs.gather_iter(part, store=store))
        gs.broadcast_object(part, src=1, store=store)
    gs.barrier()
    return _scan_count(url) - before


@pytest.mark.timeout(120)
def test_gathers_never_scan_the_keyspace(redis_url: str, prefix: str) -> None:
    """Parts are deleted by name: a shared Redis with millions of keys costs nothing more."""
    options = {"key_prefix": prefix, "chunk_size": 256 << 10}
    scans = gs.launch(_gathers_job, nproc_per_node=2, backend="gloo", args=(redis_url, options))
    assert scans[0] == 0
    assert _raw_keys(redis_url, prefix) == []  # shutdown swept the job area


def _stopped_server_job(url: str, pid: int) -> tuple[str, str, float]:
    store = gs.open_store(url, socket_connect_timeout=2)
    assert gs.all_gather_object(gs.get_rank(), store=store, timeout=30) == [0, 1, 2]
    gs.barrier(timeout=30)  # every rank has cleaned up its part
    if gs.get_rank() == 0:
        os.kill(pid, signal.SIGKILL)  # the parent reaps it; wait until the port is closed
        port = urllib.parse.urlsplit(url).port
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) != 0:
                    break
            time.sleep(0.05)
    gs.barrier(timeout=30)
    start = time.monotonic()
    try:
        gs.gather_object(np.zeros(1000), store=store, timeout=30)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.timeout(120)
def test_stopped_server_fails_every_rank(tmp_path: Any) -> None:
    service = services.start_redis(workdir=str(tmp_path))
    client = _raw(service.url)
    client.config_set("requirepass", PASSWORD)
    client.close()
    url = service.url.replace("redis://", f"redis://:{PASSWORD}@")
    try:
        results = gs.launch(
            _stopped_server_job,
            nproc_per_node=3,
            backend="gloo",
            args=(url, service.process.pid),
            timeout=60,
        )
    finally:
        service.stop()
    for kind, message, seconds in results:
        assert kind == "StoreUnavailableError", message
        assert PASSWORD not in message and "***" in message
        assert seconds < 30


def test_unix_socket(tmp_path: Any) -> None:
    executable = shutil.which("redis-server") or "/usr/bin/redis-server"
    sock = tmp_path / "redis.sock"
    argv = [executable, "--port", "0", "--unixsocket", str(sock), "--save", "", "--dir", tmp_path]
    server = subprocess.Popen(list(map(str, argv)), stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        store = gs.open_store(f"unix://{sock}?db=2&ttl=60", key_prefix="u/")
        assert isinstance(store, RedisStore) and store.url == f"unix://{sock}"
        store.put("k", b"over a unix socket")
        assert bytes(pickle.loads(pickle.dumps(store)).get("k") or b"") == b"over a unix socket"
        big = os.urandom(9 << 20)  # 3 chunks, pipelined over the socket
        store.put("big", big)
        assert bytes(store.get("big") or b"") == big
        store.discard("big")
        client = redis.Redis(unix_socket_path=str(sock), db=2)
        assert client.keys() == [b"u/k"] and 0 < client.ttl(b"u/k") <= 60
        client.close()
        store.close()
    finally:
        server.terminate()
        server.wait(10)


def test_tls_url_is_understood() -> None:
    store = RedisStore(f"rediss://user:{PASSWORD}@redis.example:6380/3", ssl_cert_reqs="none")
    assert str(store) == "rediss://user:***@redis.example:6380/3"
    assert issubclass(store._pool.connection_class, redis.SSLConnection)
    assert store._pool.connection_kwargs["db"] == 3
    clone = pickle.loads(pickle.dumps(store))
    assert clone._pool.connection_kwargs["password"] == PASSWORD
    assert clone._options() == {"ssl_cert_reqs": "none"}


# --- the pipelined wire ------------------------------------------------------------------------


class _CuttingProxy:
    """A TCP proxy to Redis that, once armed, cuts the next ``times`` replies carrying
    ``marker``: it forwards ``keep`` bytes of each and closes that connection (a real
    dropped link)."""

    def __init__(self, upstream: str) -> None:
        parts = urllib.parse.urlsplit(upstream)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.marker: bytes | None = None
        self.keep = self.times = 0
        self.cuts = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, marker: bytes, keep: int = 0, times: int = 1) -> None:
        with self.lock:
            self.marker, self.keep, self.times = marker, keep, times

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                with self.lock:
                    cut = replies and self.marker is not None and self.marker in data
                    if cut:
                        self.cuts, self.times = self.cuts + 1, self.times - 1
                        self.marker = self.marker if self.times else None
                if cut:
                    dst.sendall(data[: self.keep])
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def proxy(gatherstore_redis_url: str) -> Iterator[_CuttingProxy]:
    proxy = _CuttingProxy(gatherstore_redis_url)
    yield proxy
    proxy.close()


def test_retried_set_that_landed_is_the_writers_own(
    proxy: _CuttingProxy, gatherstore_redis_url: str, prefix: str
) -> None:
    """The link drops after the SET NX landed, before its reply: the retry's nil reply is
    the writer's own value, not a KeyExistsError."""
    store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", key_prefix=prefix, chunk_size=4096)
    try:
        store.put("warm", b"x")  # connected and authenticated before the link is cut
        proxy.arm(b"+OK")
        assert store.put("inline", b"mine") == 4
        proxy.arm(b"+OK")
        data = os.urandom(20_000)  # 5 chunks in flight, then the manifest
        assert store.put("chunked", data) == len(data)
        assert proxy.cuts == 2
        assert bytes(store.get("inline") or b"") == b"mine"
        assert bytes(store.get("chunked") or b"") == data
        with pytest.raises(KeyExistsError):  # somebody else's value is still refused
            store.put("inline", b"other")
    finally:
        store.delete("")
        store.close()
    assert _raw_keys(gatherstore_redis_url, prefix) == []


def test_replies_cut_midway_are_read_again_then_unavailable(
    proxy: _CuttingProxy, prefix: str
) -> None:
    store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", key_prefix=prefix)
    try:
        data = os.urandom(3 << 20)
        store.put("k", data)
        reply = b"$%d\r\n" % ((3 << 20) + 64)  # the value's bulk reply (with its header)
        proxy.arm(reply, keep=1000)  # the reply ends after 1000 bytes: read again
        assert bytes(store.get("k") or b"") == data and proxy.cuts == 1
        proxy.arm(reply, keep=1000, times=3)  # every try is cut
        with pytest.raises(gs.StoreUnavailableError, match="closed the connection") as info:
            store.get("k")
        assert info.value.__cause__ is None and info.value.__suppress_context__
        assert proxy.cuts == 4
        assert bytes(store.get("k") or b"") == data  # a fresh connection, nothing half-read
    finally:
        store.delete("")
        store.close()


@pytest.mark.timeout(120)
def test_values_go_out_and_come_back_without_copies(redis_url: str, prefix: str) -> None:
    """A 256 MiB part: sent from its own buffer, received into one preallocated buffer."""
    store = RedisStore(redis_url, key_prefix=prefix)
    size = 256 << 20
    try:
        put, get = round_trip_growth(store, size, seed=2)
    finally:
        store.close()
    assert put < 0.05 * size, put / size  # no join, no packed copy
    assert get < 1.05 * size, get / size  # the value, nothing else


def test_large_values_never_use_hiredis_packer(redis_url: str) -> None:
    """hiredis' command packer copies every value; the store must keep redis-py's own."""
    pytest.importorskip("hiredis")
    store = RedisStore(redis_url)
    try:
        connection = _resp.pooled(store._pool)
        try:
            assert isinstance(connection._command_packer, redis.connection.PythonRespSerializer)
        finally:
            store._pool.release(connection)
    finally:
        store.close()


READ_PART = 48 << 20


def _read_ahead_job(url: str) -> dict[str, Any]:
    """Rank 0 streams 3 parts of 48 MiB: how many reads ran at once, and its peak memory."""
    from gatherstore._config import DEFAULT_READ_AHEAD

    store = gs.open_store(url)
    rank = gs.get_rank()
    part = np.full(READ_PART, rank, dtype=np.uint8)
    busiest = 0
    seen = []
    with PeakMemory() as mem:
        for got in gs.gather_iter(part, store=store, timeout=120):
            reading = [t for t in threading.enumerate() if t.name.startswith("gatherstore-read")]
            busiest = max(busiest, len(reading))
            whole = got.nbytes == READ_PART and got.min() == got.max()  # no temporaries
            seen.append(int(got[0]) if whole else -1)
            del got
    return {
        "seen": seen,
        "busiest": busiest,
        "growth": mem.growth,
        "reset": mem.reset,
        "window": DEFAULT_READ_AHEAD,
    }


@pytest.mark.timeout(120)
def test_destination_reads_ahead_within_a_window(redis_url: str, prefix: str) -> None:
    """Parts larger than the read-ahead budget are read when asked for: the destination
    holds the part its loop keeps plus at most the budget."""
    url = f"{redis_url}?key_prefix={prefix}"
    first, *others = gs.launch(_read_ahead_job, nproc_per_node=4, backend="gloo", args=(url,))
    assert first["seen"] == [0, 1, 2, 3]
    assert first["busiest"] >= 1 and first["window"] < READ_PART
    if first["reset"]:  # the part the loop holds, what reading it takes, no read-ahead
        assert first["growth"] < 1.3 * READ_PART, first["growth"] / READ_PART
    assert [o["seen"] for o in others] == [[], [], []]
    assert _raw_keys(redis_url, prefix) == []


def test_a_chunked_value_is_read_once_and_deleted_by_name(redis_url: str, prefix: str) -> None:
    """get then discard: one GET per chunk and one of the manifest, nothing read twice."""
    store = RedisStore(redis_url, key_prefix=prefix, chunk_size=4096)
    client = _raw(redis_url)

    def calls() -> dict[str, int]:
        stats = client.info("commandstats")
        return {c: stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("get", "getrange")}

    try:
        store.put("k", os.urandom(20_000))  # 5 chunks
        before = calls()
        assert store.get("k") is not None
        store.discard("k")
        after = calls()
        assert after["get"] - before["get"] == 6 and after["getrange"] == before["getrange"]
        assert _raw_keys(redis_url, prefix) == []
    finally:
        client.close()
        store.delete("")
        store.close()
