"""The control plane: small byte exchanges through the job's rendezvous store.

Every coordination step (status/size exchange, barriers with a timeout, the
shared tmpdir path, the signing key) rides on :func:`exchange`: each rank
publishes a few bytes under a key of the job's c10d store (the TCPStore that
``init_process_group`` already runs); the last rank to arrive gathers all keys
once into one value, and every rank waits, with its own timeout, for that value
(O(W) requests per exchange, not W reads by each of W ranks).  Equal values are
sent once, so an exchange where every rank says the same (a barrier, "written")
costs O(W) bytes, and :func:`exchange_summary` sends every rank only a summary
computed once, and all values only to the ranks that need them (a gather's
destination): O(W) bytes where an all-gather of statuses costs W².  A timeout names
exactly the ranks whose keys are missing, on every rank, and breaks nothing:
unlike a gloo recv that times out (which closes the connection for good), a
store wait can simply be given up.  Nothing
here touches GPU memory or the NCCL watchdog.

The bulk "collective" route of objects needs a real gloo group:
:func:`control_group` creates it once per job.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import os
import socket
import struct
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from ._config import DEFAULT_TIMEOUT
from ._errors import GatherTimeout, MismatchError, RemoteRankError

__all__ = [
    "Outcome",
    "bounded",
    "control_group",
    "exchange",
    "exchange_on",
    "exchange_summary",
    "hosts",
    "is_initialized",
    "reset",
    "serialized",
    "step",
    "store",
]

# the verdict key's value: every rank's value, a summary of them, or the ranks that were late
_VALUES, _SUMMARY, _LATE = b"V", b"S", b"L"
_HOSTS = "host/"  # a rank's hostname at "host/<rank>"

#: Computes, on one rank, what every rank needs from all values (None: send all values).
Summarize = Callable[[list[bytes]], bytes | None]


@dataclass(frozen=True)
class Outcome:
    """What one rank got from an exchange: every value (``values``; None where only
    the summary was sent to it), the ``summary``, or the ranks that were ``late``."""

    values: list[bytes] | None = None
    summary: bytes | None = None
    late: list[int] | None = None


# how long ranks that timed out wait for the one rank judging who is late
_JUDGE_GRACE = 5.0
#: Seconds past an exchange's timeout after which its store host counts as frozen
#: (an exchange may take up to _JUDGE_GRACE more than its timeout to agree on a verdict).
HOST_GRACE = 2 * _JUDGE_GRACE

# one gatherstore collective at a time per process (see serialized)
_calls = threading.RLock()
F = TypeVar("F", bound=Callable[..., Any])

# the default group this state belongs to, its control store, gloo group, step counter
_state: dict[str, Any] = {"world": None}


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


def _label(what: str) -> bytes:
    """``what``, with the calling thread's name outside the main thread."""
    thread = threading.current_thread()
    if thread is threading.main_thread():
        return what.encode()
    return f"{what} (thread {thread.name!r})".encode()


def is_initialized() -> bool:
    """Whether a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def _current() -> dict[str, Any]:
    world = dist.group.WORLD
    if _state["world"] is not world:
        base = dist.distributed_c10d._get_default_store()
        store = dist.PrefixStore("gatherstore", base)  # type: ignore[attr-defined]
        # where this rank runs, for the layout (see hosts()): published at its first use
        # of the control plane, outside the exchanges' steps
        store.set(f"{_HOSTS}{dist.get_rank()}", socket.gethostname())
        _state.update(world=world, store=store, group=None, step=0)
    return _state


def hosts(timeout: float) -> list[str]:
    """Every rank's hostname, in rank order.

    Each rank publishes its own at its first use of the control plane (init, or its
    first gatherstore collective), outside the exchanges' numbered steps: a rank
    that asks alone waits only until the others next use gatherstore, and no call
    is put out of step.

    Raises:
        GatherTimeout: some ranks did not publish within ``timeout`` s (named).
    """
    store, world = _current()["store"], dist.get_world_size()
    keys = [f"{_HOSTS}{r}" for r in range(world)]

    def read() -> list[str]:
        try:
            store.wait(keys, _dt.timedelta(seconds=timeout))
        except RuntimeError:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if not missing:  # they arrived just now
                return read()
            raise _late("topology", missing, timeout) from None
        return [value.decode() for value in store.multi_get(keys)]

    found: list[str] = bounded(read, timeout, "topology")
    return found


def control_group() -> Any:
    """A gloo group of gatherstore's own, created once per default group.

    Creating it is itself a collective: every rank must reach it together
    (``launch`` and ``init_from_env`` create it eagerly).
    """
    state = _current()
    if state["group"] is None:
        state["group"] = dist.new_group(
            backend="gloo", timeout=_dt.timedelta(seconds=DEFAULT_TIMEOUT)
        )
    return state["group"]


def step() -> int:
    """The number of exchanges this job has run: the same on every rank between two
    exchanges, so it names the current call (e.g. keys of its own on :func:`store`)."""
    return int(_current()["step"])


def store() -> Any:
    """The job's rendezvous store, under gatherstore's own key prefix."""
    return _current()["store"]


def bounded(run: Callable[[], Any], timeout: float, what: str) -> Any:
    """``run()`` (requests to the rendezvous store), given up on after ``timeout`` plus
    :data:`HOST_GRACE` s where a rank other than this one hosts the store (a frozen
    host would otherwise block the request for the store's own timeout).

    Raises:
        GatherTimeout: the store's host did not answer in time.
    """
    hosts = _rank0_hosts_store()
    if hosts and dist.get_rank() == 0:
        return run()
    return _bounded(run, timeout, what, hosts)


def reset() -> None:
    """Forget the control state (called when the default group is destroyed)."""
    _state.clear()
    _state["world"] = None


def exchange(payload: bytes, *, timeout: float, what: str = "exchange") -> list[bytes]:
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
    values, _ = exchange_summary(payload, timeout=timeout, what=what)
    assert values is not None
    return values


def exchange_summary(
    payload: bytes,
    *,
    timeout: float,
    what: str = "exchange",
    summarize: Summarize | None = None,
    full: Collection[int] | None = None,
) -> tuple[list[bytes] | None, bytes | None]:
    """:func:`exchange`, where every rank gets ``summarize(payloads)`` (computed once,
    on one rank) and only the ranks in ``full`` (default: all) get the payloads.

    Returns ``(payloads or None, summary or None)``.  Where ``summarize`` returns
    None (say, a rank reported a failure) or raises, every rank gets the payloads
    and no summary.  Raises as :func:`exchange` does.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return [payload], _summary(summarize, [payload])
    state = _current()
    state["step"] += 1
    labelled = _label(what) + b"\0" + payload
    rank, hosts = dist.get_rank(), _rank0_hosts_store()

    def summarize_labelled(values: list[bytes]) -> bytes | None:
        labels, payloads = _split(values)
        return None if len(set(labels)) > 1 else _summary(summarize, payloads)

    def run() -> Outcome:
        return exchange_on(
            state["store"],
            f"{state['step']}/",
            rank,
            dist.get_world_size(),
            labelled,
            timeout=timeout,
            rank0_hosts=hosts,
            summarize=summarize_labelled if summarize else None,
            full=full,
        )

    try:
        # rank 0 hosting the store cannot wait on a frozen host: itself
        outcome: Outcome = run() if rank == 0 and hosts else _bounded(run, timeout, what, hosts)
    except RuntimeError as exc:
        raise RemoteRankError(
            0,
            f"the job's rendezvous store (hosted by rank 0 or its launcher) is unreachable: {exc}",
            context=what,
        ) from exc
    if outcome.late is not None:
        raise _late(what, outcome.late, timeout)
    values = None if outcome.values is None else _unlabel(outcome.values, what)
    return values, outcome.summary


def _summary(summarize: Summarize | None, values: list[bytes]) -> bytes | None:
    """``summarize(values)``; None when there is none or it fails (all values go out then)."""
    if summarize is None:
        return None
    try:
        return summarize(values)
    except Exception:  # a summary is an optimisation: every rank can still decide from all values
        return None


def _bounded(run: Callable[[], Any], timeout: float, what: str, rank0_hosts: bool) -> Any:
    """``run()`` in a thread, given up on after ``timeout`` plus :data:`HOST_GRACE` s.

    A c10d store client waits on a frozen (stopped, not dead) store host for the
    store's own timeout, whatever the timeout of the wait: bounding the exchange
    here makes a frozen host fail the call in time instead of hanging it.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = run()
        except BaseException as exc:  # handed over to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="gatherstore-exchange", daemon=True)
    thread.start()
    thread.join(timeout + HOST_GRACE)
    if thread.is_alive():
        host = "rank 0, which hosts" if rank0_hosts else "the launcher, which hosts"
        raise GatherTimeout(
            f"{what}: {host} the job's rendezvous store, did not answer within "
            f"{timeout + HOST_GRACE:g} s; it is frozen or unreachable (end the job: its "
            "process group cannot go on without that store)",
            ranks=[0] if rank0_hosts else [],
            timeout=timeout,
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def exchange_on(
    store: Any,
    prefix: str,
    rank: int,
    world: int,
    value: bytes,
    *,
    timeout: float,
    rank0_hosts: bool = False,
    summarize: Summarize | None = None,
    full: Collection[int] | None = None,
) -> Outcome:
    """One exchange among ``world`` ranks on a c10d ``store`` under ``prefix``.

    Returns every rank's ``value`` in rank order (with ``summarize``: the summary,
    and the values only on the ranks in ``full``, default all), or the ranks missing
    at the first timeout: one verdict that every rank (a late one included, once
    it arrives) returns.  Each rank deletes its own key once it has read the
    values' verdict (so no rank deletes W keys in a row), and the last rank to read
    deletes the rest (every key, after a timeout).

    Raises:
        RuntimeError: the store failed (torch's ``DistStoreError``).
    """
    keys = [f"{prefix}{r}" for r in range(world)]
    verdict = prefix + "all"
    full = range(world) if full is None else full
    store.set(keys[rank], value)
    if store.add(prefix + "arrived", 1) == world:  # the last arriver gathers, once
        store.compare_set(verdict, "", _proposal(store, prefix, keys, summarize, full))
    try:
        store.wait([verdict], _dt.timedelta(seconds=timeout))
    except RuntimeError:  # a timeout, or the store is gone (then the next call raises)
        _judge(store, prefix, keys, summarize, full)
    outcome = _read(store, prefix, rank in full)
    # the values are out; unless a judge ran (it, or a stalled last arriver, may still
    # gather), nothing reads this rank's key again
    keep = outcome.late is not None or store.add(prefix + "judge", 0) > 0
    if not keep:
        store.delete_key(keys[rank])
    if store.add(prefix + "read", 1) == world:  # the last reader tidies up the rest
        left = keys if keep else []
        for key in [*left, verdict, *(prefix + k for k in ("arrived", "judge", "read", "full"))]:
            store.delete_key(key)
        if outcome.late is None and rank0_hosts and rank != 0:
            store.set(prefix + "done", b"")
    elif outcome.late is None and rank0_hosts and rank == 0:
        _outlive_readers(store, prefix + "done", timeout)
    return outcome


def _proposal(
    store: Any, prefix: str, keys: list[str], summarize: Summarize | None, full: Collection[int]
) -> bytes:
    """The verdict once every key is in: all values, or a summary (the values go
    to a key of their own first, for the ranks in ``full``)."""
    values = store.multi_get(keys)
    summary = _summary(summarize, values)
    if summary is None:
        return _pack(values)
    if full:
        store.set(prefix + "full", _pack(values))
    return _SUMMARY + summary


def _read(store: Any, prefix: str, in_full: bool) -> Outcome:
    """This rank's outcome from the verdict (and the values' key, for a rank in ``full``)."""
    packed = store.get(prefix + "all")
    if packed.startswith(_LATE):
        return Outcome(late=list(json.loads(packed[len(_LATE) :])))
    if packed.startswith(_SUMMARY):
        values = _unpack(store.get(prefix + "full")) if in_full else None
        return Outcome(values=values, summary=packed[len(_SUMMARY) :])
    return Outcome(values=_unpack(packed))


def _judge(
    store: Any, prefix: str, keys: list[str], summarize: Summarize | None, full: Collection[int]
) -> None:
    """After a timeout, decide the verdict: the ranks whose keys are missing.

    One rank checks the W keys while the others wait a little for its verdict
    (so a timeout costs O(W) requests too); the first proposal wins, so every
    rank agrees even when a late rank arrives between two ranks' timeouts.
    """
    verdict = prefix + "all"
    first = store.add(prefix + "judge", 1) == 1
    if not first:
        try:
            store.wait([verdict], _dt.timedelta(seconds=_JUDGE_GRACE))
            return
        except RuntimeError:  # the judge is gone or stuck: judge too
            pass
    late = [r for r, key in enumerate(keys) if not store.check([key])]
    if late:
        store.compare_set(verdict, "", _LATE + json.dumps(late).encode())
        return
    # every rank arrived, so the last of them publishes: the first judge gives it a
    # grace before gathering itself (a later judge has waited that grace already)
    if first:
        with contextlib.suppress(RuntimeError):
            store.wait([verdict], _dt.timedelta(seconds=_JUDGE_GRACE))
            return
    store.compare_set(verdict, "", _proposal(store, prefix, keys, summarize, full))


def _pack(values: list[bytes]) -> bytes:
    """Values as one, each distinct value once: the runs of equal values (index into
    the distinct ones, length), the distinct values' lengths, then their bytes.
    When every rank sends the same bytes this is O(1), not O(W)."""
    distinct: dict[bytes, int] = {}
    runs: list[int] = []
    for value in values:
        index = distinct.setdefault(value, len(distinct))
        if runs and runs[-2] == index:
            runs[-1] += 1
        else:
            runs += [index, 1]
    head = struct.pack(
        f"<II{len(runs)}I{len(distinct)}I",
        len(runs) // 2,
        len(distinct),
        *runs,
        *map(len, distinct),
    )
    return _VALUES + head + b"".join(distinct)


def _unpack(packed: bytes) -> list[bytes]:
    """What :func:`_pack` packed."""
    body = memoryview(packed)[len(_VALUES) :]
    count, kinds = struct.unpack_from("<II", body)
    runs = struct.unpack_from(f"<{2 * count}I", body, 8)
    lengths = struct.unpack_from(f"<{kinds}I", body, 8 + 8 * count)
    distinct, offset = [], 8 + 8 * count + 4 * kinds
    for length in lengths:
        distinct.append(bytes(body[offset : offset + length]))
        offset += length
    values: list[bytes] = []
    for index, run in zip(runs[::2], runs[1::2], strict=True):
        values += [distinct[index]] * run
    return values


def _rank0_hosts_store() -> bool:
    """Whether rank 0's process hosts the job's store (no torchrun agent or
    ``launch`` parent does), so that rank 0 must not leave before the others."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _outlive_readers(store: Any, done: str, timeout: float) -> None:
    """Return only once every rank has read: rank 0 often hosts the store, and a
    rank 0 that exits right after the job's last exchange would take the store
    away from ranks still reading it."""
    try:
        store.wait([done], _dt.timedelta(seconds=timeout))
    except RuntimeError:  # a rank died mid-read: its failure surfaces in the next call
        return
    store.delete_key(done)


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


def _late(what: str, late: list[int], timeout: float) -> GatherTimeout:
    return GatherTimeout(
        f"{what}: ranks {late} did not arrive within {timeout:g} s; they are still busy, "
        "stuck, or have stopped (raise the timeout if they legitimately work longer)",
        ranks=late,
        timeout=timeout,
    )
