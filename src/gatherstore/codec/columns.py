"""Array columns: many arrays or tensors as one region, or as views of the storages they share.

A field of records, or a list's items, that holds arrays or tensors of one kind
travels as one column (see :mod:`gatherstore.codec.records`):

- small arrays or CPU tensors of one dtype and trailing shape are copied into one
  region (each distinct array once, however many places hold it), with the
  first-dimension lengths kept for ragged ones, and rebuilt as views of it;
- views of 4 KiB or more that share a few storages (the rows of batches, torch or
  numpy) are never copied: per storage, one array or tensor covering its views
  travels as a storage span (see :mod:`gatherstore.codec.storage`: memory that other
  objects share still travels once), with each view's offset into it, and each is
  rebuilt as a view of it again;
- anything else (large arrays, mixed dtypes or shapes, CUDA tensors) is no column.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from itertools import repeat
from typing import Any

import numpy as np
import torch

from gatherstore.codec import storage

__all__ = [
    "LARGE_VALUE",
    "VIEW_VALUE",
    "Column",
    "Kind",
    "distinct",
    "joined",
    "rebuilt",
    "stacked",
]

#: Fields whose arrays average this many bytes or more are not copied into a column:
#: they travel as storage spans, straight from their memory; so do those whose arrays
#: are views (of one batch, of each other) from :data:`VIEW_VALUE` bytes on, so that
#: memory they share travels once.
LARGE_VALUE = 64 << 10
VIEW_VALUE = 4 << 10
#: Values of a column looked at to choose how it travels.
_SAMPLE = 16
# a column's looks at its values are passes in C (map), not Python loops over thousands
_dtype, _shape = operator.attrgetter("dtype"), operator.attrgetter("shape")


Kind = tuple[Any, ...]


class Column:
    """An out-of-band region: the bytes of ``pieces`` back to back, ``nbytes`` of them.

    A column of small numpy arrays keeps the arrays themselves as its pieces, not yet
    joined: a part written into a file takes their bytes straight from them (see
    ``gatherstore.codec.frames.Frame.seal_into``), one copy instead of two; anything else asks for
    :attr:`segments`, which joins them once.
    """

    __slots__ = ("nbytes", "pieces")

    def __init__(self, pieces: list[Any], nbytes: int | None = None) -> None:
        self.pieces = pieces
        self.nbytes = sum(p.nbytes for p in pieces) if nbytes is None else nbytes

    @property
    def segments(self) -> list[memoryview]:
        """The column as memoryviews of its bytes (its arrays joined into one the first
        time: a view of each small array would cost more than copying it)."""
        if self.pieces and type(self.pieces[0]) is np.ndarray:
            first = self.pieces[0]  # the arrays share a dtype, a dimension and a trailing shape
            joined = np.concatenate(self.pieces) if first.ndim else np.stack(self.pieces)
            if joined.dtype != first.dtype:  # numpy joins in native byte order; keep the original
                joined = joined.astype(first.dtype)
            self.pieces = [joined.reshape(-1).view(np.uint8).data]
        return self.pieces


def _unique(values: list[Any], once: bool) -> tuple[list[Any], np.ndarray[Any, Any] | None]:
    """The distinct objects of ``values`` (by identity, first seen first) and, when some
    repeat, each value's position among them (``once``: none repeats, known already)."""
    if once or distinct(values):
        return values, None
    first: dict[int, int] = {}
    for value in values:
        first.setdefault(id(value), len(first))
    seen = list({id(v): v for v in values}.values())
    return seen, np.fromiter(map(first.__getitem__, map(id, values)), np.int64, len(values))


def _joinable(values: list[Any], nbytes: Callable[[Any], int], view: Callable[[Any], bool]) -> bool:
    """Whether a column's arrays are copied into one region (see :data:`LARGE_VALUE`),
    judged by a sample of them (evenly spaced: the cost stays flat in the column's length)."""
    sample = values[:: max(len(values) // _SAMPLE, 1)]
    average = sum(map(nbytes, sample)) / max(len(sample), 1)
    return average < VIEW_VALUE or (average < LARGE_VALUE and not any(map(view, sample)))


def _numpy_column(values: list[Any], once: bool) -> tuple[Kind, Any] | None:
    """One raw-bytes column for small arrays of one plain dtype and trailing shape, else None."""
    if type(values[0]) is not np.ndarray or set(map(type, values)) != {np.ndarray}:
        return None
    dtypes = set(map(_dtype, values))
    shapes = set(map(_shape, values))
    if len(dtypes) != 1 or len({(len(s), s[1:]) for s in shapes}) != 1:  # ndim, trailing
        return None
    (dtype,), shape = dtypes, next(iter(shapes))
    if dtype.hasobject or dtype.fields is not None:
        return None
    if not _joinable(values, _array_bytes, _array_view):
        return None
    values, positions = _unique(values, once)
    lengths: np.ndarray | int | None
    if not shape:
        lengths, rows = None, len(values)
    elif len(shapes) == 1:
        lengths, rows = shape[0], len(values) * shape[0]
    else:
        lengths = np.fromiter(map(len, values), np.int64, len(values))
        rows = int(lengths.sum())
    trailing = shape[1:]
    column = Column(values, rows * math.prod(trailing) * dtype.itemsize)
    kind = ("np", dtype.str, trailing, not shape)
    return kind, (column, _compact(lengths), positions)


def _array_bytes(value: Any) -> int:
    return int(value.nbytes)


def _array_view(value: Any) -> bool:
    return value.base is not None


def _tensor_bytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


def _tensor_view(value: torch.Tensor) -> bool:
    return value._base is not None


def _tensor_column(values: list[Any], once: bool) -> tuple[Kind, Any] | None:
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
    values, positions = _unique(values, once)
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


def _view_column(values: list[Any], once: bool) -> tuple[Kind, Any] | None:
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
    values, positions = _unique(values, once)
    count = len(values)
    offsets = np.fromiter(map(_storage_offset, values), np.int64, count)
    starts = np.fromiter(map(_data_ptr, values), np.int64, count) - offsets * first.element_size()
    grouped = _grouped(starts)
    if grouped is None:
        return None
    firsts, groups = grouped
    extent = storage.elements_spanned(shape, stride)
    covered = _covered(groups, offsets, extent)
    if covered is None:
        return None
    low, sizes = covered
    room = [values[i].untyped_storage().nbytes() // first.element_size() for i in firsts]
    if any(top > n for top, n in zip((low + sizes).tolist(), room, strict=True)):
        return None  # storages that share one buffer, the first of them too short for all
    covers = [
        torch.empty(0, dtype=dtype).set_(values[i].untyped_storage(), start, (size,), (1,))
        for i, start, size in zip(firsts.tolist(), low.tolist(), sizes.tolist(), strict=True)
    ]
    kind = ("vt", str(dtype).removeprefix("torch."), tuple(shape), tuple(stride))
    return kind, (covers, groups.astype(np.int64), offsets - low[groups], positions)


def _grouped(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Views grouped by the storage ``keys`` names: (each group's first view, each view's
    group); None when there are fewer than :data:`_VIEWS_PER_STORAGE` views a storage."""
    _, firsts, groups = np.unique(keys, return_index=True, return_inverse=True)
    if len(firsts) * _VIEWS_PER_STORAGE > len(keys):
        return None
    return firsts, groups


def _covered(
    groups: np.ndarray, starts: np.ndarray, extent: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Per storage, where the cover of its views starts and how long it is (views from
    ``starts``, each over ``extent``); None when the covers would be more than twice the
    memory the views span: rows taken sparsely from a big batch travel as spans of their
    own, not as the batch."""
    count = int(groups.max()) + 1
    low = np.full(count, np.iinfo(np.int64).max, np.int64)
    high = np.zeros(count, np.int64)
    np.minimum.at(low, groups, starts)
    np.maximum.at(high, groups, starts)
    sizes = high - low + extent
    order = np.lexsort((starts, groups))
    gaps = np.diff(starts[order])[groups[order][1:] == groups[order][:-1]]
    spanned = len(starts) * extent - int(np.maximum(extent - gaps, 0).sum())
    return (low, sizes) if int(sizes.sum()) <= 2 * spanned else None


_base, _strides = operator.attrgetter("base"), operator.attrgetter("strides")


def _address(array: np.ndarray[Any, Any]) -> int:
    return int(array.__array_interface__["data"][0])


def _array_view_column(values: list[Any], once: bool) -> tuple[Kind, Any] | None:
    """The numpy twin of ``_view_column``: views of one dtype, shape and strides that share
    a few base arrays (the rows of batches), as one array per base covering its views (a
    span) and each view's byte offset into it; else None."""
    first = values[0]
    if not all(type(v) is np.ndarray for v in values) or first.dtype.hasobject or not first.size:
        return None
    shape, strides, dtype = first.shape, first.strides, first.dtype
    if np.dtype(dtype.str) != dtype:  # fields or subarrays: not named by its string
        return None
    if any(s < 0 or s % dtype.itemsize for s in strides):
        return None
    if any(map(operator.is_, map(_base, values), repeat(None))):  # not views
        return None
    if set(map(_strides, values)) != {strides} or {v.shape for v in values} != {shape}:
        return None
    if {v.dtype for v in values} != {dtype}:
        return None
    values, positions = _unique(values, once)
    count = len(values)
    grouped = _grouped(np.fromiter(map(id, map(_base, values)), np.int64, count))
    if grouped is None:
        return None
    groups = grouped[1]
    addresses = np.fromiter(map(_address, values), np.int64, count)
    extent = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + dtype.itemsize
    covered = _covered(groups, addresses, extent)
    if covered is None:
        return None
    low, sizes = covered
    if ((addresses - low[groups]) % dtype.itemsize).any():  # not whole items apart
        return None
    order = np.lexsort((addresses, groups))  # by base, then by address: the lowest first
    lowest = order[np.unique(groups[order], return_index=True)[1]]
    covers = [
        np.lib.stride_tricks.as_strided(
            values[i], shape=(size // dtype.itemsize,), strides=(dtype.itemsize,)
        )
        for i, size in zip(lowest.tolist(), sizes.tolist(), strict=True)
    ]
    kind = ("vn", dtype.str, tuple(shape), tuple(strides))
    return kind, (covers, groups.astype(np.int64), addresses - low[groups], positions)


def joined(values: list[Any], once: bool = False) -> tuple[Kind, Any] | None:
    """``values`` (a field of records, or a list's items) as one column, else None;
    ``once``: the caller knows that no object appears twice in ``values``."""
    return (
        _numpy_column(values, once)
        or _tensor_column(values, once)
        or _view_column(values, once)
        or _array_view_column(values, once)
    )


def _compact(lengths: np.ndarray | int | None) -> Any:
    """None (0-d), an int (all equal) or the lengths array."""
    if lengths is None or isinstance(lengths, int):
        return lengths
    if len(lengths) and (lengths == lengths[0]).all():
        return int(lengths[0])
    return lengths


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


def _in_runs(
    column: Any,
    one: Callable[[int, int], Any],
    many: Callable[[int, int, int, int], list[Any]],
) -> list[Any]:
    """The views of a column of views, made a run at a time: a run of views of one cover at
    evenly spaced offsets (the rows of a batch) with one call, ``many(cover, first offset,
    step, count)``; any other view with ``one(cover, offset)``."""
    _, groups, offsets, positions = column
    bounds = [0, *(np.flatnonzero(groups[1:] != groups[:-1]) + 1).tolist(), len(groups)]
    steps = np.diff(offsets)
    found: list[Any] = []
    for start, end in itertools.pairwise(bounds):
        run, group = steps[start : end - 1], int(groups[start])
        if len(run) and run.min() == run.max() >= 0:
            found += many(group, int(offsets[start]), int(run[0]), end - start)
        else:
            found += [one(group, offset) for offset in offsets[start:end].tolist()]
    return found if positions is None else [found[i] for i in positions]


def _view_values(kind: Kind, column: Any) -> list[Any]:
    """The tensors of a column of views (see ``_view_column``), as views again."""
    covers = column[0]
    _, _, shape, stride = kind
    starts = [cover.storage_offset() for cover in covers]
    return _in_runs(
        column,
        lambda g, offset: covers[g].as_strided(shape, stride, starts[g] + offset),
        lambda g, offset, step, count: list(
            covers[g].as_strided((count, *shape), (step, *stride), starts[g] + offset).unbind(0)
        ),
    )


def _array_view_values(kind: Kind, column: Any) -> list[Any]:
    """The arrays of a column of numpy views (see ``_array_view_column``), as views again."""
    covers = column[0]
    _, name, shape, strides = kind
    dtype = np.dtype(name)
    return _in_runs(
        column,
        lambda g, offset: np.ndarray(shape, dtype, covers[g], offset, strides),
        lambda g, offset, step, count: list(
            np.ndarray((count, *shape), dtype, covers[g], offset, (step, *strides))
        ),
    )


def rebuilt(kind: Kind, count: int, column: Any) -> list[Any]:
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


def stacked(kind: Kind, count: int, column: Any) -> np.ndarray[Any, Any] | None:
    """The ``count`` arrays or tensors of a column copied into one region, all of one
    shape, as one numpy array of ``count`` rows (a view of the region); None for any
    other column, and for tensors of a dtype numpy lacks."""
    if kind[0] not in ("np", "pt"):
        return None
    buf, lengths, positions = column
    if positions is not None or not (lengths is None or isinstance(lengths, int)):
        return None
    name, trailing, zero_d = kind[1:]
    if kind[0] == "np":
        dtype = np.dtype(name)
    else:
        try:
            dtype = torch.empty(0, dtype=getattr(torch, name)).numpy().dtype
        except TypeError:  # bfloat16, ...
            return None
    shape = (count,) if zero_d else (count, lengths, *trailing)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def distinct(items: list[Any]) -> bool:
    """Whether no object appears twice in ``items`` (8 bytes an item, not a set's ~60)."""
    ids = np.fromiter(map(id, items), np.int64, len(items))
    ids.sort()
    return not (ids[1:] == ids[:-1]).any()
