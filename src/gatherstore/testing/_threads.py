"""A check's other client: work run in a thread, its errors kept for the check."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["started"]


def started(work: Callable[[], None], done: threading.Event) -> tuple[threading.Thread, list[Any]]:
    """A started thread running ``work``; it sets ``done`` when it ends, and the list
    returned holds what ``work`` raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors
