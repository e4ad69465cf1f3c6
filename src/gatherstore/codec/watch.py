"""Watching memory while a part is unpickled, so that a wrong estimate ends in an error.

The memory check before a gather counts what unpickling will allocate from an
estimate (see ``gatherstore.codec.sizing``).  An estimate can be wrong (objects
whose rebuild allocates far more than they look), and the kernel kills a
process that outgrows its memory cgroup.  So while memory is plentiful parts
are unpickled at full speed; once the pickle streams loaded since the last look
could, at the worst ratio measured (about 30 bytes rebuilt per pickled byte,
for lists of tiny dicts), outgrow half the headroom, the unpickler reads its
stream through ``Watched``, which looks at the headroom every MiB of
stream and stops before it runs out.
"""

from __future__ import annotations

import io
import threading

from gatherstore._errors import InsufficientMemoryError
from gatherstore.host import memory

__all__ = ["Watched", "needs_watch"]

#: Bytes rebuilt per pickled byte at the worst measured (lists of tiny dicts).
WORST_RATIO = 32
#: Headroom below which unpickling stops.
RESERVE = 128 << 20
#: Bytes of stream read between two looks at the headroom.
STEP = 1 << 20

_lock = threading.Lock()
_unwatched = [0]  # bytes that may still be rebuilt before memory is looked at again


def needs_watch(stream_bytes: int) -> bool:
    """Whether unpickling a stream of ``stream_bytes`` must be watched."""
    worst = stream_bytes * WORST_RATIO
    with _lock:
        if worst > _unwatched[0]:
            _unwatched[0] = max(memory.headroom() - RESERVE, 0) // 2
        if worst > _unwatched[0]:
            return True
        _unwatched[0] -= worst
        return False


class Watched(io.RawIOBase):
    """A pickle stream as a raw file that stops when memory runs low (wrap it in a
    ``BufferedReader`` of ``STEP`` bytes: one look per refill)."""

    def __init__(self, stream: memoryview, who: str) -> None:
        super().__init__()
        self.stream, self.who, self.pos = stream, who, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        room = memory.headroom()
        if room < RESERVE:
            raise InsufficientMemoryError(
                f"rebuilding {self.who} stopped with {room / 2**20:.0f} MiB of memory left "
                f"(at {self.pos / 2**20:.0f} MiB of its pickle stream): its objects take far "
                "more memory than estimated before the gather. Use gs.gather_iter (one part "
                "at a time), gather less per call, or raise the job's memory limit"
            )
        n = min(len(buffer), len(self.stream) - self.pos)
        buffer[:n] = self.stream[self.pos : self.pos + n]
        self.pos += n
        return n
