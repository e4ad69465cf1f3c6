"""The damage the conformance suite does to values really stored, and what it hits.

Each case names the value's payload size (an inline value, or one of five chunks
at the suite's chunk size), what is damaged (the value itself, which for a
chunked value is its manifest, or its first chunk) and how.  Every case must
make a read raise ``IntegrityError``, and ``discard`` must still remove the
value with every chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gatherstore.stores.layout import HEADER, HEADER_SIZE

__all__ = ["DAMAGE", "LARGE", "SMALL"]

SMALL, LARGE = 100, 5000  # payload sizes: an inline value, and one of five chunks
_OTHER = b"j.chunks/" + b"0" * 32 + b"/"  # the chunk folder of key "j", as long as k's


def _with(raw: bytes, offset: int, field: bytes) -> bytes:
    """``raw`` with ``field`` written over it at ``offset``."""
    return raw[:offset] + field + raw[offset + len(field) :]


def _manifest(raw: bytes, **change: int) -> bytes:
    """A chunked value with its header's ``total`` or ``count`` changed."""
    magic, kind, total, count = HEADER.unpack_from(raw)
    fields = {"total": total, "count": count, **change}
    return HEADER.pack(magic, kind, fields["total"], fields["count"]) + raw[HEADER.size :]


def _chunks_named(raw: bytes, directory: bytes) -> bytes:
    """A chunked value whose manifest names ``directory`` for its chunks."""
    count: int = HEADER.unpack_from(raw)[3]
    return raw[: HEADER_SIZE + 8 * count] + directory


def _case(name: str, size: int, target: str, how: Callable[[bytes], bytes]) -> Any:
    return pytest.param(size, target, how, id=name)


DAMAGE = [
    _case("foreign bytes", SMALL, "value", lambda raw: b"not a gatherstore value" * 4),
    _case("shorter than a header", SMALL, "value", lambda raw: raw[: HEADER_SIZE - 1]),
    _case("emptied", SMALL, "value", lambda raw: b""),
    _case("truncated", SMALL, "value", lambda raw: raw[:-10]),
    _case("grown", SMALL, "value", lambda raw: raw + b"x"),
    _case("altered magic", SMALL, "value", lambda raw: _with(raw, 0, b"X")),
    _case("truncated chunk", LARGE, "chunk", lambda raw: raw[:-1]),
    _case("grown chunk", LARGE, "chunk", lambda raw: raw + b"x"),
    _case("unknown kind", LARGE, "value", lambda raw: _with(raw, 8, b"\x09")),
    _case("chunked turned inline", LARGE, "value", lambda raw: _with(raw, 8, b"\x00")),
    _case("manifest cut short", LARGE, "value", lambda raw: raw[: HEADER_SIZE + 4]),
    _case("manifest total grown", LARGE, "value", lambda r: _manifest(r, total=LARGE + 1)),
    _case("manifest total shrunk", LARGE, "value", lambda r: _manifest(r, total=LARGE - 1)),
    _case("manifest count too large", LARGE, "value", lambda raw: _manifest(raw, count=6)),
    _case("manifest points elsewhere", LARGE, "value", lambda r: _chunks_named(r, b"../x/")),
    _case("manifest names another key's", LARGE, "value", lambda r: _chunks_named(r, _OTHER)),
    _case("manifest directory not text", LARGE, "value", lambda r: r[:-2] + b"\xff/"),
]
