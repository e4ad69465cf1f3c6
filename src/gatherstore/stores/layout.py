"""How a store value is laid out: a 64-byte header, then the payload or a manifest.

An inline value carries its payload after the header; a value larger than the
store's ``max_value_size`` is written as chunks under ``<key>.chunks/`` first
and its header (the manifest, listing the chunk sizes) last, so a reader never
sees a partial value.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

__all__ = [
    "CHUNKED",
    "CHUNKS",
    "HEADER",
    "HEADER_SIZE",
    "INLINE",
    "MAGIC",
    "Buffer",
    "header",
    "nbytes",
    "split",
]

Buffer = bytes | bytearray | memoryview

MAGIC = b"GSTORE\x00\x01"
HEADER = struct.Struct("<8sBxxxxxxxQQ")  # magic, kind, total payload, chunk count
HEADER_SIZE = 64
INLINE, CHUNKED = 0, 1
CHUNKS = ".chunks"


def header(kind: int, total: int, count: int) -> bytes:
    """The 64-byte header of a value: inline (``count`` 0) or a chunked manifest."""
    return HEADER.pack(MAGIC, kind, total, count).ljust(HEADER_SIZE, b"\0")


def nbytes(buf: Buffer) -> int:
    """The size of a buffer in bytes."""
    return memoryview(buf).nbytes


def split(buffers: Sequence[Buffer], limit: int) -> Iterator[list[memoryview]]:
    """Regroup ``buffers`` into runs of at most ``limit`` bytes, without copying."""
    run: list[memoryview] = []
    room = limit
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while len(view):
            take = view[:room]
            run.append(take)
            view = view[len(take) :]
            room -= len(take)
            if room == 0:
                yield run
                run, room = [], limit
    if run:
        yield run
