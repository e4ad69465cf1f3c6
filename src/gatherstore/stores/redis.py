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

A job's keys are also named in an index (a Redis set beside the job's
prefix, same TTL), so that the job's end deletes exactly those keys instead
of SCANning the keyspace; a deleted key leaves the index too (``SREM``), so
the index names only keys that exist.  While the job reads, the TTL of every
indexed key is renewed at least every ``ttl / 4`` seconds, so that parts
waiting for a slow ``gather_iter`` consumer do not expire.  A Redis used as a
cache (``maxmemory`` with an ``allkeys-*`` policy) may evict the index itself:
the index holds a sentinel from the job's start, and when the job's end does
not find it there, it also deletes what is left under the job's prefix, by a
SCAN of that prefix alone.

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

import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import redis
import redis.backoff
import redis.connection
import redis.retry

from . import _resp
from .base import JOB_AREA, Buffer, Store, hide_password
from .deadline import END_JOB_TIMEOUT, deadline, time_left

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_TTL", "MAX_CHUNK_SIZE", "RedisStore"]

#: Largest value Redis accepts in one key (``proto-max-bulk-len``'s default).
MAX_CHUNK_SIZE = 512 << 20
#: Default ``chunk_size``: 1 GB reads through the store were fastest at 2-4 MiB chunks
#: (page-cache and allocator friendly); 4 MiB keeps per-key round trips cheap on a network.
DEFAULT_CHUNK_SIZE = 4 << 20
#: Default lifetime of every key, in seconds.
DEFAULT_TTL = 3600.0

_SCHEMES = ("redis", "rediss", "unix")
_OWN_PARSERS: dict[str, Any] = {"ttl": float, "chunk_size": int, "key_prefix": str}
_CONNECTION_DEFAULTS: dict[str, Any] = {
    "socket_connect_timeout": 10.0,
    "socket_timeout": 60.0,
    # a few quick retries of a dropped connection; the call's deadline bounds them all
    "retry": redis.retry.Retry(redis.backoff.EqualJitterBackoff(cap=0.5, base=0.01), 3),
}
_SECRETS = ("password",)
_BATCH = 1000  # keys per SCAN step, per UNLINK and per SPOP
_INDEX = ".keys"  # suffix of a job's index: "<prefix>gatherstore/<job>.keys"
_SENTINEL = b"/"  # a member of every index from the job's start (no key has this name)
_GLOB_SPECIALS = "\\*?[]"
_connection: Any = redis.connection  # redis-py's helpers, untyped
_IN_FLIGHT = 4  # SETs or GETs of large values sent ahead of their replies on one connection
_MANY_IN_FLIGHT = 32  # GETs of whole values (parts, small as a rule) sent ahead at once
_ATTEMPTS = 3  # tries of a wire batch when the connection drops
_T = TypeVar("_T")


def _shown(url: str) -> str:
    """``url`` for messages: no password, no query (which may carry one)."""
    return hide_password(url.split("#", 1)[0].split("?", 1)[0])


def _to_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"sign={value!r} in the URL query: use true or false")


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (SCAN MATCH)."""
    return "".join(f"\\{c}" if c in _GLOB_SPECIALS else c for c in text)


def _parse_query(url: str, query: str) -> tuple[dict[str, Any], bool | None]:
    """Typed options of a URL query, and its ``sign`` flag (None when absent)."""
    options: dict[str, Any] = {}
    sign: bool | None = None
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if name == "sign":
            sign = _to_bool(value)
            continue
        parser: Any = _OWN_PARSERS.get(name) or _connection.URL_QUERY_ARGUMENT_PARSERS.get(name)
        try:
            options[name] = parser(value) if parser else value
        except (TypeError, ValueError):
            shown = "***" if name in _SECRETS else repr(value)
            raise ValueError(
                f"option {name}={shown} in the URL {_shown(url)} is not valid; fix or remove "
                "it (the options are listed in gatherstore.stores.redis)"
            ) from None
    return options, sign


def _check_address(url: str, parts: urllib.parse.SplitResult) -> None:
    """Refuse a port that is not a number in 1..65535 and a database that is not a number."""
    example = "redis://host:6379/0"
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 0 < port < 65536:
        text = parts.netloc.rsplit("@", 1)[-1].rsplit(":", 1)[-1]
        raise ValueError(
            f"the port {text!r} in the Redis URL {_shown(url)} is not a number between 1 "
            f"and 65535; use e.g. {example}"
        )
    db = parts.path.strip("/")
    if parts.scheme != "unix" and db and not db.isdigit():
        raise ValueError(
            f"the database {db!r} in the Redis URL {_shown(url)} is not a number; use e.g. "
            f"{example}"
        )
    if parts.scheme == "unix" and not parts.path.strip("/"):
        raise ValueError(
            f"the Redis URL {_shown(url)} names no socket; use unix:///path/to/redis.sock"
        )


def _check_conflicts(url: str, in_url: dict[str, Any], keywords: dict[str, Any]) -> None:
    for name in sorted(in_url.keys() & keywords.keys()):
        a, b = in_url[name], keywords[name]
        if a != b:
            shown = ("***", "***") if name in _SECRETS else (repr(a), repr(b))
            raise ValueError(
                f"option {name!r} is given twice with different values: {shown[0]} in the "
                f"URL {_shown(url)} and {shown[1]} as a keyword; give it once"
            )


class _DeadlineConnection:
    """Mixin for a redis-py connection class: every socket wait ends by the deadline.

    The configured timeouts stay the ceiling; inside :func:`~.deadline.deadline`
    connects, sends and reads wait at most the time the call has left.
    """

    _socket_timeout: float | None
    _socket_connect_timeout: float | None
    _sock: Any

    @property
    def socket_timeout(self) -> float | None:
        return time_left(self._socket_timeout)

    @socket_timeout.setter
    def socket_timeout(self, value: float | None) -> None:
        self._socket_timeout = value

    @property
    def socket_connect_timeout(self) -> float | None:
        return time_left(self._socket_connect_timeout)

    @socket_connect_timeout.setter
    def socket_connect_timeout(self, value: float | None) -> None:
        self._socket_connect_timeout = value

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self._bound()
        super().send_packed_command(command, check_health)  # type: ignore[misc]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        self._bound()
        return super().read_response(*args, **kwargs)  # type: ignore[misc]

    def _bound(self) -> None:
        """Set the socket's timeout to the time left (redis-py >= 7 has
        ``update_current_socket_timeout`` for this; the socket call works on every version).
        A timeout of 0 means redis-py is polling the socket: left alone."""
        sock = self._sock
        if sock is not None and sock.gettimeout() != 0:
            sock.settimeout(self.socket_timeout)


def _bounded_class(cls: type[Any]) -> type[Any]:
    """``cls`` (a redis-py connection class) with :class:`_DeadlineConnection` mixed in."""
    return type(f"Deadline{cls.__name__}", (_DeadlineConnection, cls), {})


class RedisStore(Store):
    """Values as Redis strings, each with a TTL; see the module docstring for the options.

    Raises (at construction):
        ValueError: a wrong scheme, an option given twice with different values, an
            unknown option, or ``ttl`` / ``chunk_size`` out of range.
    """

    unavailable_errors: ClassVar[tuple[type[BaseException], ...]] = (redis.RedisError, OSError)
    reachable_by_others: ClassVar[bool] = True

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", **options: Any) -> None:
        usage = (
            "use redis://host:port/db, rediss://host:port/db (TLS) or unix:///path/to/redis.sock"
        )
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError as exc:
            raise ValueError(f"{_shown(url)} is not a valid Redis URL ({exc}); {usage}") from None
        if parts.scheme not in _SCHEMES:
            raise ValueError(f"{_shown(url)} is not a Redis URL: {usage}")
        _check_address(url, parts)
        self._url = url.split("#", 1)[0].split("?", 1)[0]  # unix:///… keeps its slashes
        try:
            parsed = _connection.parse_url(self._url).items()
        except ValueError as exc:
            raise ValueError(f"{_shown(url)} is not a valid Redis URL ({exc}); {usage}") from None
        in_url = {k: v for k, v in parsed if k != "connection_class"}
        query, sign = _parse_query(url, parts.query)
        _check_conflicts(url, {**in_url, **query}, options)
        self._given = {**query, **options}  # with the query-less URL, reopens this store
        own = {name: self._given[name] for name in _OWN_PARSERS if name in self._given}
        self.ttl = float(own.get("ttl", DEFAULT_TTL))
        self.chunk_size = int(own.get("chunk_size", DEFAULT_CHUNK_SIZE))
        self.key_prefix = str(own.get("key_prefix", ""))
        if not self.ttl > 0:
            raise ValueError(f"ttl={self.ttl!r} must be a positive number of seconds")
        if not 1024 <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(
                f"chunk_size={self.chunk_size} must be between 1024 and {MAX_CHUNK_SIZE} "
                "bytes (Redis refuses values over 512 MiB)"
            )
        self.max_value_size = self.chunk_size  # type: ignore[misc]
        if sign is not None:
            self.sign_parts = sign
        connection = {k: v for k, v in self._given.items() if k not in _OWN_PARSERS}
        self._pool = redis.ConnectionPool.from_url(
            self._url, **{**_CONNECTION_DEFAULTS, **_resp.python_packer(), **connection}
        )
        self._pool.connection_class = _bounded_class(self._pool.connection_class)
        try:  # unknown options fail here, not at the first command
            self._pool.connection_class(**self._pool.connection_kwargs)
        except TypeError as exc:
            raise ValueError(
                f"unknown Redis option in {sorted(connection)} for {self}: {exc}"
            ) from None
        self._client = redis.Redis(connection_pool=self._pool)
        self._ttl_ms = max(1, round(self.ttl * 1000))
        self._renewed: dict[str, float] = {}  # job index -> when its TTLs were last reset

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

    @staticmethod
    def _index_of(key: str) -> str | None:
        """The index of the job area ``key`` lies in (``gatherstore/<job>/…``), if any."""
        root, _, rest = key.partition("/")
        job, inside, _ = rest.partition("/")
        return f"{root}/{job}{_INDEX}" if root == JOB_AREA and job and inside else None

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
        indexes = [self._index_of(key) for key, _ in items]
        commands = []
        for (key, views), index in zip(sets, indexes, strict=True):
            command = _resp.pack_set(key, views, self._ttl_ms)
            if index is not None:
                name = self._key(index)
                ttl = b"%d" % self._ttl_ms
                command = [
                    *_resp.pack(b"SADD", name, key),
                    *_resp.pack(b"PEXPIRE", name, ttl),
                    *command,
                ]
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
        self._renew(key)
        value: Buffer | None = self._get_many([self._key(key)], [None])[0][1]
        return value

    def _read_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        """Many values with one pipeline of GETs: small values do not wait for each other."""
        if keys:
            self._renew(keys[0])
        commands = [_resp.pack(b"GET", self._key(key)) for key in keys]
        got = self._wire(
            lambda wire: wire.run(commands, lambda i: wire.bulk(None)), window=_MANY_IN_FLIGHT
        )[0]
        return [value for _, value in got]

    def _read_many_into(self, items: Sequence[tuple[str, memoryview]]) -> list[int | None]:
        if items:
            self._renew(items[0][0])
        got = self._get_many([self._key(k) for k, _ in items], [view for _, view in items])
        return [size for size, _ in got]

    def _replace(self, key: str, buffers: Sequence[Buffer]) -> None:
        """``SET key value PX ttl`` (indexed like any key of a job area)."""
        name = self._key(key)
        pipe = self._client.pipeline(transaction=False)
        index = self._index_of(key)
        if index is not None:
            pipe.sadd(self._key(index), name)
            pipe.pexpire(self._key(index), self._ttl_ms)
        pipe.set(name, b"".join(memoryview(b).cast("B") for b in buffers), px=self._ttl_ms)
        pipe.execute()

    def prepare_job(self, job_id: str) -> str:
        """Start the job's index with its sentinel, which tells the job's end whether
        Redis evicted the index meanwhile."""
        locator = super().prepare_job(job_id)
        index = self._key(locator.rstrip("/") + _INDEX)
        with self._mapped(f"create the index of the job area {locator!r}"):
            self._client.sadd(index, _SENTINEL)
            self._client.pexpire(index, self._ttl_ms)
        return locator

    def _renew(self, key: str) -> None:
        """Every ``ttl / 4`` s of reading a job area: reset the TTL of every key it indexes
        (the keys that exist: deleted ones left the index)."""
        index = self._index_of(key)
        if index is None:
            return
        now = time.monotonic()
        if now - self._renewed.setdefault(index, now) <= self.ttl / 4:
            return
        self._renewed[index] = now
        members: set[bytes] = self._client.smembers(self._key(index))  # type: ignore[assignment]
        inside = self._key(index[: -len(_INDEX)] + "/")
        pipe = self._client.pipeline(transaction=False)
        for name in [*(m for m in members if m.startswith(inside)), self._key(index)]:
            pipe.pexpire(name, self._ttl_ms)
        pipe.execute()

    def end_job(self, locator: str) -> None:
        """Delete the keys the job's index names (only those inside the job's area), then
        the index; SCAN the area's prefix only when the index lost its sentinel (evicted)."""
        area = locator.rstrip("/")
        index, inside = self._key(area + _INDEX), self._key(area + "/")
        with deadline(END_JOB_TIMEOUT), self._mapped(f"delete the job area {locator!r}"):
            intact = False
            while True:
                names: list[bytes] = self._client.spop(index, _BATCH)  # type: ignore[assignment]
                if not names:
                    break
                intact = intact or _SENTINEL in names
                mine = [name for name in names if name.startswith(inside)]
                if mine:
                    self._client.unlink(*mine)
            self._client.unlink(index)
            if not intact:
                self._delete_prefix(area + "/")

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
        yield from self._client.scan_iter(match=pattern + b"*", count=_BATCH)

    def _list(self, prefix: str) -> Iterable[str]:
        start = len(self._key(""))
        found = {raw[start:] for raw in self._scan(prefix)}  # SCAN may repeat keys
        return sorted(k.decode("utf-8", "surrogateescape") for k in found)

    def _delete(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), _BATCH):
            self._unlink([self._key(k) for k in keys[i : i + _BATCH]])

    def _unlink(self, names: Sequence[bytes]) -> None:
        """``UNLINK`` these keys and ``SREM`` them from their job's index, in one round trip."""
        start = len(self._key(""))
        by_index: dict[bytes, list[bytes]] = {}
        for name in names:
            index = self._index_of(name[start:].decode("utf-8", "surrogateescape"))
            if index is not None:
                by_index.setdefault(self._key(index), []).append(name)
        pipe = self._client.pipeline(transaction=False)
        pipe.unlink(*names)
        for index_name, members in by_index.items():
            pipe.srem(index_name, *members)
        pipe.execute()

    def _delete_prefix(self, prefix: str) -> None:
        batch: list[bytes] = []
        for raw in self._scan(prefix):
            batch.append(raw)
            if len(batch) == _BATCH:
                self._unlink(batch)
                batch = []
        if batch:
            self._unlink(batch)

    def close(self) -> None:
        self._client.close()
        self._pool.disconnect()
