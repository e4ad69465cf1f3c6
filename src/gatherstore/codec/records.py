"""Record batches: runs of same-shaped records packed into columns before pickling.

Evaluation results are long lists of small records (a dict per image holding a
few arrays and scalars).  Pickling them object by object runs at well under
0.1 GB/s.  Before pickling, every run of records with the same structure (dicts
with the same string keys in the same order, instances of one plain dataclass, or
tuples of one length, ``(image_id, logits)``) becomes a :class:`Batch`: one column
per field.  Fields of arrays or tensors become array columns (see
:mod:`gatherstore.codec.columns`: one copied region, or views of the storages they
share); fields of records (``{"id", "pred": {"boxes", "scores"}}``) become a batch
of their own, and fields of lists of records (``{"image_id", "instances": [...]}``)
one batch of all their records; other fields become plain Python lists, which
pickle fast.  On load the records are rebuilt with array fields as views into the
part.  Dicts and tuples of plain values only (COCO's ``{"image_id", "bbox": [...],
"score"}``) stay as they are: pickle writes and reads them faster than columns.

A list of arrays or tensors is one such column by itself, and a long dict
(``{image_id: record}``, ``{name: tensor}``) packs its values as such a list, its
keys a plain list beside them.

A dataclass is batched only when pickle would rebuild it the same way: one
that defines its own pickling (``__reduce__``, ``__reduce_ex__``,
``__getstate__``, ``__setstate__``, a ``copyreg`` reducer) or whose
``__dict__`` differs from its fields is pickled as it says.

Packing keeps pickle's identities.  A run in which one record appears twice is
pickled plainly, a container met twice is packed once, and packing stops at a
cycle.  Records and array values that something besides their container holds
are reported (see :class:`Packed`): the pickler may meet them elsewhere in the
object, where they would be rebuilt a second time, so ``gatherstore.codec.frames`` then pickles
the object plainly.  Lists that are not homogeneous fall back to plain pickling
per run of records; this is never a user-visible format choice.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import itertools
import operator
import sys
from collections import deque
from collections.abc import Callable
from itertools import repeat
from typing import Any

import numpy as np
import torch

from gatherstore.codec import columns

__all__ = [
    "REBUILD",
    "Batch",
    "Columns",
    "Packed",
    "columnar",
    "listed",
    "pack",
    "structure",
]

#: Shortest run of records worth a batch.
MIN_RUN = 8
#: Containers shorter than this are searched for lists of records (depth-limited).
_SCAN_LEN = 64
_SCAN_DEPTH = 4
_PROTOCOL = (
    "__reduce__",
    "__reduce_ex__",
    "__getstate__",
    "__setstate__",
    "__getnewargs__",
    "__getnewargs_ex__",
)
#: Where parts of format 4 name the rebuild of a list of arrays (see
#: ``gatherstore.codec.columns.rebuilt``).
_column_values = columns.rebuilt


def structure(record: Any) -> tuple[type, tuple[Any, ...]] | None:
    """(record type, field names) of a dict whose keys are strings or of a plain dataclass
    instance, or (tuple, its positions) of a tuple; None for anything else, and for a
    record without fields."""
    kind = type(record)
    if kind is dict:
        names = tuple(record)
        return (dict, names) if names and _named(names) else None
    if kind is tuple:
        return (tuple, _positions(len(record))) if record else None
    fields = _plain_fields(kind)  # type: ignore[arg-type]
    if fields and tuple(getattr(record, "__dict__", ())) == fields:
        return (kind, fields)
    return None


def _named(keys: tuple[Any, ...]) -> bool:
    """Whether a dict's keys are all exactly ``str`` (``1``, ``1.0``, ``True`` and
    ``np.int64(1)`` are equal keys of different types: records keyed so stay dicts)."""
    return all(type(key) is str for key in keys)


@functools.lru_cache(maxsize=64)
def _positions(length: int) -> tuple[int, ...]:
    return tuple(range(length))


@functools.lru_cache(maxsize=256)
def _plain_fields(kind: type) -> tuple[str, ...] | None:
    """The field names of a dataclass that pickle rebuilds from its ``__dict__`` alone
    (no pickling protocol of its own), else None."""
    if not dataclasses.is_dataclass(kind) or kind in copyreg.dispatch_table:
        return None
    if kind.__new__ is not object.__new__:  # pickle calls it: so must the rebuild
        return None
    if any(getattr(kind, name, None) is not getattr(object, name, None) for name in _PROTOCOL):
        return None
    return tuple(f.name for f in dataclasses.fields(kind))


def _references(values: list[Any]) -> np.ndarray:
    """Each of ``values``' reference counts (one of them the count's own).

    Something that ``values`` holds twice, among ``held`` references each, has more than
    ``held + 1``: so when none has, every object of ``values`` is there once.
    """
    return np.fromiter(map(sys.getrefcount, values), np.int64, len(values))


def _once(counts: np.ndarray, held: int) -> bool:
    """Whether :func:`_references` ``counts`` show every object there once (see there)."""
    return bool((counts <= held + 1).all())


class _Screen:
    """What one :func:`pack` replaced that something else may also hold (see ``Packed``),
    and how deep it nests batches in records' fields."""

    def __init__(self) -> None:
        self.shared: dict[int, Any] = {}
        self.twice = False
        self.nesting = 0

    def check(self, values: list[Any], held: int, counts: np.ndarray | None = None) -> None:
        """Note the objects of ``values`` (replaced by packing) that something holds
        besides the ``held`` references packing knows of, ``values`` itself among them;
        one noted here and before is replaced in two places.  ``counts``: their
        :func:`_references`, taken before anything else held them."""
        if counts is None:
            counts = _references(values)
        found = {id(values[i]): values[i] for i in np.flatnonzero(counts > held + 1).tolist()}
        if found:
            self.twice = self.twice or not self.shared.keys().isdisjoint(found)
            self.shared.update(found)


def _nested(values: list[Any], screen: _Screen) -> tuple[columns.Kind, Any]:
    """A field that is not an array column: (kind, column).  Records
    (``{"id", "pred": {"boxes", "scores"}}``) are packed as a list of them, and lists of
    records (``{"image_id", "instances": [{"bbox", "score"}, ...]}``) as one list of all
    their records and each one's length, a few levels deep; anything else is ``values``
    itself, pickled as it is."""
    if screen.nesting >= _SCAN_DEPTH:
        return ("py",), values
    screen.nesting += 1
    try:
        if structure(values[0]) is not None and columnar(values):
            return ("py",), _pack_list(values, 2, screen)  # its record, and ``values``
        if set(map(type, values)) == {list} and columns.distinct(values):
            flat = list(itertools.chain.from_iterable(values))
            if structure(flat[0] if flat else None) is not None and columnar(flat):
                packed = _pack_list(flat, 2, screen)  # its list, and ``flat``
                if packed is not flat:
                    screen.check(values, 2)  # the lists: their record, and ``values``
                    lengths = np.fromiter(map(len, values), np.int64, len(values))
                    return ("lists",), (packed, lengths)
        return ("py",), values
    finally:
        screen.nesting -= 1


def _lists(column: tuple[list[Any], np.ndarray[Any, Any]]) -> list[list[Any]]:
    """The lists of a field of lists of records (see ``_nested``), from all their records."""
    flat, lengths = column
    ends = np.cumsum(lengths).tolist()
    return [flat[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]


class Batch:
    """A run of records with one structure, pickled as columns.

    ``held``: the references to each record packing knows of (``records`` among them);
    what ``screen`` is told of records and values held by anything else.
    """

    def __init__(
        self,
        records: list[Any],
        structure: tuple[type, tuple[Any, ...]],
        held: int,
        screen: _Screen,
    ) -> None:
        self.cls, self.names = structure
        self.count = len(records)
        self.kinds: list[columns.Kind] = []
        self.columns: list[Any] = []
        plain = 0
        for name in self.names:
            if self.cls is dict or self.cls is tuple:
                values = list(map(operator.itemgetter(name), records))
            else:
                values = [r.__dict__[name] for r in records]
            # the references each array may have: its record, and ``values``
            counts = _references(values) if type(values[0]) in _ARRAYS else None
            once = counts is not None and _once(counts, 2)
            packed = columns.joined(values, once)
            if packed is not None:
                screen.check(values, 2, counts)
            else:
                packed = _nested(values, screen)
                plain += packed[1] is values
            self.kinds.append(packed[0])
            self.columns.append(packed[1])
        #: Whether columns pay: pickle writes and reads dicts and tuples of numbers,
        #: strings and other plain values faster than their columns, so a run of them is
        #: a batch only when some field joins (arrays, tensors, records, lists of records).
        #: Dataclasses always pay: pickle reduces each through Python calls.
        self.pays = plain < len(self.names) or self.cls not in (dict, tuple)
        if self.pays:
            screen.check(records, held)

    def __reduce__(self) -> tuple[Callable[..., list[Any]], tuple[Any, ...]]:
        return (_unbatch, (self.cls, self.names, self.kinds, self.count, self.columns))


def _field(kind: columns.Kind, count: int, column: Any) -> list[Any]:
    """The ``count`` values of a field of a batch, from its column."""
    if kind[0] == "py":
        values: list[Any] = listed(column)
        return values
    if kind[0] == "lists":
        return _lists((listed(column[0]), column[1]))
    return columns.rebuilt(kind, count, column)


_instance_dict = operator.attrgetter("__dict__")


def _unbatch(
    cls: type, names: tuple[Any, ...], kinds: list[columns.Kind], count: int, data: list[Any]
) -> list[Any]:
    values = [_field(kind, count, column) for kind, column in zip(kinds, data, strict=True)]
    if any(len(field) != count for field in values):
        raise ValueError(f"a batch of {count} records has a field of another length")
    if cls is tuple:
        return list(zip(*values, strict=True))
    # Filled a field at a time: a copy of one template dict per record, its values then
    # replaced, is faster than a dict built from each record's pairs (measured: 0.6
    # against 0.85 us a record of five fields), which hashes and inserts every key.
    if cls is dict:
        out = targets = list(map(dict.copy, repeat(dict.fromkeys(names), count)))
    else:
        out = list(map(object.__new__, repeat(cls, count)))
        targets = list(map(_instance_dict, out))
    for name, field in zip(names, values, strict=True):
        deque(map(operator.setitem, targets, repeat(name), field), maxlen=0)
    return out


#: What a batch's pickle calls to rebuild its records; stored parts name it: keep its name.
REBUILD = _unbatch


class Columns:
    """A batch loaded as its columns, its records not rebuilt (``as_columns``):
    what reads a field at a time (an export to Arrow) takes the columns as they are,
    without a record made per row."""

    def __init__(
        self,
        cls: type,
        names: tuple[Any, ...],
        kinds: list[columns.Kind],
        count: int,
        data: list[Any],
    ) -> None:
        self.cls, self.names, self.kinds, self.count, self.data = cls, names, kinds, count, data
        self.cache: dict[Any, list[Any]] = {}
        #: Called the first time its records are rebuilt (a load that counts batches).
        self.on_rows: Callable[[], None] | None = None
        #: Its columns that are batches loaded as columns themselves.
        self.inner = [
            inner
            for kind, column in zip(kinds, data, strict=True)
            if type(inner := column[0] if kind[0] == "lists" else column) is Columns
        ]

    def __len__(self) -> int:
        return self.count

    def rows(self) -> list[Any]:
        """The records, rebuilt as a plain load rebuilds them."""
        if self.on_rows is not None:
            self.on_rows()
            self.on_rows = None
        return _unbatch(self.cls, self.names, self.kinds, self.count, self.data)

    def field(self, name: Any) -> list[Any]:
        """The ``count`` values of the field ``name`` (rebuilt once: the list is kept)."""
        if name not in self.cache:
            i = self.names.index(name)
            self.cache[name] = _field(self.kinds[i], self.count, self.data[i])
        return self.cache[name]

    def stacked(self, name: Any) -> np.ndarray[Any, Any] | None:
        """The field ``name`` as one array of ``count`` rows, a view of its column, when
        its values are arrays or tensors of one shape copied into one region; else None."""
        i = self.names.index(name)
        return columns.stacked(self.kinds[i], self.count, self.data[i])


def listed(value: Any) -> Any:
    """``value``, a batch loaded as :class:`Columns` rebuilt as its records."""
    return value.rows() if type(value) is Columns else value


class _Arrays:
    """A list of arrays or tensors packed into one column; unpickles to the list."""

    def __init__(self, kind: columns.Kind, count: int, column: Any) -> None:
        self.kind, self.count, self.column = kind, count, column

    def __reduce__(self) -> tuple[Callable[..., list[Any]], tuple[Any, ...]]:
        return (columns.rebuilt, (self.kind, self.count, self.column))


_ARRAYS = (np.ndarray, torch.Tensor)


def columnar(obj: list[Any] | dict[Any, Any]) -> bool:
    """Whether ``pack`` may turn ``obj`` (a list, or a long dict's values) into columns: a
    run of same-shaped records, or of arrays or tensors (judged by its first and last)."""
    if type(obj) is dict:
        if len(obj) < _SCAN_LEN:
            return False
        values = obj.values()
        first, last = next(iter(values)), next(reversed(values))
    else:
        if len(obj) < MIN_RUN:
            return False
        first, last = obj[0], obj[-1]
    if type(first) in _ARRAYS:
        return type(last) is type(first)
    shape = structure(first)
    return shape is not None and shape == structure(last)


class _Chunks:
    """A list split into plain runs and batches; unpickles to the original list."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks

    def __reduce__(self) -> tuple[Callable[..., list[Any]], tuple[Any, ...]]:
        return (_concat, (self.chunks,))


def _concat(chunks: list[Any]) -> list[Any]:
    out: list[Any] = []
    for chunk in chunks:
        out.extend(listed(chunk))
    return out


class _Keyed:
    """A long dict whose values were packed; unpickles to the dict."""

    def __init__(self, keys: list[Any], values: Any) -> None:
        self.keys, self.values = keys, values

    def __reduce__(self) -> tuple[Callable[..., dict[Any, Any]], tuple[Any, ...]]:
        return (_keyed, (self.keys, self.values))


def _keyed(keys: list[Any], values: list[Any]) -> dict[Any, Any]:
    return dict(zip(keys, values, strict=True))


def _pack_arrays(items: list[Any], held: int, screen: _Screen) -> Any:
    """``items``, arrays or tensors, as one column when they join (see
    ``gatherstore.codec.columns``)."""
    counts = _references(items)
    packed = columns.joined(items, _once(counts, held))
    if packed is None:
        return items
    screen.check(items, held, counts)
    return _Arrays(packed[0], len(items), packed[1])


def _packable(run: list[Any], depth: int = 0) -> bool:
    """Whether the first or last record of ``run`` is a dataclass, or holds a value that
    packs: an array or tensor, or (a few levels deep) a record or a list of records that
    holds one.  Without one, the run is no batch (see ``Batch.pays``), and is not made
    one to find that out."""
    for record in (run[0], run[-1]):
        if type(record) is not dict and type(record) is not tuple:
            return True  # a dataclass (see ``Batch.pays``)
        for value in record.values() if type(record) is dict else record:
            if type(value) in _ARRAYS:
                return True
            if depth >= _SCAN_DEPTH:
                continue
            inner = [value] if structure(value) is not None else value
            records = type(inner) is list and inner and structure(inner[0]) is not None
            if records and _packable(inner, depth + 1):
                return True
    return False


def _pack_list(items: list[Any], held: int, screen: _Screen) -> Any:
    """``items`` as batches and plain runs, or ``items`` itself when nothing batches;
    ``held``: the references to each item packing knows of (``items`` among them)."""
    kinds = set(map(type, items))
    if len(kinds) == 1 and type(items[0]) in _ARRAYS:
        return _pack_arrays(items, held, screen)
    if kinds.isdisjoint((dict, tuple)) and all(not _plain_fields(k) for k in kinds):
        return items  # no records
    if kinds == {dict}:  # the usual list of dicts: one run when they share their keys
        names = list(map(tuple, items))
        first = names[0]
        if first and _named(first) and names.count(first) == len(names):  # one run
            if not _packable(items):
                return items
            if columns.distinct(items):
                whole = Batch(items, (dict, first), held, screen)
                return whole if whole.pays else items
    if kinds == {tuple}:  # and of tuples: one run when they have one length
        lengths = set(map(len, items))
        if len(lengths) != 1 or not _packable(items) or not columns.distinct(items):
            return items
        whole = Batch(items, (tuple, _positions(lengths.pop())), held, screen)
        return whole if whole.pays else items
    signatures = [structure(item) for item in items]
    chunks: list[Any] = []
    start = 0
    batched = False
    while start < len(items):
        end = start + 1
        while end < len(items) and signatures[end] == signatures[start]:
            end += 1
        signature = signatures[start]
        run = items[start:end]
        batch: Batch | None = None
        if (
            signature is not None
            and end - start >= MIN_RUN
            and _packable(run)
            and columns.distinct(run)
        ):
            batch = Batch(run, signature, held + 1, screen)  # and ``run``
        if batch is not None and batch.pays:
            chunks.append(batch)
            batched = True
        elif chunks and type(chunks[-1]) is list:
            chunks[-1].extend(run)
        else:
            chunks.append(run)
        start = end
    if not batched:
        return items
    return chunks[0] if len(chunks) == 1 else _Chunks(chunks)


@dataclasses.dataclass
class Packed:
    """What :func:`pack` made of an object."""

    #: The object with its lists of records (and long dicts' values) as batches.
    value: Any
    #: Records, arrays and containers that packing replaced and that something besides
    #: their container may also hold (the object itself among them, when replaced):
    #: should the pickler meet one of them elsewhere in the object, it would be rebuilt
    #: twice, no longer one object.
    shared: list[Any]
    #: Whether packing replaced one object in two places (say a record held by two
    #: fields): ``value`` would rebuild it twice, so the object is pickled as it is.
    twice: bool = False


class _Cycle(Exception):
    """A container holds itself: the object is pickled as it is."""


class _Packer:
    """One :func:`pack`: what each container became (a container met twice is packed
    once), the containers being searched, and what was replaced (see ``_Screen``)."""

    def __init__(self, held: int) -> None:
        self.held = held  # the references packing knows of to the top container's items
        self.done: dict[int, Any] = {}
        self.open: set[int] = set()
        self.screen = _Screen()
        #: Containers replaced below the top (screened once packing is over).
        self.replaced: list[Any] = []

    def pack(self, obj: Any, depth: int) -> Any:
        kind = type(obj)
        if kind is not list and kind is not tuple and kind is not dict:
            return obj
        key = id(obj)
        if key in self.done:
            return self.done[key]
        if key in self.open:
            raise _Cycle
        self.open.add(key)
        try:
            packed = self._packed(obj, depth)
        finally:
            self.open.discard(key)
        if packed is not obj and depth:
            self.replaced.append(obj)
        self.done[key] = packed
        return packed

    def _packed(self, obj: Any, depth: int) -> Any:
        kind = type(obj)
        held = self.held if depth == 0 else 1  # the references to the container's items
        if kind is list and len(obj) >= MIN_RUN:
            packed = _pack_list(obj, held, self.screen)
            if packed is not obj:
                return packed
        if kind is dict and len(obj) >= _SCAN_LEN:
            values = list(obj.values())
            packed = _pack_list(values, held + 1, self.screen)  # and ``values``
            if packed is not values:
                return _Keyed(list(obj), packed)
        if depth >= _SCAN_DEPTH or len(obj) >= _SCAN_LEN:
            return obj
        if kind is dict:
            found = {k: self.pack(v, depth + 1) for k, v in obj.items()}
            changed = any(found[k] is not v for k, v in obj.items())
            return _Rebuilt(dict, found) if changed else obj
        items = [self.pack(v, depth + 1) for v in obj]
        return _Rebuilt(kind, items) if any(map(operator.is_not, items, obj)) else obj


def pack(obj: Any, held: int = 1) -> Packed:
    """``obj`` with its lists of records (and long dicts' values) replaced by batches.

    Only exact ``list``/``tuple``/``dict`` containers are searched (short ones,
    a few levels deep); nothing else is touched.  ``held``: the references packing may
    take for granted to the items of ``obj`` when it is a list or a dict (2 for a slice
    of one: the slice and the whole).
    """
    _plain_fields.cache_clear()  # a class may have gained a pickling hook since the last
    packer = _Packer(held)
    try:
        value = packer.pack(obj, 0)
    except _Cycle:
        return Packed(obj, [])
    screen = packer.screen
    screen.check(packer.replaced, 2)  # its container, and ``replaced``
    if value is not obj:  # a record may hold the very list or dict it is in
        screen.shared[id(obj)] = obj
    return Packed(value, list(screen.shared.values()), screen.twice)


class _Rebuilt:
    """A small container some of whose items were packed; unpickles to ``kind``."""

    def __init__(self, kind: type, items: Any) -> None:
        self.kind, self.items = kind, items

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.kind, (self.items,))
