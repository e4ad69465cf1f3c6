"""``gatherstore gc``: remove the job areas that crashed jobs left in a store.

A job area is what :mod:`gatherstore._session` creates at a store's first use:
on tmpdir/file stores a directory ``gatherstore-<job>-*`` under the base
directory, on key stores the prefix ``gatherstore/<job>/``; each holds a
``marker`` value, JSON with the job id and its creation time.  Only areas
that match this shape are touched: a directory without a readable marker
counts only when its name is ``gatherstore-<16 hex digits>-*`` (its age is
then its mtime), and only directories owned by the current user.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._session import MARKER
from .stores.base import JOB_AREA, Store, hide_password, job_directory
from .stores.file import FileStore

__all__ = ["Leftover", "collect", "find", "parse_duration"]

_JOB_DIR = re.compile(re.escape(job_directory()) + r"([0-9a-f]{16})-.+")
_JOB_ID = re.compile(r"[0-9a-f]{16}")

_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds of a duration such as ``30s``, ``15m``, ``1h``, ``2d`` or ``1.5h``.

    Raises:
        ValueError: ``text`` is not a non-negative number followed by s, m, h, d or w.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw])\s*", text.lower())
    if match is None:
        raise ValueError(f"{text!r} is not a duration; use e.g. 30s, 15m, 1h or 2d")
    return float(match.group(1)) * _SECONDS[match.group(2)]


@dataclass(frozen=True)
class Leftover:
    """One job area: where it is, its job id, its creation time and how that was known."""

    where: str
    job: str
    created: float
    source: str  # "marker" | "mtime"


def _marker(store: Store, key: str) -> dict[str, Any] | None:
    """The marker JSON at ``key``, or None when absent or unreadable."""
    try:
        raw = store.get(key)
        value = json.loads(bytes(raw)) if raw is not None else None
    except Exception:  # a damaged or foreign marker: treated as absent
        return None
    if isinstance(value, dict) and isinstance(value.get("created"), (int, float)):
        return value
    return None


def _directories(store: FileStore) -> Iterator[Leftover]:
    try:
        children = list(store.root.iterdir())
    except FileNotFoundError:
        return
    for path in sorted(children):
        if not path.name.startswith(job_directory()) or path.is_symlink() or not path.is_dir():
            continue
        if path.stat().st_uid != os.getuid():
            continue
        marker = _marker(FileStore(path), MARKER)
        named = _JOB_DIR.fullmatch(path.name)
        if marker is not None and path.name.startswith(job_directory(str(marker.get("job")))):
            yield Leftover(str(path), str(marker["job"]), float(marker["created"]), "marker")
        elif named is not None:
            yield Leftover(str(path), named.group(1), path.stat().st_mtime, "mtime")


def _prefixes(store: Store) -> Iterator[Leftover]:
    jobs = sorted({key.split("/")[1] for key in store.list(f"{JOB_AREA}/") if key.count("/") >= 2})
    for job in jobs:
        marker = _marker(store, f"{JOB_AREA}/{job}/{MARKER}")
        if _JOB_ID.fullmatch(job) and marker is not None and marker.get("job") == job:
            yield Leftover(
                f"{hide_password(store.url)}/{JOB_AREA}/{job}/",
                job,
                float(marker["created"]),
                "marker",
            )


def find(store: Store) -> list[Leftover]:
    """Every job area gatherstore created in ``store``, young and old."""
    if isinstance(store, FileStore):
        return list(_directories(store))
    return list(_prefixes(store))


def _remove(store: Store, item: Leftover) -> bool:
    if isinstance(store, FileStore):
        store.end_job(item.where)
        return not Path(item.where).exists()
    area = f"{JOB_AREA}/{item.job}"
    store.end_job(f"{area}/")  # by the job's index where the store keeps one
    if store.list(f"{area}/"):  # keys the index does not name (e.g. an older gatherstore's)
        store.delete(area)
    return not store.list(f"{area}/")


def collect(
    store: Store, older_than: float, *, dry_run: bool = False, now: float | None = None
) -> tuple[list[Leftover], list[Leftover]]:
    """Remove the job areas of ``store`` created more than ``older_than`` seconds ago.

    Returns:
        (removed, or with ``dry_run`` the areas that would be; those that could not be removed).

    Raises:
        StoreUnavailableError: the store cannot be listed.
    """
    now = time.time() if now is None else now
    removed, failed = [], []
    for item in find(store):
        if now - item.created < older_than:
            continue
        if dry_run or _remove(store, item):
            removed.append(item)
        else:
            failed.append(item)
    return removed, failed
