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

Options come from the URL query or keywords, e.g.
``redis://:secret@host:6379/0?ttl=600&chunk_size=33554432&socket_timeout=30``:

- ``ttl``: seconds every key lives (default 3600);
- ``chunk_size``: largest value written as one key, in bytes;
- ``key_prefix``: a namespace for every key of this store (default none);
- ``sign``: whether parts are HMAC-signed (default yes);
- any redis-py connection option (``password``, ``username``, ``socket_timeout``,
  ``socket_connect_timeout``, ``ssl_ca_certs``, ``max_connections``, …).

The same option given in the URL and as a keyword with different values is
refused.  The password never appears in ``str(store)`` or in error messages,
but survives pickling, so ranks can reopen the store.
"""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import redis
import redis.connection

from . import _resp
from .base import Buffer, Store, hide_password

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
_CONNECTION_DEFAULTS: dict[str, Any] = {"socket_connect_timeout": 10.0, "socket_timeout": 60.0}
_SECRETS = ("password",)
_BATCH = 1000  # keys per SCAN step and per UNLINK
_GLOB_SPECIALS = "\\*?[]"
_connection: Any = redis.connection  # redis-py's helpers, untyped
_IN_FLIGHT = 4  # SETs or GETs sent ahead of their replies on one connection
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


def _python_packer() -> dict[str, Any]:
    """Connection option that sends large values straight from their buffers.

    With hiredis installed, redis-py packs commands with ``hiredis.pack_command``,
    which first copies every memoryview into bytes and then the whole command
    into one more buffer; redis-py's pure-Python packer sends them as they are.
    Replies are still parsed by hiredis.
    """
    try:
        if not _connection.HIREDIS_AVAILABLE:
            return {}
        encode = _connection.Encoder("utf-8", "strict", decode_responses=False).encode
        return {"command_packer": _connection.PythonRespSerializer(6000, encode)}
    except AttributeError:  # pragma: no cover - other redis-py layouts
        return {}


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
                f"option {name}={shown} in the URL {_shown(url)} is not valid"
            ) from None
    return options, sign


def _check_conflicts(url: str, in_url: dict[str, Any], keywords: dict[str, Any]) -> None:
    for name in sorted(in_url.keys() & keywords.keys()):
        a, b = in_url[name], keywords[name]
        if a != b:
            shown = ("***", "***") if name in _SECRETS else (repr(a), repr(b))
            raise ValueError(
                f"option {name!r} is given twice with different values: {shown[0]} in the "
                f"URL {_shown(url)} and {shown[1]} as a keyword; give it once"
            )


def _bound(conn: Any) -> None:
    """Let the next socket wait last at most the connection's timeout (or the time left)."""
    conn._sock.settimeout(conn.socket_timeout)


def _pooled(pool: redis.ConnectionPool) -> Any:
    """A connected connection of ``pool`` (redis-py 5 still wants a command name)."""
    try:
        return pool.get_connection()
    except TypeError:  # pragma: no cover - redis-py < 5.3
        return pool.get_connection("GET")


class RedisStore(Store):
    """Values as Redis strings, each with a TTL; see the module docstring for the options.

    Raises (at construction):
        ValueError: a wrong scheme, an option given twice with different values, an
            unknown option, or ``ttl`` / ``chunk_size`` out of range.
    """

    unavailable_errors: ClassVar[tuple[type[BaseException], ...]] = (redis.RedisError, OSError)
    reachable_by_others: ClassVar[bool] = True

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", **options: Any) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in _SCHEMES:
            raise ValueError(
                f"{_shown(url)} is not a Redis URL: use redis://host:port/db, "
                "rediss://host:port/db (TLS) or unix:///path/to/redis.sock"
            )
        self._url = url.split("#", 1)[0].split("?", 1)[0]  # unix:///… keeps its slashes
        parsed = _connection.parse_url(self._url).items()
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
            self._url, **{**_CONNECTION_DEFAULTS, **_python_packer(), **connection}
        )
        try:  # unknown options fail here, not at the first command
            self._pool.connection_class(**self._pool.connection_kwargs)
        except TypeError as exc:
            raise ValueError(
                f"unknown Redis option in {sorted(connection)} for {self}: {exc}"
            ) from None
        self._client = redis.Redis(connection_pool=self._pool)
        self._ttl_ms = max(1, round(self.ttl * 1000))

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

    def _wire(self, work: Callable[[_resp.Wire], _T]) -> tuple[_T, int]:
        """``work`` on a pooled connection's wire, and how many tries it took: a dropped
        connection is replaced and ``work`` runs again (``_ATTEMPTS`` in all)."""
        for attempt in range(1, _ATTEMPTS + 1):
            conn = _pooled(self._pool)
            try:
                # each send and reply waits at most the socket timeout (or the time left)
                wire = _resp.Wire(conn, _IN_FLIGHT, functools.partial(_bound, conn))
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
        """``SET NX PX`` of every item, pipelined; each value is one atomic SET."""
        sets = [
            (self._key(key), [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes])
            for key, buffers in items
        ]
        commands = [_resp.pack_set(key, views, self._ttl_ms) for key, views in sets]
        replies, tries = self._wire(lambda wire: wire.run(commands, lambda i: wire.line()))
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
        value: Buffer | None = self._get_many([self._key(key)], [None])[0][1]
        return value

    def _read_many_into(self, items: Sequence[tuple[str, memoryview]]) -> list[int | None]:
        got = self._get_many([self._key(k) for k, _ in items], [view for _, view in items])
        return [size for size, _ in got]

    def _read_head(self, key: str, size: int) -> Buffer | None:
        head: bytes = self._client.getrange(self._key(key), 0, size - 1)  # type: ignore[assignment]
        return head or None  # b"" for an absent key; stored values are never empty

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
            self._client.unlink(*(self._key(k) for k in keys[i : i + _BATCH]))

    def _delete_prefix(self, prefix: str) -> None:
        batch: list[bytes] = []
        for raw in self._scan(prefix):
            batch.append(raw)
            if len(batch) == _BATCH:
                self._client.unlink(*batch)
                batch = []
        if batch:
            self._client.unlink(*batch)

    def close(self) -> None:
        self._client.close()
        self._pool.disconnect()
