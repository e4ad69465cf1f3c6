"""gatherstore.compat.mmengine side by side with the real mmengine.dist: serially, in 3 gloo
ranks, and under an unchanged mmengine Evaluator (patched and unpatched); its object functions
on other process groups, through gatherstore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from compat_groups import TAIL, pair_of, subgroups, torch_objects_refused
from compat_same import (
    differences,
    kept_steps,
    outcome,
    recorder,
    reused_buffer,
    signature_differences,
    steps_of,
)

import gatherstore as gs
from gatherstore.compat import mmengine as compat

mmdist = pytest.importorskip("mmengine.dist")

OPS = ["sum", "mean", "max", "min", "product"]


def script(d: Any, tmp: Path, tag: str) -> list[tuple[str, Any]]:
    """The same calls on ``d`` (mmengine.dist or the compat module), with their outcomes."""
    rank, world = d.get_rank(), d.get_world_size()
    out, record = recorder()

    for name in ("get_world_size", "get_rank", "get_dist_info", "is_main_process"):
        record(name, getattr(d, name))
    for name in ("is_distributed", "get_backend", "get_comm_device", "infer_launcher"):
        record(name, getattr(d, name))
    record("master_only", lambda: d.master_only(lambda x: x * 2)(21))
    record("barrier", d.barrier)
    obj = {"rank": rank, "items": list(range(rank * 3)), "z": None, "a": (rank, "x" * rank)}
    record("all_gather_object", lambda: d.all_gather_object(obj))
    record("all_gather_object str", lambda: d.all_gather_object("s" * rank))
    record("gather_object dst=0", lambda: d.gather_object(obj))
    record("gather_object dst=last", lambda: d.gather_object([rank], dst=world - 1))
    for src in {0, world - 1}:
        lst = [rank, {"k": rank}, None] if rank == src else [None, None, None]
        record(
            f"broadcast_object_list {src}",
            lambda lst=lst, src=src: (d.broadcast_object_list(lst, src), lst),
        )
    record("broadcast_object_list tuple", lambda: d.broadcast_object_list((1, 2)))
    part = [{"i": rank + world * k, "v": float(k)} for k in range(4 - rank % 2)]
    part.insert(1, None)
    for device in ("cpu", "gpu"):
        record(
            f"collect_results {device}", lambda device=device: d.collect_results(part, 7, device)
        )
    record("collect_results cpu size>", lambda: d.collect_results_cpu(part, 100))
    record("collect_results_gpu", lambda: d.collect_results_gpu(part, 5))
    record("all_gather_object reused buffer", lambda: reused_buffer(d.all_gather_object, rank))
    record("gather_object reused buffer", lambda: reused_buffer(d.gather_object, rank))
    for device in ("cpu", "gpu"):
        record(
            f"collect_results {device} reused buffer",
            lambda device=device: reused_buffer(
                lambda o: d.collect_results([o], world, device), rank
            ),
        )
    record("collect_results bad device", lambda: d.collect_results(part, 5, "tpu"))
    record("collect_results gpu+tmpdir", lambda: d.collect_results(part, 5, "gpu", str(tmp)))
    # a user folder: mmengine removes it afterwards, gatherstore leaves it (checked separately)
    user = tmp / f"user-{tag}"
    record("collect_results tmpdir", lambda: d.collect_results(part, 6, "cpu", str(user)))
    for op in [*OPS, "MAX", "band", "bor", "bxor"]:
        ints = op in ("band", "bor", "bxor")
        t = torch.arange(6).reshape(2, 3) + rank if ints else torch.arange(6.0).reshape(2, 3) * rank
        record(f"all_reduce {op}", lambda t=t, op=op: (d.all_reduce(t, op), t))
    t = torch.tensor([rank + 1, 2])
    record("all_reduce mean int", lambda: (d.all_reduce(t, "mean"), t))
    record("all_reduce bad op", lambda: d.all_reduce(torch.ones(1), "median"))
    record("all_gather", lambda: d.all_gather(torch.full((2, 2), float(rank))))
    record("all_gather 0-d", lambda: d.all_gather(torch.tensor(rank)))
    record("gather", lambda: d.gather(torch.tensor([rank, rank]), dst=world - 1))
    b = torch.full((3,), rank, dtype=torch.int16)
    record("broadcast", lambda: (d.broadcast(b, src=world - 1), b))
    np.random.seed(rank)
    record("sync_random_seed", d.sync_random_seed)
    data = {"b": torch.ones(2) * rank, "a": torch.tensor(float(rank)), "c": torch.ones(2, 2)}
    record("all_reduce_dict", lambda: (d.all_reduce_dict(data, "mean"), data))
    record("all_reduce_dict not dict", lambda: d.all_reduce_dict([1]))
    for coalesce, bucket in ((True, -1), (False, -1), (True, 1)):
        params = [torch.nn.Parameter(torch.ones(3) * rank), torch.nn.Parameter(torch.ones(2, 2))]
        record(
            f"all_reduce_params {coalesce} {bucket}",
            lambda p=params, c=coalesce, s=bucket: (
                d.all_reduce_params(p, c, s),
                [x.data for x in p],
            ),
        )
    nested = {"x": torch.ones(1), "y": [torch.zeros(2), torch.zeros(1)]}
    cpu = torch.device("cpu")
    record("get_data_device", lambda: d.get_data_device(nested))
    record("get_data_device empty", lambda: d.get_data_device([]))
    record("get_data_device empty dict", lambda: d.get_data_device({"a": []}))
    record("get_data_device bad", lambda: d.get_data_device(3))
    meta = torch.ones(1, device="meta")
    record("get_data_device mixed", lambda: d.get_data_device([torch.ones(1), meta]))
    record("get_data_device mixed dict", lambda: d.get_data_device({"m": meta, "c": torch.ones(1)}))
    record("cast_data_device", lambda: d.cast_data_device(nested, torch.device("cpu")))
    dst = {"x": torch.zeros(1), "y": [torch.ones(2), torch.ones(1)]}
    record(
        "cast_data_device out", lambda: (d.cast_data_device(nested, torch.device("cpu"), dst), dst)
    )
    record("cast_data_device bad out", lambda: d.cast_data_device(nested, torch.device("cpu"), []))
    record("cast_data_device short out", lambda: d.cast_data_device(nested, cpu, {"x": dst["x"]}))
    record("cast_data_device set out", lambda: d.cast_data_device({1}, cpu, {2}))
    record("cast_data_device empty", lambda: d.cast_data_device([], cpu))
    record("cast_data_device bad", lambda: d.cast_data_device("s", cpu))
    record("init_dist bad launcher", lambda: d.init_dist("ssh"))
    return out


# mmengine's messages kept word for word (they say what to pass instead), except where
# mmengine names data's type twice: out's own type is named here
SAME_WORDS = {"get_data_device", "cast_data_device"}
OWN_WORDS = "cast_data_device bad out"


def compare(tmp: Path) -> list[str]:
    """Run the script on both modules; every difference, plus this rank's local answers."""
    problems = differences(
        script(mmdist, tmp, "mm"),
        script(compat, tmp, "gs"),
        lambda label: label.split()[0] in SAME_WORDS and label != OWN_WORDS,
    )
    if not (tmp / "user-gs").is_dir():
        problems.append("collect_results removed the user's tmpdir")
    return problems


def test_serial_matches_mmengine(tmp_path: Path) -> None:
    assert compare(tmp_path) == []
    assert compat.get_local_rank() == mmdist.get_local_rank() == 0
    assert compat.get_local_size() == mmdist.get_local_size() == 1
    assert compat.get_local_group() is mmdist.get_local_group() is None
    assert compat.get_default_group() is None  # mmengine raises without a process group


def test_signatures_match_mmengine() -> None:
    problems = []
    for name in mmdist.__all__:
        assert name in compat.__all__, name
        problems += signature_differences(getattr(mmdist, name), getattr(compat, name), name)
    assert problems == []


def ranks_compare(tmp: str) -> dict[str, Any]:
    """In each of 3 ranks: the side-by-side script, then local topology answers."""
    from mmengine.dist import utils as mm_utils

    problems = compare(Path(tmp))
    gs.barrier()
    if (Path(tmp) / "user-mm").exists():
        problems.append("mmengine kept its tmpdir (expected it removed)")
    local = {
        "before": (compat.get_local_rank(), compat.get_local_size()),
        "mm_raises": outcome(mmdist.get_local_rank)[0] == "raised",
    }
    compat.init_local_group(0, 3)
    mm_utils.init_local_group(0, 3)
    local["after"] = (compat.get_local_rank(), compat.get_local_size())
    local["mm_after"] = (mmdist.get_local_rank(), mmdist.get_local_size())
    local["default_group"] = compat.get_default_group() is mmdist.get_default_group()
    return {"problems": problems, "local": local}


@pytest.mark.timeout(180)
def test_three_gloo_ranks_match_mmengine(tmp_path: Path) -> None:
    results = gs.launch(ranks_compare, nproc_per_node=3, backend="gloo", args=(str(tmp_path),))
    for rank, result in enumerate(results):
        assert result["problems"] == [], rank
        local = result["local"]
        assert local["before"] == (rank, 3) and local["mm_raises"]
        assert local["after"] == local["mm_after"] == (rank, 3)
        assert local["default_group"]


# --- any process group: through gatherstore, never torch's object collectives ------------


def on_subgroups() -> dict[str, Any]:
    """In 4 ranks, torch's object collectives refused: the object functions on two pairs
    (ranks 0-1 and 2-3) and on the group of ranks 1-3."""
    rank = compat.get_rank()
    pair, tail = subgroups()
    first, last = pair_of(rank)
    pair_list = [rank, {"k": rank}] if rank == last else [None, None]
    tail_list = ["from 2"] if rank == 2 else [rank]
    with torch_objects_refused() as called:
        compat.broadcast_object_list(pair_list, last, pair)
        compat.broadcast_object_list(tail_list, 2, tail)
        everyone = reused_buffer(lambda o: compat.all_gather_object(o, pair), rank)
        on_first = reused_buffer(lambda o: compat.gather_object(o, first, pair), rank)
        out = {
            "dist info": (compat.get_dist_info(pair), compat.get_dist_info(tail)),
            "all_gather_object": compat.all_gather_object({"rank": rank}, pair),
            "gather_object": compat.gather_object(rank, first, pair),
            "all_gather_object tail": compat.all_gather_object(rank, tail),
            "gather_object tail": compat.gather_object(rank * 10, 3, tail),
            "broadcast_object_list": pair_list,
            "broadcast_object_list tail": tail_list,
            "barrier": compat.barrier(pair),
            "reused buffer": (kept_steps(everyone), kept_steps(on_first)),
        }
    return {**out, "called": called}


@pytest.mark.timeout(180)
def test_object_functions_on_any_group_go_through_gatherstore_in_four_ranks() -> None:
    results = gs.launch(on_subgroups, nproc_per_node=4, backend="gloo", timeout=60)
    for rank, out in enumerate(results):
        pair = pair_of(rank)
        first, last = pair
        steps = steps_of(pair)
        # dst and src are global ranks; a rank outside a group gets what mmengine returns
        # there ([], None, its own list) and -1 as its rank and size
        assert out == {
            "dist info": ((rank % 2, 2), (rank - 1, 3) if rank in TAIL else (-1, -1)),
            "all_gather_object": [{"rank": r} for r in pair],
            "gather_object": pair if rank == first else None,
            "all_gather_object tail": TAIL if rank in TAIL else [],
            "gather_object tail": [10, 20, 30] if rank == 3 else None,
            "broadcast_object_list": [last, {"k": last}],
            "broadcast_object_list tail": ["from 2"] if rank in TAIL else [0],
            "barrier": None,
            "reused buffer": (steps, steps if rank == first else [None] * 3),
            "called": [],
        }, rank


# --- end to end: an unchanged mmengine Evaluator ------------------------------------------


def evaluate(tmp: str, patched: bool) -> dict[str, Any]:
    """3 ranks evaluate a 10-sample dataset split by a DistributedSampler."""
    from mmengine.evaluator import BaseMetric, Evaluator

    class Order(BaseMetric):
        def process(self, data_batch: Any, data_samples: Any) -> None:
            self.results += [
                {"index": s["index"], "hit": s["index"] % 3 != 0} for s in data_samples
            ]

        def compute_metrics(self, results: list[Any]) -> dict[str, Any]:
            return {
                "acc": sum(r["hit"] for r in results) / len(results),
                "order": [r["index"] for r in results],
            }

    rank, world, size = gs.get_rank(), gs.get_world_size(), 10
    user = Path(tmp) / ("patched" if patched else "plain")
    handle = compat.patch() if patched else None
    try:
        evaluator = Evaluator(Order(collect_dir=str(user), prefix="order"))
        indices = [*range(size), 0, 1]  # the sampler pads to a multiple of the world
        mine = indices[rank::world]
        for start in range(0, len(mine), 2):
            evaluator.process([{"index": i} for i in mine[start : start + 2]])
        metrics = evaluator.evaluate(size)
        gs.barrier()
        inside = sorted(p.name for p in user.iterdir()) if user.is_dir() else None
        job_dirs = [n for n in inside or [] if n.startswith("gatherstore-")]
        left = [p.name for n in job_dirs for p in (user / n).rglob("*")]
        return {"metrics": metrics, "user_dir": inside, "job_dirs": job_dirs, "left": left}
    finally:
        if handle is not None:
            handle.undo()


@pytest.mark.timeout(180)
def test_evaluator_patched_equals_unpatched_and_uses_the_store(tmp_path: Path) -> None:
    plain = gs.launch(evaluate, nproc_per_node=3, backend="gloo", args=(str(tmp_path), False))
    patched = gs.launch(evaluate, nproc_per_node=3, backend="gloo", args=(str(tmp_path), True))
    expected = {"order/acc": 0.6, "order/order": list(range(10))}
    for rank in range(3):
        assert plain[rank]["metrics"] == patched[rank]["metrics"] == expected
        # mmengine removes the collect_dir it was given.  Patched, the parts went through
        # gatherstore's file:// store there: it created its private job folder inside the
        # user's folder, deleted the parts once read (only the job's marker and heartbeat
        # are left until shutdown) and keeps the user's folder
        assert plain[rank]["user_dir"] is None
        assert len(patched[rank]["job_dirs"]) == 1
        assert sorted(patched[rank]["left"]) == ["heartbeat", "marker"]
    assert not any(p.name.startswith("gatherstore-") for p in (tmp_path / "patched").iterdir())


def test_patch_swaps_bindings_and_undoes() -> None:
    import mmengine.dist
    import mmengine.dist.dist as defining
    import mmengine.evaluator.metric as metric

    original = metric.collect_results
    with compat.patch() as handle:
        assert compat.patch() is handle  # twice is harmless
        assert metric.collect_results is compat.collect_results
        assert mmengine.dist.all_gather_object is compat.all_gather_object
        assert defining.broadcast_object_list is compat.broadcast_object_list
        assert mmengine.dist.all_reduce is not compat.all_reduce  # tensors stay mmengine's
    assert metric.collect_results is original
    handle.undo()  # again: nothing
    assert mmengine.dist.collect_results is original


# --- init_dist under SLURM: the node list through gatherstore's one parser -----------------


def slurm_init(env: dict[str, str], port: int) -> Any:
    """init_dist("slurm") in a one-task job with ``env``: the master it chose, or why not
    and which variables it had set by then.  The environment is restored afterwards."""
    import os

    import torch.distributed as dist

    task = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", **env}
    before = dict(os.environ)
    os.environ.update(task)
    try:
        compat.init_dist("slurm", backend="gloo", port=port)
        joined = (os.environ["MASTER_ADDR"], dist.get_world_size())
        dist.destroy_process_group()
        return joined
    except ValueError as exc:
        changed = sorted(k for k in os.environ if k not in task and os.environ[k] != before.get(k))
        return ("raised", str(exc), changed)
    finally:
        os.environ.clear()
        os.environ.update(before)


@pytest.mark.timeout(180)
def test_init_dist_under_slurm_takes_the_master_from_the_steps_node_list() -> None:
    import multiprocessing as mp
    import socket
    from concurrent.futures import ProcessPoolExecutor

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cases = {
        # every 127.x address is this machine: the group comes up on the host chosen
        "job": {"SLURM_NODELIST": "127.0.0.[1-3],cpu1"},
        "step": {"SLURM_NODELIST": "gpu[01-02]", "SLURM_STEP_NODELIST": "127.0.0.[7-8]"},
        "malformed": {"SLURM_NODELIST": "gpu[04-01]"},
    }
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        got = {
            k: pool.submit(slurm_init, env, port).result(timeout=120) for k, env in cases.items()
        }
    assert got["job"] == ("127.0.0.1", 1)
    assert got["step"] == ("127.0.0.7", 1)  # the step's first node, where rank 0 runs
    kind, message, changed = got["malformed"]
    assert kind == "raised"
    assert "gpu[04-01]" in message and "[01-04,07]" in message  # names the list and the form
    assert changed == []  # nothing set before the list was read
