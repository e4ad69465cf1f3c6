"""What a ``store=`` argument names: a route (``"auto"``, ``"collective"``, ``"stream"``)
or a store, opened once per URL.

A URL is opened at its first use and the same ``gatherstore.stores.Store`` serves
every later call that names it (one job area per store); the stores opened this way
are closed when the process group is shut down.
"""

from __future__ import annotations

from gatherstore._config import ROUTES
from gatherstore.stores.base import Store
from gatherstore.stores.registry import default_store, open_store

__all__ = ["close_opened", "resolve"]

#: The stores opened from URLs, by URL: reused per URL, closed at ``shutdown``.
_opened: dict[str, Store] = {}


def resolve(spec: str | Store | None) -> str | Store:
    """A route name, or an open Store (reused per URL); None: the default store.

    Raises:
        ValueError: an unknown scheme or a malformed URL.
        ImportError: the store needs a package that is not installed.
    """
    spec = default_store(spec)
    if isinstance(spec, Store) or spec in ROUTES:
        return spec
    if spec not in _opened:
        _opened[spec] = open_store(spec)
    return _opened[spec]


def close_opened() -> None:
    """Close and forget the stores opened from URLs (``shutdown`` calls it)."""
    opened = list(_opened.values())
    _opened.clear()
    for store in opened:
        store.close()
