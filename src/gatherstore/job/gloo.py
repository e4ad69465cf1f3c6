"""Transfers over gatherstore's gloo group that keep the call's timeout.

A blocking gloo op waits for the group's own timeout (30 min by default), and
a rank that was killed or frozen mid-op surfaces as a raw torch RuntimeError
that names nobody.  Here every op runs asynchronously with the time left of
the call as its own gloo timeout (so nothing stays pending in gloo's threads,
where it would block ``destroy_process_group``), polled so that signals are
handled; then every rank reports over the control plane, so a rank that
never reports is named (a GatherTimeout) and a rank whose op failed is named
too.  A gloo op that did not finish leaves the group out of step for good:
the group is marked broken and later calls refuse it at once with a message
that says how to go on.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from gatherstore._config import default_timeout
from gatherstore._errors import GatherError, GatherTimeout, RemoteRankError, ranks_named, seconds
from gatherstore._time import Deadline
from gatherstore.job import control
from gatherstore.job import state as job
from gatherstore.job.exchange import late_error

__all__ = [
    "GRACE",
    "all_gather_op",
    "broadcast_op",
    "broken",
    "group",
    "gather_op",
    "mark_broken",
    "refuse",
    "transfer",
]

#: Starts one gloo op on a group with a timeout of its own; returns its Work.
Start = Callable[[Any, _dt.timedelta], Any]

#: Seconds past the call's deadline that ranks wait for each other's reports.
GRACE = 5.0
#: Seconds past the call's deadline that a gloo op (whose own timeout is the deadline)
#: may take to say it is over, before it counts as not finished.
_OP_SLACK = 1.0
_POLL_FIRST = 0.001  # the longest pause between looks at a transfer, in its first second
_POLL_MAX = 0.01  # ... and after


_HOW_ON = (
    "gatherstore's gloo group cannot be used again in this job (a gloo op that did not "
    "finish leaves it out of step); store='auto' now sends small objects through tmpdir "
    "on one machine; otherwise pass store='tmpdir', 'file:///<shared dir>', 'redis://...' "
    "or 's3://...', or restart the job"
)


def group() -> Any:
    """A gloo group of gatherstore's own beside the current process group, made once per
    group: for the default group, a group of every rank; for another, a gloo twin of its
    members only, rendezvoused under the group's own keys (no other rank takes part, and
    ranks are the group's ranks).

    Creating it is itself a collective of the group's members: each must reach it
    together (``launch`` and ``init_from_env`` create the default group's eagerly).
    """
    state = job.group_state()
    if state.gloo_group is None:
        timeout = _dt.timedelta(seconds=default_timeout())
        if state.is_default:
            state.gloo_group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            rendezvous = dist.PrefixStore("gloo/", control.store())  # type: ignore[attr-defined]
            state.gloo_group = dist.ProcessGroupGloo(rendezvous, state.rank, state.size, timeout)
    return state.gloo_group


def broken() -> str:
    """Why gatherstore's gloo group is unusable in this job, or "" while it is usable."""
    return job.group_state().gloo_broken if dist.is_initialized() else ""


def mark_broken(what: str, why: str) -> str:
    """Mark gatherstore's gloo group unusable after a transfer that did not finish;
    returns what to tell the user about going on."""
    job.group_state().gloo_broken = f"{what}: {why}"
    return _HOW_ON


def refuse(what: str, why: str) -> GatherError:
    """The error for a call that needs the gloo group after it broke."""
    return GatherError(f"{what}: refused, an earlier call broke the group ({why}); {_HOW_ON}")


def _options(options: Any, timeout: _dt.timedelta) -> Any:
    options.timeout = timeout
    options.asyncOp = True
    return options


def all_gather_op(slots: list[torch.Tensor], tensor: torch.Tensor) -> Start:
    """Every rank's ``tensor`` into ``slots`` (one per rank)."""
    return lambda group, timeout: group.allgather(
        [slots], [tensor], _options(c10d.AllgatherOptions(), timeout)
    )


def gather_op(slots: list[torch.Tensor] | None, tensor: torch.Tensor, dst: int) -> Start:
    """Every rank's ``tensor`` into ``slots`` on ``dst`` (None elsewhere)."""

    def start(group: Any, timeout: _dt.timedelta) -> Any:
        options = _options(c10d.GatherOptions(), timeout)
        options.rootRank = dst
        return group.gather([] if slots is None else [slots], [tensor], options)

    return start


def broadcast_op(tensor: torch.Tensor, src: int) -> Start:
    """``src``'s ``tensor`` into ``tensor`` on every rank."""

    def start(group: Any, timeout: _dt.timedelta) -> Any:
        options = _options(c10d.BroadcastOptions(), timeout)
        options.rootRank = src
        options.rootTensor = 0
        return group.broadcast([tensor], options)

    return start


def transfer(start: Start, *, what: str, deadline: Deadline) -> None:
    """Run one gloo op (``all_gather_op``, ...) until it ends, by ``deadline`` at the latest.

    Raises:
        GatherTimeout: ranks that did not report within ``GRACE`` s past the end of
            the op (killed, frozen, or in another call), named.
        RemoteRankError: a rank's op failed; or rank 0's rendezvous store is gone.
        GatherError: every rank reported, but the op failed or timed out here.
    """
    error = ""
    try:
        left = max(deadline.ends - time.monotonic(), 0.001)
        work = start(group(), _dt.timedelta(seconds=left))
        pause, began = 0.0002, time.monotonic()
        while not work.is_completed() and time.monotonic() < deadline.ends + _OP_SLACK:
            time.sleep(pause)  # in Python, not in C++: signals are handled meanwhile
            # a short op is seen done within a millisecond; a long one costs few wakeups
            longest = _POLL_FIRST if time.monotonic() - began < 1.0 else _POLL_MAX
            pause = min(pause * 2, longest)
        if not work.is_completed():
            error = f"the transfer did not finish within {seconds(deadline.timeout)} s"
        else:
            work.wait()
    except RuntimeError as exc:  # gloo: e.g. "Connection closed by peer", "Timed out"
        late = deadline.passed()
        error = (
            f"the transfer did not finish within {seconds(deadline.timeout)} s"
            if late
            else f"the transfer failed: {str(exc).splitlines()[0]}"
        )
    if error:
        mark_broken(what, error)
    remaining = max(deadline.ends - time.monotonic(), 0.0) + GRACE
    try:
        reports = control.exchange(error.encode(), timeout=remaining, what=f"{what} (transfer)")
    except GatherTimeout as exc:  # named with the call's timeout, not the reports' own
        named = late_error(f"{what} (transfer)", exc.ranks, deadline.timeout)
        note = f"; {_HOW_ON}" if error else ""
        raise GatherTimeout(f"{named}{note}", ranks=exc.ranks, timeout=deadline.timeout) from None
    failed = [r for r, report in enumerate(reports) if report]
    if failed and not error:
        raise RemoteRankError(failed[0], reports[failed[0]].decode(), ranks=failed, context=what)
    if error:
        raise GatherError(f"{what}: {error} (failing: {ranks_named(failed)}); {_HOW_ON}")
