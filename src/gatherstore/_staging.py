"""CUDA memory to the host through one bounded, reused pinned buffer.

``Tensor.cpu()`` copies into fresh pageable memory: the driver stages it through a
small buffer of its own, and every page of the destination faults on first touch
(1.3 GB/s measured for 256 MiB on an H200 host, against 54 GB/s for a pinned
copy).  Here each process allocates one pinned buffer at its first use
(``GATHERSTORE_PINNED`` bytes, two halves) and keeps it until ``gs.shutdown()``.
Sources are packed into one half at a time, on a side stream of their device,
asynchronously: while one half fills, the other is copied into the part's host
buffer by worker threads (see ``_workers``), which also take the first-touch
faults of its fresh pages in parallel; the host waits once per half, not per
tensor.  The
side stream first waits for what the caller's current stream has queued, so a
tensor that a kernel is still writing is copied once that kernel is done.  No GPU
memory is allocated.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from . import _config as config
from . import _workers as workers

__all__ = ["release", "to_host"]

#: Bytes per copy a worker thread makes out of the pinned buffer.
_COPY = 2 << 20

_lock = threading.Lock()
_pinned: list[torch.Tensor] = []  # the process's pinned buffer, once allocated
_streams: dict[torch.device, torch.cuda.Stream] = {}


def _buffer() -> torch.Tensor:
    if not _pinned:
        _pinned.append(torch.empty(config.PINNED, dtype=torch.uint8, pin_memory=True))
    return _pinned[0]


def _stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return _streams[device]


def to_host(copies: list[tuple[torch.Tensor, np.ndarray[Any, Any]]]) -> None:
    """Copy each (CUDA uint8 tensor, host uint8 array of its length) pair, through the
    pinned buffer; returns once every byte is on the host.

    Sources are packed back to back into a half (small tensors share one), one
    event per half: the host waits once per half filled, not once per tensor
    (the GPU may be time-sliced between several processes).
    """
    with _lock:
        pinned = _buffer()
        half = len(pinned) // 2
        halves = [pinned[:half], pinned[half : 2 * half]]
        ready: set[torch.device] = set()
        which = 0
        filling = _Half(halves[which])
        pending: _Half | None = None
        for source, host in copies:
            target = torch.from_numpy(host)
            device = source.device
            stream = _stream(device)
            if device not in ready:  # after the caller's queued work on the device
                stream.wait_event(torch.cuda.current_stream(device).record_event())
                ready.add(device)
            start = 0
            while start < len(source):
                take = min(len(source) - start, half - filling.used)
                filling.add(source[start : start + take], target[start : start + take], stream)
                start += take
                if filling.used == half:
                    pending = _swap(filling, pending)
                    which = 1 - which
                    filling = _Half(halves[which])
        pending = _swap(filling, pending)
        if pending is not None:
            pending.drain()


class _Half:
    """One half of the pinned buffer while it fills: its copies queued, and where each
    piece goes on the host."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.used = buffer, 0
        self.pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.events: list[torch.cuda.Event] = []
        self.streams: set[torch.cuda.Stream] = set()

    def add(self, source: torch.Tensor, target: torch.Tensor, stream: torch.cuda.Stream) -> None:
        piece = self.buffer[self.used : self.used + len(source)]
        with torch.cuda.stream(stream):
            piece.copy_(source, non_blocking=True)
        self.streams.add(stream)
        self.pieces.append((piece, target))
        self.used += len(source)

    def close(self) -> None:
        self.events = [stream.record_event() for stream in self.streams]

    def drain(self) -> None:
        """Wait for this half's copies, then copy its pieces into the part."""
        for event in self.events:
            event.synchronize()
        work = [
            (target[start : start + _COPY], piece[start : start + _COPY])
            for piece, target in self.pieces
            for start in range(0, len(piece), _COPY)
        ]
        workers.run(_copy, work)


def _copy(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    target, piece = pair
    np.copyto(target.numpy(), piece.numpy())


def _swap(full: _Half, pending: _Half | None) -> _Half | None:
    """Close the half just filled, and drain the one before it (the next fill reuses it)."""
    if not full.pieces:
        return pending
    full.close()
    if pending is not None:
        pending.drain()
    return full


def release() -> None:
    """Free the pinned buffer (``gs.shutdown()``); the next CUDA gather allocates it anew."""
    with _lock:
        if not _pinned:
            return
        _pinned.clear()
        _streams.clear()
        empty = getattr(torch._C, "_host_emptyCache", None)  # torch caches freed pinned blocks
        if empty is not None:
            empty()
