"""What a stopping process does for the result sets it writes.

On SIGTERM or SIGINT, whichever handler is in charge, every open set writes
what it buffered (see ``_signals``' stop hooks); at ``gs.shutdown()`` and at
exit each writes it and ends its run, so that the next job takes the set over
at once.  A process
forked from a rank (a DataLoader worker) does neither for the rank's sets.
"""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Protocol

from gatherstore.job import hooks
from gatherstore.results import job

__all__ = ["STOP_FLUSH", "closed", "end_all", "opened"]

#: Seconds a stopping process (a signal, or its exit) waits for its values to be written.
STOP_FLUSH = 60.0


class _Open(Protocol):
    def drain(self) -> None: ...

    def end(self) -> None: ...


_live: weakref.WeakSet[_Open] = weakref.WeakSet()


def opened(rs: _Open) -> None:
    """``rs`` is open: flush it on a stop signal, end it at exit."""
    _live.add(rs)
    job.on_stop(_drain_all)


def closed(rs: _Open) -> None:
    """``rs`` is closed or discarded: nothing more to do for it."""
    _live.discard(rs)


def _drain_all() -> None:
    for rs in list(_live):
        rs.drain()


@atexit.register
def end_all() -> None:
    """Write what every open set buffered and end its run (``gs.shutdown``, and at exit)."""
    for rs in list(_live):
        rs.end()


os.register_at_fork(after_in_child=_live.clear)
hooks.at_shutdown(end_all, before_group_ends=True)
