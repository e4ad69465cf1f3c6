"""Stores by URL scheme: lazy ``"module:Class"`` targets, entry points, fsspec fallback.

Precedence of the default store: the call's argument, then
``set_default_store``, then ``GATHERSTORE_STORE``, then ``"auto"``.
"""

import difflib
import importlib
import os
import urllib.parse
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from gatherstore import _config as config
from gatherstore._config import ROUTES
from gatherstore.stores.base import Store, hide_password

__all__ = [
    "check_scheme",
    "default_store",
    "known_schemes",
    "open_store",
    "register_store",
    "set_default_store",
]


_FSSPEC = "gatherstore.stores.fsspec:FsspecStore"

#: scheme -> {"class": Store class or "module:Class", "needs": the package it imports,
#: "err": the command that installs it}, as fsspec keeps them
_registry: dict[str, dict[str, Any]] = {
    "tmpdir": {"class": "gatherstore.stores.tmpdir:TmpdirStore"},
    "file": {"class": "gatherstore.stores.file:FileStore"},
    **{
        scheme: {
            "class": "gatherstore.stores.redis:RedisStore",
            "needs": "redis",
            "err": "pip install redis",
        }
        for scheme in ("redis", "rediss", "unix")
    },
    "s3": {"class": _FSSPEC, "needs": "s3fs", "err": "pip install 'gatherstore[s3]'"},
    "gs": {"class": _FSSPEC, "needs": "gcsfs", "err": "pip install gcsfs"},
    "az": {"class": _FSSPEC, "needs": "adlfs", "err": "pip install adlfs"},
}
_entry_points_loaded = [False]
_default: list[str | Store | None] = [None]


def register_store(
    scheme: str, target: str | type[Store], *, clobber: bool = False, hint: str | None = None
) -> None:
    """Make ``scheme://`` URLs open ``target``, in this process.

    A package can register its store for every process instead, with an entry point in
    the group ``gatherstore.stores`` (see "A store of your own").

    Args:
        scheme: the URL scheme, without ``://``.
        target: a ``Store`` subclass, or ``"module:Class"``, imported at the first
            use of the scheme (so that registering costs no import).
        clobber: replace what the scheme is registered to.
        hint: how to install what ``target`` needs (e.g. ``"pip install mystore"``),
            shown when its import fails.

    Raises:
        ValueError: ``scheme`` is already registered to something else and
            ``clobber`` is False.

    Examples:
        >>> gs.register_store("mystore", "mypackage.stores:MyStore")
        >>> store = gs.open_store("mystore://bucket/prefix")
    """
    current = _registry.get(scheme, {}).get("class")
    if current is not None and current != target and not clobber:
        raise ValueError(
            f"store scheme {scheme!r} is already registered to {current!r}; "
            "pass clobber=True to replace it"
        )
    _registry[scheme] = {"class": target, **({"err": hint} if hint else {})}


def _load_entry_points() -> None:
    if _entry_points_loaded[0]:
        return
    _entry_points_loaded[0] = True
    for ep in entry_points(group="gatherstore.stores"):
        if ep.name not in _registry:
            _registry[ep.name] = {"class": ep.value}


def known_schemes() -> list[str]:
    """Every scheme gatherstore can open, fsspec's protocols included.

    Returns:
        The schemes, sorted, with the routes ``auto``, ``collective`` and ``stream``.

    Examples:
        >>> "redis" in gatherstore.stores.known_schemes()
        True
    """
    _load_entry_points()
    from fsspec.registry import known_implementations

    return sorted(set(_registry) | set(known_implementations) | set(ROUTES))


def _entry(scheme: str) -> dict[str, Any]:
    """The registry entry of ``scheme`` (fsspec's protocols open FsspecStore)."""
    _load_entry_points()
    entry = _registry.get(scheme)
    if entry is not None:
        return entry
    from fsspec.registry import known_implementations

    if scheme in known_implementations:  # its package is its class's, e.g. "ocifs.OCIFileSystem"
        package = known_implementations[scheme]["class"].partition(".")[0]
        if package == "fsspec":  # one of fsspec's own: what it misses is named when it fails
            return {"class": _FSSPEC}
        return {"class": _FSSPEC, "needs": package, "err": f"pip install {package}"}
    close = difflib.get_close_matches(scheme, known_schemes(), n=1)
    raise ValueError(
        f"unknown store scheme {scheme!r}"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + "; gatherstore's stores are tmpdir, tmpdir:///base, file:///shared/dir, "
        "redis://host:port/db (rediss://, unix://), s3://bucket/prefix, gs://, az:// and "
        "the other fsspec protocols, and the routes auto, collective and stream; "
        "gatherstore.stores.register_store adds one"
    )


def _missing(scheme: str, entry: dict[str, Any], exc: ImportError) -> ImportError:
    """The ImportError of a store whose package is missing, in one sentence that ends with
    the command that installs it (fsspec's own ImportError names the missing module only
    in its cause)."""
    cause = exc.__cause__ if isinstance(exc.__cause__, ImportError) else None
    name = exc.name or (cause.name if cause else None) or entry.get("needs")
    if entry.get("err") and entry.get("needs") in (None, name):
        hint = entry["err"]  # the scheme's own command (an extra may bring more)
    else:  # a package the scheme's package needs in turn, or one of fsspec's own
        hint = f"pip install {name}" if name else "install the package that provides it"
    return ImportError(
        f"store scheme {scheme!r} needs {name or exc}, which is not installed: {hint}", name=name
    )


def check_scheme(spec: str) -> None:
    """Check that the URL ``spec`` names a store gatherstore knows, without importing or
    opening it.

    Raises:
        ValueError: the URL cannot be parsed, or its scheme is unknown; names the URL
            (passwords and secret query parameters hidden).  A bare path is refused with
            its ``file://`` URL.
    """
    if spec.startswith(("/", ".", "~")) or ("/" in spec and ":" not in spec):
        url = Path(os.path.abspath(os.path.expanduser(spec))).as_uri()
        raise ValueError(f"store {spec!r} is a path, not a store URL: give its URL, {url}")
    scheme = _scheme(spec)
    try:
        _entry(scheme)
    except ValueError as exc:
        raise ValueError(f"store {hide_password(spec)!r}: {exc}") from None


def _resolve(scheme: str) -> type[Store]:
    entry = _entry(scheme)
    target = entry["class"]
    if isinstance(target, str):
        module, _, name = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), name)
        except ImportError as exc:
            raise _missing(scheme, entry, exc) from None
        except AttributeError:
            raise TypeError(f"store scheme {scheme!r}: {module} has no {name!r}") from None
    if not (isinstance(target, type) and issubclass(target, Store)):
        raise TypeError(
            f"store scheme {scheme!r} is registered to {target!r}, which is not a "
            "gatherstore.stores.Store subclass; register a Store subclass"
        )
    return target


def _scheme(spec: str) -> str:
    """The scheme of a URL (``a::b://…`` chains are fsspec's: their first protocol)."""
    first = spec.split("::", 1)[0]
    try:
        scheme = urllib.parse.urlsplit(first).scheme
    except ValueError as exc:
        raise ValueError(
            f"store URL {hide_password(spec)!r} cannot be parsed ({exc}); use "
            "scheme://host[:port]/path, e.g. redis://host:6379/0 or s3://bucket/prefix"
        ) from None
    return scheme or first.split(":", 1)[0]


def open_store(spec: str | Store, **options: Any) -> Store:
    """The store a spec names, open: to pass as ``store=`` to several calls, or to
    use through the ``Store`` API.

    Args:
        spec: a ``Store`` (returned as it is) or a URL: ``"tmpdir"`` or
            ``"tmpdir:///base"``, ``"file:///shared/dir"``, ``"redis://host:port/db"``,
            ``"s3://bucket/prefix"`` or any fsspec URL.
        **options: the store's options (fsspec storage options, Redis options, ...;
            see each store's page); ``sign=True`` or ``False`` overrides whether parts
            are signed.

    Returns:
        The store.  Stores opened from the same URL and options are equal, and share
        one job area.

    Raises:
        ValueError: a malformed URL or option, an unknown scheme, or a route
            ("auto", "collective") that is not a store; the message names the spec.
        ImportError: the store needs a package that is not installed (with the
            command that installs it).
        TypeError: the scheme is registered to something that is not a Store.

    Examples:
        >>> store = gs.open_store("s3://eval-results/run-42", anon=False)
        >>> merged = gs.gather_object(preds, store=store)
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
    check_scheme(spec)
    cls = _resolve(_scheme(spec))
    try:
        return cls.from_url(spec, **options)
    except ImportError as exc:  # a package the store needs at open time, e.g. s3fs
        last = _scheme(spec.rsplit("::", 1)[-1])  # in a chain, the innermost filesystem's
        raise _missing(last, _entry(last), exc) from None


def set_default_store(spec: str | Store | None) -> None:
    """Make ``spec`` the store object collectives use when none is passed, in this
    process (call it on every rank).

    It comes before ``GATHERSTORE_STORE``; a call's own ``store=`` comes before it.

    Args:
        spec: a store URL, a ``Store``, a route (``"auto"``, ``"collective"``,
            ``"stream"``), or None to unset it.  A URL's scheme is checked now; the
            store opens at its first use.

    Raises:
        ValueError: a malformed URL or an unknown scheme.
        ImportError: the scheme's store needs a package that is not installed.
        TypeError: the scheme is registered to something that is not a Store.

    Examples:
        >>> gs.set_default_store("file:///nfs/scratch/gather")
        >>> merged = gs.gather_object(preds)  # through that folder
    """
    if isinstance(spec, str) and spec not in ROUTES:
        check_scheme(spec)
        _resolve(_scheme(spec))
    _default[0] = spec


def default_store(spec: str | Store | None = None) -> str | Store:
    """The store spec in force.

    Args:
        spec: a call's own ``store=``.

    Returns:
        ``spec``, else what ``set_default_store`` set, else ``GATHERSTORE_STORE``, else
        ``"auto"``.

    Examples:
        >>> gatherstore.stores.default_store()  # nothing set
        'auto'
    """
    if spec is not None:
        return spec
    if _default[0] is not None:
        return _default[0]
    return config.store_spec() or "auto"
