"""What the result-set tests run in their ranks (``gs.launch``), and the values they add."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import gatherstore as gs

NAME = "eval/ckpt-1"


@contextlib.contextmanager
def redis_database(url: str, db: int) -> Iterator[str]:
    """The URL of database ``db`` of the Redis at ``url``, empty before and after, whose
    keys live a day (result sets outlive the store's default hour)."""
    import redis

    parts = urllib.parse.urlsplit(url)
    with redis.Redis.from_url(urllib.parse.urlunsplit(parts._replace(path=f"/{db}"))) as client:
        client.flushdb()
        yield urllib.parse.urlunsplit(parts._replace(path=f"/{db}", query="ttl=86400"))
        client.flushdb()


def value(i: int) -> dict[str, Any]:
    """Sample ``i``'s prediction: arrays of varying length, a string, a number."""
    boxes = np.arange(4 * (i % 7), dtype=np.float32).reshape(-1, 4) + i
    return {"id": i, "boxes": boxes, "score": i / 3, "name": f"img-{i}"}


def same(got: Any, want: Any) -> bool:
    """Whether two predictions of :func:`value` are equal, arrays included."""
    return (
        isinstance(got, dict)
        and got.keys() == want.keys()
        and all(
            np.array_equal(got[k], want[k])
            if isinstance(want[k], np.ndarray)
            else got[k] == want[k]
            for k in want
        )
    )


def opened(store: Any) -> Any:
    """``store`` as ranks open it: a URL, or (URL, fsspec options)."""
    return gs.open_store(store[0], **store[1]) if isinstance(store, tuple) else store


def evaluate(
    store: Any, n: int, out: str, *, limit: int | None = None, gather: bool = True, pace: float = 0
) -> tuple[int, list[Any] | None]:
    """One evaluation run: open the set, compute this rank's share of what is pending (at
    most ``limit``), then gather.  Writes ``pid-<rank>`` and, after every add, the count
    to ``progress-<rank>`` and the key to ``added-<rank>`` in ``out``."""
    rank, world = gs.get_rank(), gs.get_world_size()
    rs = gs.ResultSet(NAME, store=opened(store), flush_every=(5, "0.3s"), timeout=60)
    todo = rs.pending(range(n))
    mine = todo[rank::world][:limit]
    Path(out, f"pid-{rank}").write_text(str(os.getpid()))
    with open(Path(out, f"added-{rank}"), "a", buffering=1) as log:
        for count, i in enumerate(mine, 1):
            rs.add(i, value(i))
            log.write(f"{i}\n")
            Path(out, f"progress-{rank}").write_text(f"{count} {len(mine)}")
            time.sleep(pace)
    return len(todo), rs.gather(timeout=60) if gather else None


def add_until_stopped(store: Any, out: str, own_handler: int | None) -> None:
    """Add values until a signal ends the process; rank ``own_handler`` first installs a
    SIGTERM handler of its own that ends the rank with SystemExit(3).  Buffers never
    fill: only the signal's flush makes the values durable."""
    rank = gs.get_rank()
    if rank == own_handler:

        def mine(signum: int, frame: Any) -> None:
            Path(out, f"own-handler-{rank}").write_text("ran")
            raise SystemExit(3)

        signal.signal(signal.SIGTERM, mine)
    rs = gs.ResultSet(NAME, store=opened(store), flush_every=(10**6, "1GB", "600s"))
    Path(out, f"pid-{rank}").write_text(str(os.getpid()))
    with open(Path(out, f"added-{rank}"), "a", buffering=1) as log:
        for i in range(rank, 10**7, gs.get_world_size()):
            rs.add(i, value(i))
            log.write(f"{i}\n")
            time.sleep(0.002)
