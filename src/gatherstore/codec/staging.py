"""CUDA memory to the host through one bounded, reused pinned buffer.

``Tensor.cpu()`` copies into fresh pageable memory: the driver stages it through a
small buffer of its own, and every page of the destination faults on first touch
(1.4 GB/s measured for 256 MiB on an H200 host, against 55 GB/s for a pinned
copy).  Here each process allocates one pinned buffer at its first use
(``GATHERSTORE_PINNED`` bytes) and keeps it until ``gs.shutdown()``.  The buffer is
a ring of :data:`SLOTS` slots.  Sources are packed into one slot after the other,
asynchronously, on a side stream of their device, one event per slot and side
stream.  Each time a slot is filled, every slot whose copies the device has
finished goes to worker threads (see ``gatherstore.host.workers``), which copy it into the part's
host buffer in pieces of :data:`PIECE` bytes, taking the first-touch faults of its
fresh pages on many cores, while the device fills the next slots.  A slot is
refilled once its pieces are out.  The side stream first waits for what the
caller's current stream has queued, so a tensor that a kernel is still writing is
copied once that kernel is done.  No GPU memory is allocated.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from gatherstore import _config as config
from gatherstore.host import workers

__all__ = ["release", "to_host"]

#: Slots of the pinned ring, and bytes per copy a worker thread makes out of one.  Measured
#: on an H200 host, 256 MiB from 64 tensors into fresh memory through 128 MiB: 8 slots and
#: 4 MiB pieces 17.7 GB/s, 16 slots 15.7 GB/s, 32 slots of 2 MiB pieces 12.5 GB/s; two
#: halves drained once each 11.0 GB/s; a pinned ``copy_`` alone 54.9 GB/s.
SLOTS = 8
PIECE = 4 << 20
#: Bytes a slot holds at least (a small ``GATHERSTORE_PINNED`` makes fewer slots).
_MIN_SLOT = 4 << 10

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
    pinned ring; returns once every byte is on the host."""
    with _lock:
        pinned = _buffer()
        ring = _Ring(pinned, max(1, min(SLOTS, len(pinned) // _MIN_SLOT)))
        try:
            for device, group in itertools.groupby(copies, key=lambda pair: pair[0].device):
                stream = _stream(device)
                stream.wait_event(torch.cuda.current_stream(device).record_event())
                ring.streams.add(stream)
                with torch.cuda.stream(stream):  # the copies queue on the side stream
                    for source, host in group:
                        size, start = source.numel(), 0
                        while start < size:
                            start += ring.put(source, host, start, size)
            ring.finish()
        finally:
            ring.settle()


class _Ring:
    """The pinned buffer as a ring of slots while one part is staged (see the module)."""

    def __init__(self, buffer: torch.Tensor, slots: int) -> None:
        self.size = len(buffer) // slots
        self.slots = [buffer[i * self.size : (i + 1) * self.size] for i in range(slots)]
        self.current, self.used = 0, 0
        self.pieces: list[tuple[torch.Tensor, np.ndarray[Any, Any]]] = []
        self.streams: set[torch.cuda.Stream] = set()  # the side streams used (each slot's events)
        #: filled slots whose pieces are not yet handed to the threads: events, slot, pieces
        self.closed: deque[tuple[list[torch.cuda.Event], int, list[Any]]] = deque()
        self.out: list[list[Future[None]]] = [[] for _ in self.slots]  # each slot's copies

    def put(self, source: torch.Tensor, host: np.ndarray[Any, Any], start: int, end: int) -> int:
        """Queue the copy of as much of ``source[start:end]`` as the current slot holds
        (on the current stream); how much."""
        take = min(end - start, self.size - self.used)
        piece = self.slots[self.current][self.used : self.used + take]
        whole = start == 0 and take == source.numel()
        piece.copy_(source if whole else source[start : start + take], non_blocking=True)
        self.pieces.append((piece, host if whole else host[start : start + take]))
        self.used += take
        if self.used == self.size:
            self._close()
        return take

    def _close(self) -> None:
        """Seal the current slot with its events; hand the threads every slot the device
        has finished, then move on to the next slot once its last pieces are out."""
        if not self.pieces:
            return
        self._seal()
        self.current = (self.current + 1) % len(self.slots)
        self.used, self.pieces = 0, []
        while self.closed and all(e.query() for e in self.closed[0][0]):  # type: ignore[no-untyped-call]
            self._drain()
        while self.closed and self.closed[0][1] == self.current:
            self._drain()
        self._wait(self.current)

    def _seal(self) -> None:
        """Queue the current slot for the threads, behind an event on each side stream."""
        events = [stream.record_event() for stream in self.streams]
        self.closed.append((events, self.current, self.pieces))

    def _drain(self) -> None:
        """Wait for the oldest filled slot, and hand its pieces to the threads."""
        events, slot, pieces = self.closed.popleft()
        for event in events:
            event.synchronize()
        task: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = []
        size = 0
        for piece, host in pieces:  # small pieces share a task, large ones are cut
            source = piece.numpy()
            for start in range(0, len(source), PIECE):
                part = (
                    (host, source)
                    if len(source) <= PIECE
                    else (host[start : start + PIECE], source[start : start + PIECE])
                )
                task.append(part)
                size += len(part[1])
                if size >= PIECE:
                    self.out[slot].append(workers.submit(_copy, task))
                    task, size = [], 0
        if task:
            self.out[slot].append(workers.submit(_copy, task))

    def _wait(self, slot: int) -> None:
        for future in self.out[slot]:  # kept until all are done: ``settle`` waits for them
            future.result()
        self.out[slot] = []

    def finish(self) -> None:
        """Drain what is left; every byte is on the host when this returns."""
        if self.pieces:
            self._seal()
            self.pieces = []
        while self.closed:
            self._drain()
        for slot in range(len(self.slots)):
            self._wait(slot)

    def settle(self) -> None:
        """After a failure too: no copy in flight still reads or writes the buffer (the
        failure itself is already on its way)."""
        for futures in self.out:
            for future in futures:
                with contextlib.suppress(BaseException):
                    future.exception()  # waits
        for stream in _streams.values():
            with contextlib.suppress(Exception):
                stream.synchronize()


def _copy(pairs: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]) -> None:
    for host, source in pairs:
        np.copyto(host, source)


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
