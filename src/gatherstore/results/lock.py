"""One writer job at a time: a result set's runs, each claimed by a job and kept by its heartbeat.

Opening a set makes the job its next *run*: rank 0 writes ``runs/<run>/claim``
(create-only, so of two jobs that open the set at the same moment one wins)
and beats in ``runs/<run>/heartbeat`` with the heartbeat of job areas (see
``gatherstore.job.heartbeat``) until the job ends, when it marks the run ended.  A job that
finds the last run alive is refused with an error naming that job.  A run
counts as alive unless it ended, or its heartbeat (without one, its claim) is
older than ``MISSED`` beat intervals, or, seen from the host that beat, the
beating process no longer runs: a stale writer's set is taken over.  The job
that holds the last run may open the set again (a run of its own each time).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from gatherstore import _config as config
from gatherstore._errors import GatherError
from gatherstore._time import END_JOB_TIMEOUT, deadline
from gatherstore.job import heartbeat
from gatherstore.stores.base import KeyExistsError, Store

__all__ = ["RUNS", "Held", "Run", "acquire", "last_run", "release", "runs", "stop_beating"]

RUNS = "runs/"
_mine: set[str] = set()  # the jobs of the runs this process holds: it may open a set again


def _area(store: Store, run: int) -> Store:
    return store.scoped(f"{RUNS}{run:06d}")


@dataclass(frozen=True)
class Held:
    """A run this process claimed and beats for."""

    run: int
    job: str
    locator: str
    area: Store


@dataclass(frozen=True)
class Run:
    """What a run's claim and last heartbeat say."""

    run: int
    job: str
    host: str
    pid: int
    started: float  # when it claimed the run (wall clock)
    seen: float  # its last beat, else its claim
    ended: bool
    alive: bool


def runs(store: Store) -> list[int]:
    """The numbers of the set's runs, ascending."""
    found = set()
    for key in store.list(RUNS):
        part = key[len(RUNS) :].split("/", 1)[0]
        if part.isdigit():
            found.add(int(part))
    return sorted(found)


def _json(store: Store, key: str) -> dict[str, Any] | None:
    with contextlib.suppress(Exception):  # absent, damaged or foreign: no sign of life
        raw = store.get(key)
        value = json.loads(bytes(raw)) if raw is not None else None
        return value if isinstance(value, dict) else None
    return None


def last_run(store: Store, run: int) -> Run | None:
    """What is known of run ``run`` (None: neither its claim nor a beat can be read)."""
    claim = _json(store, f"{RUNS}{run:06d}/claim")
    beat = _json(_area(store, run), heartbeat.HEARTBEAT)
    info = beat or claim
    if info is None or not isinstance(info.get("at"), (int, float)):
        return None
    ended = bool(info.get("ended"))
    every = info.get("every")
    every = float(every) if isinstance(every, (int, float)) and every > 0 else None
    if ended:
        alive = False
    elif beat is not None and beat.get("host") == socket.gethostname():
        alive = heartbeat.running(beat)  # its own host can tell for sure
    else:
        quiet = time.time() - float(info["at"])
        alive = quiet < heartbeat.MISSED * (every or config.heartbeat_interval())
    started = (claim or {}).get("at", info["at"])
    return Run(
        run,
        str(info.get("job", "?")),
        str(info.get("host", (claim or {}).get("host", "?"))),
        int(info.get("pid", (claim or {}).get("pid", 0)) or 0),
        float(started),
        float(info["at"]),
        ended,
        alive,
    )


def _refuse_if_alive(store: Store, run: int, what: str) -> None:
    found = last_run(store, run)
    if found is None or not found.alive or found.job in _mine:
        return
    now = time.time()
    raise GatherError(
        f"{what} is being written by another job: job {found.job} on {found.host} (pid "
        f"{found.pid}, rank 0), run {run}, which opened it {now - found.started:.0f} s ago and "
        f"showed life {now - found.seen:.0f} s ago. A set has one writer job at a time: wait "
        "for that job to end, or stop it. A writer that is gone is taken over once its "
        f"heartbeat is {heartbeat.MISSED} intervals old (GATHERSTORE_HEARTBEAT), at once from "
        "its own host"
    )


def acquire(store: Store, what: str, world: int) -> Held:
    """Claim the set's next run for this job and beat for it (on rank 0).

    Raises:
        GatherError: the last run's job is alive; names it.
        StoreUnavailableError: the store failed.
    """
    known = runs(store)
    if known:
        _refuse_if_alive(store, known[-1], what)
    run = (known[-1] if known else 0) + 1
    job = uuid.uuid4().hex[:16]
    claim = {"job": job, "host": socket.gethostname(), "pid": os.getpid(), "world": world}
    claim["at"] = time.time()
    try:
        store.put(f"{RUNS}{run:06d}/claim", json.dumps(claim).encode())
    except KeyExistsError:  # another job claimed it a moment ago
        _refuse_if_alive(store, run, what)
        raise GatherError(f"{what}: another job opened it at the same moment; try again") from None
    locator = f"result set {store} run {run}"
    area = _area(store, run)
    heartbeat.start(locator, area, job)
    _mine.add(job)
    return Held(run, job, locator, area)


def stop_beating(held: Held) -> None:
    """Stop the run's heartbeat (a beat under way lands first)."""
    heartbeat.stop(held.locator)
    _mine.discard(held.job)


def release(held: Held) -> None:
    """End the run: the next job takes the set over at once.  Best effort (a run not
    marked ended is taken over once its heartbeat is stale)."""
    stop_beating(held)
    ended = {"job": held.job, "at": time.time(), "ended": True}
    try:
        with deadline(END_JOB_TIMEOUT):
            held.area.replace(heartbeat.HEARTBEAT, json.dumps(ended).encode())
    except GatherError:
        return


os.register_at_fork(after_in_child=_mine.clear)
