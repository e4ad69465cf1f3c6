"""A job's use of one store: its private area, the shared-ness check, the signing key.

At a store's first use in a job every rank comes here together: rank 0
prepares the job's area (e.g. a fresh 0700 directory) and writes a marker;
every rank checks it sees the marker, else every rank raises
StoreNotSharedError.  When the store's parts are signed, rank 0 draws a random
key and broadcasts it over the gloo control group; it is never written to any
store.  The job's area is removed when the process group is shut down (or at
exit on rank 0).  When the job is stopped from outside, whoever outlives rank
0 sweeps: every rank on SIGTERM/SIGINT (see ``gatherstore.job.signals``), a rank that finds
rank 0 late or its rendezvous store gone (``after_failure``), and the
``gs.launch`` parent, which hosts the rendezvous store and reads there the
areas rank 0 published (see ``gatherstore.job.published``).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gatherstore._errors import (
    GatherError,
    GatherTimeout,
    RemoteRankError,
    StoreNotSharedError,
    ranks_named,
    seconds,
)
from gatherstore._time import Deadline
from gatherstore.job import control, gloo, heartbeat, signals
from gatherstore.job import published as publication
from gatherstore.job import state as job
from gatherstore.job.report import failure, raise_failures, status
from gatherstore.job.state import JobStores
from gatherstore.stores.base import Store

__all__ = [
    "MARKER",
    "JobSession",
    "abandon",
    "after_failure",
    "create_area",
    "end_sessions",
    "has_sessions",
    "last_timeout",
    "note_timeout",
    "session_for",
]

MARKER = "marker"
# how long a rank looks for rank 0's marker: a share seen through a loaded network
# filesystem may lag by seconds, but a store that is not shared must fail fast
_VISIBILITY_WAIT = (2.0, 10.0)
_RETRY_PAUSE = 0.1  # between lookups that failed with a store error (see stores.waiting)


@dataclass
class JobSession:
    """One store's state in this job: the job-scoped store, key, call counter."""

    base: Store
    locator: str
    store: Store
    key: bytes | None = field(repr=False)  # the signing key: never in a repr or a log
    calls: int = 0
    published: str = ""  # key of this area on the launcher's store (its creator only)
    owner: bool = False  # whether this rank created the area (its group's rank 0)

    def next_call(self) -> str:
        """A key prefix unique to this (job, call); identical on every rank."""
        self.calls += 1
        return f"call-{self.calls}"


#: This process's stores state (one job at a time per process).
STORES: JobStores[JobSession] = JobStores()


def session_for(store: Store, timeout: float) -> JobSession:
    """The job's session on ``store``, set up collectively at its first use.

    Every step of the set-up (rank 0 creating the area, the exchanges, the signing
    key) shares one deadline, ``timeout`` seconds from now.

    Raises:
        StoreNotSharedError: some ranks cannot see rank 0's marker.
        RemoteRankError: rank 0 could not prepare the store.
    """
    group = job.group_state()
    sessions = STORES.for_group(dist.group.WORLD)  # keyed by group and store equality
    cached = sessions.get((group.name, store))
    if cached is not None:
        heartbeat.on_call(cached.locator)  # rank 0 shows gc the job is alive
        return cached
    rank = group.rank
    limit = Deadline.start(timeout)
    answer, error = status(True), None
    if rank == 0:
        try:
            with limit.for_store():
                job_id, locator = create_area(store)
                heartbeat.start(locator, store.join_job(locator), job_id)
            answer = status(True, locator=locator)
        except Exception as exc:
            answer, error = failure(exc), exc
    reply = json.loads(control.exchange(answer, timeout=limit.left(), what="store setup")[0])
    raise_failures([reply], f"setting up store {store}", error)
    job_store = store.join_job(reply["locator"])
    session = JobSession(store, reply["locator"], job_store, None, owner=rank == 0)
    missed = "" if rank == 0 else _misses_marker(job_store, timeout)
    flags = control.exchange(missed.encode(), timeout=limit.left(), what="store check")
    blind = [r for r, flag in enumerate(flags) if flag]
    if blind:
        if rank == 0:
            _end(session)
        why = "; ".join(f"rank {r}: {flags[r].decode(errors='replace')}" for r in blind[:3])
        raise StoreNotSharedError(
            f"store {store} is not visible from {ranks_named(blind)}, which cannot see the "
            f"job area {reply['locator']!r} that rank 0 created ({why}). Use a store every rank "
            "shares: tmpdir only on one machine; across machines file:///<shared dir>, "
            "redis:// or s3:// (memory:// lives inside one process)",
            ranks=blind,
            store=str(store),
        )
    if job_store.sign_parts:
        session.key = _shared_key(limit)
    sessions[group.name, store] = session
    # a stopped job removes its areas (where the program has no handler); gs.launch and
    # init_from_env installed this already, here it covers groups the program created
    signals.install(abandon)
    if rank == 0:
        session.published = publication.publish(store, session.locator)
        atexit.register(_end, session)
    return session


def create_area(store: Store) -> tuple[str, str]:
    """A new job area in ``store`` with the creator's marker in it: (job id, locator).

    Raises:
        StoreUnavailableError: the store cannot create or write it.
    """
    job_id = uuid.uuid4().hex[:16]
    locator = store.prepare_job(job_id)
    marker = {"job": job_id, "created": time.time(), "host": socket.gethostname()}
    store.join_job(locator).put(MARKER, json.dumps(marker).encode())
    return job_id, locator


def _misses_marker(job: Store, timeout: float) -> str:
    """Empty once rank 0's marker shows up within a sixth of ``timeout`` (2 to 10 s),
    else why it did not.

    A store error is retried until then: a network filesystem can fail a lookup
    while it reconnects (sshfs, NFS), and one failed ``stat`` is no proof that
    the store is not shared.
    """
    shortest, longest = _VISIBILITY_WAIT
    wait = min(max(shortest, timeout / 6), longest, timeout)
    looking = Deadline.start(wait)
    while True:
        try:
            job.wait([MARKER], max(0.0, looking.ends - time.monotonic()))
            return ""
        except GatherTimeout:
            return f"no job marker within {seconds(wait)} s"
        except Exception as exc:
            if looking.passed():
                return f"{type(exc).__name__}: {exc}"[:200]
            time.sleep(_RETRY_PAUSE)


def _shared_key(limit: Deadline) -> bytes:
    """32 random bytes from rank 0, broadcast over the gloo control group within ``limit``."""
    buf = torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8)
    gloo.transfer(gloo.broadcast_op(buf, 0), what="store setup (signing key)", deadline=limit)
    return bytes(buf.numpy())


def _end(session: JobSession, *, unpublish: bool = True) -> None:
    try:
        heartbeat.stop(session.locator)
        session.base.end_job(session.locator)
        if unpublish:
            publication.unpublish(session.published)
    except Exception:  # best effort at exit; `gatherstore gc` removes leftovers
        return


def _forget_in_forked_child() -> None:
    """A process forked from a rank (a DataLoader worker, say) does not own the rank's
    job areas: it must not remove them when it exits."""
    STORES.forget_sessions()
    atexit.unregister(_end)


os.register_at_fork(after_in_child=_forget_in_forked_child)


def has_sessions() -> bool:
    """Whether this job has used a store."""
    return bool(STORES.sessions)


def note_timeout(timeout: float) -> None:
    """Remember the timeout of the job's latest object call (``shutdown`` waits no longer)."""
    STORES.last_timeout = timeout


def last_timeout() -> float | None:
    """The timeout of the job's latest object call (None before any)."""
    return STORES.last_timeout


def end_sessions() -> None:
    """Remove every job area this rank created (its group's rank 0; called by ``shutdown``)."""
    sessions = STORES.forget_sessions()
    for session in sessions.values():
        if session.owner:
            _end(session)
    atexit.unregister(_end)


def after_failure(exc: BaseException, *, late_counts: bool = True) -> None:
    """After a failed exchange: if rank 0 (the areas' creator) is late or its
    rendezvous store is gone, this surviving rank sweeps the job's areas.

    A late rank 0 counts too (unless ``late_counts`` is False): the job cannot go
    on in step without it, and a frozen rank 0 that is killed later would leave
    its areas to the TTLs.
    """
    cause = exc.__cause__
    gone = isinstance(exc, RemoteRankError) and exc.rank == 0 and isinstance(cause, RuntimeError)
    late = late_counts and isinstance(exc, GatherTimeout) and 0 in exc.ranks
    if late or (gone and not isinstance(cause, GatherError)):
        abandon(job.group_state().name)


def abandon(group: str | None = None) -> None:
    """Remove every job area this job uses (or only those of the group named ``group``,
    see ``GroupState.name``), from any rank, and forget them.

    For a job that is being stopped, or whose rank 0 (the areas' creator) is
    gone: whoever outlives the creator sweeps.  Safe to run on several ranks
    at once and from a thread.
    """
    for session in list(STORES.forget_sessions(group).values()):
        # not the rendezvous store: its one client may be blocked in the main thread
        _end(session, unpublish=False)
    atexit.unregister(_end)
