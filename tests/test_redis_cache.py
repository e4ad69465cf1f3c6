"""Redis used as a cache: an evicting server leaves no key of a job behind; the job's
index names only keys that exist, so it stays small and renewals touch only those."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

import gatherstore as gs
from gatherstore.testing import services


@pytest.fixture
def evicting(tmp_path: Path) -> Iterator[str]:
    """A redis-server of this test's own with 6 MiB of memory, evicting any key (LRU)."""
    try:
        service = services.start_redis(workdir=str(tmp_path))
    except (RuntimeError, OSError) as exc:
        from gatherstore.testing.plugin import _unavailable

        _unavailable("redis-server", exc)
    with service, redis.Redis.from_url(service.url) as client:
        client.config_set("maxmemory", 6 << 20)
        client.config_set("maxmemory-policy", "allkeys-lru")
        yield service.url


def _job_keys(url: str) -> list[str]:
    with redis.Redis.from_url(url) as client:
        return sorted(k.decode() for k in client.keys("gatherstore*"))


def _overflowing_job(url: str) -> list[str]:
    """Each rank sends 3 MiB parts (3 chunks each) through a 6 MiB Redis, 4 times, idle
    for a moment between calls (while other clients fill the cache)."""
    store = gs.open_store(url, chunk_size=1 << 20)
    rank = gs.get_rank()
    outcomes = []
    for i in range(4):
        part = np.full(3 << 20, rank + i, dtype=np.uint8)
        try:
            got = gs.gather_object(part, store=store, timeout=60)
            outcomes.append(
                "ok" if got is None or [int(p[0]) for p in got] == [i, i + 1] else "bad"
            )
        except gs.GatherError as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
        time.sleep(1.0)
    return outcomes


def _fill(url: str, stop: threading.Event) -> None:
    """Another client using the Redis as a cache: new 64 KiB values, without pause."""
    with redis.Redis.from_url(url) as client:
        n = 0
        while not stop.is_set():
            client.set(f"cache/{n}", b"x" * (64 << 10))
            n += 1


@pytest.mark.timeout(300)
def test_an_evicting_redis_leaves_no_key_of_the_job(evicting: str, gatherstore_run: Any) -> None:
    stop = threading.Event()
    filler = threading.Thread(target=_fill, args=(evicting, stop), daemon=True)
    filler.start()
    try:
        results = gatherstore_run(_overflowing_job, 2, evicting, timeout=240)
    finally:
        stop.set()
        filler.join()
    # every call gathered or raised a GatherError (anything else fails the job itself):
    # a part or chunk evicted, an OOM refusal, the marker evicted before a rank saw it
    assert all(o == "ok" or o.split(":")[0].endswith("Error") for out in results for o in out)
    with redis.Redis.from_url(evicting) as client:
        assert int(client.info("stats")["evicted_keys"]) > 0  # it did evict
    assert _job_keys(evicting) == []


def test_a_lost_index_still_leaves_nothing(gatherstore_redis_url: str) -> None:
    """The state eviction leaves, made on purpose: the index gone, a manifest gone, its
    chunks still there.  The job's end still deletes every key of the area."""
    store = gs.open_store(gatherstore_redis_url, chunk_size=1024, key_prefix="lost-index/")
    locator = store.prepare_job("0123456789abcdef")
    area = store.join_job(locator)
    area.put("marker", b"{}")
    area.put("call-1/0", b"v" * 5000)  # a manifest and 5 chunks
    area.put("call-1/1", b"small")
    with redis.Redis.from_url(gatherstore_redis_url) as client:
        client.delete("lost-index/gatherstore/0123456789abcdef.keys")
        client.delete("lost-index/gatherstore/0123456789abcdef/call-1/0")
        client.set("lost-index/gatherstore/0123456789abcdef-other", b"beside the area")
        store.end_job(locator)
        left = sorted(k.decode() for k in client.keys("lost-index/*"))
        client.delete(*left)
    assert left == ["lost-index/gatherstore/0123456789abcdef-other"]


def _many_calls_job(url: str) -> dict[str, Any]:
    """30 gathers of chunked parts; then what the job's index holds, seen by rank 0."""
    store = gs.open_store(url, chunk_size=1024)
    for i in range(30):
        gs.all_gather_object(b"p" * 5000 + bytes([i]), store=store, timeout=60)
    if gs.get_rank() != 0:
        return {}
    with redis.Redis.from_url(url) as client:
        (index,) = client.keys("gatherstore/*.keys")
        members = sorted(m.decode() for m in client.smembers(index))
        ttls = {m: client.pttl(m) for m in members}
    return {"members": members, "ttls": ttls}


@pytest.mark.timeout(180)
def test_the_index_names_only_keys_that_exist(
    gatherstore_redis_url: str, gatherstore_run: Any
) -> None:
    url = gatherstore_redis_url.rsplit("/", 1)[0] + "/12"
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    out = gatherstore_run(_many_calls_job, 2, url, timeout=150)[0]
    # 30 calls wrote 2 x 30 x 6 keys; the index keeps the area's bookkeeping only
    names = [m.rsplit("/", 1)[-1] for m in out["members"]]
    assert names == ["", "heartbeat", "marker"], json.dumps(out["members"])
    assert _job_keys(url) == []
