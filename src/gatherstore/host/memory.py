"""How much memory this process may still use: the node's, capped by its memory cgroups.

The kernel kills a process that outgrows its memory cgroup, and /dev/shm holds
its files in the same RAM.  The headroom is ``MemAvailable``, capped by every
enclosing cgroup's limit minus its usage (v1 and v2, less the page cache the
kernel drops first); the free space of /dev/shm is reported beside it.  What a
route needs of it is ``gatherstore.calls.fit``'s.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

from gatherstore._config import SHM
from gatherstore.host import mappings

__all__ = ["cgroup_headroom", "headroom", "mem_available", "shm_free"]

_UNLIMITED = 1 << 62
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> bytes | None:
    """A small file's bytes (one ``read``: these are read on every call), or None."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if text == b"max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _reclaimable(stat: Path, field: str) -> int:
    """Page cache the kernel drops before it kills (``inactive_file`` of memory.stat)."""
    text = _read(stat)
    if text is not None:
        key = b"\n" + field.encode() + b" "
        start = (b"\n" + text).find(key)
        if start >= 0:
            end = text.find(b"\n", start)
            with contextlib.suppress(ValueError):
                return int(text[start + len(key) - 1 : None if end < 0 else end])
    return 0


@functools.lru_cache(maxsize=8)
def _cgroup_dirs(proc_cgroup: str) -> tuple[tuple[Path, str, str, str], ...]:
    """(directory, limit file, usage file, reclaimable field) of this process's memory cgroup
    and every ancestor, for cgroup v2 and v1 (the same for as long as the process stays
    in its cgroups: kept)."""
    return tuple(_walk(proc_cgroup))


def _walk(proc_cgroup: str) -> Iterator[tuple[Path, str, str, str]]:
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            files = ("memory.max", "memory.current", "inactive_file")
            mount = _CGROUP_ROOT
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            mount = _CGROUP_ROOT / "memory"
        else:
            continue
        directory = mount / path.lstrip("/")
        while True:
            yield (directory, *files)
            if directory == mount or mount not in directory.parents:
                break
            directory = directory.parent


def cgroup_headroom(proc_cgroup: str | None = None) -> int:
    """Bytes this process's memory cgroups still allow (huge when unlimited or unknown)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return _UNLIMITED
    room = _UNLIMITED
    for directory, limit_file, usage_file, field in _cgroup_dirs(proc_cgroup):
        limit = _read_int(directory / limit_file)
        usage = _read_int(directory / usage_file)
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        used = max(usage - _reclaimable(directory / "memory.stat", field), 0)
        room = min(room, max(limit - used, 0))
    return room


def mem_available() -> int:
    """``MemAvailable`` of /proc/meminfo in bytes (huge when unknown)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return _UNLIMITED


def headroom() -> int:
    """Bytes this process may still allocate: ``MemAvailable`` capped by its cgroups, once
    the parts it let go are unmapped (see ``gatherstore.host.mappings``)."""
    mappings.drained()
    return min(mem_available(), cgroup_headroom())


def shm_free() -> int:
    """Free bytes of /dev/shm when this process can write there, else 0."""
    with contextlib.suppress(OSError):
        if os.access(SHM, os.W_OK):
            stat = os.statvfs(SHM)
            return stat.f_bavail * stat.f_frsize
    return 0
