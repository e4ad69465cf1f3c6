"""gatherstore.compat.detectron2 side by side with a stand-in of today's detectron2.utils.comm
(tests/standins): signatures, serial and 3-rank answers, the per-machine local process group,
gathers on it and on other groups through gatherstore, and patch() reaching every call site
of detectron2's evaluation and data code."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from compat_groups import TAIL, pair_of, torch_objects_refused
from compat_same import (
    differences,
    kept_steps,
    module_signature_differences,
    outcome,
    recorder,
    reused_buffer,
    steps_of,
)
from compat_standins import CountingStore, standin_packages  # noqa: F401 (a fixture)

import gatherstore as gs
from gatherstore.compat import detectron2 as ours

pytestmark = pytest.mark.usefixtures("standin_packages")


def comm() -> Any:
    import detectron2.utils.comm as module

    return module


def script(d: Any) -> list[tuple[str, Any]]:
    """The same calls on ``d`` (the stand-in or the compat module), with their outcomes."""
    rank, world = d.get_rank(), d.get_world_size()
    out, record = recorder()
    for name in ("get_world_size", "get_rank", "is_main_process", "synchronize"):
        record(name, getattr(d, name))
    record("local group before", d.get_local_process_group)
    if world == 1:
        record("local rank and size", lambda: (d.get_local_rank(), d.get_local_size()))
    record("create 2 per machine", lambda: d.create_local_process_group(2))
    record("create 1 per machine", lambda: d.create_local_process_group(1))
    record("create again", lambda: d.create_local_process_group(1))
    if world > 1:
        record("create with another count", lambda: d.create_local_process_group(3))
    record("local rank and size after", lambda: (d.get_local_rank(), d.get_local_size()))
    record("local group size", lambda: dist.get_world_size(d.get_local_process_group()))
    obj = {"rank": rank, "items": list(range(rank)), "s": "x" * rank, "none": None}
    record("all_gather", lambda: d.all_gather(obj))
    record("all_gather local group", lambda: d.all_gather(obj, d.get_local_process_group()))
    record("gather", lambda: d.gather(obj))
    record("gather last", lambda: d.gather([rank], dst=world - 1))
    record("all_gather reused buffer", lambda: reused_buffer(d.all_gather, rank))
    record("gather reused buffer", lambda: reused_buffer(d.gather, rank))
    np.random.seed(rank + 7)
    record("shared_random_seed", d.shared_random_seed)
    values = {"loss_b": torch.tensor(float(rank)), "loss_a": torch.tensor(2.0 * rank + 1)}
    for average in (True, False):
        # ranks other than 0 keep what detectron2's reduction leaves there (see the README)
        reduced = outcome(lambda a=average: d.reduce_dict(dict(values), a))
        out.append((f"reduce_dict {average}", reduced if rank == 0 else "not compared"))
    return out


def compare() -> list[str]:
    return differences(script(comm()), script(ours))


def test_signatures_match_detectron2() -> None:
    assert module_signature_differences(comm(), ours) == []
    assert ours._LOCAL_PROCESS_GROUP is comm()._LOCAL_PROCESS_GROUP is None


def test_serial_matches_detectron2() -> None:
    assert compare() == []


def ranks_compare() -> dict[str, Any]:
    d = comm()
    before = {
        "ours": (ours.get_local_rank(), ours.get_local_size()),  # by host: 3 on this machine
        "detectron2": outcome(d.get_local_rank)[:2],
    }
    return {"problems": compare(), "before": before}


@pytest.mark.timeout(180)
def test_three_gloo_ranks_match_detectron2() -> None:
    results = gs.launch(ranks_compare, nproc_per_node=3, backend="gloo", timeout=60)
    for rank, result in enumerate(results):
        assert result["problems"] == [], rank
        assert result["before"] == {"ours": (rank, 3), "detectron2": ("raised", AssertionError)}


def local_group_across_jobs() -> list[Any]:
    """The local group a job made, then what a second job in the same process sees."""
    ours.create_local_process_group(1)
    return [ours.get_local_size(), ours.get_local_process_group().size()]


def test_a_finished_jobs_local_group_is_not_used_by_the_next() -> None:
    for _ in range(2):  # launch() runs each job in fresh processes; here both in this one
        gs.launch(local_group_across_jobs, nproc_per_node=1, backend="gloo", timeout=60)
    with pytest.raises(AssertionError, match="create_local_process_group"):
        ours.get_local_process_group()


# --- any process group: through gatherstore, never torch's object collectives ------------


def on_subgroups() -> dict[str, Any]:
    """In 4 ranks, torch's object collectives refused: the gathers on the local groups
    (2 ranks per machine: ranks 0-1 and 2-3) and on the group of ranks 1-3."""
    rank = ours.get_rank()
    ours.create_local_process_group(2)
    local, tail = ours.get_local_process_group(), dist.new_group(TAIL)
    with torch_objects_refused() as called:
        kept = reused_buffer(lambda o: ours.all_gather(o, local), rank)
        out = {
            "local rank and size": (ours.get_local_rank(), ours.get_local_size()),
            "all_gather local": ours.all_gather({"rank": rank}, local),
            "gather local": ours.gather(rank, dst=pair_of(rank)[0], group=local),
            "all_gather tail": ours.all_gather(rank, tail),
            "gather tail": ours.gather(rank * 10, dst=3, group=tail),
            "reused buffer": kept_steps(kept),
        }
    return {**out, "called": called}


@pytest.mark.timeout(180)
def test_gathers_on_any_group_go_through_gatherstore_in_four_ranks() -> None:
    results = gs.launch(on_subgroups, nproc_per_node=4, backend="gloo", timeout=60)
    for rank, out in enumerate(results):
        pair = pair_of(rank)
        # dst is a global rank, as torch's gather_object takes it; outside a group, [] as
        # detectron2 returns there
        assert out == {
            "local rank and size": (rank % 2, 2),
            "all_gather local": [{"rank": r} for r in pair],
            "gather local": pair if rank == pair[0] else [],
            "all_gather tail": TAIL if rank in TAIL else [],
            "gather tail": [10, 20, 30] if rank == 3 else [],
            "reused buffer": steps_of(pair),
            "called": [],
        }, rank


# --- patch(): every call site, through the store ------------------------------------------


def evaluate(tmp: str) -> dict[str, Any]:
    """detectron2's evaluators and sampler, unpatched and patched, with a counting store."""
    from detectron2.data.samplers.distributed_sampler import TrainingSampler
    from detectron2.evaluation.coco_evaluation import COCOEvaluator
    from detectron2.evaluation.sem_seg_evaluation import SemSegEvaluator

    gs.set_default_store(CountingStore(gs.open_store(f"file://{tmp}")))
    gs.all_gather_object(None)  # the job's area exists before anything is counted
    rank, out = gs.get_rank(), {}
    for patched in (False, True):
        with ours.patch() if patched else contextlib.nullcontext():
            writes = CountingStore.writes
            sem = SemSegEvaluator(3)
            sem.process([rank, 1], [rank, 2])
            coco = COCOEvaluator()
            coco.process([rank, rank + 3], [0.5, 0.25])
            np.random.seed(rank)
            out[patched] = [sem.evaluate(), coco.evaluate(), TrainingSampler(10).seed]
            out[f"writes {patched}"] = CountingStore.writes - writes
    return out


@pytest.mark.timeout(180)
def test_patched_evaluation_goes_through_the_store_in_three_ranks(tmp_path: Path) -> None:
    results = gs.launch(evaluate, nproc_per_node=3, backend="gloo", args=(str(tmp_path),))
    for rank, out in enumerate(results):
        assert out[False] == out[True]
        if rank == 0:
            assert out[True][:2] == [{"pixels": 6, "acc": 3 / 6}, {"image_ids": [0, 1, 2, 3, 4, 5]}]
        assert out["writes False"] == 0  # torch's object collectives: nothing in the store
        # every rank wrote its part for all_gather (the name bound in sem_seg_evaluation);
        # ranks 1 and 2 theirs for comm.gather to rank 0, rank 0 the seed it shares
        assert out["writes True"] >= 2, rank


def test_patch_swaps_every_binding_and_undoes() -> None:
    from detectron2.data.samplers import distributed_sampler
    from detectron2.evaluation import coco_evaluation, sem_seg_evaluation

    d = comm()
    originals = {n: getattr(d, n) for n in ("all_gather", "gather", "shared_random_seed")}
    with ours.patch() as handle:
        assert ours.patch() is handle  # twice is harmless
        for name in originals:
            assert getattr(d, name) is getattr(ours, name)
        assert sem_seg_evaluation.all_gather is ours.all_gather  # bound by name
        # called through the module, as coco_evaluation and the sampler call them
        assert coco_evaluation.comm.gather is ours.gather
        assert distributed_sampler.comm.shared_random_seed is ours.shared_random_seed
        assert d.reduce_dict is not ours.reduce_dict  # tensors stay detectron2's
    for name, original in originals.items():
        assert getattr(d, name) is original
    assert sem_seg_evaluation.all_gather is originals["all_gather"]
    assert not handle.active


def test_patch_reaches_modules_imported_while_patched_and_undo_restores_them() -> None:
    original = comm().all_gather
    with ours.patch():
        from detectron2.evaluation import sem_seg_evaluation  # first imported now

        assert sem_seg_evaluation.all_gather is ours.all_gather
    assert sem_seg_evaluation.all_gather is original
