"""SLURM: steps on a subset of the job's nodes, uneven tasks per node, node lists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gatherstore.job.slurm import expand_nodelist, layout, master_addr, tasks_per_node
from gatherstore.testing.services import free_ports

# a job holding node[0-2] whose step runs on node1 and node2 only: 2 tasks, then 1
STEP = {
    "SLURM_JOB_NODELIST": "node[0-2]",
    "SLURM_NODELIST": "node[0-2]",
    "SLURM_TASKS_PER_NODE": "4(x3)",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "2,1",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NTASKS": "3",
}


def test_master_addr_is_the_steps_first_node() -> None:
    assert master_addr(STEP) == "node1"
    assert master_addr({"SLURM_JOB_NODELIST": "gpu[007-009]"}) == "gpu007"
    assert master_addr({"SLURM_NODELIST": "a[1-2],b"}) == "a1"
    with pytest.raises(ValueError, match=r"SLURM_STEP_NODELIST.*MASTER_ADDR"):
        master_addr({"SLURM_PROCID": "0"})


def test_tasks_per_node() -> None:
    assert tasks_per_node("2(x2),1") == [2, 2, 1]
    assert tasks_per_node("4") == [4]
    assert tasks_per_node("1,3(x2),2") == [1, 3, 3, 2]
    for bad in ("", "2(x)", "x2", "2(x2", "2,,1", "-1"):
        with pytest.raises(ValueError, match="tasks per node"):
            tasks_per_node(bad)


@pytest.mark.parametrize("nodeid", [True, False], ids=["SLURM_NODEID", "block"])
def test_layout_of_uneven_tasks_per_node(nodeid: bool) -> None:
    """SLURM_STEP_TASKS_PER_NODE=2(x2),1: ranks 0-1 on node 0, 2-3 on node 1, 4 on node 2."""
    env = {"SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_TASKS_PER_NODE": "8(x4)"}
    expected = [(0, 2, 0, 3), (1, 2, 0, 3), (0, 2, 1, 3), (1, 2, 1, 3), (0, 1, 2, 3)]
    for rank, (local_rank, local_size, node, nnodes) in enumerate(expected):
        task = dict(env)
        if nodeid:
            task |= {"SLURM_NODEID": str(node), "SLURM_LOCALID": str(local_rank)}
        assert layout(task, rank, 5) == (local_rank, local_size, node, nnodes)


def test_layout_from_the_node_name_and_the_jobs_variables() -> None:
    env = {
        "SLURM_STEP_NODELIST": "n[08-10]",
        "SLURM_TASKS_PER_NODE": "1,2(x2)",
        "SLURMD_NODENAME": "n09",
        "SLURM_LOCALID": "1",
        "SLURM_DISTRIBUTION": "cyclic",  # rank order tells nothing; the node name does
    }
    assert layout(env, 3, 5) == (1, 2, 1, 3)
    assert layout({**env, "SLURMD_NODENAME": "elsewhere"}, 3, 5) is None


@pytest.mark.parametrize(
    "env",
    [
        {},  # no tasks per node at all
        {"SLURM_TASKS_PER_NODE": "2(x2)"},  # 4 tasks, not this world of 5
        {"SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_NNODES": "2"},  # 3 nodes, not 2
        {"SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_NODEID": "3"},
        {"SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_NODEID": "0", "SLURM_LOCALID": "2"},
        {"SLURM_TASKS_PER_NODE": "two"},
        {"SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_STEP_NODELIST": "n[2-1]"},
    ],
)
def test_layout_that_does_not_add_up_is_none(env: dict[str, str]) -> None:
    """None: the topology then groups ranks by hostname instead of trusting SLURM."""
    assert layout(env, 4, 5) is None


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b[1-2]", ["a1", "b1", "b2"]),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
        ("x[1],y[2-3],z", ["x1", "y2", "y3", "z"]),
        ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
        ("node-[1-2]-ib", ["node-1-ib", "node-2-ib"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("gpu[001-002,010],cpu[7-8]", ["gpu001", "gpu002", "gpu010", "cpu7", "cpu8"]),
        ("n[09-11,100]", ["n09", "n10", "n11", "n100"]),
        ("a[1-2]b[01-02]", ["a1b01", "a1b02", "a2b01", "a2b02"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts
    # init_from_env's MASTER_ADDR under SLURM is the first host
    assert expand_nodelist(nodelist)[0] == hosts[0]


@pytest.mark.parametrize(
    "nodelist",
    [
        *["", " ", ",", "a,,b", "a, b", "node[", "node[01-", "node[01-04", "node]"],
        *["node[]", "node[a-b]", "node[1-2-3]", "node[3-1]", "node[1,]", "node[[1]]"],
        *["node[1-2]]", "node[-1]", "node[1-]", "node[²]"],
    ],
)
def test_expand_nodelist_rejects_malformed_lists(nodelist: str) -> None:
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(nodelist)


# --- a real start: independent processes with SLURM's variables only --------------------------

SLURM_TASK = """
import json, os, sys
import gatherstore as gs

assert gs.init_from_env(backend="gloo", timeout=60) is True
report = gs.describe()
report["MASTER_ADDR"] = os.environ["MASTER_ADDR"]
report["gathered"] = gs.gather_object({"rank": gs.get_rank()}, store="auto", timeout=60)
report["sum"] = gs.all_reduce(gs.get_rank() + 1)
print("RESULT " + json.dumps(report), flush=True)
gs.shutdown()
"""


def slurm_step_env(rank: int, step_tasks: list[int], first_host: str, port: int) -> dict[str, str]:
    """What srun exports to task ``rank`` of a step on the job's last nodes, ``first_host``
    being the step's first node (block distribution), and nothing torchrun would."""
    starts = [sum(step_tasks[:node]) for node in range(len(step_tasks))]
    node = max(n for n, start in enumerate(starts) if start <= rank)
    spec = ",".join(map(str, step_tasks))
    return {
        "SLURM_JOB_NODELIST": f"gs-absent-node0,{first_host},gs-node[2-{len(step_tasks)}]",
        "SLURM_TASKS_PER_NODE": f"{max(step_tasks) + 1}(x{len(step_tasks) + 1})",
        "SLURM_STEP_NODELIST": f"{first_host},gs-node[2-{len(step_tasks)}]",
        "SLURM_STEP_TASKS_PER_NODE": spec,
        "SLURM_STEP_NUM_NODES": str(len(step_tasks)),
        "SLURM_NNODES": str(len(step_tasks)),
        "SLURM_NTASKS": str(sum(step_tasks)),
        "SLURM_PROCID": str(rank),
        "SLURM_NODEID": str(node),
        "SLURM_LOCALID": str(rank - starts[node]),
        "MASTER_PORT": str(port),
    }


def without_launchers() -> dict[str, str]:
    """This process's environment minus every launcher variable."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    return {
        k: v
        for k, v in os.environ.items()
        if k not in launcher and not k.startswith(("SLURM_", "GROUP_", "TORCHELASTIC_", "OMPI_"))
    }


def parse_reports(outputs: list[str]) -> list[dict[str, Any]]:
    """The RESULT line of each task's stdout."""
    reports = []
    for out in outputs:
        (line,) = [line for line in out.splitlines() if line.startswith("RESULT ")]
        reports.append(json.loads(line.split("RESULT ", 1)[1]))
    return reports


@pytest.mark.timeout(120)
def test_a_step_on_a_subset_of_the_jobs_nodes(tmp_path: Path) -> None:
    """3 tasks, 2 on the step's first node (``localhost``) and 1 on the next: every task
    finds rank 0 on the step's first node, not the job's, and knows its place."""
    script = tmp_path / "task.py"
    script.write_text(SLURM_TASK)
    port = free_ports()[0]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**without_launchers(), **slurm_step_env(rank, [2, 1], "localhost", port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    try:
        done = [proc.communicate(timeout=100) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0, 0], [err for _, err in done]
    reports = parse_reports([out for out, _ in done])
    places = [(r["local_rank"], r["local_size"], r["node_rank"], r["nnodes"]) for r in reports]
    assert places == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 1, 1, 2)]
    assert all(r["MASTER_ADDR"] == "localhost" and r["launcher"] == "slurm" for r in reports)
    assert reports[0]["gathered"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert [r["gathered"] for r in reports[1:]] == [None, None]
    assert [r["sum"] for r in reports] == [6, 6, 6]
