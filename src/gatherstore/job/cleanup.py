"""``gatherstore gc``: remove the job areas of jobs that are gone.

A job area is what ``gatherstore.job.session`` creates at a store's first use:
on tmpdir/file stores a directory ``gatherstore-<job>-*`` under the base
directory, on key stores the prefix ``gatherstore/<job>/``; each holds a
``marker`` (JSON: job id, creation time) and a ``heartbeat`` that the job's
rank 0 rewrites while it runs (see ``gatherstore.job.heartbeat``).  An area is
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
import re
import time
from dataclasses import dataclass
from typing import Any

from gatherstore import _config as config
from gatherstore._errors import GatherError
from gatherstore.job import heartbeat
from gatherstore.job.session import MARKER
from gatherstore.stores.base import JobArea, Store, job_directory

__all__ = ["Leftover", "collect", "find"]

_JOB_ID = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class Leftover:
    """One job area: where it is, its job, its last sign of life and what showed it."""

    where: str  # how it is shown
    locator: str  # what the store takes to join or remove it
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


def _judge(
    where: str, locator: str, job: str, area: Store, fallback: float | None
) -> Leftover | None:
    """The area's last sign of life: its heartbeat, else its marker, else ``fallback``
    (a directory's mtime; None: not an area gatherstore made)."""
    beat = _value(area, heartbeat.HEARTBEAT, job)
    default = config.heartbeat_interval()
    if beat is not None and isinstance(beat.get("at"), (int, float)):
        every = beat.get("every")
        every = float(every) if isinstance(every, (int, float)) and every > 0 else default
        running = heartbeat.running(beat)
        return Leftover(where, locator, job, float(beat["at"]), "heartbeat", every, running)
    marker = _value(area, MARKER, job)
    if marker is not None and isinstance(marker.get("created"), (int, float)):
        return Leftover(where, locator, job, float(marker["created"]), "marker", default)
    if fallback is not None:
        return Leftover(where, locator, job, fallback, "mtime", default)
    return None


def _belongs(locator: str, job: str) -> bool:
    """Whether the area ``locator`` is named after ``job`` (a marker names its own job)."""
    name = locator.rstrip("/").rsplit("/", 1)[-1]
    return name == job or name.startswith(job_directory(job))


def _judged(store: Store, entry: JobArea) -> Leftover | None:
    """The area ``entry``'s job and last sign of life, or None when it is not a job area
    gatherstore made (or cannot be opened as one)."""
    if entry.job is not None and not _JOB_ID.fullmatch(entry.job):
        return None
    try:
        area = store.join_job(entry.locator)  # a folder: O_NOFOLLOW, inside the base
    except GatherError:
        return None
    try:
        marker = _value(area, MARKER)
        job = str(marker.get("job")) if marker else entry.job
        if job is None or not _belongs(entry.locator, job):
            return None
        return _judge(entry.shown, entry.locator, job, area, entry.changed)
    finally:
        if area is not store:
            area.close()


def find(store: Store) -> list[Leftover]:
    """Every job area gatherstore created in ``store``, alive and gone."""
    return [found for entry in store.job_areas() if (found := _judged(store, entry))]


def _remove(store: Store, item: Leftover) -> bool:
    try:
        return store.remove_area(item.locator)
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
