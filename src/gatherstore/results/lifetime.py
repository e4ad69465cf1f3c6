"""What a stopping process does for the result sets it writes.

On SIGTERM or SIGINT, whichever handler is in charge, every open set writes
what it buffered (see ``gatherstore.job.signals``' stop hooks); at ``gs.shutdown()`` and at
exit each writes it and ends its run, so that the next job takes the set over
at once.  A process
forked from a rank (a DataLoader worker) does neither for the rank's sets.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable

from gatherstore.job import hooks
from gatherstore.results import job

__all__ = ["STOP_FLUSH", "closed", "end_all", "opened"]

#: Seconds a stopping process (a signal, or its exit) waits for its values to be written.
STOP_FLUSH = 60.0


#: Each open set's ``drain`` and ``end``, held weakly: a set the program dropped is gone.
_live: weakref.WeakKeyDictionary[object, tuple[weakref.WeakMethod[Callable[[], None]], ...]]
_live = weakref.WeakKeyDictionary()


def opened(rs: object, *, drain: Callable[[], None], end: Callable[[], None]) -> None:
    """``rs`` is open: ``drain()`` writes what it buffered on a stop signal, ``end()``
    ends its run at exit."""
    _live[rs] = (weakref.WeakMethod(drain), weakref.WeakMethod(end))
    job.on_stop(_drain_all)


def closed(rs: object) -> None:
    """``rs`` is closed or discarded: nothing more to do for it."""
    _live.pop(rs, None)


def _each(which: int) -> None:
    for methods in list(_live.values()):
        method = methods[which]()
        if method is not None:
            method()


def _drain_all() -> None:
    _each(0)


@atexit.register
def end_all() -> None:
    """Write what every open set buffered and end its run (``gs.shutdown``, and at exit)."""
    _each(1)


os.register_at_fork(after_in_child=_live.clear)
hooks.at_shutdown(end_all, before_group_ends=True)
