"""How job areas are named, in every kind of store.

A job's keys live in one area, removed when the job ends: ``gatherstore/<job>/``
in key-value and object stores, a ``gatherstore-<job>-<random>`` folder in
filesystem stores.  ``gatherstore gc`` finds what crashed jobs left by these names.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["JOB_AREA", "JobArea", "job_directory", "job_keys"]

#: Every job area is named after this: ``gatherstore/<job>/`` keys in key-value and
#: object stores, ``gatherstore-<job>-*`` directories in filesystem stores.
JOB_AREA = "gatherstore"


def job_keys(job_id: str) -> str:
    """The key prefix of a job's area in a key-value or object store."""
    return f"{JOB_AREA}/{job_id}/"


def job_directory(job_id: str | None = None) -> str:
    """The name prefix of a job's directory in a filesystem store (of any job's: None)."""
    return f"{JOB_AREA}-" if job_id is None else f"{JOB_AREA}-{job_id}-"


class JobArea(NamedTuple):
    """A job area a store holds: its ``locator`` (what ``join_job`` and ``end_job`` take),
    how to show it, the ``job`` its name says (None: ask its marker), and when it was
    last changed where its marker and heartbeat cannot say (None: unknown)."""

    locator: str
    shown: str
    job: str | None
    changed: float | None
