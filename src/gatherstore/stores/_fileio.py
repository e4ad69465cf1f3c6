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

import errno
import operator
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .base import Buffer
from .layout import writable

__all__ = ["read_whole", "write_all"]

_READ_STEP = 1 << 30  # bytes per read() call (Linux returns at most ~2 GiB per call)
_RANGE = 16 << 20  # bytes per read of a large value, a few ranges at once
_RANGES = 4
_IOV_MAX = 1024


#: A memoryview's or an array's bytes (a pass in C over many small buffers).
_nbytes = operator.attrgetter("nbytes")


def write_all(fd: int, buffers: Sequence[memoryview | np.ndarray]) -> None:
    """Write ``buffers`` back to back with ``writev``, handling partial writes (in time
    linear in their count: a part may have a segment per array).

    numpy arrays are written as they are: a memoryview of each would cost more than its
    bytes when there are many small ones (a column's, see ``_columns``).
    """
    pending: list[Any] = list(buffers)  # numpy arrays: buffers to writev, untyped
    first = 0
    while first < len(pending):
        batch = pending[first : first + _IOV_MAX]
        try:
            written = os.writev(fd, batch)
        except (BufferError, ValueError):  # numpy: "ndarray is not C-contiguous"
            batch = pending[first : first + _IOV_MAX] = list(map(_raw, batch))
            written = os.writev(fd, batch)
        if written == sum(map(_nbytes, batch)):
            first += len(batch)
            continue
        if not written:
            raise OSError(errno.EIO, "the file took none of the bytes written to it")
        for index, buf in enumerate(batch, first):  # a partial write: resume inside a buffer
            if written < buf.nbytes:
                pending[index] = _raw(buf)[written:]
                first = index
                break
            written -= buf.nbytes


def _raw(buf: memoryview | np.ndarray) -> memoryview:
    """``buf``'s bytes as a flat memoryview (a contiguous copy of a strided array)."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8).data
    return buf.cast("B")


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
