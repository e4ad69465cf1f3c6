"""What a ``store=`` argument names: a route (``"auto"``, ``"collective"``, ``"stream"``)
or a store, opened once per URL.

A URL is opened at its first use and the same ``gatherstore.stores.Store`` serves
every later call that names it (one job area per store); the stores opened this way
are closed when the process group is shut down.
"""

from __future__ import annotations

from ._config import ROUTES
from ._job import STORES
from .stores.base import Store
from .stores.registry import default_store, open_store

__all__ = ["close_opened", "resolve"]


def resolve(spec: str | Store | None) -> str | Store:
    """A route name, or an open Store (reused per URL); None: the default store.

    Raises:
        ValueError: an unknown scheme or a malformed URL.
        ImportError: the store needs a package that is not installed.
    """
    spec = default_store(spec)
    if isinstance(spec, Store) or spec in ROUTES:
        return spec
    opened = STORES.opened
    if spec not in opened:
        opened[spec] = open_store(spec)
    return opened[spec]


def close_opened() -> None:
    """Close and forget the stores opened from URLs (``shutdown`` calls it)."""
    opened = list(STORES.opened.values())
    STORES.opened.clear()
    for store in opened:
        store.close()
