"""The control plane: small byte exchanges through the job's rendezvous store.

Every coordination step (status/size exchange, barriers with a timeout, the
shared tmpdir path, the signing key) rides on :func:`exchange`: each rank
publishes a few bytes under a key of the job's c10d store (the TCPStore that
``init_process_group`` already runs), then waits, with its own timeout, for the
keys of all ranks.  A timeout names exactly the ranks whose keys are missing,
on every rank, and breaks nothing: unlike a gloo recv that times out (which
closes the connection for good), a store wait can simply be given up.  Nothing
here touches GPU memory or the NCCL watchdog.

The bulk "collective" route of objects needs a real gloo group:
:func:`control_group` creates it once per job.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from typing import Any

import torch.distributed as dist

from ._config import DEFAULT_TIMEOUT
from ._errors import GatherError, GatherTimeout, MismatchError, RemoteRankError

__all__ = ["control_group", "exchange", "is_initialized", "reset"]

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

    Raises:
        GatherTimeout: some ranks did not arrive within ``timeout`` seconds; its
            ``ranks`` are those ranks (the same on every rank that waited).
        RemoteRankError: the job's store went away (the process hosting it, rank 0 or
            the launcher, ended).
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return [payload]
    state = _current()
    state["step"] += 1
    store, world = state["store"], dist.get_world_size()
    prefix = f"{state['step']}/"
    keys = [f"{prefix}{r}" for r in range(world)]
    verdict = prefix + "late"
    try:
        store.set(keys[dist.get_rank()], what.encode() + b"\0" + payload)
        try:
            store.wait(keys, _dt.timedelta(seconds=timeout))
            late: list[int] = []
        except RuntimeError:
            late = [r for r, key in enumerate(keys) if not store.check([key])]
        # Every rank proposes its view; the first proposal wins, so all ranks agree
        # even when a late rank arrives between one rank's timeout and another's wait.
        decided = json.loads(store.compare_set(verdict, "", json.dumps(late)))
        if decided:
            _raise_late(what, decided, timeout)
        labelled: list[bytes] = store.multi_get(keys)
        done = prefix + "done" if _rank0_hosts_store() else ""
        if store.add(prefix + "read", 1) == world:  # the last reader tidies up
            for key in [*keys, verdict, prefix + "read"]:
                store.delete_key(key)
            if done and dist.get_rank() != 0:
                store.set(done, b"")
        elif done and dist.get_rank() == 0:
            _outlive_readers(store, done, timeout)
        return _unlabel(labelled, what)
    except GatherError:
        raise
    except RuntimeError as exc:
        raise RemoteRankError(
            0,
            f"the job's rendezvous store (hosted by rank 0 or its launcher) is unreachable: {exc}",
            context=what,
        ) from exc


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


def _raise_late(what: str, late: list[int], timeout: float) -> None:
    raise GatherTimeout(
        f"{what}: ranks {late} did not arrive within {timeout:g} s; they are still busy, "
        "stuck, or have stopped (raise the timeout if they legitimately work longer)",
        ranks=late,
        timeout=timeout,
    )
