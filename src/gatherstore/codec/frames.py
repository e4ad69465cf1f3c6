"""Framing of one rank's object: pickle protocol 5 with out-of-band regions.

A part is ``header | digest | region table | pickle stream | regions``.  The
regions are pickle's out-of-band buffers, the columns of record batches (see
:mod:`gatherstore.codec.records`) and the storage spans of large arrays and of
tensors (see :mod:`gatherstore.codec.storage`: memory that views share travels
once): written straight from their memory with vectored writes, and on read
rebuilt as views of the part's buffer: memory of the reader's own (a store reads a
file into private memory, never a mapping another process could change), or the
sealed memory of a part handed over (see ``gatherstore.routes.handover``).  CUDA tensors
reach the part through a pinned staging buffer (see :mod:`gatherstore.codec.staging`),
so objects never grow GPU memory, and are rebuilt on the CPU; tensors that
require grad are detached.  cloudpickle is used only when plain pickle fails.

The digest (see :mod:`gatherstore.codec.digest`) is an XXH3-128 checksum, or a keyed
BLAKE3 hash (a MAC, 3-4x faster than HMAC-SHA256 with SHA extensions) when a
signing key is given; it also covers the part's *binding* (associated data naming
its job, call and rank, never stored), so a part replayed from another call or
planted under another rank's key fails the check.  It is checked before anything is
unpickled, and a part from another format version, truncated or altered, raises
:class:`~gatherstore.IntegrityError`.  Verify a buffer no other process can change:
what is verified must be what is unpickled.
"""

from __future__ import annotations

import contextlib
import gc
import hmac
import io
import mmap
import os
import pickle
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import cloudpickle
import numpy as np
import torch

from gatherstore._errors import GatherError, IntegrityError
from gatherstore.codec import culprit, records, sizing, storage, watch
from gatherstore.codec import digest as _digest
from gatherstore.codec.columns import Column
from gatherstore.host.writes import write_all

__all__ = [
    "FORMAT_VERSION",
    "Frame",
    "Pickled",
    "Regions",
    "Unpickler",
    "Verified",
    "collection_paused",
    "decode",
    "duplicate",
    "encode",
    "framed",
    "guard",
    "load",
    "pickler",
    "rebuilding",
    "verify",
]

# 6: read-only aliased arrays (5 read too); 5: columns of numpy views, tuple and nested
# batches, packed dicts (4 read too); 4: regions
# named by a global the part's unpickler resolves (3: by persistent ids, read too); 3:
# storage spans, XXH3-128 checksums; 2: signatures are keyed BLAKE3
FORMAT_VERSION = 6
_READS = (3, 4, 5, 6)
T = TypeVar("T")
_MAGIC = b"GSPART\x00\x00"
# magic, version, flags, out-of-band buffers, persistent regions, pickle length, total
_HEAD = struct.Struct("<8sIIQQQQ")
_HEAD_SIZE = 64
_DIGEST_SIZE = _digest.SIZE
_PREFIX = _HEAD_SIZE + _DIGEST_SIZE
# flags: cloudpickled, signed, the last region is the span table (see _storage)
_CLOUDPICKLE, _SIGNED, _SPANS = 1, 2, 4
_ALIGN_LARGE, _ALIGN_SMALL, _LARGE = 64, 16, 1 << 16
_PADDING = bytes(_ALIGN_LARGE)
_OUT_OF_BAND_MIN = 4096
#: How :meth:`Frame.seal_into` maps what it wrote, to digest it: its pages mapped at once,
#: privately (a shared one, even read-only, stops the memfd's seal for as long as it lives).
_MAPPED = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)


@dataclass
class Frame:
    """An encoded part: ``segments`` written back to back make ``nbytes`` bytes.

    :func:`encode` leaves it unsealed; :meth:`seal` adds the digest (XXH3-128) or,
    with a key, the keyed BLAKE3 signature, once the route is known.
    """

    nbytes: int
    _fields: tuple[int, int, int, int]  # flags, buffers, persistent regions, pickle length
    _body: list[memoryview | Column]  # table, padding, pickle stream, regions
    segments: list[memoryview] = field(default_factory=list)
    #: Estimated bytes unpickling allocates besides the part (see ``gatherstore.codec.sizing``).
    rebuilt: int = 0
    #: The objects whose memory the regions are read from, alive until the frame goes.
    _keep: list[Any] = field(default_factory=list)

    def seal(self, key: bytes | None, bind: bytes = b"") -> Frame:
        """Compute the digest (signature when ``key`` is given) over ``bind`` and the frame.

        ``bind`` names where the part belongs (job, call, rank); the reader must
        pass the same bytes to :func:`verify`.  Returns self.
        """
        head = self._head(key)
        body = self._buffers(joined=True)
        sealed = _digest.digest([head, *body], key, bind)
        self.segments = [head, memoryview(sealed), *body]
        return self

    def seal_into(self, fd: int, key: bytes | None, bind: bytes = b"") -> None:
        """Write the frame into the empty file ``fd`` (a memfd), sealed as :meth:`seal`
        would: its regions go straight from their memory (a column's arrays unjoined,
        one copy instead of two), and the digest is computed over what the file holds,
        then written in its place.  Nothing else may write ``fd`` meanwhile.

        Raises:
            OSError: the file could not be written (e.g. out of memory).
        """
        head = self._head(key)
        write_all(fd, [head, memoryview(bytes(_DIGEST_SIZE)), *self._buffers(joined=False)])
        mapped = mmap.mmap(fd, self.nbytes, _MAPPED, mmap.PROT_READ)
        try:
            sealed = _digest.digest([head, memoryview(mapped)[_PREFIX:]], key, bind)
        finally:
            with contextlib.suppress(BufferError):  # still viewed (an error's traceback):
                mapped.close()  # unmapped when the view goes
        os.pwrite(fd, sealed, _HEAD_SIZE)

    def _head(self, key: bytes | None) -> memoryview:
        flags, count, columns, pickle_len = self._fields
        if key is not None:
            flags |= _SIGNED
        head = _HEAD.pack(_MAGIC, FORMAT_VERSION, flags, count, columns, pickle_len, self.nbytes)
        return memoryview(head.ljust(_HEAD_SIZE, b"\0"))

    def _buffers(self, joined: bool) -> list[Any]:
        """The body's buffers: memoryviews, and each column's arrays joined into one
        (``joined``, see ``Column.segments``) or as they are (its ``pieces``)."""
        found: list[Any] = []
        for region in self._body:
            if isinstance(region, Column):
                found += region.segments if joined else region.pieces
            else:
                found.append(region)
        return found

    def copy_into(self, out: memoryview) -> None:
        """Copy the sealed frame into ``out`` (``nbytes`` long)."""
        pos = 0
        for seg in self.segments:
            out[pos : pos + len(seg)] = seg
            pos += len(seg)


def _rebuild_tensor(buf: memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A small tensor pickled in the stream (large ones travel as spans)."""
    kind = getattr(torch, dtype)
    view = memoryview(buf)
    if view.nbytes == 0:
        return torch.empty(shape, dtype=kind)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8).view(kind).reshape(shape)


def _reduce_array(obj: Any, spans: storage.Spans) -> Any:
    """Large arrays travel as spans; small strided ones are made contiguous first: numpy's
    own reduction of them loses a non-native byte order."""
    if obj.dtype.hasobject:
        return NotImplemented
    if obj.nbytes >= _OUT_OF_BAND_MIN:
        return spans.array(obj)
    if obj.flags.c_contiguous or obj.flags.f_contiguous:
        return NotImplemented
    return np.ascontiguousarray(obj).__reduce_ex__(5)


def _region(ref: int) -> Any:
    """Names a region in a pickle stream (columns count up from 0, spans down from -1);
    only the unpickler of the part it belongs to resolves it (``Unpickler.find_class``)."""
    raise GatherError("a region of a gatherstore part was unpickled outside its part")


def _reduce_object(obj: Any, spans: storage.Spans, columns: list[Column]) -> Any:
    """How ``obj`` is pickled: arrays and tensors as spans or in the stream, columns and
    spans as references to their regions; NotImplemented for everything else.  Called
    for objects other than numbers, strings and builtin containers only, unlike a
    persistent id, which would be asked for every object."""
    kind = type(obj)
    if kind is np.ndarray:
        return _reduce_array(obj, spans)
    if kind is storage.SpanRef:
        return (_region, (-1 - obj.index,))
    if kind is Column:
        columns.append(obj)
        return (_region, (len(columns) - 1,))
    if kind is not torch.Tensor or obj.layout != torch.strided or obj.is_quantized:
        return NotImplemented
    tensor = obj.detach()
    if tensor.device.type not in ("cpu", "cuda"):
        tensor = tensor.cpu()
    large = tensor.numel() * tensor.element_size() >= _OUT_OF_BAND_MIN
    if tensor.numel() and (large or tensor.device.type == "cuda"):
        return spans.tensor(tensor)
    tensor = tensor.cpu().resolve_conj().resolve_neg().contiguous()
    flat = tensor.reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    dtype = str(tensor.dtype).removeprefix("torch.")
    buffer = pickle.PickleBuffer(raw)  # type: ignore[arg-type]
    return (_rebuild_tensor, (buffer, dtype, tuple(tensor.shape)))


class _Pickler(pickle.Pickler):
    """Stores record-batch columns and storage spans as regions (see ``_region``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.columns: list[Column] = []
        self.spans = storage.Spans()

    def reducer_override(self, obj: Any) -> Any:
        return _reduce_object(obj, self.spans, self.columns)


class _CloudPickler(cloudpickle.Pickler):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.columns: list[Column] = []
        self.spans = storage.Spans()

    def reducer_override(self, obj: Any) -> Any:
        reduced = _reduce_object(obj, self.spans, self.columns)
        if reduced is NotImplemented:
            return super().reducer_override(obj)
        return reduced


@dataclass
class Pickled:
    stream: bytes
    buffers: list[memoryview]
    columns: list[Column]
    spans: storage.Spans
    flags: int


#: Memo ids of the objects a packed part must not meet (see ``_dump``): pickle refuses to
#: write an id this large, so meeting one of them raises instead of writing it.
_GUARD = 1 << 32
_TOO_LARGE = "memo id too large"
#: Pickle opcodes that take one memo slot (push None, memoize, pop): the stream starts
#: with one per guarded object, so that the unpickler's memo ids match the pickler's.
_SLOT = pickle.NONE + pickle.MEMOIZE + pickle.POP


class _Split(Exception):
    """The pickler met, outside its batch, an object that packing replaced."""


def _out_of_band(buffers: list[memoryview]) -> Callable[[pickle.PickleBuffer], bool]:
    """pickle's ``buffer_callback``: large buffers go to ``buffers`` (regions of the part),
    small ones stay in the stream (cheaper than a table entry each)."""

    def keep(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < _OUT_OF_BAND_MIN:
            return True
        buffers.append(raw)
        return False

    return keep


def pickler(stream: io.BytesIO, flags: int, buffers: list[memoryview]) -> _Pickler | _CloudPickler:
    """A pickler of parts into ``stream`` (cloudpickle's when ``flags`` says so)."""
    kind = _CloudPickler if flags & _CLOUDPICKLE else _Pickler
    return kind(stream, protocol=5, buffer_callback=_out_of_band(buffers))


def guard(pickler: _Pickler | _CloudPickler, guarded: list[Any], stream: io.BytesIO) -> None:
    """Give a ``pickler`` that has written nothing yet a memo of ``guarded`` under ids it
    refuses to write (see ``_GUARD``), and ``stream`` the memo slots that keep the
    unpickler's ids in step."""
    if not guarded:
        return
    with collection_paused():  # a tuple per guard: no collection of the whole heap for them
        pickler.memo = {id(obj): (_GUARD + i, obj) for i, obj in enumerate(guarded)}
    stream.write(_SLOT * len(guarded))


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cycle collection paused (a caller's ``gc.disable()`` holds): unpickling
    keeps every container it makes, and would set it off every 700 of them, each time
    over all made since (1M COCO result dicts: 2.5 s with it, 0.96 s paused and one
    collection after).  What it would have found it finds once it runs again."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _dump(value: Any, flags: int, guarded: list[Any] | None = None) -> Pickled | None:
    """``value`` pickled (with cloudpickle when ``flags`` says so); None when plain pickle
    cannot pickle it.

    Raises:
        _Split: the pickler met one of ``guarded`` (objects packing replaced, see
            ``gatherstore.codec.records.Packed``): it would be rebuilt twice, no longer one object.
    """
    stream = io.BytesIO()
    buffers: list[memoryview] = []
    pickling = pickler(stream, flags, buffers)
    guard(pickling, guarded or [], stream)
    try:
        pickling.dump(value)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        if guarded and _TOO_LARGE in str(exc):
            raise _Split from exc
        if flags:
            raise
        return None
    return Pickled(stream.getvalue(), buffers, pickling.columns, pickling.spans, flags)


def _pickle(obj: Any) -> Pickled:
    """``obj`` pickled with its records packed; as it is when packing would split an
    object held in two places; with cloudpickle when plain pickle cannot pickle it."""
    packed = records.pack(obj)
    plain = packed.value is obj or packed.twice
    done = None
    if not plain:
        try:
            done = _dump(packed.value, 0, packed.shared)
        except _Split:
            plain = True
    if plain:
        done = _dump(obj, 0)
    if done is None:
        done = _dump(obj, _CLOUDPICKLE)
    assert done is not None  # cloudpickle raises instead
    return done


def _pad(pos: int, size: int) -> int:
    align = _ALIGN_LARGE if size >= _LARGE else _ALIGN_SMALL
    return -pos % align


def encode(obj: Any) -> Frame:
    """Serialise ``obj`` into an unsealed frame (see :meth:`Frame.seal`); CUDA tensors
    are on the host once this returns.

    Raises:
        Exception: whatever pickling raises when neither pickle nor cloudpickle can, its
            message naming where in ``obj`` the culprit is (see ``gatherstore.codec.culprit``).
    """
    return framed(culprit.named(_pickle, obj), sizing.rebuilt_size(obj, _OUT_OF_BAND_MIN))


def framed(pickled: Pickled, rebuilt: int) -> Frame:
    """The unsealed frame of a pickled object (``rebuilt``: see ``Frame.rebuilt``)."""
    data, flags = pickled.stream, pickled.flags
    regions: list[memoryview | Column] = [b.cast("B") for b in pickled.buffers]
    regions += pickled.columns
    persistent = len(pickled.columns)
    if pickled.spans.spans:
        spans = pickled.spans.regions()
        spans.table[:, 0] += len(pickled.columns)  # regions count among the persistent ones
        regions += [*spans.segments, spans.table.data.cast("B")]
        persistent += len(spans.segments) + 1
        flags |= _SPANS
    pos = _PREFIX + 16 * len(regions)
    pad = _pad(pos, len(data))
    body: list[memoryview | Column] = [memoryview(_PADDING[:pad]), memoryview(data)]
    pos += pad + len(data)
    table: list[int] = []
    for region in regions:
        size = region.nbytes
        pad = _pad(pos, size)
        if pad:
            body.append(memoryview(_PADDING[:pad]))
        pos += pad
        table += (pos, size)
        body.append(region)
        pos += size
    table_view = memoryview(struct.pack(f"<{len(table)}Q", *table))
    fields = (flags, len(pickled.buffers), persistent, len(data))
    return Frame(pos, fields, [table_view, *body], rebuilt=rebuilt, _keep=pickled.spans.keep)


@dataclass
class Verified:
    """A part whose digest checked out: its pickle stream and regions, as views, and
    whose part it is (for the errors of :func:`load`)."""

    stream: memoryview
    buffers: list[memoryview]
    #: The regions the stream references: columns, then span regions (see
    #: ``gatherstore.codec.storage``).
    columns: list[memoryview]
    rank: int | None = None
    where: str | None = None
    #: Where each span is (region, offset), when the part has spans.
    spans: memoryview | None = None


def verify(
    data: Any,
    *,
    key: bytes | None = None,
    bind: bytes = b"",
    rank: int | None = None,
    where: str | None = None,
) -> Verified:
    """Check a frame's header and digest (signature with ``key``) without unpickling.

    ``bind`` must equal what the writer sealed with (see :meth:`Frame.seal`).

    Raises:
        IntegrityError: foreign format or version, truncated, or digest/signature
            mismatch; names ``rank`` and ``where``.
    """
    view = memoryview(data).cast("B")
    who = f"part of rank {rank}" if rank is not None else "part"
    if where:
        who += f" ({where})"

    def fail(why: str) -> IntegrityError:
        return IntegrityError(f"{who} {why}", rank=rank, key=where)

    if len(view) < _PREFIX:
        raise fail(f"is truncated: {len(view)} bytes, shorter than the frame header")
    magic, version, flags, count, columns, pickle_len, total = _HEAD.unpack_from(view)
    if magic != _MAGIC:
        raise fail("is not a gatherstore part (bad magic)")
    if version not in _READS:
        raise fail(
            f"has format version {version}, this gatherstore reads "
            f"{' and '.join(map(str, _READS))}: run the same gatherstore version on every rank"
        )
    if len(view) != total:
        raise fail(f"is truncated or padded: {len(view)} bytes, the header says {total}")
    signed = bool(flags & _SIGNED)
    if signed != (key is not None):
        raise fail(
            "is signed but no key was given"
            if signed
            else "is unsigned but a signature is required"
        )
    expected = _digest.digest([view[:_HEAD_SIZE], view[_PREFIX:]], key, bind)
    if not hmac.compare_digest(expected, bytes(view[_HEAD_SIZE:_PREFIX])):
        what = "signature" if signed else "checksum"
        raise fail(
            f"failed its {what} check: it was altered, written by someone else, or "
            "belongs to another call or rank"
        )
    return _regions(view, flags, count, columns, pickle_len, rank, where)


def _regions(
    view: memoryview,
    flags: int,
    count: int,
    columns: int,
    pickle_len: int,
    rank: int | None = None,
    where: str | None = None,
) -> Verified:
    """The pickle stream and regions of the frame in ``view``, as views of it."""
    regions = count + columns
    table = struct.unpack_from(f"<{2 * regions}Q", view, _PREFIX)
    pos = _PREFIX + 16 * regions
    pickle_at = pos + _pad(pos, pickle_len)
    views = [view[off : off + n] for off, n in zip(table[::2], table[1::2], strict=True)]
    spans = views.pop() if flags & _SPANS else None
    stream = view[pickle_at : pickle_at + pickle_len]
    return Verified(stream, views[:count], views[count:], rank, where, spans)


def duplicate(frame: Frame) -> Any:
    """A copy of the object ``frame`` encodes, rebuilt from one copy of its bytes (arrays
    are views into that copy, never into the original's memory).

    What torch's object collectives hand back for a rank's own object; no digest is
    computed or checked, since the bytes never leave this process.
    """
    buf = bytearray(frame.nbytes)
    view = memoryview(buf)
    pos = _PREFIX  # the header and digest stay zero: nobody reads them
    for segment in frame._buffers(joined=True):
        view[pos : pos + segment.nbytes] = segment.cast("B")
        pos += segment.nbytes
    flags, count, columns, pickle_len = frame._fields
    return load(_regions(view, flags, count, columns, pickle_len))


class Regions:
    """The regions a pickle stream's references resolve to (those of the part, or of the
    chunk, being unpickled): columns (from 0 up), then spans (from -1 down)."""

    def __init__(self, verified: Verified) -> None:
        self.use(verified)

    def use(self, verified: Verified) -> None:
        """Resolve from now on to the regions of ``verified``."""
        self.columns = verified.columns
        self.loaded = storage.Loaded(verified.columns, verified.spans)

    def resolve(self, ref: int) -> Any:
        """The region ``ref`` names."""
        return self.columns[ref] if ref >= 0 else self.loaded.at(-1 - ref)


class Unpickler(pickle.Unpickler):
    """Unpickles verified parts from ``stream`` (a file over their pickle streams), their
    columns and spans from ``regions`` (named by ``_region``, or in a part of format 3 by
    persistent ids)."""

    def __init__(self, regions: Regions, stream: Any, buffers: Any) -> None:
        super().__init__(stream, buffers=buffers)
        self.regions = regions

    def find_class(self, module: str, name: str) -> Any:
        if module in (__name__, "gatherstore._serialize") and name == _region.__name__:
            # not a bound method of the unpickler: the unpickler's memo keeps what this
            # returns, and a reference back to it would keep the part alive until a collection
            return self.regions.resolve
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        return self.regions.resolve(pid)


def _unpickle(verified: Verified) -> Any:
    """The part's object: straight from its stream in place, or, when memory could run
    low, through a reader that stops before it does (see ``gatherstore.codec.watch``)."""
    if watch.needs_watch(len(verified.stream)):
        who = "a part" if verified.rank is None else f"the part of rank {verified.rank}"
        reader = io.BufferedReader(watch.Watched(verified.stream, who), watch.STEP)
        return Unpickler(Regions(verified), reader, verified.buffers).load()
    if verified.columns:
        stream = io.BytesIO(verified.stream)
        return Unpickler(Regions(verified), stream, verified.buffers).load()
    return pickle.loads(verified.stream, buffers=verified.buffers)


def load(verified: Verified) -> Any:
    """Unpickle a verified part; arrays are views into its buffer.

    Raises:
        InsufficientMemoryError: memory ran low while the part was rebuilt.
        GatherError: the part cannot be rebuilt in this process (say, its class is
            missing here or its ``__setstate__`` fails); names the rank whose part it
            is, with the unpickler's error as its cause.
    """
    return rebuilding(verified, _unpickle)


def rebuilding(verified: Verified, rebuild: Callable[[Verified], T]) -> T:
    """``rebuild(verified)``, the cycle collection paused meanwhile (see
    ``collection_paused``), its errors as :func:`load` raises them."""
    try:
        with collection_paused():
            return rebuild(verified)
    except (GatherError, MemoryError):
        raise
    except Exception as exc:
        who = "a part" if verified.rank is None else f"the part of rank {verified.rank}"
        where = f" ({verified.where})" if verified.where else ""
        raise GatherError(
            f"{who}{where} was sent intact but cannot be rebuilt here: "
            f"{type(exc).__name__}: {exc}; every rank must be able to import and rebuild what "
            "the others send (same code and package versions on every rank)"
        ) from exc


def decode(
    data: Any,
    *,
    key: bytes | None = None,
    bind: bytes = b"",
    rank: int | None = None,
    where: str | None = None,
) -> Any:
    """:func:`verify`, then :func:`load`."""
    return load(verify(data, key=key, bind=bind, rank=rank, where=where))
