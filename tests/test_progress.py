"""Progress on long gathers and the one DEBUG line per call, in real gloo groups."""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest

import gatherstore as gs
from gatherstore.routes import progress as _progress


def _gather_with_logs(spec: str, progress: bool | None) -> dict[str, Any]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("gatherstore")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    obj = bytes(300_000) * (gs.get_rank() + 1)
    out = gs.gather_object(obj, store=spec, progress=progress)
    parts = list(gs.gather_iter(obj, store=spec, progress=progress))
    results = gs.collect_results([gs.get_rank()], store=spec, progress=progress)
    everyone = gs.all_gather_object(gs.get_rank(), store=spec, progress=progress)
    logger.removeHandler(handler)
    return {
        "log": stream.getvalue(),
        "sizes": None if out is None else [len(o) for o in out],
        "iter": len(parts),
        "results": results,
        "everyone": everyone,
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec", ["tmpdir", "collective"])
def test_progress_and_one_debug_line_per_call(spec: str, monkeypatch: Any) -> None:
    monkeypatch.delenv("GATHERSTORE_PROGRESS", raising=False)
    ranks = gs.launch(_gather_with_logs, nproc_per_node=3, backend="gloo", args=(spec, True))
    for out in ranks:
        lines = [line for line in out["log"].splitlines() if ": route " in line]
        calls = ["gather_object", "gather_iter", "collect_results", "all_gather_object"]
        assert [line.split(":")[0] for line in lines] == calls, out["log"]
        assert all(f"route {spec}" in line or "[" in line for line in lines)
        assert " bytes, " in lines[0] and lines[0].endswith(" s)")
        # each phase's seconds: what a sender encodes, the agreement, the move, the reading
        sent = "write" if spec == "tmpdir" else "transfer"
        phases = [p.split(" ")[0] for p in lines[0].partition(" s (")[2][:-1].split(", ")]
        assert phases == (["agree", sent, "read"] if out is ranks[0] else
                          ["encode", "agree", sent, "read"])  # fmt: skip
        progress = [line for line in out["log"].splitlines() if "parts," in line]
        # tqdm is installed here: the destination draws bars on stderr, not log lines;
        # without tqdm the same calls log "k/n parts, ... of ..." lines (next test)
        assert progress == []
        assert out["everyone"] == [0, 1, 2]
    assert ranks[0]["sizes"] == [300_000, 600_000, 900_000]
    assert ranks[0]["iter"] == 3 and ranks[1]["iter"] == 0


def test_progress_falls_back_to_the_logger_without_tqdm(
    monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # import tqdm fails
    caplog.set_level(logging.INFO, logger="gatherstore")
    progress = _progress.Progress("gather_object", 2, 3 << 20, enabled=True)
    progress.update(1 << 20)
    progress.update(2 << 20)
    progress.close()
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "gather_object: receiving 2 parts, 3.0 MiB"
    assert messages[-1] == "gather_object: 2/2 parts, 3.0 MiB of 3.0 MiB"


@pytest.mark.parametrize(
    ("argument", "setting", "nbytes", "expected"),
    [
        (True, "0", 0, True),
        (False, "1", 1 << 40, False),
        (None, "1", 0, True),
        (None, "0", 1 << 40, False),
        (None, "", 1 << 40, False),  # stderr is not a terminal under pytest
    ],
)
def test_who_decides_whether_progress_shows(
    monkeypatch: Any, argument: bool | None, setting: str, nbytes: int, expected: bool
) -> None:
    monkeypatch.setenv("GATHERSTORE_PROGRESS", setting)
    assert _progress.wanted(argument, nbytes) is expected
