"""The network services' ceilings: each client library alone, on the bytes the cases move.

For Redis and S3 the bench measures, once per run and as the median of the
run's ``--repeats`` passes (the cases' own statistic), what the client library
does with the same number of bytes without gatherstore: with its default
settings (one blocking SET/GET per 4 MiB value; s3fs's ``pipe_file`` and
``cat_file``) and with the fastest settings gatherstore uses (several values
or parts in flight, large socket reads, no payload hashing on ``http://``).
gatherstore's throughput is then reported as a share of both.

Each client runs in a fresh interpreter, as every case does. A long-lived
process is not a fair place: once glibc's allocator has freed a few large
blocks it keeps them, and a client that allocates a new buffer per value then
skips the page faults a fresh process pays (on these VMs 2 us a page, which
moves redis-py's GET from 0.5 to 3 GB/s).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import multiprocessing
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from gatherstore.cli.bench.cases import Case

__all__ = ["REDIS_VALUE", "S3_PART", "fresh_bucket", "measure", "measure_redis", "measure_s3"]

#: Bytes per Redis value (gatherstore's default chunk size) and per S3 part or range.
REDIS_VALUE = 4 << 20
S3_PART = 16 << 20
_DEPTH = 4  # values or parts in flight in the fast settings
_TTL_MS = 600_000
_T = TypeVar("_T")


def _median(passes: list[tuple[float, float]]) -> tuple[float, float]:
    """Median seconds of (write, read) passes, write and read each on its own: the
    statistic the cases report (their median over ``--repeats``)."""
    return statistics.median(w for w, _ in passes), statistics.median(r for _, r in passes)


def _rates(prefix: str, nbytes: int, write: float, read: float) -> dict[str, float]:
    """GB/s (1e9 bytes/s) of a write, a read and both in sequence."""
    gb = nbytes / 1e9
    return {
        f"{prefix}_write_gbps": gb / write,
        f"{prefix}_read_gbps": gb / read,
        f"{prefix}_gbps": gb / (write + read),
    }


def _fresh(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` in a fresh interpreter (spawned), the state every case starts in."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _source(nbytes: int) -> memoryview:
    """``nbytes`` of incompressible bytes (services must not profit from zeros)."""
    return memoryview(np.random.default_rng(0).bytes(nbytes))


def _slices(nbytes: int, step: int) -> list[tuple[int, int]]:
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, step)]


# --- Redis ---------------------------------------------------------------------------------------
def _redis_pass(client: Any, src: memoryview, depth: int, keys: list[bytes]) -> tuple[float, float]:
    """Seconds to SET every value (``depth`` per round trip), then GET them back.

    ``depth`` 1 is redis-py as one uses it: ``client.set`` then ``client.get``.
    """
    spans = _slices(len(src), REDIS_VALUE)
    out = bytearray(len(src))

    def write() -> None:
        if depth == 1:
            for key, (a, b) in zip(keys, spans, strict=True):
                client.set(key, src[a:b], px=_TTL_MS)
            return
        for i in range(0, len(spans), depth):
            pipe = client.pipeline(transaction=False)
            for key, (a, b) in zip(keys[i : i + depth], spans[i : i + depth], strict=True):
                pipe.set(key, src[a:b], px=_TTL_MS)
            pipe.execute()

    def read() -> None:
        if depth == 1:
            for key, (a, b) in zip(keys, spans, strict=True):
                out[a:b] = client.get(key)
            return
        for i in range(0, len(spans), depth):
            pipe = client.pipeline(transaction=False)
            for key in keys[i : i + depth]:
                pipe.get(key)
            for value, (a, b) in zip(pipe.execute(), spans[i : i + depth], strict=True):
                out[a:b] = value

    try:
        return _timed(write), _timed(read)
    finally:
        client.unlink(*keys)


def _redis_wire(url: str, src: memoryview, prefix: str) -> tuple[float, float]:
    """Seconds of gatherstore's wire: every value SET, then GET, 4 in flight, no copies."""
    from gatherstore.stores.registry import open_store

    spans = _slices(len(src), REDIS_VALUE)
    store = open_store(url, key_prefix=prefix, ttl=_TTL_MS / 1000)
    out = memoryview(bytearray(len(src)))
    keys = [f"{i}" for i in range(len(spans))]
    try:
        write = _timed(
            lambda: store._write_many(
                [(k, [src[a:b]]) for k, (a, b) in zip(keys, spans, strict=True)]
            )
        )
        read = _timed(
            lambda: store._read_many_into(
                [(k, out[a:b]) for k, (a, b) in zip(keys, spans, strict=True)]
            )
        )
        return write, read
    finally:
        store.delete("")
        store.close()


#: The redis-py clients measured: name -> (hiredis importable, hiredis packs commands,
#: values per round trip). ``redis_default`` is redis-py as ``pip install redis``
#: installs it; ``redis_default_hiredis`` the same with hiredis (``gatherstore[redis]``).
_REDIS_CLIENTS = {
    "redis_default": (False, False, 1),
    "redis_default_hiredis": (True, True, 1),
    "redis_pipelined": (True, False, _DEPTH),
    "redis_hiredis_packer": (True, True, _DEPTH),
}


def _hide_hiredis() -> None:
    """Load redis-py as it comes without hiredis (only before redis-py is imported)."""
    if "redis" in sys.modules:
        raise RuntimeError("redis-py is already imported; hiredis can no longer be hidden")
    sys.modules["hiredis"] = None  # type: ignore[assignment]  # `import hiredis` now fails


def _redis_client(url: str, nbytes: int, repeats: int, name: str) -> tuple[float, float]:
    """Median (write, read) seconds of the Redis client ``name`` (run in a fresh process).

    ``redis_fast`` is gatherstore's wire; the others are redis-py per ``_REDIS_CLIENTS``,
    pipelined ones with 1 MiB socket reads.
    """
    run = uuid.uuid4().hex
    src = _source(nbytes)
    if name == "redis_fast":
        prefixes = [f"gatherstore-ceiling-{run}-{i}/" for i in range(repeats)]
        return _median([_redis_wire(url, src, prefix) for prefix in prefixes])
    hiredis, hiredis_packs, depth = _REDIS_CLIENTS[name]
    if not hiredis:
        _hide_hiredis()
    import redis

    from gatherstore.stores._resp import python_packer

    options: dict[str, Any] = {} if hiredis_packs else python_packer()
    if depth > 1:
        options["socket_read_size"] = 1 << 20
    keys = [f"gatherstore-ceiling-{run}-{i}".encode() for i in range(-(-nbytes // REDIS_VALUE))]
    client = redis.Redis.from_url(url, **options)
    try:
        return _median([_redis_pass(client, src, depth, keys) for _ in range(repeats)])
    finally:
        client.close()


def measure_redis(url: str, nbytes: int, repeats: int = 1) -> dict[str, float]:
    """Redis ceilings of ``nbytes`` in 4 MiB values, written then read back (the median
    of ``repeats`` passes of each), every client in a fresh process.

    ``redis_default``: redis-py without hiredis, ``set`` then ``get`` of each value,
    one per round trip; ``redis_default_hiredis`` (with hiredis): the same, hiredis
    packing and parsing; ``redis_pipelined``: pipelines of 4, the Python command
    packer, 1 MiB socket reads; ``redis_hiredis_packer`` (with hiredis): the same
    with hiredis' packer, which copies every value before it is sent;
    ``redis_fast``: gatherstore's wire.
    """
    repeats = max(1, repeats)
    names = ["redis_default", "redis_pipelined", "redis_fast"]
    if importlib.util.find_spec("hiredis"):
        names += ["redis_default_hiredis", "redis_hiredis_packer"]
    out: dict[str, float] = {}
    for name in names:
        out.update(_rates(name, nbytes, *_fresh(_redis_client, url, nbytes, repeats, name)))
    return out


# --- S3 ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fresh_bucket(options: dict[str, Any], label: str) -> Iterator[str]:
    """A fresh bucket named ``gatherstore-<label>-…`` on the S3 endpoint of ``options``
    (s3fs's), removed with everything in it afterwards."""
    import s3fs

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    bucket = f"gatherstore-{label}-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    try:
        yield bucket
    finally:
        fs.rm(bucket, recursive=True)


def _s3_default(options: dict[str, Any], path: str, src: memoryview) -> tuple[float, float]:
    """s3fs as it comes: ``pipe_file`` of the bytes, ``cat_file`` back."""
    import s3fs

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    data = bytes(src)
    return _timed(lambda: fs.pipe_file(path, data)), _timed(lambda: fs.cat_file(path))


def _s3_fast(options: dict[str, Any], prefix: str, src: memoryview) -> tuple[float, float]:
    """gatherstore's settings: 16 MiB create-only objects, 4 PUTs then 4 GETs in flight."""
    import s3fs

    from gatherstore.stores.fsspec import fast_s3_options

    fs = s3fs.S3FileSystem(**fast_s3_options(options), skip_instance_cache=True)
    spans = _slices(len(src), S3_PART)
    out = memoryview(bytearray(len(src)))

    def put(span: tuple[int, int]) -> None:
        fs.pipe_file(f"{prefix}/{span[0]}", bytes(src[span[0] : span[1]]), mode="create")

    def get(span: tuple[int, int]) -> None:
        out[span[0] : span[1]] = fs.cat_file(f"{prefix}/{span[0]}")

    with ThreadPoolExecutor(_DEPTH) as pool:
        return _timed(lambda: list(pool.map(put, spans))), _timed(
            lambda: list(pool.map(get, spans))
        )


def _s3_obstore(options: dict[str, Any], prefix: str, src: memoryview) -> tuple[float, float]:
    """obstore (Rust ``object_store``) in gatherstore's shape, for the client shoot-out:
    16 MiB create-only objects, 4 PUTs then 4 GETs in flight, unsigned payload."""
    obstore = importlib.import_module("obstore")
    stores = importlib.import_module("obstore.store")
    endpoint = str((options.get("client_kwargs") or {}).get("endpoint_url", ""))
    bucket, _, base = prefix.partition("/")
    store = stores.S3Store(
        bucket,
        endpoint=endpoint,
        access_key_id=options["key"],
        secret_access_key=options["secret"],
        region="us-east-1",
        virtual_hosted_style_request=False,
        unsigned_payload=endpoint.startswith("http://"),
        client_options={"allow_http": endpoint.startswith("http://")},
    )
    spans = _slices(len(src), S3_PART)
    out = memoryview(bytearray(len(src)))

    def put(span: tuple[int, int]) -> None:
        obstore.put(store, f"{base}/{span[0]}", src[span[0] : span[1]], mode="create")

    def get(span: tuple[int, int]) -> None:
        out[span[0] : span[1]] = memoryview(obstore.get(store, f"{base}/{span[0]}").bytes())

    with ThreadPoolExecutor(_DEPTH) as pool:
        return _timed(lambda: list(pool.map(put, spans))), _timed(
            lambda: list(pool.map(get, spans))
        )


#: The S3 clients measured: name -> one pass (options, key prefix, bytes) -> (write, read) s.
_S3_CLIENTS: dict[str, Callable[[dict[str, Any], str, memoryview], tuple[float, float]]] = {
    "s3_default": _s3_default,
    "s3_fast": _s3_fast,
    "s3_obstore": _s3_obstore,
}


def _s3_client(
    options: dict[str, Any], bucket: str, nbytes: int, repeats: int, name: str
) -> tuple[float, float]:
    """Median (write, read) seconds of the S3 client ``name`` (run in a fresh process),
    every pass under a prefix of its own in ``bucket``."""
    src = _source(nbytes)
    run = _S3_CLIENTS[name]
    return _median([run(options, f"{bucket}/{name}-{i}", src) for i in range(repeats)])


def measure_s3(options: dict[str, Any], nbytes: int, repeats: int = 1) -> dict[str, float]:
    """S3 ceilings of ``nbytes``: s3fs's defaults (one object) and the fast settings,
    and obstore in the same shape when it is installed (the client shoot-out); the
    median of ``repeats`` passes of each, every client in a fresh process.

    ``options``: s3fs storage options (endpoint and credentials).
    """
    repeats = max(1, repeats)
    names = ["s3_default", "s3_fast"]
    if importlib.util.find_spec("obstore") and {"key", "secret"} <= options.keys():
        names.append("s3_obstore")
    out: dict[str, float] = {}
    with fresh_bucket(options, "ceiling") as bucket:
        for name in names:
            write, read = _fresh(_s3_client, options, bucket, nbytes, repeats, name)
            out.update(_rates(name, nbytes, write, read))
    return out


def measure(
    chosen: list[Case], nbytes: int, notes: list[str], repeats: int = 1
) -> dict[str, float]:
    """The ceilings of the services the ``chosen`` cases use, each the median of ``repeats``
    passes (as the cases are); a failure becomes a note."""
    out: dict[str, float] = {}
    for case in chosen:
        if case.service not in ("redis", "s3") or any(k.startswith(case.service) for k in out):
            continue
        try:
            if case.service == "redis":
                out.update(measure_redis(case.store, nbytes, repeats))
            else:
                out.update(measure_s3(case.options, nbytes, repeats))
        except Exception as exc:
            notes.append(f"{case.service} ceiling not measured: {type(exc).__name__}: {exc}")
    return out
