"""``gatherstore bench --scale``: the control-plane exchange with up to thousands of ranks.

Ranks are simulated by threads, each with its own TCPStore client (its own
connection, as a real rank has), against one TCPStore server in this process:
the store's host sees the same requests a real job's would.  Every point is the
slowest rank's time for one exchange of ``value_bytes`` per rank, median of
``repeats``.  ``"all-read-all"`` is the previous algorithm (every rank reads all
W keys: O(W²) reads on the store's host); ``"gather-once"`` is the current one
(``gatherstore.job.exchange.exchange_on``) as an all-gather exchange uses it
(every rank gets all W values: O(W) requests, W² bytes); ``"summary"`` is a
gather's status exchange (rank 0 gets all values, the others a 64-byte summary:
O(W) requests and bytes).

Run ``python -m gatherstore.cli.bench.scale`` (or ``gatherstore bench --scale``).
"""

from __future__ import annotations

import datetime as _dt
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO

import torch.distributed as dist

from gatherstore.job.exchange import Outcome, exchange_on

__all__ = ["ALGORITHMS", "main", "run_exchange", "simulate"]

Exchange = Callable[[Any, str, int, int, bytes, float], Any]


def _gather_once(store: Any, prefix: str, rank: int, world: int, value: bytes, t: float) -> Any:
    return exchange_on(store, prefix, rank, world, value, timeout=t)


def _summary(store: Any, prefix: str, rank: int, world: int, value: bytes, t: float) -> Any:
    return exchange_on(
        store, prefix, rank, world, value, timeout=t, summarize=lambda _: bytes(64), full=[0]
    )


def _all_read_all(store: Any, prefix: str, rank: int, world: int, value: bytes, t: float) -> Any:
    """The previous exchange's request pattern: set, wait for all, multi_get all W keys."""
    keys = [f"{prefix}{r}" for r in range(world)]
    store.set(keys[rank], value)
    store.wait(keys, _dt.timedelta(seconds=t))
    values = store.multi_get(keys)
    if store.add(prefix + "read", 1) == world:
        for key in [*keys, prefix + "read"]:
            store.delete_key(key)
    return Outcome(values=values)


ALGORITHMS: dict[str, Exchange] = {
    "all-read-all": _all_read_all,
    "gather-once": _gather_once,
    "summary": _summary,
}


def simulate(
    world: int,
    body: Callable[[Any, int], Any],
    *,
    timeout: float = 120.0,
) -> tuple[list[Any], Any]:
    """Run ``body(client, rank)`` in ``world`` threads with their own TCPStore clients.

    Returns each rank's result (or the exception it raised) and the server store,
    still open, so that callers can count what is left in it.
    """
    span = _dt.timedelta(seconds=timeout)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=span, wait_for_workers=False)  # type: ignore[attr-defined]
    with ThreadPoolExecutor(32) as pool:  # connecting takes a while on some machines
        clients = list(
            pool.map(
                lambda _: dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=span),  # type: ignore[attr-defined]
                range(world),
            )
        )
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = body(clients[rank], rank)
        except Exception as exc:  # reported to the caller as the rank's result
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, server


def run_exchange(algorithm: str, world: int, *, value_bytes: int = 120, repeats: int = 3) -> float:
    """Median over ``repeats`` of the slowest rank's seconds for one exchange.

    Raises:
        RuntimeError: a simulated rank failed or got another rank's value.
    """
    exchange = ALGORITHMS[algorithm]
    start = threading.Barrier(world)

    def body(store: Any, rank: int) -> list[float]:
        times, outcomes = [], []
        for step in range(repeats):
            start.wait()
            began = time.perf_counter()
            outcomes.append(
                exchange(store, f"{step}/", rank, world, bytes([rank % 256]) * value_bytes, 60)
            )
            times.append(time.perf_counter() - began)
        # checked after the timed steps: in threads, it would hold the GIL others need
        expected = [bytes([r % 256]) for r in range(world)]
        for step, got in enumerate(outcomes):
            if (got.values is None and got.summary is None) or (
                got.values is not None and [v[:1] for v in got.values] != expected
            ):
                raise RuntimeError(f"rank {rank} got wrong values at step {step}")
        return times

    results, _ = simulate(world, body)
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"{algorithm} at W={world}: {failed[0]!r}")
    return float(statistics.median(max(r[step] for r in results) for step in range(repeats)))


def main(
    worlds: Sequence[int] = (64, 256, 1024),
    algorithms: Sequence[str] = tuple(ALGORITHMS),
    out: TextIO = sys.stdout,
) -> int:
    """Print the slowest rank's exchange time per algorithm and world size; 0."""
    out.write(f"{'W':>6} " + " ".join(f"{name:>14}" for name in algorithms) + "\n")
    for world in worlds:
        times = [run_exchange(name, world) for name in algorithms]
        out.write(f"{world:>6} " + " ".join(f"{t * 1e3:>11.0f} ms" for t in times) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
