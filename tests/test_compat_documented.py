"""gatherstore.compat.detectron2, .vis4d and .virtex against what their originals' documentation
states (the libraries are not installable here): signatures, serial answers, 3-rank answers."""

from __future__ import annotations

import inspect
import os
import pickle
import socket
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gatherstore as gs
from gatherstore.compat import detectron2, virtex, vis4d

# name -> (parameter names with defaults, as the documentation gives them)
DOCUMENTED: dict[Any, dict[str, list[tuple[str, Any]]]] = {
    detectron2: {
        "get_world_size": [],
        "get_rank": [],
        "get_local_rank": [],
        "get_local_size": [],
        "is_main_process": [],
        "synchronize": [],
        "all_gather": [("data", None), ("group", None)],
        "gather": [("data", None), ("dst", 0), ("group", None)],
        "shared_random_seed": [],
        "reduce_dict": [("input_dict", None), ("average", True)],
    },
    vis4d: {
        "all_gather_object_cpu": [
            ("data", None),
            ("tmpdir", None),
            ("rank_zero_return_only", True),
            ("use_system_tmp", False),
        ],
        "all_gather_object_gpu": [("data", None), ("rank_zero_return_only", True)],
        "all_reduce_dict": [("py_dict", None), ("reduce_op", "sum"), ("to_float", True)],
        "broadcast": [("obj", None), ("src", 0)],
        "create_tmpdir": [("rank", None), ("tmpdir", None), ("use_system_tmp", True)],
        "distributed_available": [],
        "get_local_rank": [],
        "get_rank": [],
        "get_world_size": [],
        "is_module_wrapper": [("module", None)],
        "obj2tensor": [("pyobj", None), ("device", torch.device("cuda"))],
        "pad_to_largest_tensor": [("tensor", None)],
        "rank_zero_only": [("func", None)],
        "reduce_mean": [("tensor", None)],
        "serialize_to_tensor": [("data", None)],
        "synchronize": [],
        "tensor2obj": [("tensor", None)],
    },
    virtex: {
        "launch": [
            ("job_fn", None),
            ("num_machines", 1),
            ("num_gpus_per_machine", 1),
            ("machine_rank", 0),
            ("dist_url", "tcp://127.0.0.1:23456"),
            ("args", ()),
        ],
        "synchronize": [],
        "get_world_size": [],
        "get_rank": [],
        "is_master_process": [],
        "average_across_processes": [("t", None)],
        "gpu_mem_usage": [],
    },
}


@pytest.mark.parametrize("module", list(DOCUMENTED), ids=lambda m: m.__name__.split(".")[-1])
def test_documented_signatures(module: Any) -> None:
    for name, documented in DOCUMENTED[module].items():
        assert name in module.__all__
        params = list(inspect.signature(getattr(module, name)).parameters.values())
        got = [(p.name, None if p.default is p.empty else p.default) for p in params]
        assert got == documented, name
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params), name
    assert detectron2._LOCAL_PROCESS_GROUP is None


def test_serial_answers(tmp_path: Path) -> None:
    for module in (detectron2, vis4d, virtex):
        assert module.get_world_size() == 1 and module.get_rank() == 0
        assert module.synchronize() is None
    assert detectron2.get_local_rank() == 0 and detectron2.get_local_size() == 1
    assert detectron2.is_main_process() and virtex.is_master_process()
    assert detectron2.all_gather({"a": 1}) == [{"a": 1}]
    assert detectron2.gather([1], dst=0) == [[1]]
    np.random.seed(3)
    expected = np.random.randint(2**31)
    np.random.seed(3)
    assert detectron2.shared_random_seed() == expected  # numpy's seed still decides
    d = {"b": torch.tensor(1.0), "a": torch.tensor(2.0)}
    assert detectron2.reduce_dict(d) is d
    assert not vis4d.distributed_available() and vis4d.get_local_rank() == 0
    assert vis4d.all_gather_object_cpu([1, 2]) == [[1, 2]]
    assert vis4d.all_gather_object_gpu("x", rank_zero_return_only=False) == ["x"]
    assert vis4d.broadcast({"k": 1}) == {"k": 1}
    assert vis4d.all_reduce_dict(d) is d
    assert vis4d.reduce_mean(d["a"]) is d["a"]
    tensor = vis4d.obj2tensor({"x": [1, 2]})  # default cuda: CPU where CUDA is absent
    assert tensor.dtype == torch.uint8 and vis4d.tensor2obj(tensor) == {"x": [1, 2]}
    assert vis4d.tensor2obj(vis4d.serialize_to_tensor("s")) == "s"
    sizes, padded = vis4d.pad_to_largest_tensor(torch.ones(3, dtype=torch.uint8))
    assert sizes == [3] and padded.shape == (3,)
    assert vis4d.rank_zero_only(lambda: 4)() == 4
    assert not vis4d.is_module_wrapper(torch.nn.Linear(1, 1))
    assert vis4d.is_module_wrapper(torch.nn.DataParallel(torch.nn.Linear(1, 1)))
    made = vis4d.create_tmpdir(0)
    assert os.path.isdir(made)
    os.rmdir(made)
    assert vis4d.create_tmpdir(0, str(tmp_path / "given")) == str(tmp_path / "given")
    t = torch.ones(2)
    assert virtex.average_across_processes(t) is None and t.tolist() == [1.0, 1.0]
    assert isinstance(virtex.gpu_mem_usage(), int)
    ran: list[int] = []
    virtex.launch(ran.append, args=(5,))  # one process: here, without CUDA
    assert ran == [5]
    with pytest.raises(ValueError, match="dist_url"):
        virtex.launch(print, num_gpus_per_machine=2, dist_url="file:///x")


def ranks(tmp: str) -> dict[str, Any]:
    """detectron2, vis4d and virtex answers in one of 3 gloo ranks."""
    rank, base = gs.get_rank(), Path(tmp)
    out: dict[str, Any] = {"rank": rank}
    out["d2 topology"] = [detectron2.get_local_rank(), detectron2.get_local_size()]
    out["d2 all_gather"] = detectron2.all_gather({"r": rank, "p": "x" * rank})
    out["d2 gather"] = detectron2.gather(rank * 10, dst=1)
    np.random.seed(rank)
    out["d2 seed"] = detectron2.shared_random_seed()
    values = {"loss_b": torch.tensor(float(rank)), "loss_a": torch.tensor(2.0 * rank)}
    out["d2 reduce_dict"] = detectron2.reduce_dict(values)
    out["d2 reduce_dict sum"] = detectron2.reduce_dict(values, average=False)
    out["v4 cpu"] = vis4d.all_gather_object_cpu([rank], str(base / "user"))
    out["v4 cpu all"] = vis4d.all_gather_object_cpu(rank, rank_zero_return_only=False)
    out["v4 system tmp"] = vis4d.all_gather_object_cpu(rank, use_system_tmp=True)
    out["v4 gpu"] = vis4d.all_gather_object_gpu({"r": rank})
    out["v4 broadcast"] = vis4d.broadcast(f"from {rank}", src=2)
    keys = ["z", "a"] if rank == 0 else ["a", "z"]
    py_dict = {k: torch.full((2,), float(rank + 1)) for k in keys}
    out["v4 all_reduce_dict"] = vis4d.all_reduce_dict(py_dict)
    ints = {"n": torch.tensor([rank, 1])}
    out["v4 all_reduce_dict mean"] = vis4d.all_reduce_dict(ints, "mean")
    out["v4 keep ints"] = vis4d.all_reduce_dict(ints, to_float=False)
    out["v4 reduce_mean"] = vis4d.reduce_mean(torch.tensor([float(rank)]))
    sizes, padded = vis4d.pad_to_largest_tensor(vis4d.obj2tensor("y" * rank))
    out["v4 pad"] = [sizes, padded.numel(), vis4d.tensor2obj(padded[: sizes[rank]])]
    out["v4 serialize"] = pickle.loads(vis4d.serialize_to_tensor(rank).numpy().tobytes())
    shared = vis4d.create_tmpdir(rank)
    out["v4 tmpdir"] = shared
    gs.barrier()
    if rank == 0:
        os.rmdir(shared)
    out["vx master"] = virtex.is_master_process()
    t = torch.tensor([float(rank), 3.0])
    d = {"x": torch.tensor(float(rank))}
    virtex.average_across_processes(t)
    virtex.average_across_processes(d)
    out["vx average"] = [t, d]
    try:
        virtex.average_across_processes(torch.tensor([rank]))
    except RuntimeError:
        out["vx int raises"] = True
    gs.barrier()
    out["user folder kept"] = (base / "user").is_dir()
    return out


@pytest.mark.timeout(180)
def test_three_gloo_ranks(tmp_path: Path) -> None:
    results = gs.launch(ranks, nproc_per_node=3, backend="gloo", args=(str(tmp_path),))
    seeds = {r["d2 seed"] for r in results}
    tmpdirs = {r["v4 tmpdir"] for r in results}
    assert len(seeds) == 1 and len(tmpdirs) == 1
    for r in results:
        rank = r["rank"]
        assert r["d2 topology"] == [rank, 3]
        assert r["d2 all_gather"] == [{"r": i, "p": "x" * i} for i in range(3)]
        assert r["d2 gather"] == ([0, 10, 20] if rank == 1 else [])
        reduced = r["d2 reduce_dict"]
        assert list(reduced) == ["loss_a", "loss_b"]  # sorted, as detectron2 returns them
        if rank == 0:
            assert reduced["loss_a"].item() == 2.0 and reduced["loss_b"].item() == 1.0
            assert r["d2 reduce_dict sum"]["loss_b"].item() == 3.0
        assert r["v4 cpu"] == ([[0], [1], [2]] if rank == 0 else None)
        assert r["v4 cpu all"] == [0, 1, 2]
        assert r["v4 system tmp"] == ([0, 1, 2] if rank == 0 else None)
        assert r["v4 gpu"] == ([{"r": 0}, {"r": 1}, {"r": 2}] if rank == 0 else None)
        assert r["v4 broadcast"] == "from 2"
        summed = r["v4 all_reduce_dict"]
        assert type(summed) is dict and list(summed) == ["z", "a"]  # rank 0's key order
        assert summed["a"].tolist() == [6.0, 6.0] and summed["a"].dtype == torch.float32
        mean = r["v4 all_reduce_dict mean"]["n"]
        assert mean.dtype == torch.float32 and mean.tolist() == [1.0, 1.0]
        kept = r["v4 keep ints"]["n"]
        assert kept.dtype == torch.int64 and kept.tolist() == [3, 3]
        assert r["v4 reduce_mean"].tolist() == [1.0]
        assert r["v4 pad"][0] == [len(vis4d.obj2tensor("y" * i)) for i in range(3)]
        assert r["v4 pad"][1] == max(r["v4 pad"][0]) and r["v4 pad"][2] == "y" * rank
        assert r["v4 serialize"] == rank
        assert r["vx master"] == (rank == 0)
        t, d = r["vx average"]
        assert t.tolist() == [1.0, 3.0] and d["x"].item() == 1.0
        assert r["vx int raises"]
        assert r["user folder kept"]


def launched(path: str) -> None:
    Path(path, f"{virtex.get_rank()}-{virtex.get_world_size()}").touch()


@pytest.mark.timeout(180)
def test_virtex_launch_runs_without_cuda(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    virtex.launch(launched, num_gpus_per_machine=2, dist_url=url, args=(str(tmp_path),))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0-2", "1-2"]


@pytest.mark.parametrize("module", [detectron2, vis4d, virtex])
def test_patch_without_the_library_says_how_to_install(module: Any) -> None:
    with pytest.raises(ImportError, match="pip install"):
        module.patch()


def test_ordered_dict_input_comes_back_as_given_serially() -> None:
    od = OrderedDict(a=torch.ones(1))
    assert vis4d.all_reduce_dict(od) is od
