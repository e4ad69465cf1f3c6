"""Record batches: runs of same-shaped records packed into columns before pickling.

Evaluation results are long lists of small records (a dict per image holding a
few arrays and scalars).  Pickling them object by object runs at well under
0.1 GB/s.  Before pickling, every run of records with the same structure —
dicts with the same keys in the same order, instances of one plain dataclass, or
tuples of one length (``(image_id, logits)``) — becomes a :class:`Batch`: one
column per field (or position); array/tensor fields that share dtype and trailing
shape are packed.  Small array columns are
written as a single out-of-band region (each distinct array once, however many
records hold it), with the first-dimension lengths kept for ragged fields;
other fields become plain Python lists, which pickle fast, and whose large
arrays and tensors travel as storage spans (see ``_storage``: no copy, each
storage once).  On load the records are rebuilt with array fields as views
into the part.

A dataclass is batched only when pickle would rebuild it the same way: one
that defines its own pickling (``__reduce__``, ``__reduce_ex__``,
``__getstate__``, ``__setstate__``, a ``copyreg`` reducer) or whose
``__dict__`` differs from its fields is pickled as it says.  A run in which one
record object appears twice is pickled plainly too, so that it stays one object.

A list of small arrays (or of small CPU tensors) of one dtype and trailing shape,
say a logits vector per sample, is one such column by itself: one copy into one
region instead of a span or an in-band pickle each, rebuilt as views of it.
Larger views that share a few storages (the rows of batch tensors, in a list or a
field of records) are never copied: they become a column of views, one tensor per
storage covering them (a span, merged with whatever else shares that memory) and
each view's offset into it.

A long dict (``{image_id: record}``, ``{name: tensor}``) packs its values as such a
list, and its keys travel as a plain list beside them.

Packing keeps pickle's identities: a container met twice is packed once, and packing
stops at a cycle.  Records and array values that something besides their container
holds are reported (see :class:`Packed`): the pickler may meet them elsewhere in the
object, where they would be rebuilt a second time, so ``_serialize`` then pickles the
object plainly.

Lists that are not homogeneous fall back to plain pickling per run of records;
this is never a user-visible format choice.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import operator
import sys
from collections.abc import Callable
from itertools import repeat
from typing import Any

import numpy as np
import torch

from . import _storage as storage

__all__ = ["Batch", "Column", "Packed", "columnar", "pack", "structure"]

#: Shortest run of records worth a batch.
MIN_RUN = 8
#: Containers shorter than this are searched for lists of records (depth-limited).
_SCAN_LEN = 64
_SCAN_DEPTH = 4
#: Fields whose arrays average this many bytes or more are not copied into a column:
#: they travel as storage spans, straight from their memory; so do those whose arrays
#: are views (of one batch, of each other) from :data:`VIEW_VALUE` bytes on, so that
#: memory they share travels once.
LARGE_VALUE = 64 << 10
VIEW_VALUE = 4 << 10
#: Values of a column looked at to choose how it travels.
_SAMPLE = 16
_PROTOCOL = ("__reduce__", "__reduce_ex__", "__getstate__", "__setstate__")
# a column's looks at its values are passes in C (map), not Python loops over thousands
_dtype, _ndim = operator.attrgetter("dtype"), operator.attrgetter("ndim")


Kind = tuple[Any, ...]


class Column:
    """An out-of-band region made of segments written back to back."""

    __slots__ = ("nbytes", "segments")

    def __init__(self, segments: list[memoryview]) -> None:
        self.segments = segments
        self.nbytes = sum(s.nbytes for s in segments)


def structure(record: Any) -> tuple[type, tuple[Any, ...]] | None:
    """(record type, field names) of a dict or plain dataclass instance, or (tuple, its
    positions) of a non-empty tuple; else None."""
    kind = type(record)
    if kind is dict:
        return (dict, tuple(record))
    if kind is tuple:
        return (tuple, _positions(len(record))) if record else None
    names = _plain_fields(kind)  # type: ignore[arg-type]
    if names is not None and tuple(getattr(record, "__dict__", ())) == names:
        return (kind, names)
    return None


@functools.lru_cache(maxsize=64)
def _positions(length: int) -> tuple[int, ...]:
    return tuple(range(length))


@functools.lru_cache(maxsize=256)
def _plain_fields(kind: type) -> tuple[str, ...] | None:
    """The field names of a dataclass that pickle rebuilds from its ``__dict__`` alone
    (no pickling protocol of its own), else None."""
    if not dataclasses.is_dataclass(kind) or kind in copyreg.dispatch_table:
        return None
    if any(getattr(kind, name, None) is not getattr(object, name, None) for name in _PROTOCOL):
        return None
    return tuple(f.name for f in dataclasses.fields(kind))


def _unique(values: list[Any]) -> tuple[list[Any], np.ndarray[Any, Any] | None]:
    """The distinct objects of ``values`` (by identity, first seen first) and, when some
    repeat, each value's position among them."""
    if _distinct(values):
        return values, None
    first: dict[int, int] = {}
    for value in values:
        first.setdefault(id(value), len(first))
    distinct = list({id(v): v for v in values}.values())
    return distinct, np.fromiter(map(first.__getitem__, map(id, values)), np.int64, len(values))


def _joinable(values: list[Any], nbytes: Callable[[Any], int], view: Callable[[Any], bool]) -> bool:
    """Whether a column's arrays are copied into one region (see :data:`LARGE_VALUE`),
    judged by a sample of them (evenly spaced: the cost stays flat in the column's length)."""
    sample = values[:: max(len(values) // _SAMPLE, 1)]
    average = sum(map(nbytes, sample)) / max(len(sample), 1)
    return average < VIEW_VALUE or (average < LARGE_VALUE and not any(map(view, sample)))


def _numpy_column(values: list[Any]) -> tuple[Kind, Any] | None:
    """One raw-bytes column for small arrays of one plain dtype and trailing shape, else None."""
    if type(values[0]) is not np.ndarray or set(map(type, values)) != {np.ndarray}:
        return None
    dtypes = set(map(_dtype, values))
    ndims = set(map(_ndim, values))
    if len(dtypes) != 1 or len(ndims) != 1:
        return None
    (dtype,), (ndim,) = dtypes, ndims
    if dtype.hasobject or dtype.fields is not None:
        return None
    if not _joinable(values, _array_bytes, _array_view):
        return None
    values, positions = _unique(values)
    try:
        joined = np.stack(values) if ndim == 0 else np.concatenate(values)
    except ValueError:  # trailing shapes differ
        return None
    if joined.dtype != dtype:  # numpy joins in native byte order; keep the original
        joined = joined.astype(dtype)
    lengths = None if ndim == 0 else np.fromiter(map(len, values), np.int64, len(values))
    column = Column([joined.reshape(-1).view(np.uint8).data])
    kind = ("np", dtype.str, joined.shape[1:], ndim == 0)
    return kind, (column, _compact(lengths), positions)


def _array_bytes(value: Any) -> int:
    return int(value.nbytes)


def _array_view(value: Any) -> bool:
    return value.base is not None


def _tensor_bytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


def _tensor_view(value: torch.Tensor) -> bool:
    return value._base is not None


def _tensor_column(values: list[Any]) -> tuple[Kind, Any] | None:
    """One column for small dense CPU tensors of one dtype and trailing shape, else None
    (CUDA tensors travel as storage spans: no copy on the device, one staging)."""
    if not all(type(v) is torch.Tensor for v in values):
        return None
    if not all(v.layout == torch.strided and not v.is_quantized for v in values):
        return None
    dtypes = {v.dtype for v in values}
    ndims = {v.dim() for v in values}
    devices = {v.device.type for v in values}
    if len(dtypes) != 1 or len(ndims) != 1 or devices != {"cpu"}:
        return None
    (dtype,), (ndim,) = dtypes, ndims
    if not _joinable(values, _tensor_bytes, _tensor_view):
        return None
    values, positions = _unique(values)
    detached = [v.detach() for v in values]
    try:
        joined = torch.stack(detached) if ndim == 0 else torch.cat(detached)
    except RuntimeError:  # trailing shapes differ
        return None
    lengths = None if ndim == 0 else np.fromiter(map(len, values), np.int64, len(values))
    flat = joined.resolve_conj().resolve_neg().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    kind = ("pt", str(dtype).removeprefix("torch."), tuple(joined.shape[1:]), ndim == 0)
    return kind, (Column([raw.data]), _compact(lengths), positions)


#: Views of a few storages make a column of views when they are at least this many per
#: storage (rows of batch tensors); fewer, each travels as a span of its own.
_VIEWS_PER_STORAGE = 4
_data_ptr, _storage_offset = (
    operator.methodcaller("data_ptr"),
    operator.methodcaller("storage_offset"),
)


def _view_column(values: list[Any]) -> tuple[Kind, Any] | None:
    """A column of CPU tensor views of one dtype, shape and strides that share a few
    storages (the rows of batch tensors), else None: per storage, one tensor covering its
    views (pickled as a span, so memory that other objects share still travels once),
    and each view's place in it.  Rebuilt as views of those tensors, without a span, and
    its Python work, per view."""
    first = values[0]
    if not all(type(v) is torch.Tensor for v in values) or first.device.type != "cpu":
        return None
    if first.layout != torch.strided or first.is_quantized or first.numel() == 0:
        return None
    shape, stride, dtype = first.shape, first.stride(), first.dtype
    if any(v.shape != shape or v.stride() != stride or v.dtype != dtype for v in values):
        return None
    if any(v.device != first.device or v.is_conj() or v.is_neg() for v in values):
        return None
    values, positions = _unique(values)
    count = len(values)
    offsets = np.fromiter(map(_storage_offset, values), np.int64, count)
    starts = np.fromiter(map(_data_ptr, values), np.int64, count) - offsets * first.element_size()
    _, firsts, groups = np.unique(starts, return_index=True, return_inverse=True)
    if len(firsts) * _VIEWS_PER_STORAGE > count:
        return None
    low = np.full(len(firsts), np.iinfo(np.int64).max, np.int64)
    high = np.zeros(len(firsts), np.int64)
    np.minimum.at(low, groups, offsets)
    np.maximum.at(high, groups, offsets)
    extent = storage.elements_spanned(shape, stride)
    sizes = (high - low + extent).tolist()
    covers = [
        torch.empty(0, dtype=dtype).set_(values[i].untyped_storage(), start, (size,), (1,))
        for i, start, size in zip(firsts.tolist(), low.tolist(), sizes, strict=True)
    ]
    kind = ("vt", str(dtype).removeprefix("torch."), tuple(shape), tuple(stride))
    return kind, (covers, groups.astype(np.int64), offsets - low[groups], positions)


_base, _strides = operator.attrgetter("base"), operator.attrgetter("strides")


def _address(array: np.ndarray[Any, Any]) -> int:
    return int(array.__array_interface__["data"][0])


def _array_view_column(values: list[Any]) -> tuple[Kind, Any] | None:
    """The numpy twin of ``_view_column``: views of one dtype, shape and strides that share
    a few base arrays (the rows of batches), as one array per base covering its views (a
    span) and each view's byte offset into it; else None."""
    first = values[0]
    if not all(type(v) is np.ndarray for v in values) or first.dtype.hasobject or not first.size:
        return None
    shape, strides, dtype = first.shape, first.strides, first.dtype
    if any(s < 0 or s % dtype.itemsize for s in strides):
        return None
    if any(map(operator.is_, map(_base, values), repeat(None))):  # not views
        return None
    if set(map(_strides, values)) != {strides} or {v.shape for v in values} != {shape}:
        return None
    if {v.dtype for v in values} != {dtype}:
        return None
    values, positions = _unique(values)
    count = len(values)
    bases = np.fromiter(map(id, map(_base, values)), np.int64, count)
    _, firsts, groups = np.unique(bases, return_index=True, return_inverse=True)
    if len(firsts) * _VIEWS_PER_STORAGE > count:
        return None
    addresses = np.fromiter(map(_address, values), np.int64, count)
    order = np.lexsort((addresses, groups))  # by base, then by address
    lowest = order[np.unique(groups[order], return_index=True)[1]]
    high = np.zeros(len(firsts), np.int64)
    np.maximum.at(high, groups, addresses)
    low = addresses[lowest]
    extent = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + dtype.itemsize
    covers = [
        np.lib.stride_tricks.as_strided(
            values[i], shape=((top - bottom + extent) // dtype.itemsize,), strides=(dtype.itemsize,)
        )
        for i, bottom, top in zip(lowest.tolist(), low.tolist(), high.tolist(), strict=True)
    ]
    kind = ("vn", dtype.str, tuple(shape), tuple(strides))
    return kind, (covers, groups.astype(np.int64), addresses - low[groups], positions)


def _joined(values: list[Any]) -> tuple[Kind, Any] | None:
    """``values`` (a field of records, or a list's items) as one column, else None."""
    return (
        _numpy_column(values)
        or _tensor_column(values)
        or _view_column(values)
        or _array_view_column(values)
    )


def _compact(lengths: np.ndarray | None) -> Any:
    """None (0-d), an int (all equal) or the lengths array."""
    if lengths is None:
        return None
    if len(lengths) and (lengths == lengths[0]).all():
        return int(lengths[0])
    return lengths


def _screen(values: list[Any], held: int, shared: list[Any]) -> None:
    """Add to ``shared`` the objects of ``values`` that something holds besides the
    ``held`` references packing knows of (``values`` itself among them)."""
    counts = np.fromiter(map(sys.getrefcount, values), np.int64, len(values))
    shared.extend(values[i] for i in np.flatnonzero(counts > held + 1).tolist())


class Batch:
    """A run of records with one structure, pickled as columns.

    ``held``: the references to each record packing knows of (``records`` among them);
    records and array values held by anything else are added to ``shared``.
    """

    def __init__(
        self,
        records: list[Any],
        structure: tuple[type, tuple[Any, ...]],
        held: int = 1,
        shared: list[Any] | None = None,
    ) -> None:
        self.cls, self.names = structure
        self.count = len(records)
        self.kinds: list[Kind] = []
        self.columns: list[Any] = []
        shared = [] if shared is None else shared
        joined = False
        for name in self.names:
            if self.cls is dict or self.cls is tuple:
                values = list(map(operator.itemgetter(name), records))
            else:
                values = [r.__dict__[name] for r in records]
            packed = _joined(values)
            if packed is not None:
                _screen(values, 2, shared)  # its record, and ``values``
                joined = True
            kind, column = packed if packed is not None else (("py",), values)
            self.kinds.append(kind)
            self.columns.append(column)
        #: Whether columns pay: pickle writes tuples as fast as columns of their values,
        #: so a run of tuples is a batch only when arrays or tensors join in a column.
        self.pays = joined or self.cls is not tuple
        if self.pays:
            _screen(records, held, shared)

    def __reduce__(self) -> tuple[Callable[..., list[Any]], tuple[Any, ...]]:
        return (_unbatch, (self.cls, self.names, self.kinds, self.count, self.columns))


def _rows(count: int, lengths: Any) -> int:
    """Total first-dimension length of a column."""
    return count * lengths if isinstance(lengths, int) else int(np.sum(lengths))


def _numpy_values(
    buf: memoryview, dtype: str, trailing: tuple[int, ...], zero_d: bool, count: int, lengths: Any
) -> list[Any]:
    base = np.frombuffer(buf, dtype=np.dtype(dtype))
    if zero_d:
        return [base[i, ...] for i in range(count)]
    base = base.reshape((_rows(count, lengths), *trailing))
    if isinstance(lengths, int):
        return list(base.reshape((count, lengths, *trailing)))
    return np.split(base, np.cumsum(lengths)[:-1])


def _tensor_values(
    buf: memoryview, dtype: str, trailing: tuple[int, ...], zero_d: bool, count: int, lengths: Any
) -> list[Any]:
    kind = getattr(torch, dtype)
    if len(buf) == 0:
        base = torch.empty(0, dtype=kind)
    elif buf.readonly:  # torch cannot honour read-only memory: copy once
        base = torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(kind)
    else:
        base = torch.frombuffer(buf, dtype=torch.uint8).view(kind)
    if zero_d:
        return list(base.unbind(0))
    base = base.reshape((_rows(count, lengths), *trailing))
    if isinstance(lengths, int):
        return list(base.reshape((count, lengths, *trailing)).unbind(0))
    return list(torch.split(base, [int(n) for n in lengths]))


def _view_values(kind: Kind, column: Any) -> list[Any]:
    """The tensors of a column of views (see ``_view_column``), as views again."""
    covers, groups, offsets, positions = column
    _, _, shape, stride = kind
    starts = [cover.storage_offset() for cover in covers]
    found = [
        covers[g].as_strided(shape, stride, starts[g] + offset)
        for g, offset in zip(groups.tolist(), offsets.tolist(), strict=True)
    ]
    return found if positions is None else [found[i] for i in positions]


def _array_view_values(kind: Kind, column: Any) -> list[Any]:
    """The arrays of a column of numpy views (see ``_array_view_column``), as views again."""
    covers, groups, offsets, positions = column
    _, dtype, shape, strides = kind
    found = [
        np.ndarray(shape, np.dtype(dtype), buffer=covers[g], offset=offset, strides=strides)
        for g, offset in zip(groups.tolist(), offsets.tolist(), strict=True)
    ]
    return found if positions is None else [found[i] for i in positions]


def _column_values(kind: Kind, count: int, column: Any) -> list[Any]:
    """The ``count`` arrays or tensors of an array column, as views of its region (or of
    the arrays and tensors a column of views covers)."""
    if kind[0] == "vt":
        return _view_values(kind, column)
    if kind[0] == "vn":
        return _array_view_values(kind, column)
    buf, lengths, positions = column
    rebuild = _numpy_values if kind[0] == "np" else _tensor_values
    distinct = count if positions is None else int(positions.max(initial=-1)) + 1
    found = rebuild(buf, kind[1], tuple(kind[2]), kind[3], distinct, lengths)
    return found if positions is None else [found[i] for i in positions]


def _unbatch(
    cls: type, names: tuple[Any, ...], kinds: list[Kind], count: int, columns: list[Any]
) -> list[Any]:
    values = [
        column if kind[0] == "py" else _column_values(kind, count, column)
        for kind, column in zip(kinds, columns, strict=True)
    ]
    if cls is dict:
        return list(map(dict, map(zip, repeat(names), zip(*values, strict=True))))
    if cls is tuple:
        return list(zip(*values, strict=True))
    out = []
    for row in zip(*values, strict=True):
        obj: Any = object.__new__(cls)
        obj.__dict__.update(zip(names, row, strict=True))
        out.append(obj)
    return out


class _Arrays:
    """A list of arrays or tensors packed into one column; unpickles to the list."""

    def __init__(self, kind: Kind, count: int, column: Any) -> None:
        self.kind, self.count, self.column = kind, count, column

    def __reduce__(self) -> tuple[Callable[..., list[Any]], tuple[Any, ...]]:
        return (_column_values, (self.kind, self.count, self.column))


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
        out.extend(chunk)
    return out


class _Keyed:
    """A long dict whose values were packed; unpickles to the dict."""

    def __init__(self, keys: list[Any], values: Any) -> None:
        self.keys, self.values = keys, values

    def __reduce__(self) -> tuple[Callable[..., dict[Any, Any]], tuple[Any, ...]]:
        return (_keyed, (self.keys, self.values))


def _keyed(keys: list[Any], values: list[Any]) -> dict[Any, Any]:
    return dict(zip(keys, values, strict=True))


def _distinct(items: list[Any]) -> bool:
    """Whether no object appears twice in ``items`` (8 bytes an item, not a set's ~60)."""
    ids = np.fromiter(map(id, items), np.int64, len(items))
    ids.sort()
    return not (ids[1:] == ids[:-1]).any()


def _pack_arrays(items: list[Any], held: int, shared: list[Any]) -> Any:
    """``items``, arrays or tensors, as one column when they join (see ``_numpy_column``)."""
    packed = _joined(items)
    if packed is None:
        return items
    _screen(items, held, shared)
    return _Arrays(packed[0], len(items), packed[1])


def _arrays_in(record: tuple[Any, ...]) -> bool:
    """Whether a tuple holds an array or tensor (without one, its run is no batch: see
    ``Batch.pays``)."""
    return any(type(value) in _ARRAYS for value in record)


def _pack_list(items: list[Any], held: int, shared: list[Any]) -> Any:
    """``items`` as batches and plain runs, or ``items`` itself when nothing batches;
    ``held``: the references to each item packing knows of (``items`` among them)."""
    kinds = set(map(type, items))
    if len(kinds) == 1 and type(items[0]) in _ARRAYS:
        return _pack_arrays(items, held, shared)
    if kinds.isdisjoint((dict, tuple)) and all(_plain_fields(k) is None for k in kinds):
        return items  # no records
    if kinds == {dict}:  # the usual list of dicts: one run when they share their keys
        names = list(map(tuple, items))
        if names.count(names[0]) == len(names) and _distinct(items):
            return Batch(items, (dict, names[0]), held, shared)
    if kinds == {tuple}:  # and of tuples: one run when they have one length
        lengths = set(map(len, items))
        if len(lengths) != 1 or not _arrays_in(items[0]) or not _distinct(items):
            return items
        whole = Batch(items, (tuple, _positions(lengths.pop())), held, shared)
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
            and (signature[0] is not tuple or _arrays_in(run[0]))
            and _distinct(run)
        ):
            batch = Batch(run, signature, held + 1, shared)  # and ``run``
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
    #: their container also holds: should the pickler meet one of them elsewhere in the
    #: object, it would be rebuilt twice, no longer one object.
    shared: list[Any]


class _Cycle(Exception):
    """A container holds itself: the object is pickled as it is."""


class _Packer:
    """One :func:`pack`: what each container became (a container met twice is packed
    once), the containers being searched, and the replaced objects held elsewhere."""

    def __init__(self) -> None:
        self.done: dict[int, Any] = {}
        self.open: set[int] = set()
        self.shared: list[Any] = []
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
        if kind is list and len(obj) >= MIN_RUN:
            packed = _pack_list(obj, 1, self.shared)
            if packed is not obj:
                return packed
        if kind is dict and len(obj) >= _SCAN_LEN:
            values = list(obj.values())
            packed = _pack_list(values, 2, self.shared)  # the dict and ``values``
            return obj if packed is values else _Keyed(list(obj), packed)
        if depth >= _SCAN_DEPTH or len(obj) >= _SCAN_LEN:
            return obj
        if kind is dict:
            found = {k: self.pack(v, depth + 1) for k, v in obj.items()}
            changed = any(found[k] is not v for k, v in obj.items())
            return _Rebuilt(dict, found) if changed else obj
        items = [self.pack(v, depth + 1) for v in obj]
        return _Rebuilt(kind, items) if any(map(operator.is_not, items, obj)) else obj


def pack(obj: Any) -> Packed:
    """``obj`` with its lists of records (and long dicts' values) replaced by batches.

    Only exact ``list``/``tuple``/``dict`` containers are searched (short ones,
    a few levels deep); nothing else is touched.
    """
    packer = _Packer()
    try:
        value = packer.pack(obj, 0)
    except _Cycle:
        return Packed(obj, [])
    _screen(packer.replaced, 2, packer.shared)  # its container, and ``replaced``
    return Packed(value, packer.shared)


class _Rebuilt:
    """A small container some of whose items were packed; unpickles to ``kind``."""

    def __init__(self, kind: type, items: Any) -> None:
        self.kind, self.items = kind, items

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.kind, (self.items,))
