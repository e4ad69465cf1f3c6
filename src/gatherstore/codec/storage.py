"""Storage spans: memory that arrays and tensors share travels once, and comes back shared.

While an object is pickled, every large numpy array and CPU tensor, and every
CUDA tensor, is pickled as a reference to the span of memory it covers (its
first to last byte, whatever its strides).  After pickling, the spans that
overlap or touch on one device (one storage, for CUDA) are merged into one
region each: the views of one batch tensor, a tensor and its slices, an array
that many records hold, all travel as the bytes of their storage span, once.

Host regions are written from the objects' own memory (no copy).  CUDA regions
are copied to the host through the pinned staging buffer (see ``gatherstore.codec.staging``),
straight into the part's buffer, never through GPU memory.

On load every region is one buffer of the part, and every array or tensor a
view into it with its shape, strides and dtype (byte order included): views of
one storage are views of one buffer again.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gatherstore.codec import staging

__all__ = ["Loaded", "Spans", "SpanRef", "elements_spanned"]


def elements_spanned(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from a non-empty torch view's first to its last (strides are never
    negative in torch)."""
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))


#: Where host spans sort among the CUDA storages' keys (device index, address).
_HOST = (-1, 0)


class SpanRef:
    """A placeholder in the pickle stream for one span (a reference to its region)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass
class _Span:
    key: tuple[int, int] | None  # None: host memory; (device index, storage address): CUDA
    start: int
    end: int


@dataclass
class Regions:
    """The merged spans: each region's bytes, and where each span landed (region, offset)."""

    segments: list[memoryview] = field(default_factory=list)
    table: np.ndarray[Any, Any] = field(default_factory=lambda: np.empty((0, 2), np.int64))


class Spans:
    """The spans of one object being pickled (see the module's docstring)."""

    def __init__(self) -> None:
        self.spans: list[_Span] = []
        self.keep: list[Any] = []  # what keeps the spans' memory alive until written
        self.storages: dict[tuple[int, int], torch.Tensor] = {}  # CUDA key -> storage bytes
        #: The merged spans (key, start, end), in order, once ``regions`` ran.
        self.extents: list[tuple[Any, int, int]] = []

    def _add(self, key: Any, start: int, end: int, owner: Any) -> SpanRef:
        self.spans.append(_Span(key, start, end))
        self.keep.append(owner)
        return SpanRef(len(self.spans) - 1)

    def array(self, arr: np.ndarray[Any, Any]) -> Any:
        """The reduction of a non-empty numpy array to its span."""
        address = arr.__array_interface__["data"][0]
        if arr.flags.c_contiguous:  # the usual case, without a pass over the strides
            low, high = 0, arr.nbytes - arr.itemsize
        else:
            pairs = list(zip(arr.shape, arr.strides, strict=True))
            low = sum((n - 1) * s for n, s in pairs if s < 0)
            high = sum((n - 1) * s for n, s in pairs if s > 0)
        ref = self._add(None, address + low, address + high + arr.itemsize, arr)
        args: tuple[Any, ...] = (ref, -low, arr.dtype, arr.shape, arr.strides)
        if _aliased(arr) and arr.__array_interface__["data"][1]:  # read-only
            args += (True,)  # np.broadcast_to's arrays: a write would change many elements
        return (_rebuild_array, args)

    def tensor(self, tensor: torch.Tensor) -> Any:
        """The reduction of a dense, non-empty, detached CPU or CUDA tensor to its span."""
        storage = tensor.untyped_storage()
        size = tensor.element_size()
        start = storage.data_ptr() + int(tensor.storage_offset()) * size
        contiguous = tensor.is_contiguous()
        items = tensor.numel() if contiguous else elements_spanned(tensor.shape, tensor.stride())
        key = None
        if tensor.device.type == "cuda":
            key = (tensor.device.index or 0, storage.data_ptr())
            known = self.storages.get(key)
            if known is None or known.numel() < storage.nbytes():  # the longest at that address
                flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
                self.storages[key] = flat.set_(storage)
        ref = self._add(key, start, start + int(items) * size, tensor)
        flags = (tensor.is_conj(), tensor.is_neg())
        dtype = str(tensor.dtype).removeprefix("torch.")
        return (_rebuild_tensor, (ref, dtype, tuple(tensor.shape), tensor.stride(), flags))

    def regions(self) -> Regions:
        """Merge the spans; host regions are views of the objects' memory, CUDA regions
        are staged to the host (see ``gatherstore.codec.staging``)."""
        out = Regions(table=np.empty((len(self.spans), 2), np.int64))
        spans = self.spans
        order = sorted(range(len(spans)), key=lambda i: (spans[i].key or _HOST, spans[i].start))
        merged: list[tuple[Any, int, int]] = []  # key, start, end
        for i in order:
            span = self.spans[i]
            if merged and merged[-1][0] == span.key and span.start <= merged[-1][2]:
                key, start, end = merged[-1]
                merged[-1] = (key, start, max(end, span.end))
            else:
                merged.append((span.key, span.start, span.end))
            out.table[i] = (len(merged) - 1, span.start - merged[-1][1])
        self.extents = merged
        on_device = sum(end - start for key, start, end in merged if key is not None)
        host = np.empty(on_device, np.uint8)  # one buffer for every CUDA region of the part
        copies, used = [], 0
        for key, start, end in merged:
            if key is None:
                memory = (ctypes.c_char * (end - start)).from_address(start)
                out.segments.append(memoryview(memory).cast("B"))
            else:
                source = self.storages[key][start - key[1] : end - key[1]]
                copies.append((source, host[used : used + end - start]))
                out.segments.append(host[used : used + end - start].data)
                used += end - start
        if copies:
            staging.to_host(copies)
        return out


class Loaded:
    """The regions of a verified part and its span table, for the rebuild of views."""

    def __init__(self, regions: list[memoryview], table: memoryview | None) -> None:
        self.regions = regions
        #: (region, offset) of each span, as Python ints (one lookup per span rebuilt)
        self.table = [] if table is None else np.frombuffer(table, np.int64).reshape(-1, 2).tolist()
        self.arrays: dict[int, np.ndarray[Any, Any]] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        self.typed: dict[tuple[int, torch.dtype], torch.Tensor | None] = {}

    def at(self, span: int) -> tuple[Loaded, int, int]:
        """Where span ``span`` is: (these regions, its region, its offset there)."""
        region, offset = self.table[span]
        return self, region, offset

    def array(self, region: int) -> np.ndarray[Any, Any]:
        if region not in self.arrays:
            self.arrays[region] = np.frombuffer(self.regions[region], np.uint8)
        return self.arrays[region]

    def tensor(self, region: int) -> torch.Tensor:
        if region not in self.tensors:
            view = self.regions[region]
            if view.readonly:  # torch cannot honour read-only memory: copy once
                view = memoryview(bytearray(view))
            self.tensors[region] = torch.frombuffer(view, dtype=torch.uint8)
        return self.tensors[region]

    def of_dtype(self, region: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The region as one tensor of ``dtype``; None when its length is not a multiple of
        the dtype's size."""
        key = (region, dtype)
        if key not in self.typed:
            whole = self.tensor(region)
            fits = whole.numel() % dtype.itemsize == 0
            self.typed[key] = whole.view(dtype) if fits else None
        return self.typed[key]


def _aliased(arr: np.ndarray[Any, Any]) -> bool:
    """Whether elements of ``arr`` share memory: a stride of 0 along an axis longer than 1."""
    return any(s == 0 and n > 1 for n, s in zip(arr.shape, arr.strides, strict=True))


def _rebuild_array(
    at: tuple[Loaded, int, int],
    first: int,
    dtype: np.dtype[Any],
    shape: Any,
    strides: Any,
    readonly: bool = False,
) -> np.ndarray[Any, Any]:
    """The array of a span; read-only where the sender's was and its elements alias."""
    loaded, region, offset = at
    base = loaded.array(region)
    out: np.ndarray[Any, Any] = np.ndarray(
        shape, dtype, buffer=base, offset=offset + first, strides=strides
    )
    if readonly:
        out.flags.writeable = False
    return out


def _rebuild_tensor(
    at: tuple[Loaded, int, int],
    dtype: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    flags: tuple[bool, bool],
) -> torch.Tensor:
    loaded, region, offset = at
    kind = getattr(torch, dtype)
    size = kind.itemsize
    if 0 in shape:
        return torch.empty(shape, dtype=kind)
    typed = loaded.of_dtype(region, kind) if offset % size == 0 else None
    if typed is not None:  # the usual case: one view of the region
        out = typed.as_strided(shape, stride, offset // size)
    else:
        span = elements_spanned(shape, stride) * size
        piece = loaded.tensor(region)[offset : offset + span]
        if offset % size:  # a view not aligned to its dtype: copied into aligned memory
            piece = piece.clone()
        out = piece.view(kind).as_strided(shape, stride)
    conj, neg = flags
    if conj:
        out = out.conj()
    if neg:
        out = out._neg_view()
    return out.resolve_conj().resolve_neg() if conj or neg else out
