"""A part loaded with its list of records as their columns, the records not rebuilt.

What reads a field at a time (an export to Arrow) takes a batch's columns as they
travelled (see :mod:`gatherstore.codec.records`): an array field of one shape is one
array already, and no record is made per row only to be taken apart again.  Only the
part's top-level list (the object, or an item of the tuple that is) loads so; a batch
anywhere else would stand where a list of records is expected, so such a part is
loaded again, plainly.
"""

from __future__ import annotations

import io
from typing import Any

from gatherstore.codec import frames, records, watch

__all__ = ["load_columns"]


class _AsColumns:
    """Stands in for the rebuild of a batch: makes its :class:`records.Columns`, and
    counts those left as columns that no other batch holds in a column (all should be
    top-level; a list of runs rebuilds its batches' records at once).  Not a bound
    method of the unpickler: its memo keeps this, and a reference back would keep the
    part alive until a collection."""

    def __init__(self) -> None:
        self.loose = 0

    def __call__(self, *args: Any) -> records.Columns:
        batch = records.Columns(*args)
        self.loose += 1 - len(batch.inner)
        for inner in batch.inner:  # counted no more: ``batch`` holds them
            inner.on_rows = None
        batch.on_rows = self._rebuilt
        return batch

    def _rebuilt(self) -> None:
        self.loose -= 1


class _Unpickler(frames.Unpickler):
    def __init__(self, verified: frames.Verified, batches: _AsColumns) -> None:
        super().__init__(frames.Regions(verified), io.BytesIO(verified.stream), verified.buffers)
        self.batches = batches

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        return self.batches if found is records.REBUILD else found


def _unpickle(verified: frames.Verified) -> Any:
    batches = _AsColumns()
    found = _Unpickler(verified, batches).load()
    top = found if type(found) is tuple else (found,)
    if batches.loose != sum(type(item) is records.Columns for item in top):
        del found, top  # not held while the part is loaded again
        return frames.load(verified)  # a batch below the top: records, as a load makes
    return found


def load_columns(verified: frames.Verified) -> Any:
    """``frames.load``, but the part's top-level list of records (the object, or an item
    of the tuple that is), when it travelled as one batch, comes as its
    :class:`records.Columns`: rebuild its records or fields through ``frames.rebuilding``
    with this ``verified``, so that their errors are those of a load.  A part with a
    batch elsewhere (in a value of a list too short to be a batch itself) is loaded
    twice, the second time plainly.

    Raises:
        the errors of ``frames.load``.
    """
    if watch.needs_watch(len(verified.stream)):  # memory could run low: records, watched
        return frames.load(verified)
    return frames.rebuilding(verified, _unpickle)
