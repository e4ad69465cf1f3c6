"""Processes forked from a rank (DataLoader workers, say) are not the rank: a signal to
one, or its exit, neither removes the rank's job areas nor stops the rank."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import gatherstore as gs


def _sleep_once_ready(ready: Any) -> None:
    """A forked worker: says it runs, then sleeps until it is stopped."""
    ready.set()
    time.sleep(60)


def _with_forked_workers(base: str) -> dict[str, Any]:
    store = gs.open_store(f"file://{base}")
    gs.all_gather_object(0, store=store, timeout=60)  # the job area exists from here on
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    stopped = ctx.Process(target=_sleep_once_ready, args=(ready,))  # stopped as DataLoader does
    stopped.start()
    assert ready.wait(30)
    stopped.terminate()
    stopped.join(30)
    child = os.fork()  # a child that exits the ordinary way: its atexit handlers run
    if child == 0:
        atexit._run_exitfuncs()
        os._exit(0)
    os.waitpid(child, 0)
    loader = torch.utils.data.DataLoader(list(range(8)), num_workers=2, batch_size=2)
    seen = [int(x) for batch in loader for x in batch]  # real workers, forked, then stopped
    time.sleep(0.5)  # a stray signal byte would have reached the watcher by now
    areas = sorted(p.name for p in Path(base).iterdir())
    gs.barrier(timeout=60)
    return {
        "stopped": stopped.exitcode,
        "seen": seen,
        "areas": areas,
        "after": gs.all_gather_object(gs.get_rank(), store=store, timeout=60),
        "handler": signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL,
    }


@pytest.mark.timeout(180)
def test_forked_workers_leave_the_rank_and_its_areas_alone(tmp_path: Path) -> None:
    results = gs.launch(
        _with_forked_workers, nproc_per_node=3, backend="gloo", args=(str(tmp_path),)
    )
    for out in results:
        assert out["stopped"] == -signal.SIGTERM
        assert out["seen"] == list(range(8))
        assert len(out["areas"]) == 1 and out["areas"][0].startswith("gatherstore-")
        assert out["after"] == [0, 1, 2]
        assert out["handler"]  # the rank's own clean-up on SIGTERM is still in place
    assert list(tmp_path.iterdir()) == []
