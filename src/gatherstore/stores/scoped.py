"""A view of a store whose keys all live under a prefix (what ``Store.scoped`` returns).

Every primitive is the parent's, forwarded by how it names keys (see
``backend.PRIMITIVES``), so a new primitive cannot be missed: the module refuses to
load while one is not forwarded.  What the parent can do is the view's too; only
whether parts are signed is the view's own.
"""

from __future__ import annotations

from typing import Any

from .backend import PRIMITIVES
from .base import Store

__all__ = ["ScopedStore"]


def _forward(name: str) -> Any:
    """Primitive ``name`` of a view under a prefix: the parent's, with the prefix added to
    every key it names (see ``PRIMITIVES``), and removed from those it lists."""
    shape = PRIMITIVES[name]

    def forwarded(self: ScopedStore, keys: Any, *rest: Any) -> Any:
        p = self.prefix
        if shape in ("key", "prefix"):
            keys = p + keys
        elif shape == "keys":
            keys = [p + key for key in keys]
        else:
            keys = [(p + key, value) for key, value in keys]
        out = getattr(self.parent, name)(keys, *rest)
        return (key[len(p) :] for key in out) if name == "_list" else out

    forwarded.__name__ = forwarded.__qualname__ = name
    return forwarded


def _parents(name: str) -> Any:
    """An attribute of a view under a prefix that is its parent's."""
    return property(lambda self: getattr(self.parent, name))


class ScopedStore(Store):
    """A view of a parent store whose keys all live under a prefix: every primitive is
    the parent's (by ``PRIMITIVES``, so none can be missed), and so is what
    the parent can do; only whether parts are signed is the view's own."""

    def __init__(self, parent: Store, prefix: str) -> None:
        super().__init__()
        self.parent = parent
        self.prefix = prefix.strip("/") + "/"
        self.sign_parts = parent.sign_parts

    _write = _forward("_write")
    _read = _forward("_read")
    _exists = _forward("_exists")
    _list = _forward("_list")
    _delete = _forward("_delete")
    _delete_prefix = _forward("_delete_prefix")
    _replace = _forward("_replace")
    _write_many = _forward("_write_many")
    _read_many = _forward("_read_many")
    _read_many_into = _forward("_read_many_into")
    _read_head = _forward("_read_head")

    max_value_size = _parents("max_value_size")
    unavailable_errors = _parents("unavailable_errors")
    poll_interval = _parents("poll_interval")
    reachable_by_others = _parents("reachable_by_others")
    is_private = _parents("is_private")
    persistent = _parents("persistent")
    shares_memory_with_host = _parents("shares_memory_with_host")

    @property
    def url(self) -> str:
        return self.parent.url

    def __str__(self) -> str:
        return f"{self.parent} [{self.prefix}]"

    def close(self) -> None:
        self.parent.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (ScopedStore, (self.parent, self.prefix))

    def _identity(self) -> tuple[Any, ...]:
        return (*self.parent._identity(), self.prefix)


_unforwarded = sorted(set(PRIMITIVES) - set(vars(ScopedStore)))
if _unforwarded:  # pragma: no cover - a primitive added to the table but not here
    raise TypeError(f"ScopedStore does not forward {_unforwarded}")
