"""Handed-over parts mapped from their memfds, and unmapped behind the program.

Unmapping the last mapping of a memfd frees its pages, about 0.15 s a GB on a 2-core
machine: a program that drops a gathered result would wait that long in its ``del``,
with nothing else to do.  A few threads of the process unmap instead, side by side (the
kernel frees the pages of several memfds in parallel), at most ``BEHIND`` bytes at a
time; beyond that, while the process forks, or when no thread can start, the program
unmaps as before.  Before this process maps another part it waits until every
unmapping it handed off is done, and so does a fork, so that a process never holds more
memory than it would unmapping at once, and a child never inherits a mapping that its
parent already let go.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import mmap
import os
import threading
import weakref

__all__ = ["BEHIND", "drained", "map_private"]

#: Bytes the unmapping threads may be left to unmap at a time.
BEHIND = 1 << 30
#: Unmapping threads: one per CPU of the process, at most this many.
UNMAPPERS = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
_libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Unmapping:
    """The mappings handed to this process's unmapping threads, and those threads."""

    def __init__(self) -> None:
        # reentrant: a finalizer may run in a thread that holds it (a garbage collection)
        self.changed = threading.Condition(threading.RLock())
        self.waiting: collections.deque[tuple[int, int]] = collections.deque()
        self.behind = 0  # bytes handed off and not unmapped yet
        self.threads = 0
        self.starting = threading.Lock()  # never taken by a finalizer
        self.forking = False

    def start(self) -> None:
        """One more thread while there are fewer than the process's CPUs (at most
        ``UNMAPPERS``).  Never from a finalizer: starting a thread takes threading's own
        lock, and a collection in a thread that holds that lock may run a finalizer."""
        with self.starting:
            if self.threads >= _most_threads():
                return
            thread = threading.Thread(target=self._unmap, name="gatherstore-unmap", daemon=True)
            try:
                thread.start()
            except (RuntimeError, MemoryError):  # no thread: unmapped in the program
                return
            with self.changed:
                self.threads += 1

    def hand_off(self, address: int, size: int) -> bool:
        """Queue a mapping for the threads; False when ``BEHIND`` bytes already wait, no
        thread runs, or the process forks (a child must not inherit it)."""
        if self.forking:  # before the lock: a forked child's may be held by a lost thread
            return False
        with self.changed:
            if self.forking or not self.threads or self.behind + size > BEHIND:
                return False
            self.behind += size
            try:
                self.changed.notify_all()  # the threads wake once the lock is let go
            finally:  # counted, so queued, whatever interrupts
                self.waiting.append((address, size))
        return True

    def drained(self) -> None:
        with self.changed:
            self.changed.notify_all()  # a thread that an interrupted hand-off left asleep
            self.changed.wait_for(lambda: self.behind == 0)

    def fork_begins(self) -> None:
        """Before a fork: unmap in the program from now on, and wait for the threads."""
        with self.changed:
            self.forking = True
        self.drained()

    def _unmap(self) -> None:
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.waiting)
                address, size = self.waiting.popleft()
            try:
                _libc.munmap(address, size)
            finally:
                with self.changed:
                    self.behind -= size
                    self.changed.notify_all()


@functools.cache
def _most_threads() -> int:
    """Unmapping threads this process may run: one per CPU of its affinity, at most
    ``UNMAPPERS`` (looked up once, not at every mapping)."""
    return min(UNMAPPERS, len(os.sched_getaffinity(0)))


_unmapping = _Unmapping()


def map_private(fd: int, size: int) -> memoryview:
    """``size`` bytes of ``fd`` mapped privately (writable, copied on write), unmapped
    once nothing views them.

    ``mmap.mmap`` would keep a duplicate of ``fd`` open for as long as the mapping
    lives: one descriptor per part a program keeps, until it runs out of them.

    Raises:
        OSError: the kernel refused the mapping (no address space or memory left).
    """
    _unmapping.start()
    drained()
    flags, prot = mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE
    address = _libc.mmap(None, size, prot, flags, fd, 0)
    if address in (None, _MAP_FAILED):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    pages = (ctypes.c_ubyte * size).from_address(address)
    # not at exit: an exit handler may still read the arrays (the kernel unmaps at exit)
    weakref.finalize(pages, _unmap, address, size).atexit = False
    return memoryview(pages).cast("B")


def drained() -> None:
    """Wait until this process's unmapping threads have unmapped all they were handed."""
    _unmapping.drained()


def _unmap(address: int, size: int) -> None:
    """A mapping nothing views any more: to the threads, else unmapped here."""
    if not _unmapping.hand_off(address, size):
        _libc.munmap(address, size)


def _fork_begins() -> None:
    _unmapping.fork_begins()


def _fork_ended() -> None:
    _unmapping.forking = False


def _forked() -> None:
    """In a forked child: nothing is left to unmap (the parent drained before the fork),
    and the parent's threads did not come along."""
    global _unmapping
    _unmapping = _Unmapping()


os.register_at_fork(before=_fork_begins, after_in_parent=_fork_ended, after_in_child=_forked)
