"""gatherstore.compat.accelerate side by side with accelerate's own gather_object: serially,
in 3 gloo ranks (equal, uneven, empty, strings, nested objects, errors), through an
unchanged Accelerator.gather_for_metrics, and a rank whose object cannot be pickled."""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from compat_groups import torch_objects_refused
from compat_same import failure, outcome, reused_buffer, same, same_outcome

import gatherstore as gs
from gatherstore.compat import accelerate as compat

operations = pytest.importorskip("accelerate.utils.operations")


class Unpicklable:
    """An object that refuses to be pickled (as one holding a lock or a socket would)."""

    def __reduce__(self) -> Any:
        raise TypeError("Unpicklable holds a lock and cannot be pickled")


def cases(rank: int) -> dict[str, Any]:
    """Each rank's object per case; accelerate flattens every rank's object into one list."""
    return {
        "equal": [rank, rank * 10],
        "uneven": [f"r{rank}-{i}" for i in range(rank + 1)],
        "empty rank": [] if rank == 1 else [rank],
        "all empty": [],
        "strings": ["é" * rank, "", "plain"],
        "a string (iterated by characters)": "ab" * rank,
        "nested": [
            {"rank": rank, "t": torch.arange(rank, dtype=torch.float16), "x": (rank, None)},
            [[rank], {"deep": ["s" * rank]}],
        ],
        "tensor (iterated by rows)": torch.full((rank + 1, 2), rank),
        "a dict (iterated by keys)": {f"k{rank}": rank},
        "not iterable": rank,
    }


def script(gather: Any) -> list[tuple[str, Any]]:
    rank = gs.get_rank()
    out = [(label, outcome(lambda o=obj: gather(o))) for label, obj in cases(rank).items()]
    reused = outcome(lambda: reused_buffer(lambda o: gather([o]), rank))
    return [*out, ("reused buffer", reused)]


def compare() -> tuple[list[str], dict[str, Any]]:
    """accelerate's gather_object, then patched, then the compat function (torch's object
    collectives refused): every difference, and accelerate's answers."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    PartialState(cpu=True)
    original = script(gather_object)
    with torch_objects_refused() as called:
        with compat.patch():
            from accelerate.utils import gather_object as patched

            through_patch = script(patched)
        direct = script(compat.gather_object)
    problems = [
        problem
        for ours in (through_patch, direct)
        for (label, a), (_, b) in zip(original, ours, strict=True)
        for problem in same_outcome(a, b, label)
    ]
    return problems + [f"torch.distributed.{name} called" for name in called], dict(original)


@pytest.mark.timeout(180)
def test_three_gloo_ranks_match_accelerate() -> None:
    for problems, answers in gs.launch(compare, nproc_per_node=3, backend="gloo", timeout=60):
        assert problems == []
        assert answers["uneven"] == ["r0-0", "r1-0", "r1-1", "r2-0", "r2-1", "r2-2"]
        assert answers["empty rank"] == [0, 2]
        assert answers["a string (iterated by characters)"] == list("abab" + "ab")
        assert answers["not iterable"][:2] == ("raised", TypeError)


def test_serial_returns_the_object_itself() -> None:
    from accelerate import PartialState

    try:
        assert PartialState().num_processes == 1
        obj = {"a": [1, 2]}
        assert operations.gather_object(obj) is obj
        assert compat.gather_object(obj) is obj
        with compat.patch():
            assert operations.gather_object("text") == "text"
    finally:
        PartialState._reset_state()


def metrics_epoch(tmp: str) -> dict[str, Any]:
    """gather_for_metrics over an uneven DataLoader (10 samples, 3 ranks, batches of 2:
    accelerate repeats 2 samples at the end and trims them), unpatched and patched;
    patched, gatherstore's default store is a file:// store in ``tmp``."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True)
    numbers = accelerator.prepare(DataLoader(list(range(10)), batch_size=2))
    words = accelerator.prepare(
        DataLoader([f"w{i}" for i in range(10)], batch_size=2, collate_fn=list)
    )
    out: dict[str, Any] = {}
    for patched in (False, True):
        if patched:
            gs.set_default_store("file://" + tmp)
        with compat.patch() if patched else contextlib.nullcontext():
            out[patched] = {
                "forced": [x for b in numbers for x in accelerator.gather_for_metrics(b, True)],
                "objects": [x for b in words for x in accelerator.gather_for_metrics(b)],
                "tensors": [x for b in numbers for x in accelerator.gather_for_metrics(b)],
            }
    gs.barrier()
    out["job folders"] = sorted({p.name.split("-")[0] for p in Path(tmp).iterdir()})
    return out


@pytest.mark.timeout(180)
def test_gather_for_metrics_patched_equals_unpatched(tmp_path: Path) -> None:
    results = gs.launch(metrics_epoch, nproc_per_node=3, backend="gloo", args=(str(tmp_path),))
    for out in results:
        plain, patched = out[False], out[True]
        assert same(plain, patched) == []
        assert [int(x) for x in patched["forced"]] == list(range(10))
        assert patched["objects"] == [f"w{i}" for i in range(10)]
        assert all(type(x) is torch.Tensor for x in patched["forced"])
        assert out["job folders"] == ["gatherstore"]  # the objects went through the file store


def one_rank_cannot_pickle() -> dict[str, Any]:
    from accelerate import PartialState

    PartialState(cpu=True)
    rank = gs.get_rank()
    with compat.patch():
        out = failure(
            lambda: operations.gather_object([Unpicklable() if rank == 1 else rank]),
            "Unpicklable holds a lock",
        )
        out["after"] = operations.gather_object([rank])  # the job goes on
    return out


@pytest.mark.timeout(180)
def test_a_rank_that_cannot_pickle_makes_every_rank_raise() -> None:
    # accelerate's own all_gather_object raises on rank 1 and leaves ranks 0 and 2 waiting
    # in the collective until the process group's timeout or until rank 1 exits; patched,
    # every rank raises at once
    results = gs.launch(one_rank_cannot_pickle, nproc_per_node=3, backend="gloo", timeout=60)
    assert [r["raised"] for r in results] == ["RemoteRankError", "TypeError", "RemoteRankError"]
    assert [r["names"] for r in results] == [1, None, 1]
    for out in results:
        assert out["says why"]
        assert out["after"] == [0, 1, 2]


def uneven_steps() -> dict[str, Any]:
    """``even_batches=False`` and a gather every step: rank 2 has one batch fewer, so it
    reaches ``wait_for_everyone`` while ranks 0 and 1 gather their last batch."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    config = DataLoaderConfiguration(even_batches=False)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(9)), batch_size=2))
    with compat.patch():
        try:
            for batch in loader:
                accelerator.gather_for_metrics([int(x) for x in batch], use_gather_object=True)
            accelerator.wait_for_everyone()
        except gs.GatherError as exc:
            return {"raised": type(exc).__name__, "details": getattr(exc, "details", None)}
        accelerator.wait_for_everyone()  # the patched barrier, in step
    return {"raised": None}


@pytest.mark.timeout(120)
def test_ranks_that_gather_a_different_number_of_times_all_raise_naming_each_other() -> None:
    # unpatched: ranks 0 and 1 wait in all_gather_object, rank 2 in the barrier, until
    # gloo's timeout; patched: all three meet on the control plane and raise at once
    results = gs.launch(uneven_steps, nproc_per_node=3, backend="gloo", timeout=60)
    calls = {0: "all_gather_object", 1: "all_gather_object", 2: "barrier"}
    assert results == [{"raised": "MismatchError", "details": calls}] * 3


def test_patch_swaps_every_site_and_undoes(monkeypatch: pytest.MonkeyPatch) -> None:
    import accelerate.accelerator as accelerator
    import accelerate.utils as utils

    original = operations.gather_object
    # a stand-in for TRL's trainers: `from accelerate.utils import gather_object`
    trainer = types.ModuleType("trl.trainer.stand_in")
    trainer.gather_object = original  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, trainer.__name__, trainer)
    sites = (operations, utils, accelerator, trainer)
    from accelerate.state import PartialState

    barrier = PartialState.wait_for_everyone
    with compat.patch() as handle:
        assert compat.patch() is handle  # twice is harmless
        for module in sites:
            assert module.gather_object is compat.gather_object
        assert operations.gather is not compat.gather_object  # tensors stay accelerate's
        assert PartialState.wait_for_everyone is compat._wait_for_everyone
    for module in sites:
        assert module.gather_object is original
    assert PartialState.wait_for_everyone is barrier
    handle.undo()  # again: nothing
    assert not handle.active


def test_patch_without_accelerate_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate.accelerator", None)
    with pytest.raises(ImportError, match="pip install accelerate"):
        compat.patch()
