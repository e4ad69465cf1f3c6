"""What a result set needs of the rest of gatherstore, in one place: its store, the
signals it flushes on, and the memory it may use (its collectives go through the one
entry, ``gatherstore.calls.entry``).

Result sets use the core only through these few functions, so that the core's
internals (the statuses, the session) can change under them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from gatherstore._config import ROUTES
from gatherstore.host import memory
from gatherstore.job import session, signals, topology
from gatherstore.stores.base import Store
from gatherstore.stores.registry import default_store, open_store

__all__ = [
    "forget_stop",
    "headroom",
    "on_stop",
    "open_persistent",
    "rank",
    "world_size",
]

T = TypeVar("T")
_USE = (
    "a result set needs a store that outlives the job: file:///<shared dir>, "
    "redis://host:port/db, s3://bucket/prefix, gs:// or az:// (memory:// for tests in one "
    "process)"
)
rank = topology.get_rank
world_size = topology.get_world_size
headroom = memory.headroom


def open_persistent(store: str | Store | None) -> Store:
    """The store ``store`` names (None: the default), when it keeps values after the job.

    Raises:
        ValueError: a route (``auto``, ``collective``, ``stream``), ``tmpdir`` (removed
            when the job ends), ``memory://`` in a job of several processes, or a bad URL;
            the message names the stores to use.
        ImportError: the store needs a package that is not installed.
    """
    spec = default_store(store)
    if isinstance(spec, str) and spec in ROUTES:
        raise ValueError(f"store={spec!r} is a route, not a store: {_USE}")
    opened = open_store(spec) if isinstance(spec, str) else spec
    if opened.url.startswith("memory:"):  # not persistent, but fine for tests in one process
        if topology.get_world_size() > 1:
            raise ValueError(f"store={opened.url!r} lives inside one process: {_USE}")
    elif not opened.persistent:
        raise ValueError(f"store={opened.url!r} is removed when the job ends: {_USE}")
    return opened


def on_stop(flush: Callable[[], None]) -> None:
    """Run ``flush`` first on SIGTERM/SIGINT, whoever handles them; where the program has
    no handler, gatherstore's removes the job's areas after it, then ends as the default
    action would (the handler gs.launch and init_from_env install)."""
    signals.install(session.abandon)
    signals.on_stop(flush)


def forget_stop(flush: Callable[[], None]) -> None:
    """Stop running ``flush`` on signals."""
    signals.forget_stop(flush)
