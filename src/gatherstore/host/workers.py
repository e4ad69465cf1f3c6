"""One pool of worker threads per process, for work that releases the GIL: checksums of
large parts, copies out of the pinned buffer.

Plain threads, not torch's: several ranks share a machine, and OpenMP threads
that spin while waiting slow every rank down once there are more of them than
cores (a copy of 256 MiB ran 20x slower with four ranks of 16 threads each).
A process forked from a rank makes a pool of its own at first use.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["run", "submit"]

#: Threads of the pool: one per core, at most this many.
MAX_THREADS = 16
T = TypeVar("T")

_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}  # by process id


def _forked() -> None:
    """In a forked child: a lock held by a thread that did not come along is free again."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def _pool() -> ThreadPoolExecutor:
    with _lock:
        pid = os.getpid()
        if pid not in _pools:
            _pools.clear()
            threads = min(os.cpu_count() or 1, MAX_THREADS)
            _pools[pid] = ThreadPoolExecutor(threads, thread_name_prefix="gatherstore-worker")
        return _pools[pid]


def run(fn: Callable[..., T], items: Iterable[Any]) -> list[T]:
    """``fn(item)`` for every item, on the pool's threads (inline for one item); the
    results in order."""
    work = list(items)
    if len(work) <= 1:
        return [fn(item) for item in work]
    return list(_pool().map(fn, work))


def submit(fn: Callable[..., T], *args: Any) -> Future[T]:
    """``fn(*args)`` on the pool's threads, now; its future."""
    return _pool().submit(fn, *args)
