"""The "stream" route: parts sent point to point, in fixed-size chunks, over gloo.

What ``auto`` uses across nodes when no shared store is configured.  Unlike
the padded collective (``W x largest`` on every receiver), each sender sends
only its own part, chunk by chunk, to the destination, which receives every
chunk straight into the buffer of the part it returns:

- the destination holds what it returns plus nothing else (chunks land in place);
- a sender holds its serialised part plus one chunk;
- the destination takes parts in rank order, so ``gather_iter`` yields each
  part as soon as it is in.

Every send and receive waits at most for the time the call has left: a rank
that is killed or frozen makes the waiting side raise :class:`GatherTimeout`
naming it, instead of hanging on the process group's own timeout, and marks
gatherstore's gloo group broken (later calls that need it refuse at once).
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import _control as control
from . import _gloo as gloo
from . import _serialize as serialize
from ._errors import GatherTimeout
from ._progress import Progress, wanted

if TYPE_CHECKING:
    from ._call import Call

__all__ = ["CHUNK", "broadcast", "broadcast_from", "gather_to", "receive", "send"]

#: Bytes per point-to-point message (``GATHERSTORE_STREAM_CHUNK`` overrides it).
CHUNK = int(os.environ.get("GATHERSTORE_STREAM_CHUNK", str(16 << 20)))


def _wait(work: Any, peer: int, deadline: float, what: str, timeout: float) -> None:
    left = deadline - time.monotonic()
    try:
        if left <= 0 or not work.wait(timeout=_dt.timedelta(seconds=left)):
            raise RuntimeError("timed out")
    except RuntimeError as exc:
        how_on = gloo.mark_broken(what, f"rank {peer} did not stream within {timeout:g} s")
        raise GatherTimeout(
            f"{what}: rank {peer} did not stream its part of the call within {timeout:g} s; "
            f"it is busy, stuck or gone; {how_on}",
            ranks=[peer],
            timeout=timeout,
        ) from exc


def _chunks(segments: list[memoryview], size: int) -> Iterator[torch.Tensor]:
    """The concatenation of ``segments`` in chunks of ``CHUNK`` bytes, each copied into
    one reused buffer (valid until the next chunk is drawn)."""
    chunk = torch.empty(min(CHUNK, size), dtype=torch.uint8)
    out = chunk.numpy()
    fill = 0
    for segment in segments:
        view = memoryview(segment).cast("B")
        while len(view):
            n = min(len(view), len(out) - fill)
            out[fill : fill + n] = view[:n]
            fill, view = fill + n, view[n:]
            if fill == len(out):
                yield chunk
                fill = 0
    if fill:
        yield chunk[:fill]


def _into(part: bytearray) -> Iterator[torch.Tensor]:
    """Views of ``part``, chunk by chunk, to receive into in place."""
    if part:
        whole = torch.frombuffer(part, dtype=torch.uint8)
        for start in range(0, len(part), CHUNK):
            yield whole[start : start + CHUNK]


def send(
    segments: list[memoryview],
    size: int,
    dst: int,
    group: Any,
    *,
    deadline: float,
    what: str,
    timeout: float,
) -> None:
    """Send the ``size`` bytes of ``segments`` to ``dst``, chunk by chunk.

    Raises:
        GatherTimeout: ``dst`` did not take a chunk before ``deadline``.
    """
    for chunk in _chunks(segments, size):
        _wait(dist.isend(chunk, dst, group=group), dst, deadline, what, timeout)


def receive(
    sizes: list[int], own: int, group: Any, *, deadline: float, what: str, timeout: float
) -> Iterator[tuple[int, bytearray]]:
    """Each other rank's part, in rank order, received chunk by chunk in place.

    Raises:
        GatherTimeout: a sender did not deliver before ``deadline``; names it.
    """
    for rank, size in enumerate(sizes):
        if rank == own:
            continue
        part = bytearray(size)
        for piece in _into(part):
            _wait(dist.irecv(piece, rank, group=group), rank, deadline, what, timeout)
        yield rank, part


def broadcast(
    segments: list[memoryview] | None,
    size: int,
    src: int,
    group: Any,
    *,
    deadline: float,
    what: str,
    timeout: float,
) -> bytearray | None:
    """``src``'s part on every rank, chunk by chunk: ``src`` passes its ``segments`` and
    gets None; the others get the ``size`` bytes, received in place.

    Raises:
        GatherTimeout: a chunk did not go through before ``deadline``; names ``src``.
    """
    part = None if segments is not None else bytearray(size)
    pieces = _chunks(segments, size) if segments is not None else _into(part or bytearray())
    for piece in pieces:
        work = dist.broadcast(piece, src, group=group, async_op=True)
        _wait(work, src, deadline, what, timeout)
    return part


# --- one object collective's use of the route ------------------------------------------
def _limits(call: Call) -> dict[str, Any]:
    return {"deadline": call.ends_at, "what": call.what, "timeout": call.timeout}


def _segments(call: Call) -> list[memoryview]:
    return [] if call.frame is None else call.frame.seal(None).segments


def gather_to(call: Call, dst: int) -> Iterator[Any] | None:
    """Send this rank's part to ``dst``; on ``dst``, every part in rank order as it
    arrives (its own object in place)."""
    group = control.control_group()
    if call.rank != dst:
        send(_segments(call), call.sizes[call.rank], dst, group, **_limits(call))
        call.frame = None
        call.finish()
        return None
    return _gathered(call, dst, group)


def _gathered(call: Call, dst: int, group: Any) -> Iterator[Any]:
    incoming = call.total - call.sizes[dst]
    progress = Progress(
        call.what, call.world - 1, incoming, enabled=wanted(call.progress, incoming)
    )
    received = receive(call.sizes, dst, group, **_limits(call))
    try:
        for rank in range(call.world):
            if rank == dst:
                yield call.own
                continue
            _, part = next(received)
            progress.update(len(part))
            yield serialize.decode(memoryview(part), rank=rank, where=call.what)
    finally:
        progress.close()
        call.finish()


def broadcast_from(call: Call, src: int) -> Any:
    """``src``'s part on this rank, broadcast chunk by chunk (``src``: its own object)."""
    part = broadcast(
        _segments(call) if call.rank == src else None,
        call.sizes[src],
        src,
        control.control_group(),
        **_limits(call),
    )
    if part is None:
        return call.own
    return serialize.decode(memoryview(part), rank=src, where=call.what)
