"""Raw hooks of the conformance suite for a store on an fsspec filesystem.

They go to the filesystem object itself, not through the Store, with its listing cache
dropped first: what they see is what the backend holds.
"""

from __future__ import annotations

import contextlib
from typing import Any

from gatherstore.stores import Store
from gatherstore.testing import StoreTests


def _fs_and_path(store: Store, key: str = "") -> tuple[Any, str]:
    """The store's filesystem (``fs``, its listing cache dropped) and the path of ``key``."""
    fs, root = store.fs, store.root  # an fsspec store's own
    fs.invalidate_cache()
    return fs, f"{root}/{key}" if key else root


class FsspecRaw(StoreTests):
    """The raw hooks through ``store.fs``."""

    def raw_keys(self, store: Store) -> list[str]:
        fs, root = _fs_and_path(store)
        return sorted(p[len(root) + 1 :] for p in fs.find(root))

    def raw_get(self, store: Store, key: str) -> bytes | None:
        fs, path = _fs_and_path(store, key)
        try:
            return bytes(fs.cat_file(path))
        except FileNotFoundError:
            return None

    def raw_set(self, store: Store, key: str, data: bytes) -> None:
        fs, path = _fs_and_path(store, key)
        fs.pipe_file(path, data)

    def raw_delete(self, store: Store, key: str) -> None:
        fs, path = _fs_and_path(store, key)
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)
