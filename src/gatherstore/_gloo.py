"""Transfers over gatherstore's gloo group that keep the call's timeout.

A blocking gloo op waits for the group's own timeout (30 min by default), and
a rank that was killed or frozen mid-op surfaces as a raw torch RuntimeError
that names nobody.  Here every op is started with ``async_op=True`` and
polled until it finishes or the call's deadline passes; then every rank
reports over the control plane, so a rank that never reports is named (a
GatherTimeout) and a rank whose op failed is named too.  A gloo op that did
not finish leaves the group out of step for good: the group is marked broken
and later calls refuse it at once with a message that says how to go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from . import _control as control
from ._errors import GatherError, GatherTimeout, RemoteRankError

__all__ = ["GRACE", "broken", "transfer"]

#: Seconds past the call's deadline that ranks wait for each other's reports.
GRACE = 5.0
_POLL_MAX = 0.01

# the default group the broken mark belongs to, and why it is broken
_state: dict[str, Any] = {"world": None, "why": ""}

_HOW_ON = (
    "gatherstore's gloo group cannot be used again in this job (a gloo op that did not "
    "finish leaves it out of step); store='auto' now sends small objects through tmpdir "
    "on one machine; otherwise pass store='tmpdir', 'file:///<shared dir>', 'redis://...' "
    "or 's3://...', or restart the job"
)


def broken() -> str:
    """Why gatherstore's gloo group is unusable in this job, or "" while it is usable."""
    return str(_state["why"]) if _state["world"] is dist.group.WORLD else ""


def refuse(what: str, why: str) -> GatherError:
    """The error for a call that needs the gloo group after it broke."""
    return GatherError(f"{what}: {why}; {_HOW_ON}")


def transfer(start: Callable[[Any], Any], *, what: str, deadline: float, timeout: float) -> None:
    """Run ``start(group)`` (an ``async_op=True`` gloo op) until it ends or ``deadline``.

    Raises:
        GatherTimeout: ranks that did not report within the deadline plus
            :data:`GRACE` (killed, frozen, or in another call), named.
        RemoteRankError: a rank's op failed; or rank 0's rendezvous store is gone.
        GatherError: every rank reported, but the op failed or timed out here.
    """
    error = ""
    try:
        work = start(control.control_group())
        pause = 0.0002
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)
        if work.is_completed():
            work.wait()
        else:
            error = f"the transfer did not finish within {timeout:g} s"
    except RuntimeError as exc:  # gloo: e.g. "Connection closed by peer"
        error = f"the transfer failed: {str(exc).splitlines()[0]}"
    if error:
        _state.update(world=dist.group.WORLD, why=f"{what}: {error}")
    remaining = max(deadline - time.monotonic(), 0.0) + GRACE
    try:
        reports = control.exchange(error.encode(), timeout=remaining, what=f"{what} (transfer)")
    except GatherTimeout as exc:
        note = f"; {_HOW_ON}" if error else ""
        raise GatherTimeout(f"{exc}{note}", ranks=exc.ranks, timeout=timeout) from None
    failed = [r for r, report in enumerate(reports) if report]
    if failed and not error:
        raise RemoteRankError(failed[0], reports[failed[0]].decode(), ranks=failed, context=what)
    if error:
        raise GatherError(f"{what}: {error} (failing ranks: {failed}); {_HOW_ON}")
