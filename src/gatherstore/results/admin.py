"""Result sets seen from outside a job: which a store holds, what each holds, which are stale.

For ``gatherstore results`` and ``gatherstore gc --result-sets``.  Looking at a
set takes no lock: it reads the set's metadata, the indexes of its chunks (with
the set's key when it is signed) and its last run's claim and heartbeat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gatherstore._errors import GatherError
from gatherstore.results import layout, lock
from gatherstore.results.read import SetReader
from gatherstore.stores.base import Store

__all__ = ["Summary", "collect", "describe", "names", "require"]

#: Names of sets an error about a missing one shows, at most.
_SHOWN = 10


def names(store: Store) -> list[str]:
    """The names of the result sets in ``store``, sorted."""
    top = f"{layout.ROOT}/"
    tail = f"/{layout.META}"
    return sorted(k[len(top) : -len(tail)] for k in store.list(top) if k.endswith(tail))


def require(store: Store, name: str) -> None:
    """Check that ``store`` holds the set ``name``, before reading or removing it: a set is
    created only by a job that writes it, never by looking at it.

    Raises:
        ValueError: ``name`` is not a set's name, or ``store`` holds no such set (the
            message names the sets it holds).
        StoreUnavailableError: the store failed.
    """
    layout.check_name(name)
    if not store.exists(f"{layout.prefix(name)}/{layout.META}"):
        raise _missing(store, name)


def _missing(store: Store, name: str) -> ValueError:
    """The error for a set that ``store`` does not hold, naming those it holds."""
    held = names(store)
    shown = ", ".join(repr(n) for n in held[:_SHOWN])
    if len(held) > _SHOWN:
        shown += f" and {len(held) - _SHOWN} more"
    return ValueError(
        f"store {store} holds no result set {name!r} (it holds {shown or 'none'}): "
        "check the set's name and the store"
    )


@dataclass(frozen=True)
class Summary:
    """A set at a glance: its runs, its last writer, its chunks and when it last showed life."""

    name: str
    runs: int
    last: lock.Run | None
    chunks: int
    unindexed: int
    seen: float

    def state(self) -> str:
        if self.last is None:
            return "no writer yet"
        if self.last.alive:
            return f"written by job {self.last.job} on {self.last.host} (pid {self.last.pid})"
        return "ended" if self.last.ended else "writer gone"


def summary(store: Store, name: str) -> Summary:
    """What ``store`` shows of the set ``name`` without its key."""
    scoped = store.scoped(layout.prefix(name))
    runs = lock.runs(scoped)
    last = lock.last_run(scoped, runs[-1]) if runs else None
    indexed, unindexed = SetReader(scoped, None, "", name).names()
    seen = last.seen if last is not None else 0.0
    return Summary(name, len(runs), last, len(indexed), len(unindexed), seen)


def describe(store: Store, name: str, key: bytes | None) -> dict[str, Any]:
    """The set ``name`` in detail: its summary, and its values and bytes (read from its
    chunks' indexes, checked with ``key``).

    Raises:
        ValueError: not a set's name, or no such set (the message names those there are).
        IntegrityError: another key, or damage.
        StoreUnavailableError: the store failed.
    """
    scoped = store.scoped(layout.prefix(layout.check_name(name)))
    meta = layout.open_meta(scoped, key, create=False)
    if meta is None:
        raise _missing(store, name)
    found = summary(store, name)
    reader = SetReader(scoped, key, meta.uid, f"result set {name!r}")
    infos = reader.infos(reader.names()[0])
    return {
        "name": name,
        "signed": meta.signed,
        "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(meta.created)),
        "runs": found.runs,
        "writer": found.state(),
        "chunks": found.chunks,
        "values": sum(i.count for i in infos),
        "bytes": sum(i.nbytes for i in infos),
        "chunks without index": found.unindexed,
    }


def collect(
    store: Store, older_than: float, *, dry_run: bool = False, now: float | None = None
) -> tuple[list[Summary], list[Summary]]:
    """Remove the result sets of ``store`` that no job writes and that showed no life for
    ``older_than`` seconds (their last run's last beat, else its claim).

    Returns:
        (removed, or with ``dry_run`` those that would be; those that could not be removed).

    Raises:
        StoreUnavailableError: the store cannot be listed.
    """
    now = time.time() if now is None else now
    removed, failed = [], []
    for name in names(store):
        found = summary(store, name)
        if found.last is None or found.last.alive or now - found.seen < older_than:
            continue  # never written (being opened), written now, or recently
        if dry_run:
            removed.append(found)
            continue
        try:
            store.delete(layout.prefix(name))
            removed.append(found)
        except GatherError:
            failed.append(found)
    return removed, failed
