"""How a destination that stops a streamed gather early tells its senders.

A destination stops early when its ``gather_iter`` is closed or dropped, a
part cannot be rebuilt, or a sender stalls or dies.  The senders must then be
released at once, told why (naming the rank that stalled, not the
destination), and, where they can be, left with the gloo group in step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from gatherstore._time import Deadline
from gatherstore.job import control

__all__ = ["RELEASE_GRACE", "Halt"]

# added to a sender's chunk counter by a destination that stops early
_HALTED = 1 << 40
#: Seconds the destination gives each sender's chunk in flight after it stopped early.
RELEASE_GRACE = 5.0


class Halt:
    """One streamed gather's keys on the rendezvous store: a counter per sender of the
    chunks it posted, and the destination's reason for stopping early.

    A sender claims each chunk before posting it (one atomic ``add``); a destination
    that stops adds a huge number to each counter instead.  So a claim that comes
    later sees the halt and posts nothing, and the destination learns from its own
    ``add`` exactly how many chunks each sender posted: it takes those, and every
    sender is released with the gloo group in step.  When the destination stopped
    because its own wait timed out, gloo has closed its connections: the senders'
    waits fail at once, and they read the reason instead.
    """

    def __init__(self, call_id: int, *, deadline: Deadline, what: str) -> None:
        self.prefix = f"stream/{call_id}/"
        self.store, self.deadline, self.what = control.store(), deadline, what

    def _run(self, fn: Callable[[], Any]) -> Any:
        left = max(self.deadline.ends - time.monotonic(), 0.0) + RELEASE_GRACE
        return control.bounded(fn, left, self.what)

    def claim(self, rank: int) -> bool:
        """Claim one more chunk for ``rank`` to post; False once the destination stopped."""
        key = f"{self.prefix}sent/{rank}"
        return int(self._run(lambda: self.store.add(key, 1))) <= _HALTED

    def done(self, rank: int) -> None:
        """``rank`` posts no more chunks: forget its counter."""
        key = f"{self.prefix}sent/{rank}"
        self._run(lambda: self.store.delete_key(key))

    def stop(self, reason: dict[str, Any], unfinished: dict[int, int]) -> dict[int, int]:
        """Stop the ``unfinished`` senders (rank -> chunks of its part) for ``reason``;
        returns how many chunks each had posted."""
        store, prefix, named = self.store, self.prefix, set(reason.get("ranks", ()))

        def run() -> dict[int, int]:
            store.set(prefix + "reason", json.dumps(reason))
            posted = {r: store.add(f"{prefix}sent/{r}", _HALTED) - _HALTED for r in unfinished}
            # who will read the reason: every sender whose claim fails, and after a timeout
            # (no chunk is taken) also those whose last chunk was in flight
            readers = [
                r
                for r, n in posted.items()
                if r not in named and (n < unfinished[r] or reason["kind"] == "timeout")
            ]
            if store.add(prefix + "readers", len(readers)) == 0:
                self._forget()
            return posted

        posted: dict[int, int] = self._run(run)
        return posted

    def reason(self, rank: int, wait: float = 0.0) -> dict[str, Any] | None:
        """The destination's reason for stopping, waiting up to ``wait`` s for it (None
        when there is none); the last reader removes the keys."""
        store, prefix = self.store, self.prefix

        def run() -> dict[str, Any] | None:
            ends = time.monotonic() + wait
            while not store.check([prefix + "reason"]):
                if time.monotonic() >= ends:
                    return None
                time.sleep(0.05)
            reason: dict[str, Any] = json.loads(store.get(prefix + "reason"))
            store.delete_key(f"{prefix}sent/{rank}")
            if rank not in reason.get("ranks", ()) and store.add(prefix + "readers", -1) == 0:
                self._forget()
            return reason

        reason: dict[str, Any] | None = self._run(run)
        return reason

    def _forget(self) -> None:
        for name in ("reason", "readers"):
            self.store.delete_key(self.prefix + name)
