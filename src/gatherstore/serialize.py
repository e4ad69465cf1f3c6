"""Framing of one rank's object: pickle protocol 5 with out-of-band buffers.

A part is ``header | digest | buffer table | pickle stream | buffers``.  Numpy
arrays and CPU tensors travel as out-of-band buffers: written straight from
their memory (no extra copy) and, on read, rebuilt as views of the part's
buffer (a memory map for files).  CUDA tensors are copied to CPU memory first,
so objects never grow GPU memory; tensors that require grad are detached.
cloudpickle is used only when plain pickle fails.  The digest is CRC-32, or
HMAC-SHA256 when a signing key is given; it is checked before anything is
unpickled, and a part from another format version, truncated or altered,
raises :class:`~gatherstore.IntegrityError`.
"""

from __future__ import annotations

import hmac
import io
import pickle
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch

from .errors import IntegrityError

__all__ = ["FORMAT_VERSION", "Frame", "decode", "encode"]

FORMAT_VERSION = 1
_MAGIC = b"GSPART\x00\x00"
_HEAD = struct.Struct("<8sIIQQQ")  # magic, version, flags, buffer count, pickle length, total
_HEAD_SIZE = 64
_DIGEST_SIZE = 32
_PREFIX = _HEAD_SIZE + _DIGEST_SIZE
_CLOUDPICKLE, _SIGNED = 1, 2
_ALIGN_LARGE, _ALIGN_SMALL, _LARGE = 64, 16, 1 << 16
_PADDING = bytes(_ALIGN_LARGE)
_OUT_OF_BAND_MIN = 4096


@dataclass
class Frame:
    """An encoded part: ``segments`` written back to back make ``nbytes`` bytes.

    :func:`encode` leaves it unsealed; :meth:`seal` adds the digest (CRC-32) or,
    with a key, the HMAC-SHA256 signature, once the route is known.
    """

    nbytes: int
    _fields: tuple[int, int, int]  # flags, buffer count, pickle length
    _body: list[memoryview]  # table, padding, pickle stream, buffers
    segments: list[memoryview] = field(default_factory=list)

    def seal(self, key: bytes | None) -> Frame:
        """Compute the digest (signature when ``key`` is given); returns self."""
        flags, count, pickle_len = self._fields
        if key is not None:
            flags |= _SIGNED
        head = _HEAD.pack(_MAGIC, FORMAT_VERSION, flags, count, pickle_len, self.nbytes)
        head_view = memoryview(head.ljust(_HEAD_SIZE, b"\0"))
        digest = _digest([head_view, *self._body], key)
        self.segments = [head_view, memoryview(digest), *self._body]
        return self

    def copy_into(self, out: memoryview) -> None:
        """Copy the sealed frame into ``out`` (``nbytes`` long)."""
        pos = 0
        for seg in self.segments:
            out[pos : pos + len(seg)] = seg
            pos += len(seg)


def _rebuild_tensor(buf: memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    kind = getattr(torch, dtype)
    view = memoryview(buf)
    if view.nbytes == 0:
        return torch.empty(shape, dtype=kind)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8).view(kind).reshape(shape)


def _reduce_tensor(obj: Any) -> Any:
    if type(obj) is not torch.Tensor or obj.layout != torch.strided or obj.is_quantized:
        return NotImplemented
    tensor = obj.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    dtype = str(tensor.dtype).removeprefix("torch.")
    buffer = pickle.PickleBuffer(raw)  # type: ignore[arg-type]
    return (_rebuild_tensor, (buffer, dtype, tuple(tensor.shape)))


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        return _reduce_tensor(obj)


class _CloudPickler(cloudpickle.Pickler):  # type: ignore[misc]
    def reducer_override(self, obj: Any) -> Any:
        reduced = _reduce_tensor(obj)
        if reduced is NotImplemented:
            return super().reducer_override(obj)
        return reduced


def _pickle(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer], int]:
    for flags, pickler in ((0, _Pickler), (_CLOUDPICKLE, _CloudPickler)):
        stream = io.BytesIO()
        buffers: list[pickle.PickleBuffer] = []

        def out_of_band(buf: pickle.PickleBuffer, buffers: list[Any] = buffers) -> bool:
            """Small buffers stay in the stream (cheaper than a table entry each)."""
            if buf.raw().nbytes < _OUT_OF_BAND_MIN:
                return True
            buffers.append(buf)
            return False

        try:
            pickler(stream, protocol=5, buffer_callback=out_of_band).dump(obj)
        except (pickle.PicklingError, TypeError, AttributeError):
            if flags:
                raise
            continue
        return stream.getvalue(), buffers, flags
    raise AssertionError("unreachable")


def _pad(pos: int, size: int) -> int:
    align = _ALIGN_LARGE if size >= _LARGE else _ALIGN_SMALL
    return -pos % align


def _digest(segments: list[memoryview], key: bytes | None) -> bytes:
    if key is not None:
        mac = hmac.new(key, digestmod="sha256")
        for seg in segments:
            mac.update(seg)
        return mac.digest()
    crc = 0
    for seg in segments:
        crc = zlib.crc32(seg, crc)
    return crc.to_bytes(4, "little").ljust(_DIGEST_SIZE, b"\0")


def encode(obj: Any) -> Frame:
    """Serialise ``obj`` into an unsealed frame (see :meth:`Frame.seal`).

    Raises:
        Exception: whatever pickling raises when neither pickle nor cloudpickle can.
    """
    data, buffers, flags = _pickle(obj)
    raws = [pb.raw() for pb in buffers]
    count = len(raws)
    pos = _PREFIX + 16 * count
    body: list[memoryview] = []
    pad = _pad(pos, len(data))
    body += [memoryview(_PADDING[:pad]), memoryview(data)]
    pickle_at = pos + pad
    pos = pickle_at + len(data)
    table: list[int] = []
    for raw in raws:
        pad = _pad(pos, raw.nbytes)
        if pad:
            body.append(memoryview(_PADDING[:pad]))
        pos += pad
        table += (pos, raw.nbytes)
        body.append(raw.cast("B"))
        pos += raw.nbytes
    table_view = memoryview(struct.pack(f"<{len(table)}Q", *table))
    return Frame(pos, (flags, count, len(data)), [table_view, *body])


def decode(
    data: Any, *, key: bytes | None = None, rank: int | None = None, where: str | None = None
) -> Any:
    """Rebuild the object of a frame, arrays as views into ``data``.

    Raises:
        IntegrityError: foreign format or version, truncated, or digest/signature
            mismatch (nothing is unpickled then); names ``rank`` and ``where``.
    """
    view = memoryview(data).cast("B")
    who = f"part of rank {rank}" if rank is not None else "part"
    if where:
        who += f" ({where})"

    def fail(why: str) -> IntegrityError:
        return IntegrityError(f"{who} {why}", rank=rank, key=where)

    if len(view) < _PREFIX:
        raise fail(f"is truncated: {len(view)} bytes, shorter than the frame header")
    magic, version, flags, count, pickle_len, total = _HEAD.unpack_from(view)
    if magic != _MAGIC:
        raise fail("is not a gatherstore part (bad magic)")
    if version != FORMAT_VERSION:
        raise fail(
            f"has format version {version}, this gatherstore reads {FORMAT_VERSION}: "
            "run the same gatherstore version on every rank"
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
    expected = _digest([view[:_HEAD_SIZE], view[_PREFIX:]], key)
    if not hmac.compare_digest(expected, bytes(view[_HEAD_SIZE:_PREFIX])):
        what = "signature" if signed else "checksum"
        raise fail(f"failed its {what} check: it was altered or written by someone else")
    table = struct.unpack_from(f"<{2 * count}Q", view, _PREFIX)
    pickle_at = _pickle_offset(_PREFIX + 16 * count, pickle_len)
    stream = view[pickle_at : pickle_at + pickle_len]
    buffers = [view[off : off + n] for off, n in zip(table[::2], table[1::2], strict=True)]
    return pickle.loads(stream, buffers=buffers)


def _pickle_offset(pos: int, pickle_len: int) -> int:
    return pos + _pad(pos, pickle_len)
