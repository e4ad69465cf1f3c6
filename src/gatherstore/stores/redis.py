"""Redis: ``redis://[[user]:password@]host:port/db``, ``rediss://…`` (TLS), ``unix:///path.sock``.

Every value is one Redis string written with ``SET key value NX PX <ttl>``:
create-only, atomic (a reader sees the whole value or nothing) and expiring, so
a crashed job leaves nothing behind for good.  Values above ``chunk_size``
(default 4 MiB; at most 512 MiB, Redis's limit for one value) are chunked by
the base class, each chunk a key with the same TTL.  Values travel on a
pipelined wire (``_resp``): 4 SETs or GETs in flight per connection, values
sent from the caller's buffers and received straight into the reader's buffer;
a SET retried after a dropped connection that finds its own first try in place
counts as written.

A job's keys are also named in an index (see ``_redis_index``), so that the
job's end deletes exactly those keys without SCANning the keyspace, and so
that their TTLs are renewed while the job reads.

Options come from the URL query or keywords, e.g.
``redis://:secret@host:6379/0?ttl=600&chunk_size=33554432&socket_timeout=30``:

- ``ttl``: seconds every key lives (default 3600);
- ``chunk_size``: largest value written as one key, in bytes;
- ``key_prefix``: a namespace for every key of this store (default none);
- ``sign``: whether parts are signed (default yes);
- any redis-py connection option (``password``, ``username``, ``socket_timeout``,
  ``socket_connect_timeout``, ``ssl_ca_certs``, ``max_connections``, …).

The same option given in the URL and as a keyword with different values is
refused.  The password never appears in ``str(store)`` or in error messages,
but survives pickling, so ranks can reopen the store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import redis

from gatherstore._time import END_JOB_TIMEOUT, deadline
from gatherstore.stores import _resp
from gatherstore.stores._redis_index import BATCH, JobIndexes
from gatherstore.stores._redis_url import (
    CONNECTION_DEFAULTS,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_TTL,
    MAX_CHUNK_SIZE,
    settings,
)
from gatherstore.stores.base import Buffer, Store

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_TTL", "MAX_CHUNK_SIZE", "RedisStore"]

_GLOB_SPECIALS = "\\*?[]"
_IN_FLIGHT = 4  # SETs or GETs of large values sent ahead of their replies on one connection
_MANY_IN_FLIGHT = 32  # GETs of whole values (parts, small as a rule) sent ahead at once
_ATTEMPTS = 3  # tries of a wire batch when the connection drops (the retries: stores.waiting)
_T = TypeVar("_T")


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (SCAN MATCH)."""
    return "".join(f"\\{c}" if c in _GLOB_SPECIALS else c for c in text)


class RedisStore(Store):
    """Values as Redis strings, each with a TTL; see the module docstring for the options.

    Raises (at construction):
        ValueError: a wrong scheme, an option given twice with different values, an
            unknown option, or ``ttl`` / ``chunk_size`` out of range.
    """

    unavailable_errors = (redis.RedisError, OSError)

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", **options: Any) -> None:
        super().__init__()
        given = settings(url, options)
        self._url, self._given = given.url, given.given
        self.ttl, self.chunk_size, self.key_prefix = given.ttl, given.chunk_size, given.key_prefix
        self.max_value_size = self.chunk_size
        if given.sign is not None:
            self.sign_parts = given.sign
        self._pool = redis.ConnectionPool.from_url(
            self._url, **{**CONNECTION_DEFAULTS, **_resp.python_packer(), **given.connection}
        )
        self._pool.connection_class = _resp.bounded_class(self._pool.connection_class)
        try:  # unknown options fail here, not at the first command
            self._pool.connection_class(**self._pool.connection_kwargs)
        except TypeError as exc:
            raise ValueError(
                f"unknown Redis option in {sorted(given.connection)} for {self}: {exc}"
            ) from None
        self._client = redis.Redis(connection_pool=self._pool)
        self._ttl_ms = max(1, round(self.ttl * 1000))
        self._indexes = JobIndexes(self._client, self._key, self.ttl)

    def _advice(self, exc: BaseException) -> tuple[str, str] | None:
        """A refused login, in words that say where the password goes."""
        if not isinstance(exc, redis.AuthenticationError):
            return None
        form = (
            "redis://:PASSWORD@host:port/db (redis://USER:PASSWORD@host:port/db for an "
            "ACL user; or the password= and username= options)"
        )
        if self._pool.connection_kwargs.get("password") is None:
            return "the server requires a password and none was given", f"put it in the URL: {form}"
        return "the server refused the user name or password given", f"check them: {form}"

    @classmethod
    def _from_url(cls, url: str, **options: Any) -> Store:
        return cls(url, **options)

    @property
    def url(self) -> str:
        return self._url

    def _options(self) -> dict[str, Any]:
        return dict(self._given)

    def _key(self, key: str) -> bytes:
        return (self.key_prefix + key).encode("utf-8", "surrogateescape")

    def _wire(self, work: Callable[[_resp.Wire], _T], window: int = _IN_FLIGHT) -> tuple[_T, int]:
        """``work`` on a pooled connection's wire (``window`` commands ahead of their
        replies), and how many tries it took: a dropped connection is replaced and
        ``work`` runs again (``_ATTEMPTS`` in all)."""
        for attempt in range(1, _ATTEMPTS + 1):
            conn = _resp.pooled(self._pool)
            try:
                # each send and reply waits at most the socket timeout (or the time left)
                wire = _resp.Wire(conn, window, conn._bound)
                return work(wire), attempt
            except (ConnectionError, redis.ConnectionError):
                conn.disconnect()
                if attempt == _ATTEMPTS:
                    raise
            except BaseException:
                conn.disconnect()  # left mid-reply
                raise
            finally:
                self._pool.release(conn)
        raise AssertionError("unreachable")  # pragma: no cover

    def _write(self, key: str, buffers: Sequence[Buffer]) -> bool:
        return self._write_many([(key, buffers)])[0]

    def _write_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        """``SET NX PX`` of every item, pipelined; each value is one atomic SET.

        A key of a job area is first added to the job's index (``SADD``, and the
        index's TTL reset), so the index never misses a key that exists.
        """
        sets = [
            (self._key(key), [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes])
            for key, buffers in items
        ]
        indexes = [self._indexes.of(key) for key, _ in items]
        commands = []
        for (key, views), index in zip(sets, indexes, strict=True):
            command = _resp.pack_set(key, views, self._ttl_ms)
            if index is not None:
                command = [*self._indexes.adding(index, key), *command]
            commands.append(command)

        def reply(wire: _resp.Wire, i: int) -> bytes:
            if indexes[i] is not None:
                wire.line(), wire.line()  # the SADD's and the PEXPIRE's
            return wire.line()

        replies, tries = self._wire(lambda wire: wire.run(commands, lambda i: reply(wire, i)))
        # a nil reply means the key exists: after a retry, maybe the first try's own value
        return [
            reply == b"+OK" or (tries > 1 and self._holds(key, views))
            for (key, views), reply in zip(sets, replies, strict=True)
        ]

    def _holds(self, key: bytes, views: Sequence[memoryview]) -> bool:
        """Whether ``key`` holds exactly the concatenation of ``views``."""
        got = self._get_many([key], [None])[0][1]
        if got is None:
            return False
        whole, pos = memoryview(got), 0
        for view in views:
            if whole[pos : pos + len(view)] != view:
                return False
            pos += len(view)
        return pos == len(whole)

    def _get_many(
        self, keys: Sequence[bytes], places: Sequence[memoryview | None]
    ) -> list[tuple[int | None, Any]]:
        commands = [_resp.pack(b"GET", key) for key in keys]
        return self._wire(lambda wire: wire.run(commands, lambda i: wire.bulk(places[i])))[0]

    def _read(self, key: str) -> Buffer | None:
        """The value in a new bytearray (writable: arrays and tensors decode in place)."""
        self._indexes.renew(key)
        value: Buffer | None = self._get_many([self._key(key)], [None])[0][1]
        return value

    def _read_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        """Many values with one pipeline of GETs: small values do not wait for each other."""
        if keys:
            self._indexes.renew(keys[0])
        commands = [_resp.pack(b"GET", self._key(key)) for key in keys]
        got = self._wire(
            lambda wire: wire.run(commands, lambda i: wire.bulk(None)), window=_MANY_IN_FLIGHT
        )[0]
        return [value for _, value in got]

    def _read_many_into(self, items: Sequence[tuple[str, memoryview]]) -> list[int | None]:
        if items:
            self._indexes.renew(items[0][0])
        got = self._get_many([self._key(k) for k, _ in items], [view for _, view in items])
        return [size for size, _ in got]

    def _replace(self, key: str, buffers: Sequence[Buffer]) -> None:
        """``SET key value PX ttl`` (indexed like any key of a job area)."""
        pipe = self._client.pipeline(transaction=False)
        self._indexes.add(pipe, key)
        pipe.set(
            self._key(key), b"".join(memoryview(b).cast("B") for b in buffers), px=self._ttl_ms
        )
        pipe.execute()

    def prepare_job(self, job_id: str) -> str:
        """Start the job's index with its sentinel, which tells the job's end whether
        Redis evicted the index meanwhile."""
        locator = super().prepare_job(job_id)
        with self._mapped(f"create the index of the job area {locator!r}"):
            self._indexes.start(locator)
        return locator

    def end_job(self, locator: str) -> None:
        """Delete the keys the job's index names, then the index; SCAN the area's prefix
        only when the index lost its sentinel (evicted)."""
        with deadline(END_JOB_TIMEOUT), self._mapped(f"delete the job area {locator!r}"):
            if not self._indexes.end(locator):
                self._delete_prefix(locator.rstrip("/") + "/")

    def _read_head(self, key: str, size: int) -> Buffer | None:
        """``GETRANGE`` and ``EXISTS`` in one transaction: GETRANGE alone answers empty bytes
        for an absent key and for an empty value (damage: stored values have a header)."""
        pipe = self._client.pipeline(transaction=True)
        pipe.getrange(self._key(key), 0, size - 1)
        pipe.exists(self._key(key))
        head, exists = pipe.execute()
        return bytes(head) if exists else None

    def _exists(self, key: str) -> bool:
        return bool(self._client.exists(self._key(key)))

    def _scan(self, prefix: str) -> Iterator[bytes]:
        pattern = _glob_escape(self.key_prefix + prefix).encode("utf-8", "surrogateescape")
        yield from self._client.scan_iter(match=pattern + b"*", count=BATCH)

    def _list(self, prefix: str) -> Iterable[str]:
        start = len(self._key(""))
        found = {raw[start:] for raw in self._scan(prefix)}  # SCAN may repeat keys
        return sorted(k.decode("utf-8", "surrogateescape") for k in found)

    def _delete(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), BATCH):
            self._unlink([self._key(k) for k in keys[i : i + BATCH]])

    def _unlink(self, names: Sequence[bytes]) -> None:
        """``UNLINK`` these keys and ``SREM`` them from their job's index, in one round trip."""
        pipe = self._client.pipeline(transaction=False)
        pipe.unlink(*names)
        self._indexes.remove(pipe, names, len(self._key("")))
        pipe.execute()

    def _delete_prefix(self, prefix: str) -> None:
        batch: list[bytes] = []
        for raw in self._scan(prefix):
            batch.append(raw)
            if len(batch) == BATCH:
                self._unlink(batch)
                batch = []
        if batch:
            self._unlink(batch)

    def close(self) -> None:
        self._client.close()
        self._pool.disconnect()
