"""Under a real ``torchrun``: a collective in a process without a process group, where the
launcher started several, raises (it would gather alone and return only its own share);
with ``gs.init_from_env()`` the same script gathers every rank's results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import os
import sys
import gatherstore as gs

if sys.argv[1] == "init":
    gs.init_from_env(backend="gloo")
rank, world = gs.get_rank(), gs.get_world_size()
part = list(range(10))[int(os.environ["RANK"]) :: 2]  # this process's share
try:
    merged = gs.collect_results(part, size=10)
except gs.GatherError as exc:
    print(f"error {type(exc).__name__}: {exc}", flush=True)
    raise SystemExit(3)
print(f"rank {rank} of {world}: {merged}", flush=True)
gs.shutdown()
"""


def _torchrun(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "evaluate.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--standalone", "--max_restarts", "0", str(script), mode]
    return subprocess.run(command, capture_output=True, text=True, timeout=100, cwd=tmp_path)


@pytest.mark.timeout(120)
def test_a_collective_without_init_under_torchrun_names_the_fix(tmp_path: Path) -> None:
    out = _torchrun(tmp_path, "no-init")
    assert out.returncode != 0, out.stdout
    errors = [line for line in out.stdout.splitlines() if line.startswith("error ")]
    assert len(errors) == 2, out.stdout + out.stderr  # each process, not a silent half
    for line in errors:
        assert line.startswith("error ProcessGroupError: collect_results: WORLD_SIZE=2 says")
        assert "gs.init_from_env()" in line and "init_process_group" in line


@pytest.mark.timeout(120)
def test_the_same_script_with_init_from_env_gathers_every_rank(tmp_path: Path) -> None:
    out = _torchrun(tmp_path, "init")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"rank 0 of 2: {list(range(10))}" in out.stdout
    assert "rank 1 of 2: None" in out.stdout


def test_topology_keeps_the_serial_answers_under_a_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gatherstore as gs

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert (gs.get_rank(), gs.get_world_size(), gs.is_distributed()) == (0, 1, False)
    with pytest.raises(gs.ProcessGroupError, match="WORLD_SIZE=2 says"):
        gs.all_gather_object("x")
    with pytest.raises(gs.ProcessGroupError, match=r"gs\.init_from_env"):
        gs.barrier()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert gs.all_gather_object("x") == ["x"]
