"""How a store value is laid out: a 64-byte header, then the payload or a manifest.

An inline value carries its payload after the header; a value larger than the
store's ``max_value_size`` is written as chunks under ``<key>.chunks/<id>/``
first and its header (the manifest, listing the chunk sizes and their folder)
last, so a reader never sees a partial value.  What is read is checked against
this layout before any chunk is fetched: a manifest names only its own key's
chunks, as many as its body holds, adding up to its total (see ``layout_of``).
"""

from __future__ import annotations

import mmap
import re
import struct
import uuid
from collections.abc import Iterator, Sequence
from typing import NamedTuple

__all__ = [
    "CHUNKED",
    "CHUNKS",
    "HEADER",
    "HEADER_SIZE",
    "INLINE",
    "MAGIC",
    "Buffer",
    "ChunksRead",
    "Damaged",
    "Layout",
    "check_key",
    "chunk_folder",
    "chunked_head",
    "header",
    "layout_of",
    "manifest",
    "nbytes",
    "split",
    "writable",
]

Buffer = bytes | bytearray | memoryview

#: Buffers from this size on are private anonymous mappings (see ``writable``).
MAPPED_FROM = 4 << 20

MAGIC = b"GSTORE\x00\x01"
HEADER = struct.Struct("<8sBxxxxxxxQQ")  # magic, kind, total payload, chunk count
HEADER_SIZE = 64
INLINE, CHUNKED = 0, 1
CHUNKS = ".chunks"
_CHUNK_FOLDER = re.compile(rb"[0-9a-f]{32}/")  # after "<key>.chunks/": one write's chunks
_FOLDER_SIZE = 33
_CHUNKS_KEPT = 4096  # values whose chunks a store remembers between a read and a delete


class Damaged(ValueError):
    """A stored value is not laid out as gatherstore writes it; the message says how."""


class Layout(NamedTuple):
    """What a stored value's header says: its payload size, and where the payload is."""

    total: int
    #: The payload of an inline value (None: the value is chunked).
    inline: memoryview | None
    #: (chunk key, size) of every chunk of a chunked value, in order.
    chunks: list[tuple[str, int]]


def check_key(key: str) -> str:
    """``key`` when it is a valid store key.

    Raises:
        ValueError: it is empty, absolute, ends in ``/``, has an empty, ``.`` or ``..``
            component, or one that ends in ``.chunks`` (chunks live there).
    """
    if (
        not key
        or key.startswith("/")
        or key.endswith("/")
        or any(part in ("", ".", "..") or part.endswith(CHUNKS) for part in key.split("/"))
    ):
        raise ValueError(
            f"store key {key!r} is not valid: use non-empty '/'-separated names, "
            f"without '.', '..' or names ending in {CHUNKS!r}"
        )
    return key


def header(kind: int, total: int, count: int) -> bytes:
    """The 64-byte header of a value: inline (``count`` 0) or a chunked manifest."""
    return HEADER.pack(MAGIC, kind, total, count).ljust(HEADER_SIZE, b"\0")


def _head(view: memoryview) -> tuple[int, int, int]:
    """The kind, total and chunk count of a header.

    Raises:
        Damaged: ``view`` is shorter than a header, or the header is not one gatherstore
            writes (another magic, an unknown kind, an inline value with chunks).
    """
    if len(view) < HEADER_SIZE:
        raise Damaged("shorter than its header")
    magic, kind, total, count = HEADER.unpack_from(view)
    if magic != MAGIC or kind not in (INLINE, CHUNKED) or (kind == INLINE and count):
        raise Damaged("not written by this version of gatherstore's store layer")
    return kind, total, count


def chunked_head(head: Buffer) -> bool:
    """Whether the value whose first bytes are ``head`` is chunked.

    Raises:
        Damaged: ``head`` is not the start of a value gatherstore writes.
    """
    return _head(memoryview(head).cast("B"))[0] == CHUNKED


def layout_of(key: str, raw: Buffer) -> Layout:
    """The layout of the value ``raw`` stored at ``key``.

    Raises:
        Damaged: the header is damaged; an inline payload is not as long as the header
            says; a manifest's body does not hold its chunk count, names another folder
            than ``<key>.chunks/<id>/``, or lists sizes that do not add up to its total.
    """
    view = memoryview(raw).cast("B")
    kind, total, count = _head(view)
    body = view[HEADER_SIZE:]
    if kind == INLINE:
        if len(body) != total:
            raise Damaged(f"truncated or grown: {len(body)} bytes, its header says {total}")
        return Layout(total, body, [])
    own = f"{key}{CHUNKS}/".encode()
    if count < 1 or len(body) != 8 * count + len(own) + _FOLDER_SIZE:
        raise Damaged(f"a manifest of {len(body)} bytes, which cannot list {count} chunks")
    folder = body[8 * count :]
    own_id = bytes(folder[len(own) :])
    if folder[: len(own)] != own or not _CHUNK_FOLDER.fullmatch(own_id):
        raise Damaged("a manifest that names chunks outside the value's own folder")
    sizes = struct.unpack_from(f"<{count}Q", body)
    if sum(sizes) != total:
        raise Damaged(f"a manifest whose chunks add up to {sum(sizes)} bytes, not {total}")
    name = f"{key}{CHUNKS}/{own_id.decode()}"
    return Layout(total, None, [(f"{name}{i:08d}", n) for i, n in enumerate(sizes)])


def chunk_folder(key: str) -> str:
    """A new folder for the chunks of one write of ``key``."""
    return f"{key}{CHUNKS}/{uuid.uuid4().hex}/"


def manifest(total: int, sizes: Sequence[int], folder: str) -> list[bytes]:
    """The value that publishes ``total`` bytes written as chunks of ``sizes`` in ``folder``."""
    sizes_packed = struct.pack(f"<{len(sizes)}Q", *sizes)
    return [header(CHUNKED, total, len(sizes)), sizes_packed, folder.encode()]


class ChunksRead:
    """The chunk keys of the values a store read, until it deletes them: a delete of a value
    just read needs not read its manifest again.  Values read but never deleted are
    forgotten after a few thousand."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[str]] = {}

    def remember(self, key: str, chunks: list[str]) -> None:
        if len(self._chunks) >= _CHUNKS_KEPT:
            self._chunks.clear()
        self._chunks[key] = chunks

    def pop(self, key: str) -> list[str] | None:
        """The chunk keys of ``key`` (forgotten now), or None when it was not read."""
        return self._chunks.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._chunks


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
