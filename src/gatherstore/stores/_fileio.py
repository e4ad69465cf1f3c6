"""Bytes to and from an open file: vectored writes, and whole reads into private memory.

A value is always read into memory of this process's own, never mapped: any process
of the same user (root too) can rewrite or truncate a file after it was verified, and
a mapping, even a private one, would show the rewrite (pages not yet copied are the
file's) or die of SIGBUS (a truncation removes copied pages too).  What was verified is
then what is unpickled, whatever happens to the file.  A large value is read in 16 MiB
ranges, four at once: faster from a network filesystem than one stream, and on
``/dev/shm`` the page faults of the new memory are taken on several cores.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from gatherstore.stores.base import Buffer
from gatherstore.stores.layout import writable

__all__ = ["read_whole"]

_READ_STEP = 1 << 30  # bytes per read() call (Linux returns at most ~2 GiB per call)
_RANGE = 16 << 20  # bytes per read of a large value, a few ranges at once
_RANGES = 4


def read_whole(fd: int) -> Buffer:
    """The whole file ``fd`` in a new writable buffer of this process's own; shorter than
    its size when it was truncated meanwhile (the layer above then reports the damage)."""
    size = os.fstat(fd).st_size
    buf = writable(size)
    view = memoryview(buf)
    spans = [(start, min(start + _RANGE, size)) for start in range(0, size, _RANGE)]
    if len(spans) > 1:
        with ThreadPoolExecutor(_RANGES, thread_name_prefix="gatherstore-file") as pool:
            got = sum(pool.map(lambda span: _read_span(fd, view, *span), spans))
    else:
        got = _read_span(fd, view, 0, size)
    return buf if got == size else view[:got]


def _read_span(fd: int, view: memoryview, start: int, end: int) -> int:
    """Read bytes ``start:end`` of the file ``fd`` into ``view`` at the same place; how many
    (fewer when the file is shorter: it was truncated meanwhile)."""
    pos = start
    while pos < end:
        n = os.preadv(fd, [view[pos : min(end, pos + _READ_STEP)]], pos)
        if not n:
            break
        pos += n
    return pos - start
