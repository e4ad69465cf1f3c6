"""The digest of a part: an XXH3-128 checksum, hashed in parallel blocks, or a keyed BLAKE3
signature.

The checksum guards against damage.  XXH3 is the fastest of those measured, but
one core of a large GPU host hashes only about 7 GB/s (30 GB/s on another
machine; CRC-32 ran at 3-4 GB/s on both): so a part is cut into blocks of
:data:`BLOCK` bytes (counted over the frame, whatever its segments), each
block hashed on a worker thread (see ``gatherstore.host.workers``: XXH3 releases the
GIL), and the digest is
the XXH3-128 of the bound prefix, the length and the blocks' digests.  The
signature (with a key) is keyed BLAKE3 on every core (its own threads).
Both cover ``bind``, length-prefixed, before the frame.
"""

from __future__ import annotations

import functools
import struct

import blake3
import xxhash

from gatherstore.host import workers

__all__ = ["BLOCK", "SIZE", "digest"]

#: Bytes of the digest field.
SIZE = 32
#: Bytes per block of the checksum, each hashed on a thread.
BLOCK = 8 << 20
_MAC_CONTEXT = "gatherstore part signature, format 2"


@functools.lru_cache(maxsize=8)
def _mac_key(key: bytes) -> bytes:
    """The 32-byte BLAKE3 key derived from a signing key of any length."""
    return blake3.blake3(key, derive_key_context=_MAC_CONTEXT).digest()


def _blocks(segments: list[memoryview], total: int) -> list[list[memoryview]]:
    """The concatenation of ``segments`` cut into blocks of :data:`BLOCK` bytes, each as
    the pieces of the segments it covers."""
    blocks: list[list[memoryview]] = [[] for _ in range(-(-total // BLOCK))]
    pos = 0
    for seg in segments:
        done = 0
        while done < len(seg):
            index, room = divmod(pos, BLOCK)
            take = min(len(seg) - done, BLOCK - room)
            blocks[index].append(seg[done : done + take])
            done += take
            pos += take
    return blocks


def _xxh3(pieces: list[memoryview]) -> bytes:
    hasher = xxhash.xxh3_128()
    for piece in pieces:
        hasher.update(piece)
    return hasher.digest()


def digest(segments: list[memoryview], key: bytes | None, bind: bytes) -> bytes:
    """Keyed BLAKE3 (with ``key``) or the XXH3-128 block digest of ``bind`` and ``segments``
    (back to back), :data:`SIZE` bytes."""
    prefix = memoryview(struct.pack("<Q", len(bind)) + bind)
    if key is not None:
        mac = blake3.blake3(key=_mac_key(key), max_threads=blake3.blake3.AUTO)
        for seg in (prefix, *segments):
            mac.update(seg)
        return bytes(mac.digest(SIZE))
    views = [memoryview(seg).cast("B") for seg in segments]
    total = sum(len(v) for v in views)
    blocks = _blocks(views, total)
    if len(blocks) > 1:
        # the pool's threads are handed indices, and the views are dropped here: a thread
        # keeps what it was handed a moment after it handed its result in, and a view
        # kept so would stop the caller from unmapping what it digested
        found = workers.run(lambda index: _xxh3(blocks[index]), range(len(blocks)))
        blocks.clear()
    else:
        found = [_xxh3(views)]
    summary = [prefix, memoryview(struct.pack("<Q", total)), *(memoryview(d) for d in found)]
    return _xxh3(summary).ljust(SIZE, b"\0")
