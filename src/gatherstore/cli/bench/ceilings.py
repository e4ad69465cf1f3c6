"""The machine's ceilings, measured once per bench run: memcpy, /dev/shm, pickle."""

from __future__ import annotations

import contextlib
import os
import pickle
import time
import uuid
from collections.abc import Callable

import numpy as np

from gatherstore.cli.bench import payloads
from gatherstore.stores.tmpdir import SHM

__all__ = ["measure"]

_PICKLE_MAX = 64 << 20


def _best(fn: Callable[[], object], tries: int = 3) -> float:
    """The fastest of ``tries`` timed calls, in seconds."""
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _shm(src: np.ndarray) -> tuple[float, float] | None:
    """Seconds to write ``src`` to a /dev/shm file and read it back (None without /dev/shm)."""
    if not os.access(SHM, os.W_OK):
        return None
    path = os.path.join(SHM, f"gatherstore-bench-{uuid.uuid4().hex}")
    dst = np.empty_like(src)
    try:
        start = time.perf_counter()
        with open(path, "wb") as f:
            f.write(src.data)
        written = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            f.readinto(dst.data)
        return written - start, time.perf_counter() - written
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _memcpy(src: np.ndarray) -> float:
    """Seconds of the fastest copy of ``src`` into an already touched buffer."""
    dst = np.empty_like(src)
    return _best(lambda: np.copyto(dst, src))


def measure(nbytes: int) -> dict[str, float | None]:
    """GB/s (1e9 bytes/s) of memcpy and of a /dev/shm write and read of ``nbytes``, and of
    ``pickle.dumps``/``loads`` (protocol 5) of a detections payload of up to 64 MiB."""
    src = np.ones(nbytes, dtype=np.uint8)
    memcpy = _memcpy(src)
    shm = _shm(src)
    del src
    n_images = payloads.image_count(min(nbytes, _PICKLE_MAX))
    preds = payloads.detections(n_images, 0, 1)
    pickled = b""

    def dump() -> None:
        nonlocal pickled
        pickled = pickle.dumps(preds, protocol=5)

    dumps = _best(dump, 2)
    loads = _best(lambda: pickle.loads(pickled), 2)
    gb = nbytes / 1e9
    pickle_gb = n_images * payloads.IMAGE_BYTES / 1e9
    return {
        "bytes": float(nbytes),
        "memcpy_gbps": gb / memcpy,
        "shm_write_gbps": gb / shm[0] if shm else None,
        "shm_read_gbps": gb / shm[1] if shm else None,
        "shm_gbps": gb / (shm[0] + shm[1]) if shm else None,
        "pickle_dumps_gbps": pickle_gb / dumps,
        "pickle_loads_gbps": pickle_gb / loads,
    }
