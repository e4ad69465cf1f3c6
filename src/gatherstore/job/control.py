"""The control plane: small byte exchanges through the job's rendezvous store.

Every coordination step (status/size exchange, barriers with a timeout, the
shared tmpdir path, the signing key) rides on ``exchange``: each rank
publishes a few bytes under a key of the job's c10d store (the TCPStore that
``init_process_group`` already runs); the last rank to arrive gathers all keys
once into one value, and every rank waits, with its own timeout, for that value
(O(W) requests per exchange, not W reads by each of W ranks).  Equal values are
sent once, so an exchange where every rank says the same (a barrier, "written")
costs O(W) bytes, and ``exchange_summary`` sends every rank only a summary
computed once, and all values only to the ranks that need them (a gather's
destination): O(W) bytes where an all-gather of statuses costs W².  A timeout names
exactly the ranks whose keys are missing, on every rank, and breaks nothing:
unlike a gloo recv that times out (which closes the connection for good), a
store wait can simply be given up.  Nothing
here touches GPU memory or the NCCL watchdog.
The protocol itself is ``gatherstore.job.exchange``; here is the job's use of it:
its numbered steps, call labels, one call at a time per process, and bounds
against a frozen store host.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime as _dt
import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist

from gatherstore._errors import GatherTimeout, MismatchError, RemoteRankError, seconds
from gatherstore.job import state as job
from gatherstore.job.exchange import (
    HOST_GRACE,
    Outcome,
    Summarize,
    exchange_on,
    late_error,
    summary_of,
    wait_for_readers,
)
from gatherstore.job.state import GroupState

__all__ = [
    "bounded",
    "call_id",
    "exchange",
    "exchange_summary",
    "hosts",
    "hosts_store",
    "is_initialized",
    "launcher_hosts_store",
    "outlive_readers",
    "serialized",
    "step",
    "store",
]

_HOSTS = "host/"  # a rank's hostname at "host/<rank>"

# one gatherstore collective at a time per process (see serialized)
_calls = threading.RLock()
# one event per exchange thread that may still be in a store wait, set as it ends
# (see _let_waits_end; after a join that Ctrl-C interrupted, is_alive() is unreliable)
_waiting: set[threading.Event] = set()
#: Seconds the exit waits for store waits that an interrupted call left behind.
EXIT_WAIT = 5.0


class _Unread(NamedTuple):
    """An exchange that ranks may still be reading from the store rank 0 hosts."""

    store: Any
    key: str  # set once every rank has read (see gatherstore.job.exchange.wait_for_readers)
    ends: float  # monotonic time after which rank 0 waits no longer


#: On a rank 0 that hosts the store: the last exchange that some rank had not read in
#: time (it died or froze before its read), which rank 0's exit waits for.
_unread: _Unread | None = None
F = TypeVar("F", bound=Callable[..., Any])


def serialized(fn: F) -> F:
    """Run ``fn`` (a gatherstore collective) while no other thread of this process is
    in one: the calls of a rank must reach the control plane one after another.

    Ranks pair their calls by order; a call made outside the main thread carries its
    thread's name in its label, so that calls that different threads made in a
    different order on different ranks raise MismatchError instead of exchanging
    each other's data.
    """

    @functools.wraps(fn)
    def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
        with _calls:
            return fn(*args, **kwargs)

    return one_at_a_time  # type: ignore[return-value]


def calls_in_turn() -> contextlib.AbstractContextManager[Any]:
    """The block of one gatherstore collective: see ``serialized``."""
    return _calls


def _label(what: str) -> bytes:
    """``what``, with the calling thread's name outside the main thread."""
    thread = threading.current_thread()
    if thread is threading.main_thread():
        return what.encode()
    return f"{what} (thread {thread.name!r})".encode()


def is_initialized() -> bool:
    """Whether a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def _current(group: Any = None) -> GroupState:
    """The current group's state (see ``gatherstore.job.state``), with its control store
    set up: the default group's keys under ``gatherstore/``, another group's under a
    prefix of its own, so that groups never read each other's keys."""
    state = job.group_state(group)
    if state.control_store is None:
        base = dist.distributed_c10d._get_default_store()
        prefix = "gatherstore" if state.is_default else f"gatherstore/group/{state.name}"
        store = dist.PrefixStore(prefix, base)  # type: ignore[attr-defined]
        # where this rank runs, for the layout (see hosts()): published at its first use
        # of the control plane, outside the exchanges' steps
        store.set(f"{_HOSTS}{state.rank}", socket.gethostname())
        state.control_store, state.step = store, 0
    return state


def hosts(timeout: float, group: Any = None) -> list[str]:
    """Every rank's hostname, in rank order, in ``group`` (None: the current group).

    Each rank publishes its own at its first use of the control plane (init, or its
    first gatherstore collective), outside the exchanges' numbered steps: a rank
    that asks alone waits only until the others next use gatherstore, and no call
    is put out of step.

    Raises:
        GatherTimeout: some ranks did not publish within ``timeout`` s (named).
    """
    state = _current(group)
    store, keys = state.control_store, [f"{_HOSTS}{r}" for r in range(state.size)]

    def read() -> list[str]:
        try:
            store.wait(keys, _dt.timedelta(seconds=timeout))
        except RuntimeError:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if not missing:  # they arrived just now
                return read()
            raise late_error("topology", missing, timeout) from None
        return [value.decode() for value in store.multi_get(keys)]

    found: list[str] = bounded(read, timeout, "topology")
    return found


def step() -> int:
    """The number of exchanges this job has run: the same on every rank between two
    exchanges, so it names the current call (e.g. keys of its own on ``store``)."""
    return _current().step


def call_id() -> str:
    """A name of the current call, the same on every rank of its group and unique in the
    job: its group's name and step (see ``step``)."""
    state = _current()
    return f"{state.name}:{state.step}" if state.name else str(state.step)


def store() -> Any:
    """The job's rendezvous store, under gatherstore's own key prefix."""
    return _current().control_store


def bounded(run: Callable[[], Any], timeout: float, what: str) -> Any:
    """``run()`` (requests to the rendezvous store), given up on after ``timeout`` plus
    ``HOST_GRACE`` s where a rank other than this one hosts the store (a frozen
    host would otherwise block the request for the store's own timeout).

    Raises:
        GatherTimeout: the store's host did not answer in time.
    """
    if hosts_store():
        return run()
    return _bounded(run, timeout, what, not launcher_hosts_store())


def exchange(
    payload: bytes, *, timeout: float, what: str = "exchange", named: float | None = None
) -> list[bytes]:
    """Give every rank every rank's ``payload``, in rank order.

    O(W) store requests per call for W ranks: each rank sets its key and counts
    itself in; the last to arrive reads all keys once and publishes them as one
    value, which every rank waits for.

    Raises:
        GatherTimeout: some ranks did not arrive within ``timeout`` seconds; its
            ``ranks`` are those ranks (the same on every rank that waited).
        MismatchError: ranks were in different gatherstore calls at this step.
        RemoteRankError: the job's store went away (the process hosting it, rank 0 or
            the launcher, ended).
    """
    values, _ = exchange_summary(payload, timeout=timeout, what=what, named=named)
    assert values is not None
    return values


def exchange_summary(
    payload: bytes,
    *,
    timeout: float,
    what: str = "exchange",
    summarize: Summarize | None = None,
    full: Collection[int] | None = None,
    named: float | None = None,
) -> tuple[list[bytes] | None, bytes | None]:
    """``exchange``, where every rank gets ``summarize(payloads)`` (computed once,
    on one rank) and only the ranks in ``full`` (default: all) get the payloads.

    Returns ``(payloads or None, summary or None)``.  Where ``summarize`` returns
    None (say, a rank reported a failure) or raises, every rank gets the payloads
    and no summary.  Raises as ``exchange`` does; a ``GatherTimeout`` names the timeout
    ``named`` (the call's own, of which this wait is what is left), else ``timeout``.
    """
    if not is_initialized() or job.group_state().size == 1:
        return [payload], summary_of(summarize, [payload])
    state = _current()
    state.step += 1
    labelled = _label(what) + b"\0" + payload
    # whether the group's rank 0 is the process that hosts the store, and must not
    # leave before the others read (see gatherstore.job.exchange.exchange_on)
    rank, hosts = state.rank, not launcher_hosts_store() and state.ranks[0] == 0

    def summarize_labelled(values: list[bytes]) -> bytes | None:
        labels, payloads = _split(values)
        return None if len(set(labels)) > 1 else summary_of(summarize, payloads)

    def run() -> Outcome:
        return exchange_on(
            state.control_store,
            f"{state.step}/",
            rank,
            state.size,
            labelled,
            timeout=timeout,
            rank0_hosts=hosts,
            summarize=summarize_labelled if summarize else None,
            full=full,
        )

    try:
        # the rank hosting the store cannot wait on a frozen host: itself
        outcome: Outcome = (
            run() if hosts_store() else _bounded(run, timeout, what, not launcher_hosts_store())
        )
    except RuntimeError as exc:
        raise RemoteRankError(
            0,
            f"the job's rendezvous store (hosted by rank 0 or its launcher) is unreachable: {exc}",
            context=what,
        ) from exc
    if rank == 0 and hosts:
        _track_readers(state.control_store, outcome, timeout)
    if outcome.late is not None:
        raise late_error(what, outcome.late, timeout if named is None else named)
    values = None if outcome.values is None else _unlabel(outcome.values, what)
    return values, outcome.summary


def _track_readers(store: Any, outcome: Outcome, timeout: float) -> None:
    """Remember the exchange that rank 0 must outlive: this one, if ranks may still be
    reading it.  Every rank that reached this exchange read the earlier ones, so an
    earlier one's key goes."""
    global _unread
    previous, _unread = _unread, None
    if outcome.unread is not None:
        _unread = _Unread(store, outcome.unread, time.monotonic() + timeout)
    if previous is not None:
        with contextlib.suppress(RuntimeError):
            previous.store.delete_key(previous.key)


@atexit.register
def outlive_readers() -> None:
    """Return once every rank has read the job's last exchange (within that exchange's
    timeout, and :data:`EXIT_WAIT` at most: a rank that died never reads): a rank 0
    that hosts the rendezvous store calls it before it destroys the store
    (``shutdown``) or leaves (at exit), so that no rank loses the store mid-read."""
    global _unread
    unread, _unread = _unread, None
    if unread is not None:
        left = min(unread.ends - time.monotonic(), EXIT_WAIT)
        wait_for_readers(unread.store, unread.key, left)


def _bounded(run: Callable[[], Any], timeout: float, what: str, rank0_hosts: bool) -> Any:
    """``run()`` in a thread, given up on after ``timeout`` plus ``HOST_GRACE`` s.

    A c10d store client waits on a frozen (stopped, not dead) store host for the
    store's own timeout, whatever the timeout of the wait: bounding the exchange
    here makes a frozen host fail the call in time instead of hanging it.
    """
    box: dict[str, Any] = {}
    ended = threading.Event()

    def target() -> None:
        try:
            box["value"] = run()
        except BaseException as exc:  # handed over to the caller's thread
            box["error"] = exc
        finally:
            ended.set()
            _waiting.discard(ended)

    # in the caller's context: ``run`` asks for the current group's state (its keys)
    context = contextvars.copy_context()
    thread = threading.Thread(
        target=context.run, args=(target,), name="gatherstore-exchange", daemon=True
    )
    _waiting.add(ended)
    thread.start()
    thread.join(timeout + HOST_GRACE)
    if thread.is_alive():
        host = "rank 0, which hosts" if rank0_hosts else "the launcher, which hosts"
        raise GatherTimeout(
            f"{what}: {host} the job's rendezvous store, did not answer within "
            f"{seconds(timeout + HOST_GRACE)} s; it is frozen or unreachable (end the job: its "
            "process group cannot go on without that store)",
            ranks=[0] if rank0_hosts else [],
            timeout=timeout,
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


@atexit.register
def _let_waits_end() -> None:
    """Give store waits still under way up to ``EXIT_WAIT`` s to end before the
    interpreter shuts down: those of a call that Ctrl-C cut short (in ``_bounded``),
    or that gave up on a frozen store host.

    A wait that returns during shutdown ends its thread inside torch's C++ frames,
    and the process aborts (SIGABRT, "terminate called without an active
    exception").  When the whole job is stopping, the store's host leaves within
    moments and the waits end here, with an error nobody reads.
    """
    ends = time.monotonic() + EXIT_WAIT
    for ended in list(_waiting):
        ended.wait(max(0.0, ends - time.monotonic()))


os.register_at_fork(after_in_child=_waiting.clear)  # the threads did not come along


def hosts_store() -> bool:
    """Whether this process hosts the job's rendezvous store (global rank 0, unless a
    launcher's process does)."""
    return not launcher_hosts_store() and dist.get_rank() == 0


def launcher_hosts_store() -> bool:
    """Whether a launcher's process (``gs.launch``'s parent, torchrun's agent) hosts the
    job's rendezvous store; else rank 0's own process does, and must not leave before
    the other ranks have read."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _split(labelled: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(labels, payloads) of labelled values."""
    pairs = [value.split(b"\0", 1) for value in labelled]
    return [label for label, _ in pairs], [payload for _, payload in pairs]


def _unlabel(labelled: list[bytes], what: str) -> list[bytes]:
    """Payloads without their labels; ranks that were in another call make every rank raise."""
    labels, payloads = _split(labelled)
    if len(set(labels)) > 1:
        calls = {rank: label.decode() for rank, label in enumerate(labels)}
        raise MismatchError(
            f"{what}: ranks are in different gatherstore calls at the same step — {calls}; "
            "every rank must make the same collective calls in the same order",
            details=calls,
        )
    return payloads
