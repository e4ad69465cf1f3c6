"""How a store value is laid out: a 64-byte header, then the payload or a manifest.

An inline value carries its payload after the header; a value larger than the
store's ``max_value_size`` is written as chunks under ``<key>.chunks/`` first
and its header (the manifest, listing the chunk sizes) last, so a reader never
sees a partial value.
"""

from __future__ import annotations

import mmap
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
    "writable",
]

Buffer = bytes | bytearray | memoryview

#: Buffers from this size on are private anonymous mappings (see :func:`writable`).
MAPPED_FROM = 4 << 20

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


def writable(size: int) -> bytearray | memoryview:
    """A new zeroed, writable buffer of ``size`` bytes, for a value read from a store.

    ``bytearray(size)`` first zeroes every byte by hand, faulting the memory in
    page by page before the value is received into it; a large buffer is instead
    a private anonymous mapping, which the kernel zeroes as the value lands in it
    (10% less CPU for the reader of a 1 GB gather).  It is unmapped when its last
    view goes.  Huge pages are not asked for: on VMs that hand free 2 MiB blocks
    back to the host they cost a host fault each, several times the saving.
    """
    if size < MAPPED_FROM:
        return bytearray(size)
    try:
        return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    except (OSError, ValueError, AttributeError, TypeError):  # pragma: no cover - no such flags
        return bytearray(size)
