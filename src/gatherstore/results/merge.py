"""A result set's values in key order, each key once, in memory bounded by a budget.

Chunks are sorted by key inside; they are opened in the order of their first
keys, as the merge reaches them, and the keys below the next unopened chunk's
first key are merged in one go (with numpy where the keys are ints).  Of a key
stored more than once, the value of the chunk whose name sorts first (the
earliest run, then the lowest rank, then the earliest flush) is kept, and of
a key added twice in one chunk the first added: the choice is the same
whoever reads.  The merge goes a block of keys at a time (:class:`Block`): read as
rows, (key, value) each, or, when its chunks were held as columns (an export), a
field at a time, straight from them.

Memory: the chunks held open plus those read ahead (at most a quarter of it)
stay within the budget;
when the next chunk would not fit, the open chunk that holds the most is
*spilled* (its values not merged yet go to an unlinked temporary file, read
back one by one), so that at most the budget plus one chunk is held,
whatever the size of the set and the order its keys were added in.  Chunks
are read ahead by threads (reads and checksums release the GIL) while the
consumer works.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import struct
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

import numpy as np

from gatherstore import _config as config
from gatherstore import codec
from gatherstore.host import memory
from gatherstore.results import order
from gatherstore.results.layout import ChunkInfo
from gatherstore.results.read import SetReader

__all__ = ["CHUNKS_AHEAD", "Block", "blocks", "budget", "merged", "overlap", "rows", "split"]

#: Chunks read ahead at most (when the budget allows).
CHUNKS_AHEAD = 8
#: Chunks read ahead take at most this share of the budget.
READ_AHEAD_SHARE = 4
_THREADS = 2
_LENGTH = struct.Struct("<Q")
_NOTHING = object()
#: A merge's range of keys as they sort (``order.order_key``): [start, stop), None unbounded.
_Bounds = tuple[tuple[int, Any] | None, tuple[int, Any] | None]


class _Spill:
    """The values of a chunk not merged yet, in an unlinked temporary file, read in order."""

    def __init__(self, values: list[Any], start: int) -> None:
        # unlinked at once: nothing is left, however the process ends
        self.file: IO[bytes] = tempfile.TemporaryFile(prefix="gatherstore-spill-")  # noqa: SIM115
        for value in values[start:]:
            frame = codec.encode(value).seal(None)
            self.file.write(_LENGTH.pack(frame.nbytes))
            for segment in frame.segments:
                self.file.write(segment)
        self.file.seek(0)
        self.next = start

    def take(self, pos: int, keep: bool) -> Any:
        """The value at ``pos`` (the ones before it are skipped); None unless ``keep``."""
        while True:
            (size,) = _LENGTH.unpack(self.file.read(_LENGTH.size))
            data = bytearray(size)
            self.file.readinto(data)  # type: ignore[attr-defined]
            here, self.next = self.next, self.next + 1
            if here == pos:
                return codec.decode(data, where="a spilled value") if keep else None

    def close(self) -> None:
        self.file.close()


class _Cursor:
    """An open chunk: its keys (in order), its values (or their spill), where it is, and
    where the keys of the merge's range end in it."""

    def __init__(
        self,
        info: ChunkInfo,
        prio: int,
        keys: order.Keys,
        values: Any,
        bounds: _Bounds,
        verified: codec.Verified,
    ) -> None:
        self.info, self.prio, self.keys = info, prio, keys
        self.values: Any = values  # a list, or a chunk's codec.Columns
        #: The chunk, while its values are columns: what rebuilds them names it.
        self.verified = verified if type(values) is codec.Columns else None
        self.ints = isinstance(keys, np.ndarray)
        self.orders = None if self.ints else [order.order_key(k) for k in keys]
        self.spill: _Spill | None = None
        self.pos, self.end = 0, len(keys)
        self.end = self.end_before(bounds[1])
        self.pos = 0 if bounds[0] is None else self.end_before(bounds[0])
        self.cost = info.nbytes + info.rebuilt

    def head(self) -> tuple[int, Any]:
        if self.orders is not None:
            return self.orders[self.pos]
        return (0, int(self.keys[self.pos]))

    def end_before(self, bound: tuple[int, Any] | None) -> int:
        """Where the keys below ``bound`` end (None: no bound), at most at the range's end."""
        if bound is None:
            return self.end
        if self.orders is not None:
            return bisect.bisect_left(self.orders, bound, lo=self.pos, hi=self.end)
        if bound[0] == 1:  # every int sorts before a str
            return self.end
        return min(int(np.searchsorted(self.keys, bound[1], side="left")), self.end)

    def rows(self) -> list[Any]:
        """Its values (a chunk loaded as columns: their records, rebuilt now).

        Raises:
            GatherError: a value cannot be rebuilt here.
        """
        columns, verified = self.values, self.verified
        if type(columns) is codec.Columns:
            assert verified is not None, "columns come from a chunk"
            self.values = codec.rebuilding(verified, lambda _: columns.rows())
            self.verified = None
        values: list[Any] = self.values
        return values

    def field(self, name: str) -> list[Any]:
        """The values of field ``name`` of its columns (see ``columns``).

        Raises:
            GatherError: a value cannot be rebuilt here.
        """
        columns, verified = self.values, self.verified
        assert verified is not None, "columns come from a chunk"
        found: list[Any] = codec.rebuilding(verified, lambda _: columns.field(name))
        return found

    def columns(self) -> codec.Columns | None:
        """Its values as columns of dicts, when it holds them so (and is not spilled)."""
        values = self.values
        return values if type(values) is codec.Columns and values.cls is dict else None

    def spill_rest(self) -> None:
        self.spill = _Spill(self.rows(), self.pos)
        self.values = []

    def close(self) -> None:
        self.values, self.verified = [], None
        if self.spill is not None:
            self.spill.close()


class Block:
    """The keys of the open chunks below a bound, in key order (of equal keys, the chunks'
    order), and where each one's value is: read it once, by :meth:`rows` or
    :meth:`fields`, before the merge goes on."""

    def __init__(
        self, merge: _Merge, cursors: list[_Cursor], keys: Any, which: Any, positions: Any
    ) -> None:
        self.merge, self.cursors = merge, cursors
        self.keys, self.which, self.positions = keys, which, positions

    def rows(self) -> Iterator[tuple[order.Key, Any]]:
        """(key, value) of each key once: the first chunk's value."""
        cursors = self.cursors
        spills = [c.spill for c in cursors]
        held = [None if c.spill is not None else c.rows() for c in cursors]
        last = self.merge.last
        keys = self.keys.tolist() if isinstance(self.keys, np.ndarray) else self.keys
        which, positions = self.which.tolist(), self.positions.tolist()
        for key, j, pos in zip(keys, which, positions, strict=True):
            first = key != last
            values = held[j]
            if values is None:  # spilled: read in order, skipped ones too
                value = spills[j].take(pos, keep=first)
            else:
                value, values[pos] = values[pos], None
            if first:
                last = self.merge.last = key
                yield key, value

    def fields(self, names: list[str]) -> tuple[Any, list[Any]] | None:
        """Each key once, and the values of each field of ``names``, taken from the
        chunks' columns: an array of a row per key where they stack, else a list; None
        unless every chunk holds every field of ``names`` in columns of dicts (see
        ``codec.load_columns``)."""
        found = self._columns(names)
        if found is None:
            return None
        keep = _firsts(self.keys, self.merge.last)
        keys = self.keys[keep] if isinstance(self.keys, np.ndarray) else _kept(self.keys, keep)
        which, positions = self.which[keep], self.positions[keep]
        if len(keys):
            self.merge.last = keys[-1] if isinstance(keys, list) else keys[-1].item()
        return keys, [_gather(self.cursors, found, name, which, positions) for name in names]

    def _columns(self, names: list[str]) -> list[codec.Columns] | None:
        """Each chunk's columns of dicts, when every chunk holds its values so, with every
        field of ``names``; else None."""
        found = [c.columns() for c in self.cursors]
        held = [c for c in found if c is not None and set(names) <= set(c.names)]
        return held if held and len(held) == len(found) else None


def _firsts(keys: Any, last: Any) -> Any:
    """Which of ``keys`` (in order) differs from the one before it (the first: from
    ``last``), as a bool array."""
    if isinstance(keys, np.ndarray):
        keep = np.empty(len(keys), dtype=bool)
        keep[1:] = keys[1:] != keys[:-1]
        if len(keys):
            keep[0] = last is _NOTHING or keys[0] != last
        return keep
    return np.fromiter(map(operator.ne, keys, [last, *keys[:-1]]), bool, len(keys))


def _kept(keys: list[Any], keep: Any) -> list[Any]:
    return list(itertools.compress(keys, keep.tolist()))


def _gather(
    cursors: list[_Cursor], found: list[codec.Columns], name: str, which: Any, positions: Any
) -> Any:
    """The values of field ``name`` at ``positions`` of the cursors' columns ``found``
    that ``which`` names: an array of rows (a copy, never a view of a chunk) where every
    chunk's field stacks into one of one dtype and row shape, else a list."""
    stacks = [held.stacked(name) for held in found]
    arrays = [stack for stack in stacks if stack is not None]
    if len(arrays) == len(stacks) and len({(a.dtype, a.shape[1:]) for a in arrays}) == 1:
        first = arrays[0]
        if len(arrays) == 1:
            at = _spaced(positions)
            return first[at].copy() if isinstance(at, slice) else first[at]
        out = np.empty((len(positions), *first.shape[1:]), dtype=first.dtype)
        for j, stack in enumerate(arrays):
            rows = np.flatnonzero(which == j)
            out[_spaced(rows)] = stack[_spaced(positions[rows])]
        return out
    lists = [cursor.field(name) for cursor in cursors]
    if len(lists) == 1:
        return list(map(lists[0].__getitem__, positions.tolist()))
    sources = map(lists.__getitem__, which.tolist())
    return list(map(operator.getitem, sources, positions.tolist()))


def _spaced(at: Any) -> Any:
    """The indexes ``at`` as a slice when they are evenly spaced (the rows of a chunk in a
    run of its own, or spread over every W-th place: ranks' shares that a sampler
    interleaved), so that a copy through it takes no temporary; else ``at``."""
    if len(at) < 2:
        return at
    step = int(at[1] - at[0])
    evenly = step > 0 and int(at[-1]) == int(at[0]) + step * (len(at) - 1)
    if evenly and (np.diff(at) == step).all():
        return slice(int(at[0]), int(at[-1]) + 1, step)
    return at


class _Merge:
    def __init__(
        self,
        infos: list[ChunkInfo],
        reader: SetReader,
        budget: int,
        bounds: _Bounds,
        columnar: bool = False,
    ) -> None:
        names = sorted(info.name for info in infos)  # the priorities of all: ranges agree
        self.prio = {name: p for p, name in enumerate(names)}
        self.bounds = bounds
        infos = [info for info in infos if _overlaps(info, bounds)]
        self.plan = sorted(infos, key=lambda i: (order.order_key(i.first), self.prio[i.name]))
        self.reader, self.budget, self.columnar = reader, budget, columnar
        self.pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="gatherstore-results-read")
        self.futures: dict[int, Future[codec.Verified]] = {}
        self.next_fetch = 0
        self.fetched = 0  # bytes read ahead, not opened yet
        self.held = 0  # bytes of the open chunks held in memory
        self.cursors: list[_Cursor] = []
        self.last: Any = _NOTHING

    def run(self) -> Iterator[Block]:
        opened = 0
        self._read_ahead()
        while opened < len(self.plan) or self.cursors:
            upcoming = self.plan[opened] if opened < len(self.plan) else None
            if upcoming is not None and (
                not self.cursors
                or order.order_key(upcoming.first) <= min(c.head() for c in self.cursors)
            ):
                self._open(opened)
                opened += 1
                continue
            bound = self.bounds[1] if upcoming is None else order.order_key(upcoming.first)
            block = self._below(bound)
            if block is not None:
                yield block
            for cursor in [c for c in self.cursors if c.pos >= c.end]:
                self.cursors.remove(cursor)
                if cursor.spill is None:
                    self.held -= cursor.cost
                cursor.close()
            self._read_ahead()

    def _read_ahead(self) -> None:
        """Read the next chunks ahead, within a quarter of the budget (the chunks held
        open come first: reading ahead must not make them spill)."""
        while self.next_fetch < len(self.plan) and len(self.futures) < CHUNKS_AHEAD:
            info = self.plan[self.next_fetch]
            fetched = self.fetched + info.nbytes
            if fetched > self.budget // READ_AHEAD_SHARE or self.held + fetched > self.budget:
                return
            self.futures[self.next_fetch] = self.pool.submit(self.reader.fetch, info)
            self.fetched += info.nbytes
            self.next_fetch += 1

    def _open(self, i: int) -> None:
        info = self.plan[i]
        future = self.futures.pop(i, None)
        if future is None:  # not read ahead: the budget had no room
            self.next_fetch = i + 1
            verified = self.reader.fetch(info)
        else:
            verified = future.result()
            self.fetched -= info.nbytes
        cost = info.nbytes + info.rebuilt
        while self.held + self.fetched + cost > self.budget:  # spill the largest open chunk
            held = [c for c in self.cursors if c.spill is None]
            if not held:
                break
            biggest = max(held, key=lambda c: c.cost)
            biggest.spill_rest()
            self.held -= biggest.cost
        keys, values = self.reader.decode(verified, info, self.columnar)
        cursor = _Cursor(info, self.prio[info.name], keys, values, self.bounds, verified)
        if cursor.pos < cursor.end:  # it holds keys of the range
            self.cursors.append(cursor)
            self.held += cost

    def _below(self, bound: tuple[int, Any] | None) -> Block | None:
        """The block of the open chunks' keys below ``bound`` (None: none)."""
        spans = [(c, c.pos, c.end_before(bound)) for c in self.cursors]
        spans = [span for span in spans if span[2] > span[1]]
        if not spans:
            return None
        merge = _merge_ints if all(c.ints for c, _, _ in spans) else _merge_any
        keys, which, positions = merge(spans)
        for cursor, _, end in spans:
            cursor.pos = end
        return Block(self, [c for c, _, _ in spans], keys, which, positions)

    def close(self) -> None:
        for future in self.futures.values():
            future.cancel()
        self.pool.shutdown(wait=False)
        for cursor in self.cursors:
            cursor.close()
        self.cursors = []


#: Keys (an int64 array, or a list), and the span and position of each, as int64 arrays.
Merged = tuple[Any, Any, Any]


def _merge_ints(spans: list[tuple[_Cursor, int, int]]) -> Merged:
    """(keys, span of each, position of each) of int-keyed spans in key order, then
    chunk order."""
    keys = np.concatenate([c.keys[a:b] for c, a, b in spans])
    which = np.concatenate([np.full(b - a, j, dtype=np.int64) for j, (_, a, b) in enumerate(spans)])
    pos = np.concatenate([np.arange(a, b, dtype=np.int64) for _, a, b in spans])
    prio = np.asarray([c.prio for c, _, _ in spans], dtype=np.int64)[which]
    by = np.lexsort((pos, prio, keys))
    return keys[by], which[by], pos[by]


def _merge_any(spans: list[tuple[_Cursor, int, int]]) -> Merged:
    """``_merge_ints`` for keys of any kind."""
    found = sorted(
        (order.order_key(k), c.prio, p, k, j)
        for j, (c, start, end) in enumerate(spans)
        for p, k in zip(range(start, end), order.unpack(c.keys[start:end]), strict=True)
    )
    which = np.fromiter((j for *_, j in found), np.int64, len(found))
    positions = np.fromiter((p for _, _, p, _, _ in found), np.int64, len(found))
    return [k for *_, k, _ in found], which, positions


def _sorted_as(key: order.Key | None) -> tuple[int, Any] | None:
    return None if key is None else order.order_key(key)


def _overlaps(info: ChunkInfo, bounds: _Bounds) -> bool:
    """Whether the chunk ``info`` may hold keys in ``bounds``."""
    start, stop = bounds
    return (start is None or order.order_key(info.last) >= start) and (
        stop is None or order.order_key(info.first) < stop
    )


def blocks(
    infos: list[ChunkInfo],
    reader: SetReader,
    budget: int,
    start: order.Key | None = None,
    stop: order.Key | None = None,
    *,
    columnar: bool = False,
) -> Iterator[Block]:
    """The chunks ``infos`` merged in key order (see the module's docstring), as blocks of
    keys, from ``start`` on and below ``stop`` (None: no bound); ``budget`` bounds the
    bytes held open and read ahead.  ``columnar``: chunks of records of one shape are held
    as their columns (``codec.load_columns``), for ``Block.fields``.

    Raises:
        IntegrityError: a chunk is damaged, planted or sealed with another key.
        GatherError: a chunk is gone, or a value cannot be rebuilt here.
        StoreUnavailableError: the store failed.
    """
    bounds: _Bounds = (_sorted_as(start), _sorted_as(stop))
    merge = _Merge(infos, reader, budget, bounds, columnar)
    try:
        yield from merge.run()
    finally:
        merge.close()


def rows(found: Iterator[Block]) -> Iterator[tuple[Any, Any]]:
    """(key, value) of the blocks ``found``, each key once, in key order."""
    try:
        for block in found:
            yield from block.rows()
    finally:
        close = getattr(found, "close", None)
        if close is not None:
            close()


def merged(
    infos: list[ChunkInfo],
    reader: SetReader,
    budget: int,
    start: order.Key | None = None,
    stop: order.Key | None = None,
) -> Iterator[tuple[Any, Any]]:
    """(key, value) of the chunks ``infos`` in key order, each key once: ``rows`` of
    ``blocks``.

    Raises:
        the errors of ``blocks``.
    """
    return rows(blocks(infos, reader, budget, start, stop))


def budget(read_ahead: int | None, infos: list[ChunkInfo], share: int = 1) -> int:
    """The read-ahead budget of each of ``share`` merges at once: a share of
    ``read_ahead``, else what overlapping chunks need (see ``overlap``), at least the
    default, and all of them together at most a quarter of the free memory."""
    if read_ahead is not None:
        return max(read_ahead // share, 1)
    room = memory.headroom()
    wanted = max(config.read_ahead(None, room), 2 * overlap(infos))
    return max(min(wanted, room // (4 * share)), 1)


def split(
    indexes: list[tuple[ChunkInfo, order.Keys]], parts: int
) -> list[tuple[order.Key | None, order.Key | None]]:
    """The keys of the chunks ``indexes`` (each with its keys) cut into at most ``parts``
    ranges [start, stop) of about as many distinct keys each, in key order (None: no
    bound); fewer when there are fewer keys, and one at least."""
    if parts == 1:
        return [(None, None)]
    batches = [keys for _, keys in indexes]
    distinct: Any
    if all(isinstance(keys, np.ndarray) for keys in batches):
        distinct = np.unique(np.concatenate(batches)) if batches else np.empty(0, np.int64)
    else:
        every = {key for keys in batches for key in order.unpack(keys)}
        distinct = sorted(every, key=order.order_key)
    count = max(1, min(parts, len(distinct)))
    at = [len(distinct) * i // count for i in range(1, count)]
    cuts = distinct[at].tolist() if isinstance(distinct, np.ndarray) else [distinct[i] for i in at]
    return list(zip([None, *cuts], [*cuts, None], strict=True))


def overlap(infos: list[ChunkInfo]) -> int:
    """The most bytes of chunks whose key ranges overlap at one key."""
    events = sorted(
        [(order.order_key(i.first), 0, i.nbytes + i.rebuilt) for i in infos]
        + [(order.order_key(i.last), 1, -(i.nbytes + i.rebuilt)) for i in infos]
    )
    most = held = 0
    for _, _, cost in events:
        held += cost
        most = max(most, held)
    return most
