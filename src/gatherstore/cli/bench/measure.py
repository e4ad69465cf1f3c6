"""Sizes and memory: parse ``256MB``, format bytes, peak RSS growth from /proc/self."""

from __future__ import annotations

from gatherstore._config import parse_size
from gatherstore.routes.progress import format_bytes

__all__ = ["PeakMemory", "format_bytes", "parse_size"]


def _status(field: str) -> int:
    """A ``Vm*`` field of /proc/self/status in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakMemory:
    """Peak RSS growth of this process over a ``with`` block.

    On entry the kernel's high-water mark is reset (``5`` to /proc/self/clear_refs,
    where allowed; ``reset`` tells) and RSS is read; ``growth`` is VmHWM at exit
    minus that RSS.
    """

    def __init__(self) -> None:
        self.before = 0
        self.growth = 0
        self.reset = False

    def __enter__(self) -> PeakMemory:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset = True
        except OSError:
            self.reset = False
        self.before = _status("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth = max(0, _status("VmHWM") - self.before)
