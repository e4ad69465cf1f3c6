"""Stores by URL scheme: lazy ``"module:Class"`` targets, entry points, fsspec fallback.

Precedence of the default store: the call's argument, then
:func:`set_default_store`, then ``GATHERSTORE_STORE``, then ``"auto"``.
"""

from __future__ import annotations

import importlib
import os
import urllib.parse
from importlib.metadata import entry_points
from typing import Any

from .base import Store

__all__ = [
    "ROUTES",
    "default_store",
    "known_schemes",
    "open_store",
    "register_store",
    "set_default_store",
]

#: Specs that are routes in ``objects.py``, not byte stores.
ROUTES = ("auto", "collective", "stream")

_registry: dict[str, str | type[Store]] = {
    "tmpdir": "gatherstore.stores.file:TmpdirStore",
    "file": "gatherstore.stores.file:FileStore",
    "redis": "gatherstore.stores.redis:RedisStore",
    "rediss": "gatherstore.stores.redis:RedisStore",
    "unix": "gatherstore.stores.redis:RedisStore",
}
_hints = {
    "redis": "pip install redis",
    "s3": "pip install 'gatherstore[s3]'",
    "gs": "pip install gcsfs",
    "az": "pip install adlfs",
}
_entry_points_loaded = [False]
_default: list[str | Store | None] = [None]


def register_store(scheme: str, target: str | type[Store], *, clobber: bool = False) -> None:
    """Make ``scheme://`` URLs open ``target`` (a Store class or ``"module:Class"``).

    Raises:
        ValueError: ``scheme`` is already registered to something else and
            ``clobber`` is False.
    """
    current = _registry.get(scheme)
    if current is not None and current != target and not clobber:
        raise ValueError(
            f"store scheme {scheme!r} is already registered to {current!r}; "
            "pass clobber=True to replace it"
        )
    _registry[scheme] = target


def _load_entry_points() -> None:
    if _entry_points_loaded[0]:
        return
    _entry_points_loaded[0] = True
    for ep in entry_points(group="gatherstore.stores"):
        if ep.name not in _registry:
            _registry[ep.name] = ep.value


def known_schemes() -> list[str]:
    """Every scheme gatherstore can open, fsspec's protocols included."""
    _load_entry_points()
    from fsspec.registry import known_implementations

    return sorted(set(_registry) | set(known_implementations) | set(ROUTES))


def _resolve(scheme: str) -> type[Store]:
    _load_entry_points()
    target = _registry.get(scheme)
    if target is None:
        from fsspec.registry import known_implementations

        if scheme in known_implementations:
            target = "gatherstore.stores.fsspec:FsspecStore"
        else:
            raise ValueError(
                f"unknown store scheme {scheme!r}; known: {', '.join(known_schemes())} "
                "(or register one with gatherstore.stores.register_store)"
            )
    if isinstance(target, str):
        module, _, name = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), name)
        except ImportError as exc:
            hint = _hints.get(scheme, f"install the package that provides {module}")
            raise ImportError(f"store scheme {scheme!r} needs {exc.name}: {hint}") from exc
    assert isinstance(target, type)
    return target


def open_store(spec: str | Store, **options: Any) -> Store:
    """The store a spec names: a Store (returned as is) or a URL.

    ``"tmpdir"`` / ``"tmpdir:///base"``, ``"file:///shared/dir"``,
    ``"redis://host:port/db"``, ``"s3://bucket/prefix"`` or any fsspec URL;
    ``options`` go to the store (fsspec storage options, Redis options, ...).

    Raises:
        ValueError: unknown scheme, or a route ("auto", "collective") that is not a store.
    """
    if isinstance(spec, Store):
        if options:
            raise ValueError("options apply to URLs only; this store is already open")
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"store spec {spec!r} is not a Store or a URL")
    if spec in ROUTES:
        raise ValueError(
            f"{spec!r} is a route for object collectives, not a byte store; "
            "pass it as store= to the object collectives, or open tmpdir, file://, "
            "redis:// or an fsspec URL here"
        )
    scheme = urllib.parse.urlsplit(spec).scheme or spec.split(":", 1)[0]
    return _resolve(scheme).from_url(spec, **options)


def set_default_store(spec: str | Store | None) -> None:
    """Make ``spec`` the store object collectives use when none is passed (None: unset)."""
    if isinstance(spec, str) and spec not in ROUTES:
        scheme = urllib.parse.urlsplit(spec).scheme or spec
        _resolve(scheme)
    _default[0] = spec


def default_store(spec: str | Store | None = None) -> str | Store:
    """The spec in force: ``spec``, else the default set, else $GATHERSTORE_STORE, else auto."""
    if spec is not None:
        return spec
    if _default[0] is not None:
        return _default[0]
    return os.environ.get("GATHERSTORE_STORE") or "auto"
