"""A store of the tests' own over one of gatherstore's, written as docs/stores/custom.md
writes a store (the primitives of ``gatherstore.stores.Store``): a test that needs a
store to behave otherwise (slow reads, altered writes) changes it in a subclass of
:class:`Over`, never in gatherstore's own store classes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import gatherstore as gs


def _passed_on(name: str) -> property:
    """What the inner store can do, as the outer one's."""
    return property(lambda self: getattr(self.inner, name))


class Over(gs.Store):
    """The store ``inner``: every primitive, job hook and capability passed on to it.
    Reads and writes of many keys go through ``_read`` and ``_write`` one key at a time
    (the base class's way), so that a subclass that changes those changes every one."""

    def __init__(self, inner: gs.Store) -> None:
        super().__init__()
        self.inner = inner
        self.sign_parts = inner.sign_parts

    @classmethod
    def _from_url(cls, url: str, **options: Any) -> gs.Store:
        return cls(gs.open_store(url, **options))

    @property
    def url(self) -> str:
        return self.inner.url

    def _options(self) -> dict[str, Any]:
        return self.inner._options()

    def __str__(self) -> str:
        return f"{type(self).__name__} over {self.inner}"

    max_value_size = _passed_on("max_value_size")
    unavailable_errors = _passed_on("unavailable_errors")
    poll_interval = _passed_on("poll_interval")
    reachable_by_others = _passed_on("reachable_by_others")
    is_private = _passed_on("is_private")
    persistent = _passed_on("persistent")
    shares_memory_with_host = _passed_on("shares_memory_with_host")
    supports_handover = _passed_on("supports_handover")
    folder = _passed_on("folder")

    # --- the job's area: the inner store's, seen through this class ---------------------
    def prepare_job(self, job_id: str) -> str:
        return self.inner.prepare_job(job_id)

    def join_job(self, locator: str) -> gs.Store:
        joined = type(self)(self.inner.join_job(locator))
        joined.sign_parts = self.sign_parts
        return joined

    def end_job(self, locator: str) -> None:
        self.inner.end_job(locator)

    def holds_area(self, locator: str) -> bool:
        return self.inner.holds_area(locator)

    # --- the primitives ------------------------------------------------------------------
    def _write(self, key: str, buffers: Sequence[Any]) -> bool:
        return self.inner._write(key, buffers)

    def _read(self, key: str) -> Any:
        return self.inner._read(key)

    def _read_head(self, key: str, size: int) -> Any:
        return self.inner._read_head(key, size)

    def _exists(self, key: str) -> bool:
        return self.inner._exists(key)

    def _list(self, prefix: str) -> Iterable[str]:
        return self.inner._list(prefix)

    def _delete(self, keys: Sequence[str]) -> None:
        self.inner._delete(keys)

    def _delete_prefix(self, prefix: str) -> None:
        self.inner._delete_prefix(prefix)

    def close(self) -> None:
        self.inner.close()
