"""gatherstore.compat.vis4d side by side with a stand-in of vis4d.common.distributed
(tests/standins): signatures, topology from the launcher's variables before any process
group, serial and 3-rank answers, and patch() reaching vis4d's evaluator and dataset code."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from compat_groups import torch_objects_refused
from compat_same import (
    differences,
    module_signature_differences,
    outcome,
    recorder,
    reused_buffer,
)
from compat_standins import CountingStore, standin_packages  # noqa: F401 (a fixture)
from torch import nn

import gatherstore as gs
from gatherstore.compat import vis4d as ours

CPU = torch.device("cpu")
NO_CUDA = not torch.cuda.is_available()


pytestmark = pytest.mark.usefixtures("standin_packages")


def v4() -> Any:
    import vis4d.common.distributed as module

    return module


def script(d: Any, tmp: Path, tag: str) -> list[tuple[str, Any]]:
    """The same calls on ``d`` (the stand-in or the compat module), with their outcomes."""
    rank, world = d.get_rank(), d.get_world_size()
    out, record = recorder()
    for name in ("get_world_size", "get_rank", "get_local_rank", "distributed_available"):
        record(name, getattr(d, name))
    record("synchronize", d.synchronize)
    record("rank_zero_only", lambda: d.rank_zero_only(lambda x: x + 1)(rank))
    record("broadcast", lambda: d.broadcast({"from": rank, "s": "x" * rank}, src=world - 1))
    # vis4d removes a tmpdir it was given; gatherstore keeps it (checked separately)
    user = str(tmp / f"user-{tag}")
    record("all_gather_object_cpu tmpdir", lambda: d.all_gather_object_cpu([rank], user))
    record("all_gather_object_cpu all", lambda: d.all_gather_object_cpu(rank, None, False))
    record("all_gather_object_cpu system", lambda: d.all_gather_object_cpu(rank, None, True, True))
    record("all_gather_object_cpu cwd", lambda: d.all_gather_object_cpu({"r": rank}))
    record("all_gather_object_gpu", lambda: d.all_gather_object_gpu({"r": [rank] * rank}))
    record("all_gather_object_gpu all", lambda: d.all_gather_object_gpu(rank, False))
    for label, gather in (
        ("cpu", lambda o: d.all_gather_object_cpu(o, None, False, True)),
        ("gpu", lambda o: d.all_gather_object_gpu(o, False)),
        ("gpu rank 0", d.all_gather_object_gpu),
    ):
        record(f"all_gather_object_{label} reused buffer", lambda g=gather: reused_buffer(g, rank))
    record("obj2tensor", lambda: d.obj2tensor({"x": [1, 2]}, CPU))
    record("tensor2obj", lambda: d.tensor2obj(d.obj2tensor(("s", rank), CPU)))
    record("serialize_to_tensor", lambda: d.serialize_to_tensor({"r": rank}))
    record("pad_to_largest_tensor", lambda: d.pad_to_largest_tensor(d.obj2tensor("y" * rank, CPU)))
    record("reduce_mean", lambda: d.reduce_mean(torch.tensor([float(rank), 1.0])))
    record("reduce_mean int", lambda: d.reduce_mean(torch.tensor([rank])))
    ordered = OrderedDict(z=torch.full((2,), float(rank + 1)), a=torch.tensor([rank, 1]))
    record("all_reduce_dict ordered", lambda: d.all_reduce_dict(ordered))
    record("all_reduce_dict ordered mean", lambda: d.all_reduce_dict(ordered, "mean"))
    ints = OrderedDict(n=torch.tensor([rank, 1]))
    record("all_reduce_dict ordered ints", lambda: d.all_reduce_dict(ints, to_float=False))
    if world == 1:  # a plain dict's keys travel on CUDA in vis4d (see the README)
        record("all_reduce_dict", lambda: d.all_reduce_dict({"b": torch.ones(1)}))
    linear = nn.Linear(2, 2)
    wrapped = nn.parallel.DistributedDataParallel(linear) if world > 1 else nn.DataParallel(linear)
    for module in (linear, wrapped, nn.Sequential(nn.ReLU(), nn.Sequential(wrapped))):
        record(
            f"is_module_wrapper {type(module).__name__}", lambda m=module: d.is_module_wrapper(m)
        )
    record("create_tmpdir", lambda: made_in(d, rank, None, True))
    record("create_tmpdir cwd", lambda: made_in(d, rank, None, False))
    record("create_tmpdir given", lambda: d.create_tmpdir(rank, str(tmp / "given")))
    return out


def made_in(d: Any, rank: int, *args: Any) -> str:
    """The folder ``d.create_tmpdir`` made its directory in (rank 0 removes the directory)."""
    made = d.create_tmpdir(rank, *args)
    d.synchronize()
    if rank == 0:
        os.rmdir(made)
    return os.path.dirname(made)


def compare(tmp: Path) -> list[str]:
    """Every difference, and every call of torch's object collectives by the compat module."""
    original = script(v4(), tmp, "v4")
    with torch_objects_refused() as called:
        problems = differences(original, script(ours, tmp, "gs"))
    return problems + [f"torch.distributed.{name} called" for name in called]


def test_signatures_match_vis4d() -> None:
    assert module_signature_differences(v4(), ours) == []


def test_serial_matches_vis4d(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "system"))
    (tmp_path / "system").mkdir()
    assert compare(tmp_path) == []
    # vis4d makes its folders in <system tmp>/.dist_tmp and ./vis4d-workspace/.dist_tmp
    assert (tmp_path / "system" / ".dist_tmp").is_dir()
    assert (tmp_path / "vis4d-workspace" / ".dist_tmp").is_dir()


LAUNCHERS = [
    {},
    {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "1"},  # torchrun, before the group exists
    {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"},  # srun
    {"SLURM_JOB_NAME": "bash", "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "3"},
    {"WORLD_SIZE": "", "RANK": "", "LOCAL_RANK": "2"},  # empty means unset
    {"LOCAL_RANK": "1"},  # a child Lightning started, before the group exists
    {"RANK": "0", "WORLD_SIZE": "2", "SLURM_NTASKS": "8", "SLURM_PROCID": "5"},  # torchrun in srun
]


@pytest.mark.parametrize("env", LAUNCHERS, ids=lambda e: ",".join(e) or "none")
def test_topology_comes_from_the_launcher_before_the_group(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_JOB_NAME", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name in ("SLURM_PROCID", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    answers = [
        [d.get_world_size(), d.get_rank(), d.get_local_rank(), d.rank_zero_only(lambda: 1)()]
        for d in (v4(), ours)
    ]
    assert answers[1] == answers[0]


def ranks_compare(tmp: str) -> dict[str, Any]:
    os.chdir(tmp)  # vis4d writes in ./vis4d-workspace
    base, rank = Path(tmp), gs.get_rank()
    problems = compare(base)
    gs.barrier()
    values = {"z": torch.ones(1) * rank, "a": torch.tensor([float(rank), 2.0])}
    plain = values if rank == 0 else dict(reversed(values.items()))  # rank 0's order wins
    return {
        "problems": problems,
        "user folder kept": (base / "user-gs").is_dir(),
        "vis4d removed it": not (base / "user-v4").exists(),
        "plain dict": ours.all_reduce_dict(plain),
        "vis4d plain dict": outcome(lambda: v4().all_reduce_dict(plain))[:2] if NO_CUDA else None,
    }


@pytest.mark.timeout(180)
def test_three_gloo_ranks_match_vis4d(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "system").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "system"))  # the ranks' system tmp
    args = (str(tmp_path),)
    results = gs.launch(ranks_compare, nproc_per_node=3, backend="gloo", args=args, timeout=60)
    for rank, result in enumerate(results):
        assert result["problems"] == [], rank
        assert result["user folder kept"] and result["vis4d removed it"]
        # a plain dict's key order comes from rank 0 without CUDA; vis4d needs CUDA for it
        summed = result["plain dict"]
        assert list(summed) == ["z", "a"] and summed["a"].tolist() == [3.0, 6.0]
        if NO_CUDA:
            assert result["vis4d plain dict"][0] == "raised"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "given",
        "system",
        "user-gs",
        "vis4d-workspace",
    ]
    assert (tmp_path / "system" / ".dist_tmp").is_dir()


@pytest.mark.skipif(not NO_CUDA, reason="the difference shows only without CUDA")
def test_obj2tensor_defaults_to_cpu_without_cuda() -> None:
    assert ours.obj2tensor("x").device == CPU
    assert outcome(lambda: v4().obj2tensor("x"))[0] == "raised"


# --- patch(): every call site, through the store ------------------------------------------


def evaluate(tmp: str) -> dict[Any, Any]:
    """vis4d's evaluator callback and dataset loader, unpatched and patched, counting writes."""
    from vis4d.data.datasets.util import load_on_rank_zero
    from vis4d.engine.callbacks.evaluator import EvaluatorCallback

    os.chdir(tmp)
    gs.set_default_store(CountingStore(gs.open_store(f"file://{tmp}")))
    gs.all_gather_object(None)  # the job's area exists before anything is counted
    rank, out = gs.get_rank(), {}
    for patched in (False, True):
        with ours.patch() if patched else contextlib.nullcontext():
            writes, results = CountingStore.writes, []
            for collect in ("cpu", "gpu"):
                callback = EvaluatorCallback(collect)
                callback.process({"rank": rank})
                callback.process(rank * 10)
                results.append(callback.on_test_epoch_end())
            results.append(load_on_rank_zero(lambda: {"classes": ["car", "person"]}))
            out[patched] = results
            out[f"writes {patched}"] = CountingStore.writes - writes
    return out


@pytest.mark.timeout(180)
def test_patched_evaluator_goes_through_the_store_in_three_ranks(tmp_path: Path) -> None:
    results = gs.launch(evaluate, nproc_per_node=3, backend="gloo", args=(str(tmp_path),))
    everyone = [{"rank": 0}, 0, {"rank": 1}, 10, {"rank": 2}, 20]
    for rank, out in enumerate(results):
        assert out[False] == out[True]
        gathered = everyone if rank == 0 else None
        assert out[True] == [gathered, gathered, {"classes": ["car", "person"]}]
        assert out["writes False"] == 0  # vis4d's own files and tensors: nothing in the store
        # ranks 1 and 2 wrote their parts of both gathers, rank 0 what it broadcast
        assert out["writes True"] >= (1 if rank == 0 else 2), rank


def test_patch_swaps_every_binding_and_undoes() -> None:
    from vis4d.data.datasets import util
    from vis4d.engine.callbacks import evaluator

    d = v4()
    names = ("all_gather_object_cpu", "all_gather_object_gpu", "broadcast")
    originals = {n: getattr(d, n) for n in names}
    with ours.patch() as handle:
        assert ours.patch() is handle
        for name in names:
            assert getattr(d, name) is getattr(ours, name)
        assert evaluator.all_gather_object_cpu is ours.all_gather_object_cpu  # bound by name
        assert evaluator.all_gather_object_gpu is ours.all_gather_object_gpu
        assert util.broadcast is ours.broadcast
        assert d.all_reduce_dict is not ours.all_reduce_dict  # tensors stay vis4d's
    for name, original in originals.items():
        assert getattr(d, name) is original
    assert evaluator.all_gather_object_cpu is originals["all_gather_object_cpu"]
    assert util.broadcast is originals["broadcast"]
