"""``gatherstore bench --hosts 2``: gathers across two simulated hosts (root only).

Builds the hosts of ``gatherstore.cli.bench.hosts`` (a share over sshfs mounted on
both hosts, or on host 2 alone with ``share_local``; Redis and S3 on host 1).  Each
round first measures the share's own ceiling: the bytes a gather moves through it,
(W - 1) parts of ``size``, written on host 2 and read back on host 1 with plain
file I/O through the mounts, a thread per part.  Then, for each case, it starts
``gs.launch(nnodes=2)`` on both hosts (fresh processes per case), every rank holding
``size`` random bytes (a numpy array), and gathers them to rank 0.  Prints per case
the median over the rounds of rank 0's time, its ratio to ``all_gather_object``,
the share's write+read time over it (``of share``: 1.00x is the share's ceiling),
rank 0's peak RSS growth, the largest peak growth of the other ranks, and every
round's time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from gatherstore.cli.bench.hosts import Hosts
from gatherstore.cli.bench.measure import PeakMemory, format_bytes

__all__ = ["CASES", "main"]

CASES = (
    "torch.all_gather_object",
    "torch.gather_object",
    "gs.file(sshfs)",
    "gs.redis",
    "gs.s3",
    "gs.auto",
)
NPROC = 2
_JOB_TIMEOUT = 1200.0


def _rank(case: str, size: int, *where: str) -> dict[str, Any]:
    """One rank of one case (run by ``gs.launch``): seconds and peak RSS growth."""
    import numpy as np

    import gatherstore as gs
    from gatherstore.cli.bench import baselines

    shared, redis_url, s3_url, s3_options = where
    rank = gs.get_rank()
    obj = np.random.default_rng(rank).integers(0, 256, size, dtype=np.uint8)
    stores = {"gs.file(sshfs)": f"file://{shared}", "gs.redis": redis_url, "gs.auto": "auto"}
    store = gs.open_store(s3_url, **json.loads(s3_options)) if case == "gs.s3" else stores.get(case)
    gs.barrier(timeout=600)
    with PeakMemory() as peak:
        began = time.perf_counter()
        if case == "torch.all_gather_object":
            out: list[Any] | None = baselines.torch_all_gather_object(obj)
        elif case == "torch.gather_object":
            out = baselines.torch_gather_object(obj)
        else:
            out = gs.gather_object(obj, store=store, timeout=600)
        seconds = time.perf_counter() - began
        ok = out is None or [len(o) for o in out] == [size] * gs.get_world_size()
        del out
    return {"rank": rank, "seconds": seconds, "growth": peak.growth, "ok": ok}


def _node(argv: list[str]) -> None:
    """On one host: ``node_rank port master case size shared redis_url s3_url s3_options``."""
    import gatherstore as gs

    node, port, master, case, size, *where = argv
    results = gs.launch(
        _rank,
        nproc_per_node=NPROC,
        nnodes=2,
        node_rank=int(node),
        master_addr=master,
        master_port=int(port),
        backend="gloo",
        args=(case, int(size), *where),
    )
    print("RESULT " + json.dumps(results), flush=True)


def _share(argv: list[str]) -> None:
    """On one host: ``write|read directory count size``, plain file I/O; prints seconds.

    ``write`` creates ``count`` files of ``size`` random bytes, ``read`` reads each
    into memory and then deletes them (not timed); one thread per file, all at once
    (the most this share gives one process: concurrent reads overlap its round trips).
    """
    import numpy as np

    mode, directory, count, size = argv[0], Path(argv[1]), int(argv[2]), int(argv[3])
    paths = [directory / f"ceiling-{i}" for i in range(count)]
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()

    def write(path: Path) -> None:
        with open(path, "xb") as f:
            f.write(data)

    def read(path: Path) -> None:
        buf = bytearray(size)
        with open(path, "rb", buffering=0) as f:
            view, pos = memoryview(buf), 0
            while pos < size and (n := f.readinto(view[pos:])):
                pos += n
        if pos != size:
            raise RuntimeError(f"{path}: read {pos} of {size} bytes")

    with ThreadPoolExecutor(count) as pool:
        began = time.perf_counter()
        list(pool.map(write if mode == "write" else read, paths))
        seconds = time.perf_counter() - began
    if mode == "read":
        for path in paths:
            path.unlink()
    print(f"RESULT {json.dumps(seconds)}", flush=True)


def _run(hosts: Hosts, index: int, argv: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": hosts[index].device}
    # the namespaces resolve no host names: c10d's warning about it would flood the table
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    command = [sys.executable, "-m", __name__, *argv]
    return hosts[index].popen(
        command, cwd=hosts.workdir, stdout=subprocess.PIPE, text=True, env=env
    )


def _results(what: str, procs: list[subprocess.Popen[str]]) -> list[Any]:
    """Every RESULT line's value of ``procs``, in order.

    Raises:
        RuntimeError: a process exited with an error.
    """
    found: list[Any] = []
    for proc in procs:
        out, _ = proc.communicate(timeout=_JOB_TIMEOUT)
        if proc.returncode:
            raise RuntimeError(f"{what}: a host's job exited with code {proc.returncode}")
        found += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return found


def _ceiling(hosts: Hosts, size: int) -> tuple[float, float]:
    """Seconds to write the parts a gather moves on host 2 and to read them on host 1."""
    argv = [str(hosts.shared), str(2 * NPROC - 1), str(size)]
    (write,) = _results("share write", [_run(hosts, 2, ["share", "write", *argv])])
    (read,) = _results("share read", [_run(hosts, 1, ["share", "read", *argv])])
    return write, read


def _case(hosts: Hosts, case: str, size: int, port: int) -> list[dict[str, Any]]:
    where = [str(size), str(hosts.shared), hosts.redis_url, hosts.s3_url]
    where.append(json.dumps(hosts.s3_options))
    procs = [
        _run(hosts, node + 1, ["node", str(node), str(port), hosts[1].addr, case, *where])
        for node in (0, 1)
    ]
    ranks = [rank for found in _results(case, procs) for rank in found]
    return sorted(ranks, key=lambda r: r["rank"])


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s ({seconds:.2f} s)"


def _table(
    out: TextIO,
    moved: int,
    ceilings: list[tuple[float, float]],
    runs: dict[str, list[list[dict[str, Any]]]],
) -> None:
    """The share's ceiling, then a row per case: medians over the rounds; ``of share``
    is the median of each round's write+read time over the case's time that round."""
    write = statistics.median(c[0] for c in ceilings)
    read = statistics.median(c[1] for c in ceilings)
    both = [sum(c) for c in ceilings]
    out.write(
        f"share ceiling, plain file I/O of {moved / 1e9:.2f} GB (written on host 2, read on "
        f"host 1): write {_gbps(moved, write)}, read {_gbps(moved, read)}, write+read "
        f"{_gbps(moved, statistics.median(both))}; runs {_each(both)}\n"
    )
    head = f"{'case':<26}{'time':>9}{'ratio':>8}{'of share':>10}{'dst peak':>12}{'others peak':>13}"
    out.write(head + "  runs\n")
    baseline = None
    for case in CASES:
        times = [ranks[0]["seconds"] for ranks in runs[case]]
        seconds = statistics.median(times)
        baseline = baseline or seconds
        share = statistics.median(c / t for c, t in zip(both, times, strict=True))
        dst = max(ranks[0]["growth"] for ranks in runs[case])
        others = max(r["growth"] for ranks in runs[case] for r in ranks[1:])
        flag = "" if all(r["ok"] for ranks in runs[case] for r in ranks) else "  (wrong result)"
        out.write(
            f"{case:<26}{seconds:>8.2f}s{seconds / baseline:>7.2f}x{share:>9.2f}x"
            f"{format_bytes(dst):>12}{format_bytes(others):>13}  {_each(times)}{flag}\n"
        )


def _each(seconds: list[float]) -> str:
    return " / ".join(f"{s:.2f}" for s in seconds)


def main(
    size: int = 200 << 20,
    out: TextIO = sys.stdout,
    subnet: str = "10.77.0",
    *,
    share_local: bool = False,
    repeats: int = 1,
) -> int:
    """Run the share's ceiling and every case ``repeats`` times on two fresh simulated
    hosts (on ``subnet``; host 1 reads the share from local disk with ``share_local``)
    and print the table; 0."""
    from gatherstore.testing.services import free_ports

    moved = (2 * NPROC - 1) * size
    mounts = "host 2; host 1 reads it from local disk" if share_local else "both hosts"
    out.write(
        f"2 hosts x {NPROC} ranks, {format_bytes(size)} per rank gathered to rank 0; "
        f"the share mounted over sshfs on {mounts}; median of {repeats}\n"
    )
    runs: dict[str, list[list[dict[str, Any]]]] = {case: [] for case in CASES}
    ceilings = []
    with Hosts(subnet, share_local=share_local) as hosts:
        for _ in range(repeats):  # rounds: the machine's load spreads over every case
            ceilings.append(_ceiling(hosts, size))
            for case in CASES:
                runs[case].append(_case(hosts, case, size, free_ports()[0]))
    _table(out, moved, ceilings, runs)
    out.flush()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "node":
        _node(sys.argv[2:])
    else:
        _share(sys.argv[2:])
