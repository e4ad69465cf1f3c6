"""``gatherstore bench --parts W``: the destination's read path with W simulated writers.

A real job of 1,000 ranks does not fit this machine, but the destination's side
of it does: the W parts are written first, through each real store with the
public Store API (in a job area of its own, sealed as ranks seal them, signed
where the store signs), then the destination's reader
(``gatherstore.routes.parts.Parts``) reads, verifies, unpickles and deletes them
in rank order, as ``gather_object`` does.  Only the reading is timed.  Each
store is measured with the reader as it is (``PARTS_REQUESTED`` reads and deletes
at once, within the read-ahead budget) and with the previous two-part window,
in the same run.  A part costs one GET (its deletes go in batches).

A local SeaweedFS answers in about a millisecond; with ``s3_latency`` S3 is also
read through ``DelayProxy``, which holds every
reply that long, as a region's round trip does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from gatherstore import codec
from gatherstore._config import DEFAULT_READ_AHEAD
from gatherstore._time import Deadline
from gatherstore.cli.bench.cases import Case, reachable
from gatherstore.cli.bench.delay import DelayProxy
from gatherstore.job.session import JobSession
from gatherstore.routes.parts import PARTS_REQUESTED, Parts, binding, part_key
from gatherstore.stores.base import Store
from gatherstore.stores.registry import open_store

__all__ = ["WINDOWS", "main", "read_back"]

#: Reader settings compared: (label, reads in flight, read-ahead budget in parts or bytes).
WINDOWS = {
    "two parts (before)": (2, 2),
    f"{PARTS_REQUESTED} in flight (now)": (PARTS_REQUESTED, None),
}
#: The stores measured, by bench case name.
STORES = ("gs.tmpdir-shm", "gs.file", "gs.redis", "gs.s3")
# documented S3 request rates per prefix (requests per second)
_S3_GETS, _S3_DELETES = 5_500, 3_500


@dataclass
class _Call:
    """What ``Parts`` needs of a call and its plan, for a destination without a
    process group."""

    sizes: tuple[int, ...]
    deadline: Deadline = field(default_factory=lambda: Deadline.start(600.0))
    what: str = "bench parts"
    rank: int = 0
    progress: bool | None = False
    own: Any = None

    def finish(self) -> None:
        return None


@contextlib.contextmanager
def _job(store: Store) -> Iterator[JobSession]:
    """A job area of its own in ``store``, removed afterwards."""
    locator = store.prepare_job(uuid.uuid4().hex[:16])
    key = os.urandom(32) if store.sign_parts else None
    try:
        yield JobSession(store, locator, store.join_job(locator), key)
    finally:
        store.end_job(locator)


def _write(session: JobSession, prefix: str, world: int, part_bytes: int) -> list[int]:
    """Parts of ranks 1..W-1, written by threads as W ranks would; their sizes."""
    payload = np.frombuffer(os.urandom(part_bytes), dtype=np.uint8)

    def write(rank: int) -> int:
        frame = codec.encode({"rank": rank, "data": payload})
        sealed = frame.seal(session.key, binding(session, prefix, rank))
        session.store.put(part_key(prefix, rank), sealed.segments)
        return frame.nbytes

    with ThreadPoolExecutor(16) as pool:
        return [0, *pool.map(write, range(1, world))]


def read_back(
    store: Store, world: int, part_bytes: int, in_flight: int, parts_ahead: int | None
) -> float:
    """Seconds the destination takes to read, verify, unpickle and delete W - 1 parts."""
    with _job(store) as session:
        sizes = _write(session, "call-1", world, part_bytes)
        budget = DEFAULT_READ_AHEAD if parts_ahead is None else parts_ahead * max(sizes)
        started = time.perf_counter()
        call = _Call(tuple(sizes))
        reader = Parts(call, call, session, "call-1", 0, budget=budget, in_flight=in_flight)
        got = [part["rank"] for part in list(reader)[1:]]
        seconds = time.perf_counter() - started
        left = [key for key in session.store.list("") if key]  # SeaweedFS lists its folder
        if got != list(range(1, world)) or left:
            raise AssertionError("the parts read back are not the ones written, or remain")
    return seconds


def _delayed(stack: contextlib.ExitStack, case: Case, seconds: float) -> Case:
    """``case`` (S3) read through a ``DelayProxy`` holding each reply ``seconds``."""
    client = dict(case.options["client_kwargs"])
    client["endpoint_url"] = stack.enter_context(DelayProxy(client["endpoint_url"], seconds)).url
    name = f"{case.name} +{seconds * 1e3:g} ms"
    return dataclasses.replace(case, name=name, options={**case.options, "client_kwargs": client})


def main(
    world: int,
    part_bytes: int,
    repeats: int = 3,
    out: TextIO | None = None,
    *,
    redis: str | None = None,
    s3: str | None = None,
    s3_latency: float | None = None,
) -> int:
    """Print the table: each store, old window against new, median of ``repeats``.

    ``redis``/``s3`` name the servers (else the environment's, else started here);
    with ``s3_latency`` (seconds) S3 is measured a second time with that round trip.
    """
    import sys

    stream = out or sys.stdout
    with contextlib.ExitStack() as stack:
        cases, notes, _ = stack.enter_context(reachable(redis, s3, services=True))
        chosen = [c for c in cases if c.name in STORES]
        if s3_latency:
            chosen += [_delayed(stack, c, s3_latency) for c in chosen if c.service == "s3"]
        print(f"W = {world} parts of {part_bytes >> 10} KiB, read by one destination", file=stream)
        print("| store | reader | time s | parts (GETs) per s | x before |", file=stream)
        print("| --- | --- | ---: | ---: | ---: |", file=stream)
        for case in chosen:
            with open_store(case.store, **case.options) as store:
                before = None
                for label, (in_flight, ahead) in WINDOWS.items():
                    times = [
                        read_back(store, world, part_bytes, in_flight, ahead)
                        for _ in range(repeats)
                    ]
                    seconds = statistics.median(times)
                    before = before or seconds
                    rate = (world - 1) / seconds
                    print(
                        f"| {case.name} | {label} | {seconds:.3f} | {rate:,.0f} | "
                        f"{before / seconds:.1f} |",
                        file=stream,
                    )
        print(
            f"(S3 documents {_S3_GETS:,} GET and {_S3_DELETES:,} DELETE requests per second "
            "per prefix; every part of a call shares one prefix)",
            file=stream,
        )
        for note in notes:
            print(f"note: {note}", file=stream)
    return 0
