"""FsspecStore on S3 against a real SeaweedFS: conformance, multipart, object collectives."""

from __future__ import annotations

import contextlib
import threading
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _jobs import check_object_collectives, object_collectives_job
from peak import round_trip_growth

import gatherstore as gs
from gatherstore.stores import Store
from gatherstore.stores.fsspec import FsspecStore, fast_s3_options
from gatherstore.testing import StoreTests
from gatherstore.testing.plugin import S3Endpoint

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("botocore.session")


@pytest.fixture(scope="module")
def s3(gatherstore_s3: S3Endpoint) -> Iterator[tuple[S3Endpoint, str, Any]]:
    """(endpoint, a bucket of this module's own, a raw botocore client)."""
    client = gatherstore_s3.client()
    bucket = f"gatherstore-test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield gatherstore_s3, bucket, client
    for key in _raw_objects(client, bucket, ""):
        client.delete_object(Bucket=bucket, Key=key)
    client.delete_bucket(Bucket=bucket)
    client.close()


def _raw_objects(client: Any, bucket: str, prefix: str) -> list[str]:
    """Every object under ``prefix``, listed with botocore (no s3fs, no caches)."""
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [item["Key"][len(prefix) :] for item in page.get("Contents", [])]
    return sorted(keys)


def _pending_uploads(client: Any, bucket: str, prefix: str) -> list[str]:
    reply = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    return [u["Key"] for u in reply.get("Uploads", [])]


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex}"


class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, s3: tuple[S3Endpoint, str, Any], prefix: str) -> Iterator[Store]:
        endpoint, bucket, _ = s3
        store = FsspecStore(f"s3://{bucket}/{prefix}", **endpoint.storage_options)
        yield store
        store.delete("")

    def raw_keys(self, store: Store) -> list[str]:
        with _raw_client(store) as (client, bucket, prefix):
            return _raw_objects(client, bucket, prefix)

    def raw_get(self, store: Store, key: str) -> bytes | None:
        with _raw_client(store) as (client, bucket, prefix):
            try:
                return client.get_object(Bucket=bucket, Key=prefix + key)["Body"].read()  # type: ignore[no-any-return]
            except client.exceptions.NoSuchKey:
                return None

    def raw_set(self, store: Store, key: str, data: bytes) -> None:
        with _raw_client(store) as (client, bucket, prefix):
            client.put_object(Bucket=bucket, Key=prefix + key, Body=data)

    def raw_delete(self, store: Store, key: str) -> None:
        with _raw_client(store) as (client, bucket, prefix):
            client.delete_object(Bucket=bucket, Key=prefix + key)


@contextlib.contextmanager
def _raw_client(store: Store) -> Iterator[tuple[Any, str, str]]:
    """(a botocore client of the store's endpoint, its bucket, its key prefix)."""
    assert isinstance(store, FsspecStore)
    bucket, _, prefix = store.root.partition("/")
    client = S3Endpoint(**_endpoint_of(store)).client()
    try:
        yield client, bucket, f"{prefix}/"
    finally:
        client.close()


def _endpoint_of(store: FsspecStore) -> dict[str, str]:
    options = store.storage_options
    return {
        "endpoint_url": options["client_kwargs"]["endpoint_url"],
        "key": options["key"],
        "secret": options["secret"],
    }


def racing_writes(store: Store, key: str, writers: int) -> list[bool]:
    """``writers`` threads write ``key`` at once, each its own value: who got it in."""
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(store._write(key, [b"%d" % i])))
        for i in range(writers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_create_only_is_enforced_by_the_server(s3: tuple[S3Endpoint, str, Any]) -> None:
    """No existence check before a PUT: If-None-Match lets exactly one of racing writers win."""
    endpoint, bucket, _ = s3
    store = FsspecStore(f"s3://{bucket}/race-{uuid.uuid4().hex}", **endpoint.storage_options)
    assert store._write("k", [b"first"]) is True
    assert store._write("k", [b"second"]) is False
    assert bytes(store._read("k") or b"") == b"first"
    assert sorted(racing_writes(store, "race", 6)) == [False] * 5 + [True]
    store.delete("")


def test_http_endpoints_send_unhashed_payloads(s3: tuple[S3Endpoint, str, Any]) -> None:
    """botocore would SHA-256 every uploaded byte for SigV4; over http:// it does not."""
    endpoint, bucket, _ = s3
    assert endpoint.endpoint_url.startswith("http://")
    store = FsspecStore(f"s3://{bucket}/sig-{uuid.uuid4().hex}", **endpoint.storage_options)
    store.fs.connect()
    sent: list[str] = []

    def observe(request: Any, **_: Any) -> None:
        sent.append(request.headers.get("x-amz-content-sha256", b"").decode())

    store.fs.s3.meta.events.register("before-send.s3.PutObject", observe)
    store.put("k", b"v" * 1000)
    assert sent == ["UNSIGNED-PAYLOAD"]
    assert bytes(store.get("k") or b"") == b"v" * 1000
    assert store.storage_options == endpoint.storage_options  # reopened alike, tuned again
    store.delete("")


def test_fast_options_keep_what_the_caller_says() -> None:
    plain = {"key": "k", "client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}
    config = fast_s3_options(plain)["config_kwargs"]
    assert config["s3"] == {"payload_signing_enabled": False}
    assert config["request_checksum_calculation"] == "when_required"
    assert plain == {"key": "k", "client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}
    tls = fast_s3_options({"endpoint_url": "https://s3.example", "config_kwargs": {"x": 1}})
    assert "s3" not in tls["config_kwargs"] and tls["config_kwargs"]["x"] == 1
    mine = {"s3": {"payload_signing_enabled": True}, "request_checksum_calculation": "x"}
    given = fast_s3_options({**plain, "config_kwargs": mine})["config_kwargs"]
    assert given["s3"] == {"payload_signing_enabled": True}
    assert given["request_checksum_calculation"] == "x"


@pytest.mark.timeout(120)
def test_large_part_is_create_only_objects_and_never_partial(
    s3: tuple[S3Endpoint, str, Any], prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, bucket, client = s3
    store = FsspecStore(f"s3://{bucket}/{prefix}", **endpoint.storage_options)
    data = np.random.default_rng(1).integers(0, 255, size=120 << 20, dtype=np.uint8)
    crc = zlib.crc32(data.data)
    seen: list[int] = []
    listed: list[list[str]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            listed.append(_raw_objects(client, bucket, f"{prefix}/"))
            if "big" in listed[-1]:
                value = store.get("big")
                seen.append(-1 if value is None else zlib.crc32(value))
                return
            done.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        store.put("big", data.data)
    finally:
        done.set()
        watcher.join(60)
    keys = _raw_objects(client, bucket, f"{prefix}/")
    chunks = [k for k in keys if k != "big"]
    assert len(chunks) == 8  # 120 MiB in 16 MiB objects
    assert all(k.startswith("big.chunks/") for k in chunks)
    sizes = [client.head_object(Bucket=bucket, Key=f"{prefix}/{k}")["ContentLength"] for k in keys]
    assert sizes[1:] == [16 << 20] * 7 + [8 << 20]
    assert sizes[0] < 4096  # the manifest, written last
    assert all("big" not in k or k == keys for k in listed)  # the manifest only with every chunk
    assert all(c == crc for c in seen)
    value = store.get("big")
    assert value is not None and zlib.crc32(value) == crc and not memoryview(value).readonly
    # a producer that dies after four chunks: nothing of it stays visible
    real_pipe, calls = store.fs.pipe_file, []

    def dying_pipe(path: str, value: Any, **kwargs: Any) -> Any:
        calls.append(path)
        if len(calls) == 5:
            raise OSError("producer died")
        return real_pipe(path, value, **kwargs)

    monkeypatch.setattr(store.fs, "pipe_file", dying_pipe)
    pieces = [data.data[i : i + (10 << 20)] for i in range(0, 100 << 20, 10 << 20)]
    with pytest.raises(gs.StoreUnavailableError, match="producer died"):
        store.put("broken", pieces)
    monkeypatch.undo()
    assert _raw_objects(client, bucket, f"{prefix}/") == keys
    assert _pending_uploads(client, bucket, f"{prefix}/") == []
    store.delete("")
    assert _raw_objects(client, bucket, f"{prefix}/") == []


# --- object collectives over s3:// in real gloo groups --------------------------------------


@pytest.mark.timeout(240)
def test_object_collectives_over_s3(s3: tuple[S3Endpoint, str, Any], prefix: str) -> None:
    endpoint, bucket, client = s3
    nproc = 3
    results = gs.launch(
        object_collectives_job,
        nproc_per_node=nproc,
        backend="gloo",
        args=(f"s3://{bucket}/{prefix}", endpoint.storage_options),
    )
    check_object_collectives(results)
    assert _raw_objects(client, bucket, f"{prefix}/") == []  # shutdown removed the job area
    assert _pending_uploads(client, bucket, f"{prefix}/") == []


PART = 256 << 20


def _big_gather_job(url: str, options: dict[str, Any]) -> list[tuple[int, int, int, bool]]:
    store = gs.open_store(url, **options)
    rank = gs.get_rank()
    array = np.random.default_rng(rank).integers(0, 1 << 62, size=PART // 8, dtype=np.int64)
    obj = {"rank": rank, "crc": zlib.crc32(array.data), "array": array}
    seen = []
    for part in gs.gather_iter(obj, store=store, timeout=300):
        got = part["array"]
        ok = zlib.crc32(got) == part["crc"] and got.flags.writeable
        seen.append((part["rank"], got.nbytes, part["crc"], ok))
        del part, got
    return seen


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_gigabyte_gather_through_s3(s3: tuple[S3Endpoint, str, Any], prefix: str) -> None:
    endpoint, bucket, client = s3
    results = gs.launch(
        _big_gather_job,
        nproc_per_node=4,
        backend="gloo",
        args=(f"s3://{bucket}/{prefix}", endpoint.storage_options),
        timeout=300,
    )
    assert [(r, n, ok) for r, n, _, ok in results[0]] == [(r, PART, True) for r in range(4)]
    assert results[1:] == [[], [], []]
    assert _raw_objects(client, bucket, f"{prefix}/") == []


@pytest.mark.timeout(180)
def test_large_parts_stream_in_blocks(s3: tuple[S3Endpoint, str, Any], prefix: str) -> None:
    """A 256 MiB part goes up and comes down block by block: no whole extra copies."""
    endpoint, bucket, _ = s3
    store = FsspecStore(f"s3://{bucket}/{prefix}", **endpoint.storage_options)
    size = 256 << 20
    put, get = round_trip_growth(store, size, seed=1)
    # 16 MiB objects, 4 in flight: measured about 0.3x (each PUT's joined body) and about
    # 1.2x (the part + the GETs in flight); a whole-body write or read held about 3x
    assert put < 0.9 * size, put / size
    assert get < 1.6 * size, get / size


def test_a_chunk_of_another_size_is_reported_truncated(
    s3: tuple[S3Endpoint, str, Any], prefix: str
) -> None:
    """Chunks are received straight into the value's buffer: a chunk object that is
    shorter or longer than the manifest says is reported, never half copied."""
    endpoint, bucket, client = s3
    store = FsspecStore(f"s3://{bucket}/{prefix}", **endpoint.storage_options)
    data = np.random.default_rng(2).integers(0, 255, size=40 << 20, dtype=np.uint8)
    try:
        store.put("big", data.data)
        value = store.get("big")
        assert value is not None and bytes(value) == data.tobytes()
        chunk = next(k for k in _raw_objects(client, bucket, f"{prefix}/") if "chunks" in k)
        for size in (1000, (16 << 20) + 1):
            client.delete_object(Bucket=bucket, Key=f"{prefix}/{chunk}")
            client.put_object(Bucket=bucket, Key=f"{prefix}/{chunk}", Body=b"x" * size)
            with pytest.raises(gs.IntegrityError, match="truncated"):
                store.get("big")
    finally:
        store.delete("")


def test_a_discard_deletes_the_manifest_then_its_chunks_in_one_request(
    s3: tuple[S3Endpoint, str, Any], prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, bucket, client = s3
    store = FsspecStore(f"s3://{bucket}/{prefix}", **endpoint.storage_options)
    store.put("big", bytes(40 << 20))  # 3 chunk objects and the manifest
    requests: list[tuple[str, Any]] = []
    real = store.fs._call_s3

    async def spy(method: str, *args: Any, **kwargs: Any) -> Any:
        requests.append((method, kwargs.get("Key") or kwargs.get("Delete")))
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "_call_s3", spy)
    store.discard("big")
    deletes = [(m, what) for m, what in requests if m.startswith("delete")]
    assert [m for m, _ in deletes] == ["delete_object", "delete_objects"]
    assert deletes[0][1] == f"{prefix}/big"  # readers see the whole value or nothing
    assert len(deletes[1][1]["Objects"]) == 3
    assert _raw_objects(client, bucket, f"{prefix}/") == []


def test_objects_s3_refuses_to_delete_are_errors() -> None:
    import asyncio

    from gatherstore.stores._s3 import delete_objects

    class Refusing:
        def __init__(self, code: str) -> None:
            self.code = code

        def split_path(self, path: str) -> tuple[str, str, None]:
            bucket, _, key = path.partition("/")
            return bucket, key, None

        def invalidate_cache(self, path: str) -> None:
            pass

        async def _call_s3(self, method: str, **kwargs: Any) -> dict[str, Any]:
            return {"Errors": [{"Key": "k", "Code": self.code, "Message": "no"}]}

    asyncio.run(delete_objects(Refusing("NoSuchKey"), ["b/k"]))  # already gone: fine
    with pytest.raises(PermissionError, match="AccessDenied"):
        asyncio.run(delete_objects(Refusing("AccessDenied"), ["b/k"]))
