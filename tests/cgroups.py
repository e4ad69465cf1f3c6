"""Real memory cgroups for tests: create one, run a script in it, remove it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import gatherstore as gs

SRC = str(Path(gs.__file__).resolve().parents[1])
TESTS = str(Path(__file__).parent)


def memory_cgroup() -> tuple[Path, str, str, str] | str:
    """A fresh memory cgroup (dir, limit file, usage file, OOM-kill counter file), or why
    this machine cannot make one.  On cgroup v2 the root's children get the memory
    controller first where they lack it (it stays on: other cgroups may use it by then)."""
    if os.geteuid() != 0:
        return "creating a memory cgroup needs root"
    name = f"gatherstore-test-{uuid.uuid4().hex[:8]}"
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():  # v2
        if "memory" not in (root / "cgroup.controllers").read_text().split():
            return f"cgroup v2 at {root} has no memory controller (disabled, or bound to v1)"
        subtree = root / "cgroup.subtree_control"
        if "memory" not in subtree.read_text().split():
            try:
                subtree.write_text("+memory")
            except OSError as exc:  # EBUSY: processes sit in the root itself (a container)
                return (
                    f"cannot enable the memory controller in {subtree} ({exc}); move the "
                    f"processes of {root}/cgroup.procs into a child cgroup first"
                )
        layout = (root / name, "memory.max", "memory.current", "memory.events")
    elif (root / "memory" / "cgroup.procs").exists():  # v1
        v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.oom_control")
        layout = (root / "memory" / name, *v1)
    else:
        return f"no memory cgroup: neither v2 at {root} nor v1 at {root}/memory is mounted"
    try:
        layout[0].mkdir()
    except OSError as exc:
        return f"cannot create the memory cgroup {layout[0]}: {exc}"
    return layout


def run_in_memory_cgroup(
    script: str, args: list[str], *, timeout: float
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run ``python -c script <cgroup.procs> <limit file> <usage file> *args`` in a fresh
    memory cgroup (the script moves itself in by writing its pid to the first), then
    remove the cgroup; returns the finished process and the cgroup's OOM-kill counters.

    Skips where the machine cannot make a memory cgroup, except under CI (``CI`` set):
    there it fails, since CI runs as root with one.
    """
    layout = memory_cgroup()
    if isinstance(layout, str):  # CI runs as root with a memory cgroup: untested is a failure
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{layout}\n(CI is set, so this fails instead of skipping)", pytrace=False)
        pytest.skip(layout)
    directory, limit, usage, events = layout
    try:
        paths = [str(directory / name) for name in ("cgroup.procs", limit, usage)]
        done = subprocess.run(
            [sys.executable, "-c", script, *paths, *args],
            env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS])},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        oom = (directory / events).read_text()
    finally:
        for _ in range(50):
            try:
                directory.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    return done, oom


def limit_to_room(limit_file: str, usage_file: str, room: int) -> int:
    """Set the cgroup's limit to ``room`` bytes over what its processes hold (its usage
    less the page cache the kernel drops first: ``inactive_file`` of memory.stat, as the
    kernel counts it before it kills); the limit set."""
    stat = Path(limit_file).with_name("memory.stat")
    field = "inactive_file" if limit_file.endswith("memory.max") else "total_inactive_file"
    counts = dict(line.split() for line in stat.read_text().splitlines())
    limit = int(Path(usage_file).read_text()) - int(counts.get(field, 0)) + room
    Path(limit_file).write_text(str(limit))
    return limit
