"""The ``gatherstore`` command: each subcommand at small sizes, and its errors."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gatherstore as gs
from gatherstore.cli import main as cli

OLD = 7200.0  # seconds: older than the --older-than 1h used below
COMMANDS = ("demo", "bench", "check", "gc", "results", "describe")


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gatherstore.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The command's one error line: the last on stderr, and the only one it wrote
    (a stopped child process may still print a warning of its own above it)."""
    lines = result.stderr.strip().splitlines()
    ours = [line for line in lines if line.startswith("gatherstore ")]
    assert len(ours) == 1 and lines[-1] == ours[0], result.stderr
    return ours[0]


# --- argument parsing -----------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["frob"], "invalid choice: 'frob'"),
        (["demo", "--size", "banana"], "'banana' is not a size"),
        (["demo", "--nproc", "0"], "'0' is not a positive integer"),
        (["gc", "--store", "tmpdir", "--older-than", "soon"], "'soon' is not a duration"),
        (["check", "--store", "foo://x"], "unknown store scheme 'foo'"),
        (["bench", "--world", "2,x"], "'x' is not a positive integer"),
        (["gc", "--store", "tmpdir"], "--older-than"),
    ],
)
def test_bad_arguments(args: list[str], expected: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert expected in result.stderr
    assert "usage: gatherstore" in result.stderr


@pytest.mark.timeout(120)
def test_python_m_gatherstore_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gatherstore", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    for command in COMMANDS:
        assert command in result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_says_what_it_does(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main([command, "--help"])
    assert stopped.value.code == 0
    description = capsys.readouterr().out.split("\n\n")[1]  # after the usage
    assert not description.startswith("options:")
    assert len(description.split()) >= 10 and description.rstrip().endswith("."), description


@pytest.mark.timeout(120)
def test_help_and_bad_arguments_import_no_torch() -> None:
    """``python -m gatherstore --help``, each command's ``--help`` and a usage error answer
    from the parser alone: the commands, and torch with them, load when one runs."""
    code = (
        "import runpy, sys\n"
        "from gatherstore.cli.main import main\n"
        f"for argv in [['--help'], *[[c, '--help'] for c in {list(COMMANDS)!r}], "
        "['demo', '--size', 'banana']]:\n"
        "    sys.argv = ['gatherstore', *argv]\n"
        "    try:\n"
        "        runpy.run_module('gatherstore', run_name='__main__', alter_sys=True)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == (2 if 'banana' in argv else 0), (argv, exc.code)\n"
        "heavy = ('torch', 'numpy', 'gatherstore.cli.commands', 'gatherstore.job.launch', "
        "'gatherstore.cli.bench.payloads', 'gatherstore.calls')\n"
        "print([m for m in heavy if m in sys.modules], file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "[]", result.stderr


@pytest.mark.timeout(120)
def test_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gatherstore", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0
    assert result.stdout == f"gatherstore {gs.__version__}\n"


# --- demo -------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_demo_small() -> None:
    result = run_cli("demo", "--size", "4MB", "--nproc", "2")
    assert result.returncode == 0, result.stderr
    assert "2 ranks (gloo), store tmpdir" in result.stdout
    assert "gathered 1,497 predictions" in result.stdout  # odd: the sampler pads rank 1
    assert "verified: count, order" in result.stdout
    assert "rank 0 +" in result.stdout and "rank 1 +" in result.stdout


@pytest.mark.timeout(180)
def test_demo_compare_runs_all_gather_object_on_the_same_payload() -> None:
    result = run_cli("demo", "--size", "4MB", "--nproc", "2", "--compare")
    assert result.returncode == 0, result.stderr
    assert "torch.distributed.all_gather_object, same predictions, same run:" in result.stdout
    assert "its peak memory growth: rank 0 +" in result.stdout


@pytest.mark.timeout(120)
def test_demo_streamed_through_a_file_store(tmp_path: Path) -> None:
    result = run_cli(
        "demo", "--size", "1MB", "--nproc", "3", "--stream", "--store", f"file://{tmp_path}"
    )
    assert result.returncode == 0, result.stderr
    assert "with gather_iter" in result.stdout
    assert list(tmp_path.iterdir()) == []  # the job area is gone


@pytest.mark.timeout(120)
def test_demo_fails_in_one_line_on_a_store_ranks_do_not_share() -> None:
    result = run_cli("demo", "--size", "1MB", "--nproc", "2", "--store", "memory://demo")
    assert result.returncode == 1
    line = one_line_error(result)
    assert line.startswith("gatherstore demo: StoreNotSharedError:")
    assert "not visible from rank 1, which cannot see the job area" in line


# --- check -------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", ["tmpdir", "memory://check"])
def test_check_one_process(spec: str) -> None:
    result = run_cli("check", "--store", spec)
    assert result.returncode == 0, result.stderr
    assert "reachable" in result.stdout and "put/get/delete" in result.stdout
    assert result.stdout.strip().endswith("ok")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_check_leaves_no_folder_it_created(tmp_path: Path, nproc: str) -> None:
    root = tmp_path / "new" / "deeper"
    result = run_cli("check", "--store", f"file://{root}", "--nproc", nproc)
    assert result.returncode == 0, result.stderr
    made = f"created the missing folders {tmp_path / 'new'}, {root} (removed after the check)"
    assert made in result.stdout.splitlines()[0] and result.stdout.strip().endswith("ok")
    assert list(tmp_path.iterdir()) == []
    root.mkdir(parents=True)  # a folder that was there stays, and is not named
    result = run_cli("check", "--store", f"file://{root}", "--nproc", nproc)
    assert result.returncode == 0 and "missing" not in result.stdout, result.stderr
    assert list(root.iterdir()) == []


def test_check_that_fails_leaves_no_folder_either(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The folders made, then the probe refused: files of this process may not grow past
    64 KiB (it is 1 MiB)."""
    spec = f"file://{tmp_path}/new/deeper"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        code = cli.main(["check", "--store", spec])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert code == 1
    said = capsys.readouterr().err
    assert "StoreUnavailableError" in said and "failed to write 'check/probe'" in said, said
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_check_tmpdir_in_two_processes() -> None:
    result = run_cli("check", "--store", "tmpdir", "--nproc", "2")
    assert result.returncode == 0, result.stderr
    assert "(mode 700)" in result.stdout
    assert "2 ranks on" in result.stdout


@pytest.mark.timeout(120)
def test_check_memory_in_two_processes_is_not_shared() -> None:
    result = run_cli("check", "--store", "memory://check", "--nproc", "2")
    assert result.returncode == 1
    line = one_line_error(result)
    assert "StoreNotSharedError" in line and "memory://" in line
    assert result.stdout == ""


@pytest.mark.timeout(120)
def test_check_unusable_base_directory(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    result = run_cli("check", "--store", f"file://{tmp_path}/a-file/dir")
    assert result.returncode == 1
    line = one_line_error(result)
    assert line.startswith("gatherstore check: StoreUnavailableError:")
    assert "cannot create a job area" in line


@pytest.mark.timeout(120)
def test_check_on_every_rank_under_torchrun() -> None:
    # --standalone: torchrun binds a free port itself
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    result = subprocess.run(
        [*torchrun, "2", "-m", "gatherstore.cli.main", "check", "--store", "tmpdir"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "ok" and lines.count("ok") == 1  # rank 0 reports
    assert "2 ranks on" in result.stdout


# --- gc -----------------------------------------------------------------------------------------
def make_job_dir(base: Path, job: str, age: float, marker_age: float | None) -> Path:
    """A job directory as a session makes it, with a marker ``marker_age`` seconds old."""
    path = base / f"gatherstore-{job}-x1y2z3"
    path.mkdir(mode=0o700)
    if marker_age is not None:
        body = {"job": job, "created": time.time() - marker_age, "host": "test"}
        gs.open_store(f"file://{path}").put("marker", json.dumps(body).encode())
    (path / "call-1").mkdir()
    (path / "call-1" / "1").write_bytes(b"part")
    os.utime(path, (time.time() - age, time.time() - age))
    return path


@pytest.mark.timeout(120)
def test_gc_removes_only_old_gatherstore_job_dirs(tmp_path: Path) -> None:
    old = make_job_dir(tmp_path, "0123456789abcdef", OLD, OLD)
    old_unmarked = make_job_dir(tmp_path, "fedcba9876543210", OLD, None)
    old_by_marker = make_job_dir(tmp_path, "aabbccddeeff0011", 60, OLD)
    young = make_job_dir(tmp_path, "00112233445566aa", 60, 60)
    young_by_marker = make_job_dir(tmp_path, "99887766554433bb", OLD, 60)
    foreign = [tmp_path / "other", tmp_path / "gatherstore-notours", tmp_path / "gatherstore-x"]
    for path in foreign:
        path.mkdir()
        os.utime(path, (time.time() - OLD, time.time() - OLD))
    everything = sorted(tmp_path.iterdir())

    dry = run_cli("gc", "--store", f"tmpdir://{tmp_path}", "--older-than", "1h", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert sorted(tmp_path.iterdir()) == everything
    for path in (old, old_unmarked, old_by_marker):
        assert f"would remove {path} " in dry.stdout
    assert "would remove 3 job area(s)" in dry.stdout

    real = run_cli("gc", "--store", f"file://{tmp_path}", "--older-than", "1h")
    assert real.returncode == 0, real.stderr
    assert "removed 3 job area(s)" in real.stdout
    assert sorted(tmp_path.iterdir()) == sorted([young, young_by_marker, *foreign])


def test_gc_on_a_key_store(capsys: pytest.CaptureFixture[str]) -> None:
    store = gs.open_store("memory://gc-keys")
    now = time.time()
    for job, age in (("0123456789abcdef", OLD), ("fedcba9876543210", 60)):
        marker = {"job": job, "created": now - age}
        store.put(f"gatherstore/{job}/marker", json.dumps(marker).encode())
        store.put(f"gatherstore/{job}/call-1/1", b"part")
    store.put(
        "gatherstore/not-a-job/marker", json.dumps({"job": "not-a-job", "created": 0}).encode()
    )
    store.put("gatherstore-0123456789abcdef", b"a key beside the prefix")
    store.put("other/key", b"x")
    before = store.list()

    assert cli.main(["gc", "--store", "memory://gc-keys", "--older-than", "1h", "--dry-run"]) == 0
    assert "would remove 1 job area(s)" in capsys.readouterr().out
    assert store.list() == before

    assert cli.main(["gc", "--store", "memory://gc-keys", "--older-than", "30m"]) == 0
    out = capsys.readouterr().out
    assert "removed memory:///gc-keys/gatherstore/0123456789abcdef/" in out
    assert store.list() == [k for k in before if "0123456789abcdef/" not in k]
    store.delete("")


def test_gc_refuses_a_route(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["gc", "--store", "auto", "--older-than", "1h"]) == 1
    assert "gc needs a store URL" in capsys.readouterr().err


# --- describe -------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_describe_is_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATHERSTORE_AUTO_THRESHOLD", "64KiB")
    result = run_cli("describe")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["world_size"] == 1 and info["rank"] == 0
    assert info["default_store"] == os.environ.get("GATHERSTORE_STORE", "auto")
    assert info["auto_threshold"] == 64 << 10
    assert os.path.isdir(info["tmpdir_base"])
    assert info["versions"]["gatherstore"] == gs.__version__
    assert info["versions"]["torch"]
