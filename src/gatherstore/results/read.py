"""Reading a result set's chunks back: which there are, what their indexes say, their values.

Only chunks whose index exists count (see ``gatherstore.results.layout``); a chunk without its
index is left by a rank that died between the two writes, and is removed when
a later job takes the set over.  Every index and chunk is verified (checksum,
or signature with the set's key) before anything in it is unpickled, and a
damaged one raises IntegrityError naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gatherstore import codec
from gatherstore._errors import GatherError
from gatherstore.results import layout, order
from gatherstore.stores.base import Store

__all__ = ["INDEX_BATCH", "SetReader"]

#: Indexes read in one request.
INDEX_BATCH = 64


class SetReader:
    """The chunks of one set (``store`` scoped to it), checked with ``key`` and its ``uid``."""

    def __init__(self, store: Store, key: bytes | None, uid: str, what: str) -> None:
        self.store, self.key, self.uid, self.what = store, key, uid, what

    def names(self) -> tuple[list[str], list[str]]:
        """(names of the chunks with an index, names of chunks without one), sorted."""
        indexed = {k[len(layout.INDEX) :] for k in self.store.list(layout.INDEX)}
        data = {k[len(layout.CHUNKS) :] for k in self.store.list(layout.CHUNKS)}
        return sorted(indexed), sorted(data - indexed)

    def where(self, kind: str, name: str) -> str:
        """A chunk or index as errors name it."""
        return f"{self.what}: {kind} {name!r} in {self.store}"

    def indexes(self, names: list[str]) -> Iterator[tuple[layout.ChunkInfo, order.Keys]]:
        """Each chunk's index (what it says, and its keys), in batches of requests.

        Raises:
            IntegrityError: an index is damaged, planted or sealed with another key.
            GatherError: an index went away meanwhile (deleted, or it expired).
        """
        for start in range(0, len(names), INDEX_BATCH):
            batch = names[start : start + INDEX_BATCH]
            raws = self.store.get_many([f"{layout.INDEX}{name}" for name in batch])
            for name, raw in zip(batch, raws, strict=True):
                if raw is None:
                    raise self._gone("the index of chunk", name)
                where = self.where("the index of chunk", name)
                yield layout.decode_index(raw, name, self.key, self.uid, where)

    def infos(self, names: list[str]) -> list[layout.ChunkInfo]:
        """What each chunk's index says (its keys dropped)."""
        return [info for info, _ in self.indexes(names)]

    def fetch(self, info: layout.ChunkInfo) -> codec.Verified:
        """Read one chunk and verify it (thread-safe: reads run ahead in threads).

        Raises:
            IntegrityError: the chunk is damaged, truncated, planted or sealed with
                another key; names it.
            GatherError: it is gone (deleted, or it expired).
        """
        raw = self.store.get(f"{layout.CHUNKS}{info.name}")
        if raw is None:
            raise self._gone("chunk", info.name)
        return layout.verify_chunk(raw, info, self.key, self.uid, self.where("chunk", info.name))

    def decode(
        self, verified: codec.Verified, info: layout.ChunkInfo, columnar: bool = False
    ) -> tuple[Any, Any]:
        """The keys and values of a verified chunk (``columnar``: see ``layout.decode_chunk``).

        Raises:
            IntegrityError: it holds another number of values than its index says.
            GatherError: a value cannot be rebuilt in this process.
        """
        return layout.decode_chunk(verified, info, self.where("chunk", info.name), columnar)

    def _gone(self, kind: str, name: str) -> GatherError:
        return GatherError(
            f"{self.where(kind, name)} is gone: deleted, or it expired (a Redis store's keys "
            "live for its ttl: give result sets a store with a ttl longer than their use)"
        )
