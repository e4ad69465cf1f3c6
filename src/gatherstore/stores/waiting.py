"""Waiting for keys: poll until each exists, backing off, or until the timeout.

Stores have no notifications in common (Redis keyspace events, S3 event
queues and inotify all need setting up), so ``Store.wait`` polls: first at an
eighth of the store's ``poll_interval``, doubling up to twenty times it, so a
key that lands at once is seen at once and a long wait costs few requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .._errors import GatherTimeout, seconds

__all__ = ["wait_for"]


def wait_for(
    exists: Callable[[str], bool],
    keys: Sequence[str],
    timeout: float,
    interval: float,
    store: object,
) -> None:
    """Block until ``exists(key)`` for every key (polling around ``interval`` seconds).

    Raises:
        GatherTimeout: some keys are still missing after ``timeout`` seconds; its ``keys``
            lists them and its message names ``store``.
    """
    missing = list(keys)
    end = time.monotonic() + timeout
    delay = interval / 8
    while True:
        missing = [k for k in missing if not exists(k)]
        if not missing:
            return
        if time.monotonic() >= end:
            raise GatherTimeout(
                f"store {store}: keys {missing} did not appear within {seconds(timeout)} s",
                keys=missing,
                timeout=timeout,
            )
        time.sleep(delay)
        delay = min(delay * 2, interval * 20)
