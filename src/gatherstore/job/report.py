"""What a rank tells the others about its part of a call, and raising it on every rank.

Each step of a collective ends with an exchange of small JSON records: ``ok`` and
the facts the step needs (sizes, free memory, ...), or a failure with its error,
kind and traceback.  When any rank failed, every rank raises together: the rank
that had the error raises its own, the others a ``RemoteRankError`` naming
the first failed rank (a ``StoreUnavailableError`` when that rank could not
use the store).
"""

from __future__ import annotations

import json
import traceback
from typing import Any

from gatherstore._errors import RemoteRankError, StoreUnavailableError

__all__ = ["failure", "raise_failures", "status"]


def status(ok: bool, **fields: Any) -> bytes:
    """A rank's record for an exchange: ``ok`` and ``fields``."""
    return json.dumps({"ok": ok, **fields}).encode()


def failure(exc: BaseException) -> bytes:
    """The record of a rank that failed with ``exc`` (its traceback included)."""
    return status(
        False,
        error=f"{type(exc).__name__}: {exc}",
        kind=type(exc).__name__,
        tb=traceback.format_exc(),
        store=str(getattr(exc, "store", "")),
    )


def raise_failures(statuses: list[Any], what: str, error: BaseException | None) -> None:
    """Raise when a rank reported a failure: ``error`` on the rank that had it, on the
    others the first failed rank's error."""
    failed = [r for r, s in enumerate(statuses) if not s["ok"]]
    if not failed:
        return
    if error is not None:
        raise error
    first = statuses[failed[0]]
    if first.get("kind") == "StoreUnavailableError":
        raise StoreUnavailableError(
            f"{what}: rank {failed[0]} cannot use the store: {first['error']}",
            store=first.get("store", ""),
        )
    raise RemoteRankError(
        failed[0], first["error"], remote_traceback=first.get("tb", ""), ranks=failed, context=what
    )
