"""gatherstore.compat.ignite's process setup side by side with the real ignite.distributed:
initialize's checks and environment, spawn and Parallel with file:// init methods (on one
node and across two), and the lines ignite writes to stderr."""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import re
import socket
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from compat_same import outcome, same_outcome

import gatherstore as gs
from gatherstore.compat import ignite as compat

idist = pytest.importorskip("ignite.distributed")

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def module(name: str) -> Any:
    return idist if name == "ignite" else compat


def in_fresh_process(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a new interpreter: no process group, logger or variable left over."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=150)


def free_port(low: int = 20000, high: int = 25000) -> int:
    """A port in [low, high) nobody listens on now."""
    for port in range(low + os.getpid() % 997, high):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def initialize_cases(name: str, port: int) -> list[Any]:
    """initialize() under several environments: its outcome, what it set up, what it left."""
    d = module(name)
    slurm = {
        "SLURM_JOB_ID": f"9{port - 15000:04d}",  # ignite's port: 15000 + its last four digits
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_NUM_NODES": "1",
    }
    cases: list[tuple[dict[str, str], dict[str, Any]]] = [
        ({}, {"init_method": "tcp://127.0.0.1:1"}),  # hangs in torch: refused
        ({"RANK": "0"}, {}),  # half a torchrun environment
        ({"RANK": "0", "LOCAL_RANK": "0"}, {}),
        ({"MASTER_PORT": str(port)}, {}),  # nothing set: one process
        ({"MASTER_PORT": str(port)}, {"rank": 0}),
        ({"MASTER_PORT": str(port)}, {"init_method": "env://", "rank": 0, "world_size": 1}),
        ({}, {"init_method": f"file:///tmp/gs-ignite-{name}-{port}", "rank": 0, "world_size": 1}),
        (slurm, {}),
        (slurm, {"rank": 0, "world_size": 1}),
    ]
    missing = dict(slurm)
    del missing["SLURM_LOCALID"]
    cases.append((missing, {}))
    results = []
    for env, kwargs in cases:
        before = dict(os.environ)
        os.environ.update(env)
        result = outcome(lambda kwargs=kwargs: d.initialize("gloo", **kwargs))
        during = [dist.is_initialized(), d.get_world_size(), d.get_rank()]
        during.append({k: os.environ.get(k) for k in ENV})
        if dist.is_initialized():
            d.finalize()
        left = dict(os.environ) != {**before, **env}
        os.environ.clear()
        os.environ.update(before)
        results.append((env, kwargs, result, during, left))
    return results


@pytest.mark.timeout(300)
def test_initialize_checks_and_environment_match_ignite() -> None:
    port = free_port(15000, 25000)
    ours = in_fresh_process(initialize_cases, "compat", port)
    theirs = in_fresh_process(initialize_cases, "ignite", port)
    for (env, kwargs, *a), (_, _, *b) in zip(theirs, ours, strict=True):
        assert same_outcome(a, b, f"{env} {kwargs}", messages=True) == []
    # a refused call leaves no process group and no variable behind
    refused = [r for r in ours if isinstance(r[2], tuple)]
    assert len(refused) == 5
    assert all(r[3][0] is False and r[4] is False for r in refused)


def log_lines(text: str) -> list[str]:
    """ignite-formatted lines without their time stamps and object addresses."""
    text = re.sub(r" at 0x[0-9a-f]+", "", text)
    return [re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", "", line) for line in text.splitlines()]


def noop(local_rank: int) -> None:
    """A function for Parallel.run."""


def serial_logs(name: str, port: int, shared: str) -> list[str]:
    d = module(name)
    os.environ["MASTER_PORT"] = str(port)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        d.show_config()
        d.auto_dataloader([1, 2, 3], batch_size=2)
        d.auto_model(torch.nn.Linear(2, 1))
        with d.Parallel(backend="gloo", nproc_per_node=2, init_method=f"file://{shared}"):
            pass
        with d.Parallel(backend="gloo") as parallel:
            parallel.run(noop)
            d.show_config()
    return log_lines(err.getvalue())


def ranks_logs(name: str) -> list[str]:
    d = module(name)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        d.show_config()
        d.auto_dataloader(list(range(10)), batch_size=6)
        d.auto_model(torch.nn.Linear(2, 1))
        with d.Parallel() as parallel:
            parallel.run(noop)
    return log_lines(err.getvalue())


@pytest.mark.timeout(300)
def test_log_lines_on_stderr_match_ignite(tmp_path: Path) -> None:
    port = free_port()
    shared = str(tmp_path / "shared")
    theirs = in_fresh_process(serial_logs, "ignite", port, shared)
    ours = in_fresh_process(serial_logs, "compat", port, shared)
    assert ours == theirs
    assert "ignite.distributed.utils INFO: world size: 1" in ours
    assert "ignite.distributed.launcher.Parallel INFO: End of run" in ours
    theirs = gs.launch(ranks_logs, nproc_per_node=3, backend="gloo", args=("ignite",))
    ours = gs.launch(ranks_logs, nproc_per_node=3, backend="gloo", args=("compat",))
    assert ours == theirs
    assert "ignite.distributed.utils INFO: world size: 3" in ours[0]
    assert ours[1] == ours[2] == []  # rank 0 only


def spawned(local_rank: int, path: str, suffix: str = "") -> None:
    Path(path, f"{local_rank}{suffix}-{gs.get_rank()}-{gs.get_world_size()}").touch()


@pytest.mark.timeout(300)
def test_spawn_and_parallel_with_file_init_run_as_ignite(tmp_path: Path) -> None:
    for name in ("ignite", "compat"):
        d, out = module(name), tmp_path / name
        out.mkdir()
        d.spawn("gloo", spawned, (str(out),), {"suffix": "s"}, nproc_per_node=2)
        init = f"file://{tmp_path}/{name}-init"
        d.spawn("gloo", spawned, (str(out),), {"suffix": "f"}, nproc_per_node=2, init_method=init)
        with d.Parallel(backend="gloo", nproc_per_node=2, init_method=init + "p") as parallel:
            parallel.run(spawned, str(out), suffix="p")
    made = sorted(p.name for p in (tmp_path / "compat").iterdir())
    assert made == sorted(p.name for p in (tmp_path / "ignite").iterdir())
    assert made == ["0f-0-2", "0p-0-2", "0s-0-2", "1f-1-2", "1p-1-2", "1s-1-2"]


@pytest.mark.timeout(300)
def test_spawn_refuses_tcp_init_with_ignites_words_before_any_process() -> None:
    url = "tcp://127.0.0.1:1"
    with pytest.raises(ValueError) as ours:
        compat.spawn("gloo", spawned, ("unused",), init_method=url)
    with pytest.raises(Exception) as theirs:  # ignite's processes fail with it
        idist.spawn("gloo", spawned, ("unused",), init_method=url)
    assert "will hang" in str(ours.value) and str(ours.value) in str(theirs.value)


def node(node_rank: int, init: str, out: str) -> None:
    """One of two "nodes": spawn 2 local ranks that meet node 0 through the file."""
    compat.spawn(
        "gloo",
        spawned,
        (out,),
        nproc_per_node=2,
        nnodes=2,
        node_rank=node_rank,
        init_method=init,
        timeout=60,
    )


@pytest.mark.timeout(300)
def test_spawn_across_two_nodes_meets_through_the_shared_file(tmp_path: Path) -> None:
    shared, out = tmp_path / "init", tmp_path / "out"
    out.mkdir()
    ctx = mp.get_context("spawn")
    nodes = [ctx.Process(target=node, args=(i, f"file://{shared}", str(out))) for i in (1, 0)]
    for proc in nodes:
        proc.start()
    for proc in nodes:
        proc.join(timeout=240)
    assert [proc.exitcode for proc in nodes] == [0, 0]
    assert sorted(p.name for p in out.iterdir()) == ["0-0-4", "0-2-4", "1-1-4", "1-3-4"]
    assert not shared.exists()  # the last node to let go removed the file


def test_spawn_across_nodes_names_a_file_nobody_shares(tmp_path: Path) -> None:
    init = tmp_path / "init"
    with pytest.raises(TimeoutError, match="filesystem every node shares"):
        compat.spawn(
            "gloo",
            spawned,
            ("unused",),
            nnodes=2,
            node_rank=1,
            init_method=f"file://{init}",
            timeout=2,
        )
    assert not init.exists()
