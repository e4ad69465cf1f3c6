"""Vectored writes of many buffers to a file descriptor, resumed after partial writes.

Both a store (a value's file) and the codec (a part sealed into a memfd) write parts
this way: a part may have a segment per array.
"""

from __future__ import annotations

import errno
import operator
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["write_all"]

_IOV_MAX = 1024

#: A memoryview's or an array's bytes (a pass in C over many small buffers).
_nbytes = operator.attrgetter("nbytes")


def write_all(fd: int, buffers: Sequence[memoryview | np.ndarray]) -> None:
    """Write ``buffers`` back to back with ``writev``, handling partial writes (in time
    linear in their count: a part may have a segment per array).

    numpy arrays are written as they are: a memoryview of each would cost more than its
    bytes when there are many small ones (a column's, see ``gatherstore.codec.columns``).
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
