"""``gatherstore gc``: remove the job areas of jobs that are gone.

A job area is what ``gatherstore._session`` creates at a store's first use:
on tmpdir/file stores a directory ``gatherstore-<job>-*`` under the base
directory, on key stores the prefix ``gatherstore/<job>/``; each holds a
``marker`` (JSON: job id, creation time) and a ``heartbeat`` that the job's
rank 0 rewrites while it runs (see ``gatherstore._heartbeat``).  An area is
removed only when its job shows no sign of life: its last beat (else its
creation) is older than ``--older-than`` and than ``MISSED`` beat intervals,
and, seen from the host that beat, the beating process no longer runs.  Age
alone never decides.

Only areas of this shape are touched: a directory (never a symlink) of the
current user whose marker or heartbeat names its job, or, without either, whose
name is ``gatherstore-<16 hex digits>-*``; on key stores a prefix whose marker
or heartbeat names its job.
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

from . import _config as config
from . import _heartbeat as heartbeat
from ._errors import GatherError
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
    """One job area: where it is, its job, its last sign of life and what showed it."""

    where: str
    job: str
    seen: float  # wall-clock time of the last beat (else of the creation)
    source: str  # "heartbeat" | "marker" | "mtime"
    every: float  # the job's beat interval (the default where it never beat)
    running: bool = False  # its beating process runs on this host

    def gone(self, older_than: float, now: float) -> bool:
        """Whether the job shows no sign of life for ``older_than`` s and MISSED beats."""
        quiet = now - self.seen
        return not self.running and quiet >= max(older_than, heartbeat.MISSED * self.every)


def _value(store: Store, key: str, job: str | None = None) -> dict[str, Any] | None:
    """The JSON object at ``key`` naming ``job`` (any job: None), or None when absent,
    unreadable or another job's."""
    try:
        raw = store.get(key)
        value = json.loads(bytes(raw)) if raw is not None else None
    except Exception:  # a damaged or foreign value: treated as absent
        return None
    if not isinstance(value, dict) or (job is not None and value.get("job") != job):
        return None
    return value


def _judge(where: str, job: str, area: Store, fallback: float | None) -> Leftover | None:
    """The area's last sign of life: its heartbeat, else its marker, else ``fallback``
    (a directory's mtime; None: not an area gatherstore made)."""
    beat = _value(area, heartbeat.HEARTBEAT, job)
    default = config.heartbeat_interval()
    if beat is not None and isinstance(beat.get("at"), (int, float)):
        every = beat.get("every")
        every = float(every) if isinstance(every, (int, float)) and every > 0 else default
        return Leftover(where, job, float(beat["at"]), "heartbeat", every, heartbeat.running(beat))
    marker = _value(area, MARKER, job)
    if marker is not None and isinstance(marker.get("created"), (int, float)):
        return Leftover(where, job, float(marker["created"]), "marker", default)
    if fallback is not None:
        return Leftover(where, job, fallback, "mtime", default)
    return None


def _directories(store: FileStore) -> Iterator[Leftover]:
    try:
        children = list(store.root.iterdir())
    except FileNotFoundError:
        return
    uid = os.geteuid()
    for path in sorted(children):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if not path.name.startswith(job_directory()) or not path.is_dir() or path.is_symlink():
            continue
        if st.st_uid != uid:
            continue
        named = _JOB_DIR.fullmatch(path.name)
        try:
            area = store.join_job(str(path))  # O_NOFOLLOW, inside the base
        except GatherError:
            continue
        try:
            marker = _value(area, MARKER)
            job = str(marker.get("job")) if marker else named.group(1) if named else None
            if job is None or not path.name.startswith(job_directory(job)):
                continue
            found = _judge(str(path), job, area, st.st_mtime if named else None)
        finally:
            area.close()
        if found is not None:
            yield found


def _prefixes(store: Store) -> Iterator[Leftover]:
    jobs = sorted({key.split("/")[1] for key in store.list(f"{JOB_AREA}/") if key.count("/") >= 2})
    shown = hide_password(store.url)
    for job in jobs:
        if not _JOB_ID.fullmatch(job):
            continue
        found = _judge(f"{shown}/{JOB_AREA}/{job}/", job, store.scoped(f"{JOB_AREA}/{job}"), None)
        if found is not None:
            yield found


def find(store: Store) -> list[Leftover]:
    """Every job area gatherstore created in ``store``, alive and gone."""
    if isinstance(store, FileStore):
        return list(_directories(store))
    return list(_prefixes(store))


def _remove(store: Store, item: Leftover) -> bool:
    try:
        if isinstance(store, FileStore):
            store.end_job(item.where)
            return not Path(item.where).exists()
        area = f"{JOB_AREA}/{item.job}"
        store.end_job(f"{area}/")  # by the job's index where the store keeps one
        if store.list(f"{area}/"):  # keys the index does not name (e.g. an older gatherstore's)
            store.delete(area)
        return not store.list(f"{area}/")
    except GatherError:
        return False


def collect(
    store: Store, older_than: float, *, dry_run: bool = False, now: float | None = None
) -> tuple[list[Leftover], list[Leftover]]:
    """Remove the job areas of ``store`` whose jobs are gone (see the module docstring):
    no beat for ``older_than`` seconds nor for ``MISSED`` beat intervals, and no live
    beating process on this host.

    Returns:
        (removed, or with ``dry_run`` the areas that would be; those that could not be removed).

    Raises:
        StoreUnavailableError: the store cannot be listed.
        ValueError: ``GATHERSTORE_HEARTBEAT`` is not a positive number.
    """
    now = time.time() if now is None else now
    removed, failed = [], []
    for item in find(store):
        if not item.gone(older_than, now):
            continue
        if dry_run or _remove(store, item):
            removed.append(item)
        else:
            failed.append(item)
    return removed, failed
