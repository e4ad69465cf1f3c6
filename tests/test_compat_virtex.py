"""gatherstore.compat.virtex side by side with a stand-in of virtex.utils.distributed
(tests/standins): signatures, serial and 3-rank answers, launch without CUDA, patch(); and
every compat module's patch() without its library."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from compat_groups import torch_objects_refused
from compat_same import differences, module_signature_differences, outcome, recorder, same_outcome
from compat_standins import standins

import gatherstore as gs
from gatherstore.compat import detectron2, virtex, vis4d


@pytest.fixture
def standin() -> Iterator[Any]:
    """The stand-in ``virtex.utils.distributed``, importable meanwhile."""
    with standins():
        import virtex.utils.distributed as module

        yield module


def script(d: Any) -> list[tuple[str, Any]]:
    """The same calls on ``d`` (the stand-in or the compat module), with their outcomes."""
    rank = d.get_rank()
    out, record = recorder()
    for name in ("get_world_size", "get_rank", "is_master_process", "synchronize", "gpu_mem_usage"):
        record(name, getattr(d, name))
    t = torch.tensor([float(rank), 3.0])
    record("average tensor", lambda: (d.average_across_processes(t), t))
    losses = {"a": torch.tensor(float(rank)), "b": torch.ones(2) * rank}
    record("average dict", lambda: (d.average_across_processes(losses), losses))
    record("average int", lambda: d.average_across_processes(torch.tensor([rank])))
    return out


def compare(original: Any) -> list[str]:
    """Every difference, and every call of torch's object collectives by the compat module."""
    answers = script(original)
    with torch_objects_refused() as called:
        problems = differences(answers, script(virtex))
    return problems + [f"torch.distributed.{name} called" for name in called]


def test_signatures_match_virtex(standin: Any) -> None:
    assert module_signature_differences(standin, virtex) == []


def test_serial_matches_virtex(standin: Any) -> None:
    assert compare(standin) == []


def ranks_compare() -> list[str]:
    import virtex.utils.distributed as original

    return compare(original)


@pytest.mark.timeout(180)
def test_three_gloo_ranks_match_virtex(standin: Any) -> None:
    assert gs.launch(ranks_compare, nproc_per_node=3, backend="gloo", timeout=60) == [[], [], []]


def test_launch_runs_one_process_in_place_without_cuda(standin: Any) -> None:
    ran: list[int] = []
    virtex.launch(ran.append, args=(5,))
    assert ran == [5]
    if not torch.cuda.is_available():  # virtex asserts CUDA even for one process
        assert outcome(lambda: standin.launch(ran.append, args=(6,)))[1] is AssertionError
    with pytest.raises(ValueError, match="dist_url"):
        virtex.launch(print, num_gpus_per_machine=2, dist_url="file:///x")


def launched(path: str) -> None:
    Path(path, f"{virtex.get_rank()}-{virtex.get_world_size()}").touch()


@pytest.mark.timeout(180)
def test_launch_runs_without_cuda(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    virtex.launch(launched, num_gpus_per_machine=2, dist_url=url, args=(str(tmp_path),))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0-2", "1-2"]


def patched_average() -> list[Any]:
    """virtex's scripts call ``dist.average_across_processes`` through the module."""
    import virtex.utils.distributed as dist

    rank, out = gs.get_rank(), []
    for patched in (False, True):
        handle = virtex.patch() if patched else None
        losses = {"loss": torch.tensor(float(rank)), "acc": torch.ones(2) * rank}
        dist.average_across_processes(losses)
        out += [losses, dist.average_across_processes is virtex.average_across_processes]
        if handle is not None:
            handle.undo()
    return out


@pytest.mark.timeout(180)
def test_patch_averages_through_gatherstore_in_three_ranks(standin: Any) -> None:
    for out in gs.launch(patched_average, nproc_per_node=3, backend="gloo", timeout=60):
        plain, was_ours, patched, is_ours = out
        assert not was_ours and is_ours
        assert same_outcome(plain, patched, "losses") == []
        assert patched["loss"].item() == 1.0


def test_patch_swaps_and_undoes(standin: Any) -> None:
    original = standin.average_across_processes
    with virtex.patch() as handle:
        assert virtex.patch() is handle
        assert standin.average_across_processes is virtex.average_across_processes
        assert standin.get_rank is not virtex.get_rank
    assert standin.average_across_processes is original


@pytest.mark.parametrize("module", [detectron2, vis4d, virtex])
def test_patch_without_the_library_says_how_to_install(module: Any) -> None:
    with pytest.raises(ImportError, match="pip install"):
        module.patch()
