"""The control plane: small byte exchanges through the job's rendezvous store.

Every coordination step (status/size exchange, barriers with a timeout, the
shared tmpdir path, the signing key) rides on :func:`exchange`: each rank
publishes a few bytes under a key of the job's c10d store (the TCPStore that
``init_process_group`` already runs); the last rank to arrive gathers all keys
once into one value, and every rank waits, with its own timeout, for that value
(O(W) requests per exchange, not W reads by each of W ranks).  A timeout names
exactly the ranks whose keys are missing, on every rank, and breaks nothing:
unlike a gloo recv that times out (which closes the connection for good), a
store wait can simply be given up.  Nothing
here touches GPU memory or the NCCL watchdog.

The bulk "collective" route of objects needs a real gloo group:
:func:`control_group` creates it once per job.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ._config import DEFAULT_TIMEOUT
from ._errors import GatherTimeout, MismatchError, RemoteRankError

__all__ = ["control_group", "exchange", "exchange_on", "is_initialized", "reset"]

# the verdict key's value: every rank's value, or the ranks that were late
_VALUES, _LATE = b"V", b"L"
# how long ranks that timed out wait for the one rank judging who is late
_JUDGE_GRACE = 5.0
#: Seconds past an exchange's timeout after which its store host counts as frozen
#: (an exchange may take up to _JUDGE_GRACE more than its timeout to agree on a verdict).
HOST_GRACE = 2 * _JUDGE_GRACE

# the default group this state belongs to, its control store, gloo group, step counter
_state: dict[str, Any] = {"world": None}


def is_initialized() -> bool:
    """Whether a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def _current() -> dict[str, Any]:
    world = dist.group.WORLD
    if _state["world"] is not world:
        base = dist.distributed_c10d._get_default_store()
        store = dist.PrefixStore("gatherstore", base)  # type: ignore[attr-defined]
        _state.update(world=world, store=store, group=None, step=0)
    return _state


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
    if not is_initialized() or dist.get_world_size() == 1:
        return [payload]
    state = _current()
    state["step"] += 1
    labelled = what.encode() + b"\0" + payload
    rank, hosts = dist.get_rank(), _rank0_hosts_store()

    def run() -> list[bytes] | tuple[str, list[int]]:
        return exchange_on(
            state["store"],
            f"{state['step']}/",
            rank,
            dist.get_world_size(),
            labelled,
            timeout=timeout,
            rank0_hosts=hosts,
        )

    try:
        # rank 0 hosting the store cannot wait on a frozen host: itself
        outcome = run() if rank == 0 and hosts else _bounded(run, timeout, what, hosts)
    except RuntimeError as exc:
        raise RemoteRankError(
            0,
            f"the job's rendezvous store (hosted by rank 0 or its launcher) is unreachable: {exc}",
            context=what,
        ) from exc
    if isinstance(outcome, list):
        return _unlabel(outcome, what)
    raise _late(what, outcome[1], timeout)


def _bounded(
    run: Callable[[], list[bytes] | tuple[str, list[int]]],
    timeout: float,
    what: str,
    rank0_hosts: bool,
) -> list[bytes] | tuple[str, list[int]]:
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
    return box["value"]  # type: ignore[no-any-return]


def exchange_on(
    store: Any,
    prefix: str,
    rank: int,
    world: int,
    value: bytes,
    *,
    timeout: float,
    rank0_hosts: bool = False,
) -> list[bytes] | tuple[str, list[int]]:
    """One exchange among ``world`` ranks on a c10d ``store`` under ``prefix``.

    Returns every rank's ``value`` in rank order, or ``("late", ranks)``: the
    ranks missing at the first timeout, one verdict that every rank (a late one
    included, once it arrives) returns.  The last rank to read deletes every key.

    Raises:
        RuntimeError: the store failed (torch's ``DistStoreError``).
    """
    keys = [f"{prefix}{r}" for r in range(world)]
    verdict = prefix + "all"
    store.set(keys[rank], value)
    if store.add(prefix + "arrived", 1) == world:  # the last arriver gathers, once
        store.compare_set(verdict, "", _pack(store.multi_get(keys)))
    try:
        store.wait([verdict], _dt.timedelta(seconds=timeout))
    except RuntimeError:  # a timeout, or the store is gone (then the next call raises)
        _judge(store, prefix, keys)
    outcome = _unpack(store.get(verdict))
    ok = isinstance(outcome, list)
    if store.add(prefix + "read", 1) == world:  # the last reader tidies up
        for key in [*keys, verdict, *(prefix + k for k in ("arrived", "judge", "read"))]:
            store.delete_key(key)
        if ok and rank0_hosts and rank != 0:
            store.set(prefix + "done", b"")
    elif ok and rank0_hosts and rank == 0:
        _outlive_readers(store, prefix + "done", timeout)
    return outcome


def _judge(store: Any, prefix: str, keys: list[str]) -> None:
    """After a timeout, decide the verdict: the ranks whose keys are missing.

    One rank checks the W keys while the others wait a little for its verdict
    (so a timeout costs O(W) requests too); the first proposal wins, so every
    rank agrees even when a late rank arrives between two ranks' timeouts.
    """
    verdict = prefix + "all"
    if store.add(prefix + "judge", 1) > 1:
        try:
            store.wait([verdict], _dt.timedelta(seconds=_JUDGE_GRACE))
            return
        except RuntimeError:  # the judge is gone or stuck: judge too
            pass
    late = [r for r, key in enumerate(keys) if not store.check([key])]
    proposal = _LATE + json.dumps(late).encode() if late else _pack(store.multi_get(keys))
    store.compare_set(verdict, "", proposal)


def _pack(values: list[bytes]) -> bytes:
    """Values as one: a count, their lengths, then their bytes."""
    lengths = struct.pack(f"<I{len(values)}I", len(values), *map(len, values))
    return _VALUES + lengths + b"".join(values)


def _unpack(packed: bytes) -> list[bytes] | tuple[str, list[int]]:
    """What :func:`_pack` packed, or ``("late", ranks)`` for a timeout verdict."""
    if packed.startswith(_LATE):
        return "late", list(json.loads(packed[len(_LATE) :]))
    body = memoryview(packed)[len(_VALUES) :]
    (count,) = struct.unpack_from("<I", body)
    lengths = struct.unpack_from(f"<{count}I", body, 4)
    values, offset = [], 4 * (count + 1)
    for length in lengths:
        values.append(bytes(body[offset : offset + length]))
        offset += length
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


def _unlabel(labelled: list[bytes], what: str) -> list[bytes]:
    """Payloads without their labels; ranks that were in another call make every rank raise."""
    labels, payloads = zip(*(value.split(b"\0", 1) for value in labelled), strict=True)
    if len(set(labels)) > 1:
        calls = {rank: label.decode() for rank, label in enumerate(labels)}
        raise MismatchError(
            f"{what}: ranks are in different gatherstore calls at the same step — {calls}; "
            "every rank must make the same collective calls in the same order",
            details=calls,
        )
    return list(payloads)


def _late(what: str, late: list[int], timeout: float) -> GatherTimeout:
    return GatherTimeout(
        f"{what}: ranks {late} did not arrive within {timeout:g} s; they are still busy, "
        "stuck, or have stopped (raise the timeout if they legitimately work longer)",
        ranks=late,
        timeout=timeout,
    )
