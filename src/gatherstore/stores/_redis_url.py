"""A Redis store's URL and options: parsed, typed and checked, the password never shown.

``redis://[[user]:password@]host:port/db``, ``rediss://…`` (TLS) or
``unix:///path.sock``; options come from the URL query or keywords (the same
option given both ways with different values is refused).  ``ttl``,
``chunk_size`` and ``key_prefix`` are the store's own, ``sign`` the signing
choice; the rest go to redis-py's connections, whose checks run at once.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any

import redis.backoff
import redis.connection
import redis.retry

from gatherstore.stores._secrets import hide_password

__all__ = [
    "CONNECTION_DEFAULTS",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_TTL",
    "MAX_CHUNK_SIZE",
    "Settings",
    "settings",
]

#: Largest value Redis accepts in one key (``proto-max-bulk-len``'s default).
MAX_CHUNK_SIZE = 512 << 20
#: Default ``chunk_size``: 1 GB reads through the store were fastest at 2-4 MiB chunks
#: (page-cache and allocator friendly); 4 MiB keeps per-key round trips cheap on a network.
DEFAULT_CHUNK_SIZE = 4 << 20
#: Default lifetime of every key, in seconds.
DEFAULT_TTL = 3600.0

_SCHEMES = ("redis", "rediss", "unix")
_OWN_PARSERS: dict[str, Any] = {"ttl": float, "chunk_size": int, "key_prefix": str}
CONNECTION_DEFAULTS: dict[str, Any] = {
    "socket_connect_timeout": 10.0,
    "socket_timeout": 60.0,
    # a few quick retries of a dropped connection; the call's deadline bounds them all
    "retry": redis.retry.Retry(redis.backoff.EqualJitterBackoff(cap=0.5, base=0.01), 3),
}
_SECRETS = ("password",)
_connection: Any = redis.connection  # redis-py's helpers, untyped
_USAGE = "use redis://host:port/db, rediss://host:port/db (TLS) or unix:///path/to/redis.sock"


@dataclass(frozen=True)
class Settings:
    """What a Redis store URL and its options say."""

    #: The URL without its query and fragment (``unix:///…`` keeps its slashes).
    url: str
    #: The options of the query and the keywords: with ``url``, they reopen the store.
    given: dict[str, Any]
    ttl: float
    chunk_size: int
    key_prefix: str
    #: The ``sign`` option (None: not given).
    sign: bool | None
    #: The options for redis-py's connections.
    connection: dict[str, Any]


def settings(url: str, options: dict[str, Any]) -> Settings:
    """The settings of a Redis store at ``url`` with keyword ``options``.

    Raises:
        ValueError: a wrong scheme, a malformed URL, port or database, an option given
            twice with different values, an option value of the wrong type, or ``ttl`` /
            ``chunk_size`` out of range; the message names it (never the password).
    """
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"{_shown(url)} is not a valid Redis URL ({exc}); {_USAGE}") from None
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"{_shown(url)} is not a Redis URL: {_USAGE}")
    _check_address(url, parts)
    bare = url.split("#", 1)[0].split("?", 1)[0]
    try:
        parsed = _connection.parse_url(bare).items()
    except ValueError as exc:
        raise ValueError(f"{_shown(url)} is not a valid Redis URL ({exc}); {_USAGE}") from None
    in_url = {k: v for k, v in parsed if k != "connection_class"}
    query, sign = _parse_query(url, parts.query)
    _check_conflicts(url, {**in_url, **query}, options)
    given = {**query, **options}
    ttl = float(given.get("ttl", DEFAULT_TTL))
    chunk_size = int(given.get("chunk_size", DEFAULT_CHUNK_SIZE))
    if not ttl > 0:
        raise ValueError(f"ttl={ttl!r} must be a positive number of seconds")
    if not 1024 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(
            f"chunk_size={chunk_size} must be between 1024 and {MAX_CHUNK_SIZE} "
            "bytes (Redis refuses values over 512 MiB)"
        )
    connection = {k: v for k, v in given.items() if k not in _OWN_PARSERS}
    key_prefix = str(given.get("key_prefix", ""))
    return Settings(bare, given, ttl, chunk_size, key_prefix, sign, connection)


def _shown(url: str) -> str:
    """``url`` for messages: no password, no query (which may carry one)."""
    return hide_password(url.split("#", 1)[0].split("?", 1)[0])


def _to_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"sign={value!r} in the URL query: use true or false")


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
            text = "***" if name in _SECRETS else repr(value)
            raise ValueError(
                f"option {name}={text} in the URL {_shown(url)} is not valid; fix or remove "
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
            f"the database {db!r} in the Redis URL {_shown(url)} is not a number; "
            f"use e.g. {example}"
        )
    if parts.scheme == "unix" and not parts.path.strip("/"):
        raise ValueError(
            f"the Redis URL {_shown(url)} names no socket; use unix:///path/to/redis.sock"
        )


def _check_conflicts(url: str, in_url: dict[str, Any], keywords: dict[str, Any]) -> None:
    for name in sorted(in_url.keys() & keywords.keys()):
        a, b = in_url[name], keywords[name]
        if a != b:
            texts = ("***", "***") if name in _SECRETS else (repr(a), repr(b))
            raise ValueError(
                f"option {name!r} is given twice with different values: {texts[0]} in the "
                f"URL {_shown(url)} and {texts[1]} as a keyword; give it once"
            )
