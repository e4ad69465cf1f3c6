"""Topology: serial answers, launched groups, hand-made groups, torchrun and SLURM."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

import gatherstore as gs
from gatherstore.testing.services import free_ports

DESCRIBE_KEYS = {
    "rank",
    "world_size",
    "local_rank",
    "local_size",
    "node_rank",
    "nnodes",
    "is_main_process",
    "is_distributed",
    "backend",
    "device",
    "hostname",
}

# every variable a launcher may export; cleared wherever a test needs "no launcher"
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any launcher variable, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "OMPI_"))
    }
    env.update(extra or {})
    return env


def topology_of_this_rank() -> dict[str, Any]:
    """What every topology function answers here, next to describe()."""
    return {
        "functions": {
            "rank": gs.get_rank(),
            "world_size": gs.get_world_size(),
            "local_rank": gs.get_local_rank(),
            "local_size": gs.get_local_size(),
            "node_rank": gs.get_node_rank(),
            "nnodes": gs.get_nnodes(),
            "is_main_process": gs.is_main_process(),
            "is_distributed": gs.is_distributed(),
            "backend": gs.backend(),
            "device": str(gs.device()),
            "gpu_mem_usage": gs.gpu_mem_usage(),
        },
        "describe": gs.describe(),
    }


def assert_single_host_group(results: list[dict[str, Any]], world: int) -> None:
    """Every rank of a one-host group of ``world`` gloo processes reports the same layout."""
    assert len(results) == world
    for rank, result in enumerate(results):
        expected = {
            "rank": rank,
            "world_size": world,
            "local_rank": rank,
            "local_size": world,
            "node_rank": 0,
            "nnodes": 1,
            "is_main_process": rank == 0,
            "is_distributed": True,
            "backend": "gloo",
            "device": "cpu",
        }
        functions, described = result["functions"], result["describe"]
        assert {k: functions[k] for k in expected} == expected
        assert {k: described[k] for k in expected} == expected
        assert described.keys() >= DESCRIBE_KEYS
        assert described["hostname"] == socket.gethostname()
        json.dumps(described)  # JSON-friendly


# --- serial: no process group ------------------------------------------------------------


def test_serial_answers_without_a_process_group() -> None:
    assert not dist.is_initialized()
    assert gs.get_world_size() == 1
    assert gs.get_rank() == 0
    assert gs.get_local_rank() == 0
    assert gs.get_local_size() == 1
    assert gs.get_node_rank() == 0
    assert gs.get_nnodes() == 1
    assert gs.is_main_process() is True
    assert gs.is_distributed() is False
    assert gs.backend() is None


def test_serial_device_and_gpu_memory() -> None:
    if torch.cuda.is_available():
        assert gs.device() == torch.device("cuda", torch.cuda.current_device())
        assert isinstance(gs.gpu_mem_usage(), int) and gs.gpu_mem_usage() >= 0
    else:
        assert gs.device() == torch.device("cpu")
        assert gs.gpu_mem_usage() == 0


def test_serial_describe() -> None:
    described = gs.describe()
    assert described.keys() >= DESCRIBE_KEYS
    assert described["rank"] == 0
    assert described["world_size"] == 1
    assert described["local_rank"] == 0
    assert described["local_size"] == 1
    assert described["node_rank"] == 0
    assert described["nnodes"] == 1
    assert described["backend"] is None
    assert described["is_distributed"] is False
    assert described["device"] == str(gs.device())
    assert described["hostname"] == socket.gethostname()
    assert described["pid"] == os.getpid()
    assert json.loads(json.dumps(described)) == described


def test_serial_answers_ignore_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a process group the environment does not matter."""
    for name, value in {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    assert (gs.get_rank(), gs.get_world_size(), gs.get_local_rank()) == (0, 1, 0)


# --- groups started by gs.launch -----------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [2, 4])
def test_topology_in_a_launched_group(nproc: int) -> None:
    results = gs.launch(topology_of_this_rank, nproc_per_node=nproc, backend="gloo")
    assert_single_host_group(results, nproc)
    assert all(r["describe"]["launcher"] == "torchrun" for r in results)
    assert not gs.is_distributed()  # the parent never joins


# --- groups created by hand: no launcher variables ------------------------------------------


def _handmade_worker(rank: int, world: int, port: int, out: str, env: dict[str, str]) -> None:
    """torch.multiprocessing.spawn target: a user's own init_process_group, then gs."""
    for name in list(os.environ):
        if name in LAUNCHER_VARS or name.startswith(("SLURM_", "OMPI_")):
            del os.environ[name]
    os.environ.update(env)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result = topology_of_this_rank()
        result["sum"] = gs.all_reduce(rank + 1)
        result["gathered"] = gs.all_gather_tensor(torch.full((rank + 1,), rank)).tolist()
        gs.barrier(timeout=30)
        result["seed"] = gs.shared_random_seed()
    finally:
        dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def _run_handmade(tmp_path: Path, world: int, env: dict[str, str]) -> list[dict[str, Any]]:
    for attempt in range(3):
        try:
            torch_mp.spawn(
                _handmade_worker, args=(world, free_ports()[0], str(tmp_path), env), nprocs=world
            )
            break
        except torch_mp.ProcessRaisedException as exc:
            # the "free" port was taken before rank 0 bound it; anything else is a failure
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.timeout(120)
def test_handmade_group_uses_hostname_grouping(tmp_path: Path) -> None:
    results = _run_handmade(tmp_path, 2, env={})
    assert_single_host_group(results, 2)
    assert all(r["describe"]["launcher"] is None for r in results)
    assert [r["sum"] for r in results] == [3, 3]
    assert all(r["gathered"] == [0, 1, 1] for r in results)
    assert len({r["seed"] for r in results}) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "stale_env",
    [
        # torchrun variables of some other job: world of 8, this "node" being node 1 of 2
        {
            "RANK": "0",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "3",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2",
        },
        # a SLURM allocation of 16 tasks on 4 nodes
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2",
            "SLURM_NNODES": "4",
            "SLURM_TASKS_PER_NODE": "4(x4)",
        },
    ],
    ids=["torchrun", "slurm"],
)
def test_handmade_group_ignores_an_environment_that_disagrees(
    tmp_path: Path, stale_env: dict[str, str]
) -> None:
    results = _run_handmade(tmp_path, 2, env=stale_env)
    assert_single_host_group(results, 2)


def _run_with_a_free_port(
    command: Callable[[int], list[str]],
    *,
    env: dict[str, str],
    port_variable: str | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``command(port)`` until it succeeds or fails for another reason than the port."""
    for attempt in range(3):
        port = free_ports()[0]
        if port_variable:
            env = {**env, port_variable: str(port)}
        done = subprocess.run(
            command(port), env=env, cwd=cwd, capture_output=True, text=True, timeout=100
        )
        if done.returncode == 0 or "EADDRINUSE" not in done.stderr or attempt == 2:
            break
    assert done.returncode == 0, done.stdout + done.stderr
    return done


# --- torchrun ----------------------------------------------------------------------------------

TORCHRUN_SCRIPT = """
import json
import pathlib
import gatherstore as gs

assert gs.init_from_env(backend="gloo") is True
assert gs.init_from_env(backend="gloo") is True  # joining twice is a no-op
described = gs.describe()
described["sum"] = gs.all_reduce(gs.get_rank() + 1)
# One file per rank: two ranks printing to one pipe may interleave their lines.
pathlib.Path(f"report-{gs.get_rank()}.json").write_text(json.dumps(described))
gs.shutdown()
assert not gs.is_distributed()
"""


@pytest.mark.timeout(120)
def test_init_from_env_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_SCRIPT)
    _run_with_a_free_port(
        lambda port: [
            *[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"],
            *["--master_port", str(port), str(script)],
        ],
        env=clean_env(),
        cwd=tmp_path,
    )
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("report-*.json"))]
    assert [r["rank"] for r in reports] == [0, 1]
    for rank, report in enumerate(reports):
        assert report["world_size"] == 2
        assert report["local_rank"] == rank
        assert report["local_size"] == 2
        assert report["node_rank"] == 0
        assert report["nnodes"] == 1
        assert report["backend"] == "gloo"
        assert report["launcher"] == "torchrun"
        assert report["is_main_process"] == (rank == 0)
        assert report["sum"] == 3


def test_init_from_env_without_a_launcher_is_serial(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name in LAUNCHER_VARS or name.startswith(("SLURM_", "OMPI_")):
            monkeypatch.delenv(name)
    assert gs.init_from_env() is False
    assert not gs.is_distributed()
    assert gs.get_world_size() == 1


def test_init_from_env_rejects_incomplete_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name in LAUNCHER_VARS or name.startswith(("SLURM_", "OMPI_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        gs.init_from_env()
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        gs.init_from_env()
    assert not gs.is_distributed()


# --- SLURM ------------------------------------------------------------------------------------

SLURM_SCRIPT = """
import json, os
import gatherstore as gs

assert gs.init_from_env(backend="gloo") is True
described = gs.describe()
described["MASTER_ADDR"] = os.environ["MASTER_ADDR"]
described["sum"] = gs.all_reduce(5)
print("RESULT " + json.dumps(described), flush=True)
gs.shutdown()
"""


def _run_slurm_script(tmp_path: Path, slurm_env: dict[str, str]) -> dict[str, Any]:
    script = tmp_path / "slurm_script.py"
    script.write_text(SLURM_SCRIPT)
    done = _run_with_a_free_port(
        lambda port: [sys.executable, str(script)],
        env=clean_env(slurm_env),
        port_variable="MASTER_PORT",
    )
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    report: dict[str, Any] = json.loads(line.split("RESULT ", 1)[1])
    return report


@pytest.mark.timeout(90)
def test_init_from_env_under_slurm(tmp_path: Path) -> None:
    report = _run_slurm_script(
        tmp_path,
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0",
            "SLURM_NNODES": "1",
            "SLURM_TASKS_PER_NODE": "1",
            # MASTER_ADDR comes from the first host of the node list
            "SLURM_JOB_NODELIST": "127.0.0.[1-3]",
        },
    )
    assert report["MASTER_ADDR"] == "127.0.0.1"
    assert report["launcher"] == "slurm"
    assert report["is_distributed"] is True
    assert report["backend"] == "gloo"
    assert (report["rank"], report["world_size"]) == (0, 1)
    assert (report["local_rank"], report["local_size"]) == (0, 1)
    assert (report["node_rank"], report["nnodes"]) == (0, 1)
    assert report["sum"] == 5


def _one_rank_asks_worker(rank: int, world: int, port: int, out: str) -> None:
    """A hand-made group (no launcher variables): only rank 0 asks for the layout, while
    the others go straight to a gather."""
    for name in list(os.environ):
        if name in LAUNCHER_VARS or name.startswith(("SLURM_", "OMPI_")):
            del os.environ[name]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result: dict[str, Any] = {}
        if gs.is_main_process():
            result["describe"] = gs.describe()
        result["gathered"] = gs.all_gather_object(rank, timeout=60)
        result["local"] = [gs.get_local_rank(), gs.get_local_size(), gs.get_nnodes()]
        result["again"] = gs.all_gather_object(rank * 2, timeout=60)
    finally:
        dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


@pytest.mark.timeout(120)
def test_a_layout_asked_for_on_one_rank_puts_no_call_out_of_step(tmp_path: Path) -> None:
    torch_mp.spawn(_one_rank_asks_worker, args=(3, free_ports()[0], str(tmp_path)), nprocs=3)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(3)]
    assert results[0]["describe"]["local_size"] == 3
    for rank, result in enumerate(results):
        assert result["gathered"] == [0, 1, 2]
        assert result["local"] == [rank, 3, 1]
        assert result["again"] == [0, 2, 4]
