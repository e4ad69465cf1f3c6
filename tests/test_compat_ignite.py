"""gatherstore.compat.ignite side by side with the real ignite.distributed: serially and in
3 gloo ranks (values, types, dtypes, devices, errors, signatures), all_gather on other process
groups through gatherstore, plus patch()."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from compat_groups import TAIL, pair_of, subgroups, torch_objects_refused
from compat_same import (
    differences,
    kept_steps,
    recorder,
    reused_buffer,
    signature_differences,
    steps_of,
)

import gatherstore as gs
from gatherstore.compat import ignite as compat

idist = pytest.importorskip("ignite.distributed")
iutils = pytest.importorskip("ignite.distributed.utils")

EXTRA = ["auto_model", "auto_optim", "auto_dataloader", "Parallel", "DistributedProxySampler"]


def script(d: Any) -> list[tuple[str, Any]]:
    """The same calls on ``d`` (ignite.distributed or the compat module), with outcomes."""
    rank, world = d.get_rank(), d.get_world_size()
    out, record = recorder()

    for name in (
        "get_world_size",
        "get_rank",
        "get_local_rank",
        "get_nproc_per_node",
        "get_nnodes",
        "get_node_rank",
        "backend",
        "device",
        "model_name",
        "hostname",
        "available_backends",
        "barrier",
        "show_config",
        "sync",
    ):
        record(name, getattr(d, name))
    for value in (rank + 1, rank + 0.5, True):
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            record(f"all_reduce {value!r} {op}", lambda v=value, op=op: d.all_reduce(v, op))
    for dtype in (torch.float32, torch.int64, torch.float64):
        t = torch.arange(4, dtype=dtype).reshape(2, 2) + rank
        record(f"all_reduce tensor {dtype}", lambda t=t: (d.all_reduce(t), t))
    bits = torch.tensor([rank % 2, 1, 0], dtype=torch.uint8)
    record("all_reduce AND", lambda: d.all_reduce(bits.clone(), "AND"))
    record("all_reduce OR", lambda: d.all_reduce(bits.clone(), "OR"))
    record("all_reduce bad op", lambda: d.all_reduce(torch.ones(1), "MEAN"))
    record("all_reduce bad type", lambda: d.all_reduce("x"))
    record("all_gather int", lambda: d.all_gather(rank))
    record("all_gather float", lambda: d.all_gather(rank / 3))
    record("all_gather str", lambda: d.all_gather("r" * (rank + 1)))
    record("all_gather obj", lambda: d.all_gather({"rank": rank, "l": [None] * rank}))
    record("all_gather reused buffer", lambda: reused_buffer(d.all_gather, rank))
    record("all_gather tensor", lambda: d.all_gather(torch.full((2, 3), rank, dtype=torch.int16)))
    record("all_gather 0-d", lambda: d.all_gather(torch.tensor(rank * 1.5)))
    for value in (torch.tensor([rank]), rank, rank / 4, f"r{rank}", {"r": rank}):
        # rank 2 is outside the group: it gets its own value back, as ignite says
        record(f"all_gather group {value!r}", lambda v=value: d.all_gather(v, group=[0, 1]))
    shapes = [[r + 1, 2] for r in range(world)]
    mine = torch.full(tuple(shapes[rank]), float(rank))
    record("all_gather_tensors_with_shapes", lambda: d.all_gather_tensors_with_shapes(mine, shapes))
    record(
        "all_gather_tensors_with_shapes group",
        lambda: d.all_gather_tensors_with_shapes(mine, shapes, group=[0, 1]),
    )
    # a group that is neither ranks nor a ProcessGroup: ignite's ValueError before any transfer
    for value in (torch.ones(1), 1.5, "s", {"o": 1}):
        record(f"all_gather bad group {value!r}", lambda v=value: d.all_gather(v, group="abc"))
    record("all_reduce bad group", lambda: d.all_reduce(torch.ones(1), group="abc"))
    record(
        "all_gather_tensors_with_shapes bad group",
        lambda: d.all_gather_tensors_with_shapes(mine, shapes, group=(0, 1)),
    )
    src = world - 1
    for value in (torch.arange(3.0) * rank, rank + 7, "text" * rank, Path(f"/p/{rank}")):
        record(f"broadcast {value!r}", lambda v=value: d.broadcast(v, src=src))
    record("broadcast None", lambda: d.broadcast(None, src=src))
    mine_or_none = {"x": torch.ones(2, dtype=torch.int32), "s": "hello", "n": 3}
    for key, value in mine_or_none.items():
        record(
            f"broadcast safe {key}",
            lambda v=value: d.broadcast(v if rank == src else None, src=src, safe_mode=True),
        )
    record("broadcast bad type", lambda: d.broadcast([1], src=0))
    record("new_group bad", lambda: d.new_group((0, 1)))
    record("one_rank_only", lambda: d.one_rank_only(rank=src, with_barrier=True)(lambda: 5)())
    record("one_rank_first bad", lambda: d.one_rank_first(rank=world).__enter__())
    order: list[int] = []
    with d.one_rank_first(rank=0):
        order.append(rank)
    record("one_rank_first", lambda: order)
    record("initialize bad backend", lambda: d.initialize("tcp"))
    if world > 1:
        record("initialize twice", lambda: d.initialize("gloo"))
    record("spawn bad backend", lambda: d.spawn("tcp", print, ()))
    for name in ("master_addr", "master_port"):
        record(
            f"spawn file:// with {name}",
            lambda n=name: d.spawn("gloo", print, (), init_method="file:///x", **{n: 1}),
        )
    for args, kwargs in PARALLEL_BAD:
        record(f"Parallel{args}{kwargs}", lambda a=args, k=kwargs: d.Parallel(*a, **k))
    return out


# Parallel arguments ignite refuses, each with its message
PARALLEL_BAD: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    (("nccl-x",), {}),
    ((None, 2), {}),
    ((), {"master_port": 1234}),
    (("gloo",), {"init_method": "tcp://127.0.0.1:1234"}),
    (("gloo", 0), {}),
    (("gloo", 1, 0), {}),
    (("gloo", 1, 2), {}),
    (("gloo", 1, 2, 2), {}),
    (("gloo", 1, 2, 1), {"master_addr": "h"}),
]


def compare() -> list[str]:
    return differences(script(idist), script(compat), lambda label: label not in OWN_MESSAGES)


# where the process group fails, the message is gatherstore's ProcessGroupError (it says
# what to check); everywhere else ignite's words
OWN_MESSAGES = {"all_gather tensor"}


def test_serial_matches_ignite() -> None:
    assert compare() == []
    assert compat.all_gather(torch.ones(2)).shape == (2,)
    assert compat.all_gather_tensors_with_shapes(torch.ones(2, 2), [[1, 2]])[0].shape == (1, 2)


def test_signatures_and_constants_match_ignite() -> None:
    problems = []
    for name in [*iutils.__all__, *EXTRA]:
        assert name in compat.__all__, name
        original, ours = getattr(idist, name), getattr(compat, name)
        if callable(original):
            problems += signature_differences(original, ours, name)
        elif isinstance(original, bool):
            assert isinstance(ours, bool), name
    assert compat.has_native_dist_support is iutils.has_native_dist_support
    assert [m.name for m in compat.registered_computation_models][:2] == ["serial", "native-dist"]
    assert problems == []


def ranks_compare() -> list[str]:
    return compare()


def ranks_unicode() -> list[Any]:
    # ignite pads strings by characters and fails on multi-byte ones; objects have no such limit
    return [compat.all_gather("é" * gs.get_rank()), compat.broadcast("ü€", src=1)]


@pytest.mark.timeout(180)
def test_three_gloo_ranks_match_ignite() -> None:
    results = gs.launch(ranks_compare, nproc_per_node=3, backend="gloo")
    assert results == [[], [], []]
    for result in gs.launch(ranks_unicode, nproc_per_node=3, backend="gloo"):
        assert result == [["", "é", "éé"], "ü€"]


def on_subgroups() -> dict[str, Any]:
    """In 4 ranks, torch's object collectives refused: all_gather on two pairs (ranks 0-1
    and 2-3, process groups) and on ranks 1-3 (a list of ranks, made into a group)."""
    rank = gs.get_rank()
    pair = subgroups()[0]
    with torch_objects_refused() as called:
        kept = reused_buffer(lambda o: compat.all_gather(o, group=pair), rank)
        out = {
            "objects": compat.all_gather({"rank": rank}, group=pair),
            "strings": compat.all_gather("é" * rank, group=pair),
            "tensor": compat.all_gather(torch.tensor([rank, -rank]), group=pair).tolist(),
            "numbers": compat.all_gather(rank / 2, group=pair),
            "objects tail": compat.all_gather({"rank": rank}, group=TAIL),
            "strings tail": compat.all_gather(f"r{rank}", group=TAIL),
            "reused buffer": kept_steps(kept),
        }
    return {**out, "called": called}


@pytest.mark.timeout(180)
def test_all_gather_on_any_group_goes_through_gatherstore_in_four_ranks() -> None:
    for rank, out in enumerate(gs.launch(on_subgroups, nproc_per_node=4, backend="gloo")):
        pair = pair_of(rank)
        # rank 0 is outside ranks 1-3: its own value back (a string in a list), as ignite says
        assert out == {
            "objects": [{"rank": r} for r in pair],
            "strings": ["é" * r for r in pair],
            "tensor": [v for r in pair for v in (r, -r)],
            "numbers": [r / 2 for r in pair],
            "objects tail": [{"rank": r} for r in TAIL] if rank in TAIL else {"rank": 0},
            "strings tail": [f"r{r}" for r in TAIL] if rank in TAIL else ["r0"],
            "reused buffer": steps_of(pair),
            "called": [],
        }, rank


def auto_helpers() -> dict[str, Any]:
    """auto_* and one_rank_first under 3 ranks, on both modules."""
    dataset = list(range(20))
    out: dict[str, Any] = {}
    for label, d in (("ignite", idist), ("compat", compat)):
        loader = d.auto_dataloader(dataset, batch_size=6, num_workers=0, shuffle=False)
        model = d.auto_model(torch.nn.Linear(2, 1))
        out[label] = {
            "batches": [b.tolist() for b in loader],
            "sampler": type(loader.sampler).__name__,
            "batch_size": loader.batch_size,
            "model": type(model).__name__,
            "optim": type(d.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))).__name__,
        }
    return out


@pytest.mark.timeout(180)
def test_auto_helpers_match_ignite_in_three_ranks() -> None:
    for result in gs.launch(auto_helpers, nproc_per_node=3, backend="gloo"):
        assert result["compat"] == result["ignite"]


def test_serial_auto_helpers_and_parallel_match_ignite() -> None:
    for d in (idist, compat):
        assert type(d.auto_model(torch.nn.Linear(2, 1))).__name__ == "Linear"
        assert [b.tolist() for b in d.auto_dataloader([1, 2, 3], batch_size=2)] == [[1, 2], [3]]
        seen: list[Any] = []
        with d.Parallel() as parallel:
            parallel.run(lambda local_rank, x, seen=seen: seen.append((local_rank, x)), 7)
        assert seen == [(0, 7)]


def patched_metric(tmp: str) -> dict[str, Any]:
    """An unchanged ignite EpochMetric and idist.all_gather of strings, unpatched and patched;
    patched, gatherstore's default store is a file:// store in ``tmp``."""
    from ignite.metrics import EpochMetric

    rank = gs.get_rank()

    def compute(preds: torch.Tensor, targets: torch.Tensor) -> float:
        return float((preds.argmax(1) == targets).float().mean())

    results: dict[Any, Any] = {}
    for patched in (False, True):
        if patched:
            gs.set_default_store("file://" + tmp)
        with compat.patch() if patched else contextlib.nullcontext():
            metric = EpochMetric(compute, check_compute_fn=False)
            metric.update((torch.eye(3)[[rank, 0]], torch.tensor([rank, rank])))
            results[patched] = metric.compute()
            results[f"words {patched}"] = idist.all_gather(f"rank{rank}")
            results[f"objects {patched}"] = idist.all_gather({"rank": rank})
    gs.barrier()
    results["job folders"] = [p.name.split("-")[0] for p in Path(tmp).iterdir()]
    return results


@pytest.mark.timeout(180)
def test_patch_keeps_ignite_metrics_equal_in_three_ranks(tmp_path: Path) -> None:
    words = ["rank0", "rank1", "rank2"]
    for out in gs.launch(patched_metric, nproc_per_node=3, backend="gloo", args=(str(tmp_path),)):
        assert out[False] == out[True]
        assert out["words False"] == out["words True"] == words
        assert out["objects False"] == out["objects True"] == [{"rank": r} for r in range(3)]
        assert out["job folders"] == ["gatherstore"]  # the strings went through the file store


def test_patch_swaps_and_undoes() -> None:
    import ignite.distributed as package
    import ignite.metrics.epoch_metric as epoch

    original = iutils.all_gather
    with compat.patch() as handle:
        assert compat.patch() is handle
        assert iutils.all_gather is package.all_gather is compat.all_gather
        assert iutils.broadcast is compat.broadcast
        assert iutils.all_reduce is not compat.all_reduce
        assert epoch.idist.all_gather is compat.all_gather
    assert iutils.all_gather is package.all_gather is original
    assert not handle.active
