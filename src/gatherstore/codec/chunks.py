"""A long list (or dict) encoded in chunks: frames that rebuild it in order.

A gather's destination need not wait for a sender's whole part before it decodes:
a sender whose object is a long list, or a long dict (records keyed by id), encodes
it as a run of chunks, each a frame of its own (a slice of the list or of the dict's
items, its records packed, its regions, its digest), and
hands each over as soon as it is encoded (see ``gatherstore.routes.handover``), while the
destination rebuilds the chunks already in.

One pickler encodes the chunks in order and one unpickler rebuilds them in the same
order, so pickle's memo spans them: an object that two chunks hold is written once
and rebuilt once, one object, as in a part sent whole.  What pickle's memo cannot
keep one breaks the run (``Unchunkable``), and the sender then sends its object
whole:

- records or arrays that packing (see ``gatherstore.codec.records``) would replace by
  columns while something besides the list holds them: a later chunk could meet
  them again and rebuild them a second time;
- memory that two chunks' arrays or tensors share (views of one storage, which a
  whole part sends once and rebuilds as views of one buffer); views of one batch
  that only touch at a chunk's edge come back as views of each chunk's buffer;
- the list (or dict) itself inside an item, or an item that plain pickle cannot write.

An item whose pickling raises another error fails the run, its message naming where in
the list (or dict) it is (see ``gatherstore.codec.culprit``), as sent whole.
"""

from __future__ import annotations

import bisect
import io
import math
import pickle
import time
from collections.abc import Iterator
from typing import Any

from gatherstore import _config as config
from gatherstore.codec import culprit, records, sizing, storage
from gatherstore.codec import frames as serialize

__all__ = ["CHUNK", "CHUNK_SECONDS", "MIN_PART", "MIN_SECONDS", "Assembly", "Chunks", "Unchunkable"]

#: Bytes a chunk aims at (``GATHERSTORE_PART_CHUNK``): small enough that the destination
#: starts early and the senders stay ahead of it, large enough that each chunk's own
#: costs (a frame, a handover) stay a small share.
CHUNK = config.PART_CHUNK
#: Estimated bytes of a part from which a list is sent in chunks.
MIN_PART = 4 * CHUNK
#: Seconds of encoding a chunk aims at, at most: small plain records (COCO's result
#: dicts) pickle at about 0.05 GB/s, and ``CHUNK`` bytes of them would take a second or
#: more, the destination waiting meanwhile.
CHUNK_SECONDS = 0.025
#: Estimated seconds of encoding a part from which a list is sent in chunks, however
#: few its bytes.
MIN_SECONDS = 4 * CHUNK_SECONDS
#: The first chunk holds at most this share of the items: it is encoded before the
#: call's plan is agreed, and it gives the estimate of the whole part's size.
_FIRST = 64


class Unchunkable(Exception):
    """A chunk cannot continue the run: the object must be sent whole."""


class Chunks:
    """One list's (or dict's) chunks, encoded one after another (see the module's
    docstring): slices of the list, or dicts of consecutive items of the dict."""

    def __init__(self, items: list[Any] | dict[Any, Any]) -> None:
        self.items = items
        # a dict's keys in order (an iterator over its items would hold its last value,
        # which packing would then count as held elsewhere)
        self._keys = list(items) if type(items) is dict else None
        self.done = 0
        self._written = 0  # bytes of the chunks encoded so far
        self._spent = 0.0  # seconds spent encoding them
        self._stream = io.BytesIO()
        self._buffers: list[memoryview] = []
        self._pickler = serialize.pickler(self._stream, 0, self._buffers)
        #: Memory the chunks so far sent, by storage key: sorted, disjoint (start, end).
        self._sent: dict[Any, list[tuple[int, int]]] = {}

    #: The first chunk, and estimates from it of the whole part: its bytes, and what
    #: rebuilding it allocates besides them (see ``Frame.rebuilt``).
    head: serialize.Frame
    nbytes: int
    rebuilt: int

    @classmethod
    def first(cls, obj: Any) -> Chunks | None:
        """``obj``'s chunks, the first one encoded, when it is a list or dict worth sending
        in chunks; None when it is not (the caller encodes it whole)."""
        if type(obj) not in (list, dict) or not CHUNK:
            return None
        count = max(records.MIN_RUN, math.ceil(len(obj) / _FIRST))
        if len(obj) < 2 * count:
            return None
        chunks = cls(obj)
        try:
            chunks.head = chunks._next(count)
        except Unchunkable:
            chunks.close()
            return None
        chunks.nbytes = round(chunks.head.nbytes * len(obj) / count)
        chunks.rebuilt = round(chunks.head.rebuilt * len(obj) / count)
        seconds = chunks._spent * len(obj) / count
        return chunks if chunks.nbytes >= MIN_PART or seconds >= MIN_SECONDS else None

    @property
    def finished(self) -> bool:
        """Whether every item is in a chunk already encoded."""
        return self.done == len(self.items)

    def rest(self) -> Iterator[serialize.Frame]:
        """The chunks after the first, of about ``CHUNK`` bytes each, or fewer items when
        those would take more than ``CHUNK_SECONDS`` to encode (as the chunks so far did).

        Raises:
            Unchunkable: a chunk cannot continue the run (see the module's docstring).
        """
        while not self.finished:
            by_bytes = max(1, round(CHUNK / max(self._written / self.done, 1.0)))
            by_time = round(CHUNK_SECONDS * self.done / max(self._spent, 1e-9))
            count = min(by_bytes, max(records.MIN_RUN, by_time), len(self.items) - self.done)
            yield self._next(count)
        self.close()

    def close(self) -> None:
        """Forget what the pickler wrote: the objects it keeps for the chunks to come
        (copied columns among them) are freed."""
        self._pickler.clear_memo()

    def _next(self, count: int) -> serialize.Frame:
        """The next ``count`` items' chunk.

        Raises:
            Unchunkable: see the module's docstring.
        """
        start = time.perf_counter()
        piece: Any
        if self._keys is None:
            piece = self.items[self.done : self.done + count]
        else:
            piece = {key: self.items[key] for key in self._keys[self.done : self.done + count]}
        packed = records.pack(piece, held=2)  # the slice, and the whole
        if packed.twice or any(obj is not piece for obj in packed.shared):
            raise Unchunkable("records or arrays that packing replaces are held elsewhere too")
        pickler, stream = self._pickler, self._stream
        pickler.columns, pickler.spans = [], storage.Spans()
        try:
            if not self.done:  # an item that holds the list itself would be rebuilt twice
                serialize.guard(pickler, [self.items], stream)
            pickler.dump(packed.value)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise Unchunkable(str(exc)) from exc
        except Exception as exc:  # sent whole it would fail as well: say where in the object
            culprit.locate(exc, self.items)
            raise
        pickled = serialize.Pickled(
            stream.getvalue(), list(self._buffers), pickler.columns, pickler.spans, 0
        )
        stream.seek(0)
        stream.truncate()
        self._buffers.clear()
        # what rebuilding allocates: estimated from the first chunk only (see ``first``)
        frame = serialize.framed(pickled, 0 if self.done else sizing.rebuilt_size(piece))
        self._claim(pickler.spans.extents)
        self.done += count
        self._written += frame.nbytes
        self._spent += time.perf_counter() - start
        return frame

    def _claim(self, extents: list[tuple[Any, int, int]]) -> None:
        """Note the memory a chunk sends; raise Unchunkable when an earlier chunk sent
        some of it (touching is fine: rows of one batch split at a chunk's edge)."""
        for key, start, end in extents:
            sent = self._sent.setdefault(key, [])
            at = bisect.bisect_left(sent, (start, end))
            before = sent[at - 1] if at else None
            after = sent[at] if at < len(sent) else None
            if (before and before[1] > start) or (after and after[0] < end):
                raise Unchunkable("two chunks share memory (views of one storage)")
            sent.insert(at, (start, end))


class _Input:
    """The file the unpickler of an ``Assembly`` reads: the current chunk's stream."""

    def __init__(self) -> None:
        self.stream = io.BytesIO()

    def read(self, size: int = -1) -> bytes:
        return self.stream.read(size)

    def readinto(self, out: Any) -> int:
        return self.stream.readinto(out)

    def readline(self) -> bytes:
        return self.stream.readline()


class _Buffers:
    """The out-of-band buffers of the chunks added so far, taken in order."""

    def __init__(self) -> None:
        self.waiting: list[memoryview] = []

    def __iter__(self) -> _Buffers:
        return self

    def __next__(self) -> memoryview:
        if not self.waiting:
            raise StopIteration
        return self.waiting.pop(0)


class Assembly:
    """A list (or dict) rebuilt from its chunks, added in order as each is verified."""

    def __init__(self) -> None:
        self.value: Any = None
        self._input = _Input()
        self._buffers = _Buffers()
        self._regions: serialize.Regions | None = None
        self._unpickler: Any = None

    def add(self, verified: serialize.Verified) -> None:
        """Rebuild the next chunk (views into its buffer, as a part's).

        Raises:
            GatherError: the chunk cannot be rebuilt here (see ``gatherstore.codec.frames.load``).
        """
        serialize.rebuilding(verified, self._add)

    def _add(self, verified: serialize.Verified) -> None:
        self._input.stream = io.BytesIO(verified.stream)
        self._buffers.waiting = list(verified.buffers)
        if self._regions is None:
            self._regions = serialize.Regions(verified)
            self._unpickler = serialize.Unpickler(self._regions, self._input, self._buffers)
        else:
            self._regions.use(verified)
        piece = self._unpickler.load()
        if self.value is None:
            self.value = piece
        elif type(self.value) is dict:
            self.value.update(piece)
        else:
            self.value.extend(piece)
