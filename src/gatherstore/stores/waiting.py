"""Waiting for keys: poll until each exists, backing off, or until the timeout.

Stores have no notifications in common (Redis keyspace events, S3 event
queues and inotify all need setting up), so ``Store.wait`` polls: first at an
eighth of the store's ``poll_interval``, doubling up to twenty times it, so a
key that lands at once is seen at once and a long wait costs few requests.

This is one of gatherstore's four repeated tries; each differs because what it
waits out differs, and each stays within the deadline in force:

- here, a key another rank has not written yet: poll, backing off, until the timeout;
- ``RedisStore._wire``, a pooled connection the server or a proxy dropped: at once,
  on a fresh connection, a few times (a dead server fails the next connect anyway);
- ``FileStore._publish``, a folder a concurrent delete pruned while a write created
  it: at once, up to 50 times (each prune needs an empty folder, so every try makes
  progress);
- ``gatherstore.job.session._misses_marker``, a network filesystem that fails a lookup while it
  reconnects (sshfs, NFS): every 0.1 s until the marker's own wait ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from gatherstore._errors import GatherTimeout, seconds

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
