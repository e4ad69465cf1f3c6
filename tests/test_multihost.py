"""Two hosts (network namespaces on this machine): launch, torchrun and SLURM starts across
them, object gathers through every shared store (sshfs, Redis and S3 on host 1), node-local
stores refused.

The hosts come from :mod:`gatherstore.cli.bench.hosts` (root, ``ip``, sshfs, sshd); without
them these tests are skipped, unless the environment variable CI is set.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_slurm import slurm_step_env, without_launchers

from gatherstore.cli.bench import hostbench
from gatherstore.cli.bench.hosts import Host, Hosts, unavailable
from gatherstore.testing.services import free_ports

NPROC = 2  # ranks per host

JOB = """
import json, os, signal, sys, time
import gatherstore as gs


def stores(shared, redis_url, s3_url, s3_options):
    return {"file": "file://" + shared, "redis": redis_url,
            "s3": gs.open_store(s3_url, **json.loads(s3_options))}


def crash(*where):
    rank, specs = gs.get_rank(), stores(*where)
    for spec in specs.values():
        gs.all_gather_object(rank, store=spec, timeout=30)
    if rank == 3:  # the last rank, on host 2, dies after the job used every store
        os.kill(os.getpid(), signal.SIGKILL)
    gs.gather_object(rank, store=specs["file"], timeout=10)


def work(*where):
    rank = gs.get_rank()
    obj = {"rank": rank, "data": bytes(1000 * (rank + 1))}
    out = {"rank": rank, "node": gs.get_node_rank(), "nnodes": gs.get_nnodes(),
           "local": [gs.get_local_rank(), gs.get_local_size()]}
    specs = {**stores(*where), "auto": "auto", "collective": "collective"}
    for name, spec in specs.items():
        got = gs.gather_object(obj, store=spec, timeout=60)
        out[name] = None if got is None else [[o["rank"], len(o["data"])] for o in got]
    try:
        gs.gather_object(obj, store="tmpdir", timeout=60)
        out["tmpdir"] = None
    except gs.GatherError as exc:
        out["tmpdir"] = type(exc).__name__
    out["after"] = gs.all_gather_object(rank, timeout=60)
    return out


if __name__ == "__main__":
    mode, where, more = sys.argv[1], sys.argv[2:6], sys.argv[6:]
    if mode == "crash":
        node, port = int(more[0]), int(more[1])
        start = time.monotonic()
        try:
            gs.launch(crash, nproc_per_node=2, nnodes=2, node_rank=node, master_addr=more[2],
                      master_port=port, backend="gloo", args=tuple(where))
            error = None
        except gs.GatherError as exc:
            error = {"type": type(exc).__name__, "rank": getattr(exc, "rank", None),
                     "message": str(exc)}
        print("CRASH " + json.dumps({"error": error, "seconds": time.monotonic() - start}))
        sys.exit(0)
    if mode == "launch":
        node, port = int(more[0]), int(more[1])
        results = gs.launch(work, nproc_per_node=2, nnodes=2, node_rank=node,
                            master_addr=more[2], master_port=port, backend="gloo",
                            args=tuple(where))
    else:
        assert gs.init_from_env(backend="gloo", timeout=60)
        results = [work(*where)]
        gs.shutdown()
    # one write: torchrun's ranks share this pipe (print writes the newline apart)
    os.write(1, ("RESULT " + json.dumps(results) + "\\n").encode())
"""


def require_hosts() -> None:
    """Skip where this machine cannot build hosts; under CI, fail instead."""
    reason = unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """Two simulated hosts, torn down after this module (also on failure or Ctrl-C)."""
    require_hosts()
    with Hosts() as built:
        (built.workdir / "job.py").write_text(JOB)
        yield built


def run_on_hosts(hosts: Hosts, starts: list[tuple[int, list[str], dict[str, str]]]) -> list[Any]:
    """Run each ``(host, argv, env)`` at once; every RESULT line's ranks, flattened."""
    procs = []
    for index, argv, env in starts:
        host_env = {**without_launchers(), "GLOO_SOCKET_IFNAME": hosts[index].device, **env}
        procs.append(
            hosts[index].popen(
                argv,
                env=host_env,
                cwd=hosts.workdir,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        done = [proc.communicate(timeout=150) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    errors = [err[-3000:] for proc, (_, err) in zip(procs, done, strict=True) if proc.returncode]
    assert not errors, "\n".join(errors)
    results = []
    for out, _ in done:  # a line per process (torchrun: one per local rank)
        for line in out.splitlines():
            if line.startswith("RESULT "):
                results += json.loads(line.split("RESULT ", 1)[1])
    return results


def check(results: list[dict[str, Any]], hosts: Hosts) -> None:
    """Every rank's gathers and refusals; nothing left on either host or the share."""
    world = 2 * NPROC
    assert [r["rank"] for r in results] == list(range(world))
    assert [r["node"] for r in results] == [0, 0, 1, 1]
    assert all(r["nnodes"] == 2 and r["local"][1] == NPROC for r in results)
    gathered = [[rank, 1000 * (rank + 1)] for rank in range(world)]
    for r in results:
        for name in ("file", "redis", "s3", "auto", "collective"):
            assert r[name] == (gathered if r["rank"] == 0 else None), (name, r)
        assert r["tmpdir"] == "StoreNotSharedError"
        assert r["after"] == list(range(world))
    for host in hosts.hosts:
        assert [p.name for p in (host.root / "shm").iterdir()] == []
        assert [p.name for p in (host.root / "tmp").iterdir() if "gatherstore" in p.name] == []
    assert list(hosts.shared.iterdir()) == []
    assert s3_objects(hosts) == []


def s3_objects(hosts: Hosts) -> list[str]:
    """Every object in the bucket of ``hosts.s3_url``, listed from host 2 (the bucket, not
    the prefix: s3fs lists an empty prefix SeaweedFS keeps as a directory)."""
    script = "import json, sys, s3fs\n"
    script += "fs = s3fs.S3FileSystem(skip_instance_cache=True, **json.loads(sys.argv[1]))\n"
    script += "print(json.dumps(fs.find(sys.argv[2])))"
    bucket = hosts.s3_url.split("/")[2]
    argv = [sys.executable, "-c", script, json.dumps(hosts.s3_options), bucket]
    listed = hosts[2].run(argv, capture_output=True, text=True, timeout=60, check=True)
    return list(json.loads(listed.stdout))


def job(hosts: Hosts, mode: str, *more: str) -> list[str]:
    where = [str(hosts.shared), hosts.redis_url, hosts.s3_url, json.dumps(hosts.s3_options)]
    return [sys.executable, "job.py", mode, *where, *more]


@pytest.mark.timeout(180)
def test_launch_on_two_hosts(hosts: Hosts) -> None:
    port = str(free_ports()[0])
    starts = [
        (node + 1, job(hosts, "launch", str(node), port, hosts[1].addr), {}) for node in (0, 1)
    ]
    check(run_on_hosts(hosts, starts), hosts)


@pytest.mark.timeout(180)
def test_torchrun_on_two_hosts(hosts: Hosts) -> None:
    port = str(free_ports()[0])
    starts = []
    for node in (0, 1):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        torchrun += ["--nproc-per-node", str(NPROC), "--node-rank", str(node)]
        torchrun += ["--master-addr", hosts[1].addr, "--master-port", port]
        starts.append((node + 1, torchrun + job(hosts, "env")[1:], {}))
    results = run_on_hosts(hosts, starts)
    check(sorted(results, key=lambda r: r["rank"]), hosts)


@pytest.mark.timeout(180)
def test_slurm_step_on_two_hosts(hosts: Hosts) -> None:
    """Independent tasks with SLURM's variables only; the step's first node is host 1."""
    port = free_ports()[0]
    starts = [
        (rank // NPROC + 1, job(hosts, "env"), slurm_step_env(rank, [2, 2], hosts[1].addr, port))
        for rank in range(2 * NPROC)
    ]
    check(run_on_hosts(hosts, starts), hosts)


@pytest.mark.timeout(240)
def test_a_crash_on_one_host_ends_both_launchers_in_time(hosts: Hosts) -> None:
    """Rank 3 (host 2) is SIGKILLed after the job used the file store, Redis and S3: each
    host's gs.launch returns within the call's timeout plus a few seconds, naming it."""
    port = str(free_ports()[0])
    procs = [
        hosts[node + 1].popen(
            job(hosts, "crash", str(node), port, hosts[1].addr),
            env={**without_launchers(), "GLOO_SOCKET_IFNAME": hosts[node + 1].device},
            cwd=hosts.workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        done = [proc.communicate(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    reports = []
    for out, err in done:
        lines = [line for line in out.splitlines() if line.startswith("CRASH ")]
        assert lines, err[-3000:]
        reports.append(json.loads(lines[0].split("CRASH ", 1)[1]))
    host1, host2 = reports
    assert host2["error"]["type"] == "RemoteRankError" and host2["error"]["rank"] == 3
    assert "SIGKILL" in host2["error"]["message"]
    assert host1["error"] is not None and "3" in host1["error"]["message"], host1
    assert host1["seconds"] < 30 + 10 + 30, "the call's timeout plus a few seconds (loaded CI)"
    assert list(hosts.shared.iterdir()) == [], "the job area on the shared mount is swept"
    assert s3_objects(hosts) == []


@pytest.mark.timeout(300)
def test_bench_hosts_prints_the_table() -> None:
    """``gatherstore bench --hosts 2`` at a small size: the share's ceiling, every case,
    right results."""
    require_hosts()
    out = io.StringIO()
    assert hostbench.main(size=2 << 20, out=out, subnet="10.77.2") == 0
    table = out.getvalue()
    assert "mounted over sshfs on both hosts" in table
    assert "share ceiling, plain file I/O of 0.01 GB" in table and "write+read" in table
    for case in hostbench.CASES:
        assert case in table
    assert "wrong result" not in table


def filesystem(host: Host, path: Path) -> str:
    """The type of the filesystem ``path`` is on, as ``host``'s processes see it."""
    found = host.run(["findmnt", "-n", "-o", "FSTYPE", "-T", str(path)], capture_output=True)
    return found.stdout.decode().strip()


def test_both_hosts_mount_the_share(hosts: Hosts) -> None:
    """Each host reads what the other wrote, through its own sshfs mount."""
    assert [filesystem(host, hosts.shared) for host in hosts.hosts] == ["fuse.sshfs"] * 2
    for writer, reader in ((1, 2), (2, 1)):
        path = hosts.shared / f"from-{writer}"
        hosts[writer].run(["sh", "-c", f"echo {writer} > {path}"], check=True)
        assert hosts[reader].run(["cat", str(path)], capture_output=True).stdout == b"%d\n" % writer
        path.unlink()


@pytest.mark.parametrize("share_local", [False, True])
def test_hosts_are_torn_down(share_local: bool) -> None:
    """Building and closing leaves no namespace, mount or directory behind; with
    ``share_local`` host 1 uses the exported directory itself."""
    require_hosts()
    with Hosts(subnet="10.77.1", share_local=share_local) as built:
        names = [host.netns for host in built.hosts]
        workdir = built.workdir
        shares = [filesystem(host, built.shared) for host in built.hosts]
    assert shares[1] == "fuse.sshfs"
    assert (shares[0] == "fuse.sshfs") is not share_local, shares
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
    assert str(workdir) not in Path("/proc/self/mounts").read_text()
    assert not workdir.exists()
