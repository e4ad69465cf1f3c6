"""``gatherstore bench --hosts 2``: gathers across two simulated hosts (root only).

Builds the hosts of :mod:`gatherstore._bench.hosts` (sshfs share, Redis and S3 on host 1),
then for each case starts ``gs.launch(nnodes=2)`` on both hosts (fresh processes per
case), every rank holding ``size`` random bytes (a numpy array), and gathers them to
rank 0.  Prints per case: rank 0's time, its ratio to ``all_gather_object``, rank 0's
peak RSS growth and the largest peak growth of the other ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, TextIO

from .hosts import Hosts
from .measure import PeakMemory, format_bytes

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


def _rank(case: str, size: int, *where: str) -> dict[str, Any]:
    """One rank of one case (run by ``gs.launch``): seconds and peak RSS growth."""
    import numpy as np

    import gatherstore as gs

    from . import baselines

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


def _case(hosts: Hosts, case: str, size: int, port: int) -> list[dict[str, Any]]:
    procs = []
    for node in (0, 1):
        argv = [sys.executable, "-m", __name__, str(node), str(port), hosts[1].addr, case]
        argv += [str(size), str(hosts.shared), hosts.redis_url, hosts.s3_url]
        argv.append(json.dumps(hosts.s3_options))
        env = {"GLOO_SOCKET_IFNAME": hosts[node + 1].device}
        procs.append(
            hosts[node + 1].popen(
                argv, cwd=hosts.workdir, stdout=subprocess.PIPE, text=True, env=_env(env)
            )
        )
    ranks: list[dict[str, Any]] = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1200)
        if proc.returncode:
            raise RuntimeError(f"{case}: a host's job exited with code {proc.returncode}")
        for line in out.splitlines():
            if line.startswith("RESULT "):
                ranks += json.loads(line[len("RESULT ") :])
    return sorted(ranks, key=lambda r: r["rank"])


def _env(extra: dict[str, str]) -> dict[str, str]:
    # the namespaces resolve no host names: c10d's warning about it would flood the table
    return {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", **extra}


def main(size: int = 200 << 20, out: TextIO = sys.stdout, subnet: str = "10.77.0") -> int:
    """Run every case on two fresh simulated hosts (on ``subnet``) and print the table; 0."""
    from ..testing.services import free_ports

    out.write(f"2 hosts x {NPROC} ranks, {format_bytes(size)} per rank gathered to rank 0\n")
    out.write(f"{'case':<26}{'time':>9}{'ratio':>8}{'dst peak':>12}{'others peak':>13}\n")
    with Hosts(subnet) as hosts:
        baseline = None
        for case in CASES:
            ranks = _case(hosts, case, size, free_ports()[0])
            seconds = ranks[0]["seconds"]
            baseline = baseline or seconds
            others = max(r["growth"] for r in ranks[1:])
            flag = "" if all(r["ok"] for r in ranks) else "  (wrong result)"
            out.write(
                f"{case:<26}{seconds:>8.2f}s{seconds / baseline:>7.2f}x"
                f"{format_bytes(ranks[0]['growth']):>12}{format_bytes(others):>13}{flag}\n"
            )
            out.flush()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 10:
        _node(sys.argv[1:])
    else:
        sys.exit(main())
