"""A scoped view of a store: every key lives under a prefix (a job's area)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .base import Buffer, Store

__all__ = ["ScopedStore"]


class ScopedStore(Store):
    """A view of a parent store whose keys all live under a prefix."""

    def __init__(self, parent: Store, prefix: str) -> None:
        self.parent = parent
        self.prefix = prefix.strip("/") + "/"
        self.max_value_size = parent.max_value_size  # type: ignore[misc]
        self.unavailable_errors = parent.unavailable_errors  # type: ignore[misc]
        self.reachable_by_others = parent.reachable_by_others  # type: ignore[misc]
        self.poll_interval = parent.poll_interval  # type: ignore[misc]
        self.sign_parts = parent.sign_parts

    def _write(self, key: str, buffers: Sequence[Buffer]) -> bool:
        return self.parent._write(self.prefix + key, buffers)

    def _read(self, key: str) -> Buffer | None:
        return self.parent._read(self.prefix + key)

    def _exists(self, key: str) -> bool:
        return self.parent._exists(self.prefix + key)

    def _list(self, prefix: str) -> Iterable[str]:
        n = len(self.prefix)
        return (k[n:] for k in self.parent._list(self.prefix + prefix))

    def _delete(self, keys: Sequence[str]) -> None:
        self.parent._delete([self.prefix + k for k in keys])

    def _delete_prefix(self, prefix: str) -> None:
        self.parent._delete_prefix(self.prefix + prefix)

    def _replace(self, key: str, buffers: Sequence[Buffer]) -> None:
        self.parent._replace(self.prefix + key, buffers)

    def _read_head(self, key: str, size: int) -> Buffer | None:
        return self.parent._read_head(self.prefix + key, size)

    def _write_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        return self.parent._write_many([(self.prefix + k, b) for k, b in items])

    def _read_many_into(self, items: Sequence[tuple[str, memoryview]]) -> list[int | None]:
        return self.parent._read_many_into([(self.prefix + k, v) for k, v in items])

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
