"""Progress of long gathers on the destination, and one DEBUG line per call.

Everything is reported on the ``gatherstore`` logger.  A destination that
receives a gather expected to take more than a few seconds shows its progress
as parts and bytes arrive: a tqdm bar on stderr when tqdm is installed, else
INFO lines on the logger.  ``progress=`` on a call decides; without it,
``GATHERSTORE_PROGRESS=0/1`` does; without that, progress shows when stderr is
a terminal and the gather is long.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from gatherstore import _config as config

__all__ = ["Progress", "format_bytes", "log_call", "logger", "wanted"]

#: The library's logger: DEBUG has one line per call (route, bytes, seconds).
logger = logging.getLogger("gatherstore")

#: Bytes per second assumed when guessing whether a gather is long.
_ASSUMED_RATE = 200e6
#: A gather expected to take at least this many seconds shows progress by default.
_LONG = 3.0
#: Seconds between two INFO lines when tqdm is not installed.
_LOG_EVERY = 5.0


def wanted(progress: bool | None, nbytes: int) -> bool:
    """Whether a destination receiving ``nbytes`` shows progress."""
    if progress is not None:
        return progress
    setting = config.progress()
    if setting is not None:
        return setting
    return sys.stderr.isatty() and nbytes / _ASSUMED_RATE >= _LONG


class Progress:
    """Parts and bytes received by one call; a no-op when not ``enabled``."""

    def __init__(self, what: str, parts: int, nbytes: int, *, enabled: bool) -> None:
        self.what, self.parts, self.nbytes = what, parts, nbytes
        self.done_parts = self.done_bytes = 0
        self.bar: Any = None
        self.enabled = enabled
        self.last_log = time.monotonic()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            logger.info("%s: receiving %d parts, %s", what, parts, format_bytes(nbytes))
            return
        self.bar = tqdm(
            total=nbytes, desc=what, unit="B", unit_scale=True, unit_divisor=1024, leave=False
        )

    def update(self, nbytes: int, parts: int = 1) -> None:
        """``nbytes`` more are in, completing ``parts`` parts (0 for a chunk of one)."""
        if not self.enabled:
            return
        self.done_parts += parts
        self.done_bytes += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"{self.done_parts}/{self.parts} parts", refresh=False)
        elif self.done_parts == self.parts or time.monotonic() - self.last_log >= _LOG_EVERY:
            self.last_log = time.monotonic()
            logger.info(
                "%s: %d/%d parts, %s of %s",
                self.what,
                self.done_parts,
                self.parts,
                format_bytes(self.done_bytes),
                format_bytes(self.nbytes),
            )

    def close(self) -> None:
        """Remove the bar (idempotent)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def log_call(
    what: str, route: str, nbytes: int, started: float, laps: list[tuple[str, float]]
) -> None:
    """The DEBUG line every rank logs once per call, with the seconds of each phase that
    ended at a lap (``(phase, perf_counter())``, in order) and of the reading after the
    last one; a handler finds them as a dict in the record's ``gatherstore_phases``."""
    ended = time.perf_counter()
    phases: dict[str, float] = {}
    last = started
    for phase, at in [*laps, ("read", ended)]:
        phases[phase] = phases.get(phase, 0.0) + at - last
        last = at
    logger.debug(
        "%s: route %s, %d bytes, %.3f s (%s)",
        what,
        route,
        nbytes,
        ended - started,
        ", ".join(f"{phase} {seconds:.3f} s" for phase, seconds in phases.items()),
        extra={"gatherstore_phases": phases},
    )


def format_bytes(nbytes: float) -> str:
    """``nbytes`` with a binary unit, e.g. ``1.5 GiB`` (negative values keep their sign)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
