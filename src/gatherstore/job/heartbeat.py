"""The heartbeat of a job's areas: how ``gatherstore gc`` tells a live job from a dead one.

The process that creates a job area (rank 0) writes a small ``heartbeat``
value into it at once, then from a daemon timer thread every interval
(``GATHERSTORE_HEARTBEAT`` seconds, default 30, and at once when a call finds
the last beat over half an interval old: the call itself never waits for a
beat), until the job's end.  The value says when (wall clock),
at what interval, and which process beats: host, boot, PID and the process's
start time.  An area counts as gone only when its last beat is older than
``MISSED`` intervals (and than gc's ``--older-than``), and, seen from the
beating host, that very process no longer runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatherstore import _config as config
from gatherstore._time import deadline
from gatherstore.stores.base import Store

__all__ = [
    "HEARTBEAT",
    "MISSED",
    "on_call",
    "running",
    "start",
    "stop",
]

#: The key of the heartbeat in a job area.
HEARTBEAT = "heartbeat"
#: Intervals without a beat after which a job counts as gone.
MISSED = 4
_DEFAULT_INTERVAL = 30.0  # the timer's wait while no area is beating
_BEAT_TIMEOUT = 10.0  # seconds one beat may take on a slow store

_logger = logging.getLogger("gatherstore")


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def _started(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot), "" when unknown or gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return ""
    return "" if fields[0] in ("Z", "X") else fields[19]


def running(beat: dict[str, Any]) -> bool:
    """Whether the process that wrote ``beat`` still runs, as far as this host can tell
    (only on the host and boot that wrote it; False elsewhere)."""
    if beat.get("host") != socket.gethostname() or beat.get("boot") != _boot_id():
        return False
    pid = beat.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if beat.get("started"):
        return bool(_started(pid) == beat["started"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process with that PID
        return True
    return True


@dataclass
class _Area:
    """One job area this process beats in."""

    store: Store
    job: str
    every: float
    last: float = 0.0  # time.monotonic() of the last beat that landed
    fields: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False
    # held while a beat writes: the job's end waits for it, so no beat lands after it
    lock: threading.RLock = field(default_factory=threading.RLock)

    def beat(self) -> None:
        """Write the heartbeat now (best effort: a failed beat is logged at DEBUG)."""
        value = {**self.fields, "job": self.job, "at": time.time(), "every": self.every}
        with self.lock:
            if self.stopped:
                return
            try:
                with deadline(min(self.every, _BEAT_TIMEOUT)):
                    self.store.replace(HEARTBEAT, json.dumps(value).encode())
                self.last = time.monotonic()
            except Exception as exc:
                _logger.debug("heartbeat in %s failed: %s", self.store, exc)


_lock = threading.Lock()
_areas: dict[str, _Area] = {}  # locator -> area
_wake = [threading.Event()]  # set: the timer thread ends
_nudge = threading.Event()  # set: the timer thread looks at once (a call, or the end)


def start(locator: str, store: Store, job: str) -> None:
    """Beat in the job area ``store`` (at ``locator``) from now until ``stop``."""
    pid = os.getpid()
    me = {"host": socket.gethostname(), "boot": _boot_id(), "pid": pid, "started": _started(pid)}
    area = _Area(store, job, config.heartbeat_interval(), fields=me)
    area.beat()
    with _lock:
        first = not _areas
        _areas[locator] = area
        if first:
            _wake[0] = threading.Event()
            threading.Thread(
                target=_timer, args=(_wake[0],), name="gatherstore-heartbeat", daemon=True
            ).start()


def on_call(locator: str) -> None:
    """A call uses the area at ``locator``: if this process beats there and the last beat
    is more than half an interval old, have the timer thread beat now.  Never waits: a
    slow or frozen store must not hold up the call (which has its own deadline)."""
    area = _areas.get(locator)
    if area is not None and time.monotonic() - area.last > area.every / 2:
        _nudge.set()


def stop(locator: str) -> None:
    """Stop beating in the area at ``locator`` (its job ends), once a beat under way has
    landed; the timer thread ends with the last area."""
    with _lock:
        area = _areas.pop(locator, None)
        if not _areas:
            _wake[0].set()
            _nudge.set()
    if area is not None:
        with area.lock:
            area.stopped = True


def _timer(wake: threading.Event) -> None:
    while True:
        with _lock:
            every = min((a.every for a in _areas.values()), default=_DEFAULT_INTERVAL)
        _nudge.wait(every)  # an interval, or a call's nudge
        _nudge.clear()
        if wake.is_set():
            return
        with _lock:
            areas = list(_areas.values())
        for area in areas:
            if time.monotonic() - area.last >= area.every / 2:
                area.beat()


def _forget_in_child() -> None:
    """A forked child does not beat for its parent: its timer thread did not come along."""
    _areas.clear()
    _wake[0] = threading.Event()


os.register_at_fork(after_in_child=_forget_in_child)
