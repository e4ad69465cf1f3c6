"""The index of a job's keys in Redis, and the renewal of their TTLs.

A job's keys are also named in an index: a Redis set beside the job's prefix
(``<prefix>gatherstore/<job>.keys``) with the same TTL, so that the job's end
deletes exactly those keys instead of SCANning the keyspace.  A key is added
before it is written and removed when it is deleted, so the index names only
keys that exist.  While the job reads, the TTL of every indexed key is renewed
at least every ``ttl / 4`` seconds, so that parts waiting for a slow consumer
do not expire.  A Redis used as a cache may evict the index itself: it holds a
sentinel from the job's start, whose absence at the job's end tells the store
to SCAN the job's prefix for what is left.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from gatherstore.stores import _resp
from gatherstore.stores.areas import JOB_AREA

__all__ = ["BATCH", "JobIndexes"]

BATCH = 1000  # members per SPOP, keys per UNLINK
_INDEX = ".keys"  # suffix of a job's index: "<prefix>gatherstore/<job>.keys"
_SENTINEL = b"/"  # a member of every index from the job's start (no key has this name)


class JobIndexes:
    """The indexes of the job areas of one store: ``key`` names a store key in Redis."""

    def __init__(self, client: redis.Redis, key: Callable[[str], bytes], ttl: float) -> None:
        self._client, self._key, self._ttl = client, key, ttl
        self._ttl_ms = max(1, round(ttl * 1000))
        self._renewed: dict[str, float] = {}  # job index -> when its TTLs were last reset

    @staticmethod
    def _area_index(key: str) -> str | None:
        """The index of the job area ``key`` lies in (``gatherstore/<job>/…``), if any."""
        root, _, rest = key.partition("/")
        job, inside, _ = rest.partition("/")
        return f"{root}/{job}{_INDEX}" if root == JOB_AREA and job and inside else None

    def of(self, key: str) -> bytes | None:
        """The Redis name of the index of ``key``'s job area (None: in no job area)."""
        index = self._area_index(key)
        return None if index is None else self._key(index)

    def adding(self, index: bytes, name: bytes) -> list[bytes | memoryview]:
        """The packed commands that add ``name`` to ``index`` and reset its TTL (two
        replies)."""
        ttl = b"%d" % self._ttl_ms
        return [*_resp.pack(b"SADD", index, name), *_resp.pack(b"PEXPIRE", index, ttl)]

    def add(self, pipe: Any, key: str) -> None:
        """Queue on ``pipe`` the addition of ``key`` to its job's index, if any."""
        index = self.of(key)
        if index is not None:
            pipe.sadd(index, self._key(key))
            pipe.pexpire(index, self._ttl_ms)

    def remove(self, pipe: Any, names: Sequence[bytes], start: int) -> None:
        """Queue on ``pipe`` the removal of the Redis keys ``names`` (store keys from
        ``start`` on) from their jobs' indexes."""
        by_index: dict[bytes, list[bytes]] = {}
        for name in names:
            index = self.of(name[start:].decode("utf-8", "surrogateescape"))
            if index is not None:
                by_index.setdefault(index, []).append(name)
        for index, members in by_index.items():
            pipe.srem(index, *members)

    def start(self, locator: str) -> None:
        """Start the index of the job area ``locator`` with its sentinel."""
        index = self._key(locator.rstrip("/") + _INDEX)
        self._client.sadd(index, _SENTINEL)
        self._client.pexpire(index, self._ttl_ms)

    def renew(self, key: str) -> None:
        """Every ``ttl / 4`` s of reading a job area: reset the TTL of every key it indexes
        (the keys that exist: deleted ones left the index)."""
        index = self._area_index(key)
        if index is None:
            return
        now = time.monotonic()
        if now - self._renewed.setdefault(index, now) <= self._ttl / 4:
            return
        self._renewed[index] = now
        members: set[bytes] = self._client.smembers(self._key(index))  # type: ignore[assignment]
        inside = self._key(index[: -len(_INDEX)] + "/")
        pipe = self._client.pipeline(transaction=False)
        for name in [*(m for m in members if m.startswith(inside)), self._key(index)]:
            pipe.pexpire(name, self._ttl_ms)
        pipe.execute()

    def end(self, locator: str) -> bool:
        """Delete the keys the index of the job area ``locator`` names (only those inside
        the area), then the index.

        Returns:
            Whether the index was intact (False: evicted, so keys may be left).
        """
        area = locator.rstrip("/")
        index, inside = self._key(area + _INDEX), self._key(area + "/")
        intact = False
        while True:
            names: list[bytes] = self._client.spop(index, BATCH)  # type: ignore[assignment]
            if not names:
                break
            intact = intact or _SENTINEL in names
            mine = [name for name in names if name.startswith(inside)]
            if mine:
                self._client.unlink(*mine)
        self._client.unlink(index)
        return intact
