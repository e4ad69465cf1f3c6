"""Redis on the wire: pipelined SETs and GETs of large values, and how commands are packed.

redis-py sends one command and parses its reply before the next, reads replies
64 KiB at a time, and copies a bulk reply at least twice (hiredis into bytes,
then the caller).  Here a bounded window of commands is in flight, a SET's
value goes out as the caller's buffers (never joined), and a GET's reply is
received with large ``recv_into`` calls straight into the caller's buffer.
redis-py still connects, authenticates, selects the database and wraps TLS,
with every socket wait bounded by the deadline in force (``DeadlineConnection``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
import redis.connection

from gatherstore._time import time_left

__all__ = [
    "DeadlineConnection",
    "Wire",
    "bounded_class",
    "pack",
    "pack_set",
    "pooled",
    "python_packer",
]

_connection: Any = redis.connection  # redis-py's helpers, untyped
_CRLF = b"\r\n"
_LINE_READ = 64  # bytes received while looking for a reply's first line
_SMALL = 64 << 10  # pieces up to this size are sent together in one buffer


class DeadlineConnection:
    """Mixin for a redis-py connection class: every socket wait ends by the deadline.

    The configured timeouts stay the ceiling; inside ``deadline``
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


def bounded_class(cls: type[Any]) -> type[Any]:
    """``cls`` (a redis-py connection class) with ``DeadlineConnection`` mixed in."""
    return type(f"Deadline{cls.__name__}", (DeadlineConnection, cls), {})


def python_packer() -> dict[str, Any]:
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


def pooled(pool: redis.ConnectionPool) -> Any:
    """A connected connection of ``pool`` (redis-py 5 still wants a command name)."""
    try:
        return pool.get_connection()
    except TypeError:  # pragma: no cover - redis-py < 5.3
        return pool.get_connection("GET")


def pack(*args: bytes | memoryview) -> list[bytes | memoryview]:
    """A RESP command as pieces to send in order; large arguments stay the caller's buffers."""
    pieces: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
    for arg in args:
        pieces += [b"$%d\r\n" % memoryview(arg).nbytes, arg, _CRLF]
    return pieces


def pack_set(key: bytes, views: Sequence[memoryview], ttl_ms: int) -> list[bytes | memoryview]:
    """``SET key <views joined> NX PX ttl_ms`` without joining the views."""
    size = sum(v.nbytes for v in views)
    ttl = b"%d" % ttl_ms
    head = b"*6\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size)
    tail = b"\r\n$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
    return [head, *views, tail]


class Wire:
    """Pipelined commands on the socket of one connected redis-py connection.

    The connection must be idle (no reply pending) and is idle again after each
    call returns; after an exception its state is unknown: disconnect it.
    """

    def __init__(self, connection: Any, window: int, bound: Callable[[], None]) -> None:
        self._sock = connection._sock
        self._window = window
        self._bound = bound  # called before each command and each reply: sets the timeout
        self._pending = bytearray()

    # --- sending ------------------------------------------------------------------------
    def _send(self, pieces: Sequence[bytes | memoryview]) -> None:
        small = bytearray()
        for piece in pieces:
            if memoryview(piece).nbytes <= _SMALL:
                small += piece
                continue
            if small:
                self._sock.sendall(small)
                small = bytearray()
            self._sock.sendall(piece)
        if small:
            self._sock.sendall(small)

    def run(
        self, commands: Sequence[Sequence[bytes | memoryview]], read: Callable[[int], Any]
    ) -> list[Any]:
        """Send ``commands`` with at most ``window`` unanswered; ``read(i)`` reads reply ``i``."""
        sent, out = 0, []
        for i in range(len(commands)):
            while sent < len(commands) and sent < i + self._window:
                self._bound()
                self._send(commands[sent])
                sent += 1
            self._bound()
            out.append(read(i))
        if self._pending:
            raise redis.ConnectionError("Redis sent more than the replies asked for")
        return out

    # --- receiving ----------------------------------------------------------------------
    def _recv(self, size: int) -> bytes:
        data: bytes = self._sock.recv(size)
        if not data:
            raise redis.ConnectionError("Redis closed the connection")
        return data

    def line(self) -> bytes:
        """The next reply's first line, without CRLF; an error reply raises ResponseError."""
        while (end := self._pending.find(_CRLF)) < 0:
            self._pending += self._recv(_LINE_READ)
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        return line

    def _fill(self, view: memoryview) -> None:
        """Receive exactly ``len(view)`` bytes into ``view``."""
        taken = min(len(self._pending), len(view))
        view[:taken] = self._pending[:taken]
        del self._pending[:taken]
        pos = taken
        while pos < len(view):
            n = self._sock.recv_into(view[pos:])
            if not n:
                raise redis.ConnectionError("Redis closed the connection")
            pos += n

    def bulk(self, into: memoryview | None) -> tuple[int | None, Any]:
        """A bulk reply: (its size or None for nil, the buffer holding it or None).

        It lands in ``into`` when the sizes match, else in a new bytearray when
        ``into`` is None; a reply of another size is received and dropped.
        """
        line = self.line()
        if line == b"_":  # RESP3's null
            return None, None
        if line[:1] != b"$":
            raise redis.ResponseError(f"expected a bulk reply, got {line[:32]!r}")
        size = int(line[1:])
        if size < 0:
            return None, None
        target = memoryview(bytearray(size)) if into is None or len(into) != size else into
        self._fill(target)
        self._fill(memoryview(bytearray(2)))  # the CRLF after the value
        keep = into is None or target is into
        return size, (target.obj if into is None else into) if keep else None
