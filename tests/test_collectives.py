"""Tensor collectives, barriers and rank filters: serially and in real gloo groups."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import gatherstore as gs

OPS = ["sum", "mean", "max", "min", "product"]


def launch(fn: Any, nproc: int, *args: Any, **kwargs: Any) -> list[Any]:
    return gs.launch(fn, nproc_per_node=nproc, backend="gloo", args=args, kwargs=kwargs)


def expected_reductions(world: int) -> dict[str, float]:
    """all_reduce of rank + 1 over ``world`` ranks, per op."""
    values = range(1, world + 1)
    return {
        "sum": sum(values),
        "mean": sum(values) / world,
        "max": world,
        "min": 1,
        "product": math.prod(values),
    }


# --- serial: no process group ------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_serial_all_reduce_of_numbers(op: str) -> None:
    result = gs.all_reduce(3, op=op)
    assert result == 3
    assert isinstance(result, float if op == "mean" else int)
    assert gs.all_reduce(2.5, op=op) == 2.5
    assert isinstance(gs.all_reduce(2.5, op=op), float)


@pytest.mark.parametrize("op", OPS)
def test_serial_all_reduce_of_tensors(op: str) -> None:
    tensor = torch.tensor([[1, 2], [3, 4]])
    result = gs.all_reduce(tensor, op=op)
    assert result is not tensor
    assert torch.equal(result, tensor.double() if op == "mean" else tensor)
    result += 1  # a new tensor: the input is untouched
    assert tensor.tolist() == [[1, 2], [3, 4]]
    floats = torch.tensor([0.5, 1.5], dtype=torch.float16)
    assert gs.all_reduce(floats, op=op).dtype == torch.float16


def test_serial_all_reduce_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="op='median'"):
        gs.all_reduce(1, op="median")
    with pytest.raises(TypeError, match="str"):
        gs.all_reduce("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bool"):
        gs.all_reduce(True)
    assert gs.all_reduce(2, op="SUM") == 2  # ops are case-insensitive


def test_serial_dict_reductions() -> None:
    metrics = {"loss": 0.25, "count": 3, "vector": torch.tensor([1.0, 2.0])}
    for reduced in (
        gs.all_reduce_dict(metrics),
        gs.all_reduce_dict(metrics, op="sum"),
        gs.reduce_dict(metrics),
        gs.reduce_dict(metrics, average=False, dst=0),
    ):
        assert list(reduced) == ["count", "loss", "vector"]  # keys sorted
        assert reduced["loss"] == 0.25
        assert reduced["count"] == 3
        assert torch.equal(reduced["vector"], metrics["vector"])
        assert reduced["vector"] is not metrics["vector"]
    assert type(gs.all_reduce_dict(metrics, op="sum")["count"]) is int
    assert type(gs.all_reduce_dict(metrics, op="mean")["count"]) is float
    assert gs.all_reduce_dict({"n": torch.tensor([1, 2])})["n"].dtype == torch.float32
    assert gs.all_reduce_dict({}) == {}
    with pytest.raises(ValueError, match="op="):
        gs.all_reduce_dict(metrics, op="median")


def test_serial_all_gather_tensor() -> None:
    tensor = torch.arange(6).reshape(3, 2)
    gathered = gs.all_gather_tensor(tensor)
    assert torch.equal(gathered, tensor)
    assert gathered.data_ptr() != tensor.data_ptr()
    assert gs.all_gather_tensor(7).tolist() == [7]
    assert gs.all_gather_tensor(torch.tensor(1.5)).tolist() == [1.5]


def test_serial_broadcast_tensor() -> None:
    tensor = torch.arange(4)
    assert torch.equal(gs.broadcast_tensor(tensor), tensor)
    with pytest.raises(ValueError, match="None"):
        gs.broadcast_tensor(None)


def test_serial_barrier_seed_and_rank_filters() -> None:
    assert gs.barrier() is None
    assert gs.barrier(timeout=0.5) is None
    seed = gs.shared_random_seed()
    assert isinstance(seed, int) and 0 <= seed < 2**31

    calls: list[str] = []

    @gs.rank_zero_only
    def on_zero(x: int) -> int:
        """Docstring kept."""
        calls.append("zero")
        return x * 2

    @gs.one_rank_only(rank=1)
    def on_one() -> str:
        calls.append("one")
        return "one"

    @gs.one_rank_only(rank=0, with_barrier=True)
    def on_zero_with_barrier() -> str:
        return "zero"

    assert on_zero(21) == 42
    assert on_zero.__name__ == "on_zero" and on_zero.__doc__ == "Docstring kept."
    assert on_one() is None
    assert on_zero_with_barrier() == "zero"
    assert calls == ["zero"]


# --- launched gloo groups: values ----------------------------------------------------------


def _collective_values() -> dict[str, Any]:
    """Runs in every rank: everything the parent checks."""
    rank, world = gs.get_rank(), gs.get_world_size()
    out: dict[str, Any] = {}
    out["numbers"] = {op: gs.all_reduce(rank + 1, op=op) for op in OPS}
    out["floats"] = gs.all_reduce(0.5 * (rank + 1))
    tensor = torch.tensor([rank + 1, 10 * (rank + 1)])
    out["tensors"] = {op: gs.all_reduce(tensor, op=op) for op in OPS}
    out["input_untouched"] = tensor.tolist() == [rank + 1, 10 * (rank + 1)]
    out["transposed"] = gs.all_reduce(torch.arange(6.0).reshape(2, 3).T).tolist()

    out["gathered"] = gs.all_gather_tensor(torch.full((rank + 1, 2), rank))
    out["gathered_numbers"] = gs.all_gather_tensor(rank).tolist()
    out["gathered_empty"] = gs.all_gather_tensor(torch.ones(rank % 2, 3)).shape
    out["gathered_all_empty"] = gs.all_gather_tensor(torch.ones(0, 2)).shape

    src = world - 1
    mine = torch.arange(6, dtype=torch.float16).reshape(2, 3) if rank == src else None
    out["broadcast"] = gs.broadcast_tensor(mine, src=src)

    out["seed"] = gs.shared_random_seed()
    out["rank_zero_only"] = gs.rank_zero_only(lambda: f"ran on {rank}")()
    last_only = gs.one_rank_only(rank=world - 1, with_barrier=True)(lambda: rank)
    out["one_rank_only"] = last_only()

    metrics = {"b": torch.tensor([rank, 1.0]), "a": rank + 1, "c": 0.5}
    out["dict_mean"] = gs.all_reduce_dict(metrics)
    out["dict_sum"] = gs.all_reduce_dict(metrics, op="sum")
    out["dict_max"] = gs.all_reduce_dict(metrics, op="max")
    out["reduce_dict"] = gs.reduce_dict(metrics, dst=1)
    out["reduce_dict_sum"] = gs.reduce_dict(metrics, average=False)
    out["metrics"] = metrics

    gs.barrier()
    gs.barrier(timeout=30)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_in_a_launched_group(world: int) -> None:
    results = launch(_collective_values, world)
    expected = expected_reductions(world)
    ranks = list(range(world))
    concatenated = [[r, r] for r in ranks for _ in range(r + 1)]
    for rank, out in enumerate(results):
        assert out["numbers"] == expected
        assert isinstance(out["numbers"]["sum"], int)
        assert isinstance(out["numbers"]["mean"], float)
        assert out["floats"] == pytest.approx(0.5 * expected["sum"])
        for op in OPS:
            tens = 10**world if op == "product" else 10
            assert out["tensors"][op].tolist() == [expected[op], tens * expected[op]]
            assert out["tensors"][op].dtype == (torch.float64 if op == "mean" else torch.int64)
        assert out["input_untouched"]
        assert out["transposed"] == (world * torch.arange(6.0).reshape(2, 3).T).tolist()

        assert out["gathered"].shape == (world * (world + 1) // 2, 2)
        assert out["gathered"].tolist() == concatenated  # no padding left
        assert out["gathered_numbers"] == ranks
        assert out["gathered_empty"] == (world // 2, 3)
        assert out["gathered_all_empty"] == (0, 2)

        assert out["broadcast"].dtype == torch.float16
        assert out["broadcast"].tolist() == [[0, 1, 2], [3, 4, 5]]

        assert out["rank_zero_only"] == ("ran on 0" if rank == 0 else None)
        assert out["one_rank_only"] == (world - 1 if rank == world - 1 else None)

        b_sum = [sum(ranks), float(world)]
        assert list(out["dict_sum"]) == ["a", "b", "c"]
        assert out["dict_sum"]["a"] == expected["sum"]
        assert isinstance(out["dict_sum"]["a"], int)
        assert out["dict_sum"]["c"] == pytest.approx(0.5 * world)
        assert out["dict_sum"]["b"].tolist() == b_sum
        assert out["dict_mean"]["a"] == pytest.approx(expected["mean"])
        assert out["dict_mean"]["b"].tolist() == pytest.approx([v / world for v in b_sum])
        assert out["dict_mean"]["c"] == pytest.approx(0.5)
        assert out["dict_max"]["a"] == world
        assert out["dict_max"]["b"].tolist() == [world - 1, 1.0]

        if rank == 1:
            assert out["reduce_dict"]["a"] == pytest.approx(expected["mean"])
        else:
            assert out["reduce_dict"]["a"] == rank + 1  # unchanged off dst
            assert out["reduce_dict"]["b"].tolist() == out["metrics"]["b"].tolist()
        if rank == 0:
            assert out["reduce_dict_sum"]["a"] == expected["sum"]
        else:
            assert out["reduce_dict_sum"]["a"] == rank + 1
    assert len({out["seed"] for out in results}) == 1


def _mixed_numbers() -> dict[str, Any]:
    """Ranks pass ints and floats for the same value (e.g. a counter that stayed 0)."""
    rank = gs.get_rank()
    value: int | float = 0 if rank == 0 else 0.5 * rank
    counts = {"seen": rank, "loss": 0 if rank == 0 else 1.5, "n": torch.tensor(2**25 + rank)}
    counts["acc"] = torch.tensor(0.5, dtype=torch.float32)
    return {
        "sum": gs.all_reduce(value),
        "max": gs.all_reduce(value, op="max"),
        "ints": gs.all_reduce(rank * 3),
        "dict": gs.all_reduce_dict(counts, op="sum"),
    }


@pytest.mark.timeout(120)
def test_ranks_may_mix_ints_and_floats() -> None:
    results = launch(_mixed_numbers, 3)
    for out in results:
        assert out["sum"] == pytest.approx(1.5)
        assert out["max"] == pytest.approx(1.0)
        assert out["dict"]["seen"] == 3 and isinstance(out["dict"]["seen"], int)
        assert out["dict"]["loss"] == pytest.approx(3.0)
        assert out["dict"]["n"].item() == 3 * 2**25 + 3  # exact, not rounded through float32
        assert out["dict"]["acc"].dtype == torch.float32
    assert [type(out["ints"]) for out in results] == [int] * 3
    assert [out["ints"] for out in results] == [9] * 3


# --- launched gloo groups: mismatches are errors on every rank ------------------------------


def _catch(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        fn(*args)
    except gs.GatherError as exc:
        return {"type": type(exc).__name__, "message": str(exc), **vars(exc)}
    return {"type": None}


def _mismatches() -> dict[str, Any]:
    rank = gs.get_rank()
    dtype = torch.float64 if rank else torch.float32
    out = {
        "dtype": _catch(gs.all_gather_tensor, torch.zeros(2, dtype=dtype)),
        "trailing": _catch(gs.all_gather_tensor, torch.zeros(1, 3 + (rank == 2))),
        "keys": _catch(gs.all_reduce_dict, {"loss": 1.0, f"only_on_{rank}": 1.0}),
        "shapes": _catch(gs.all_reduce_dict, {"v": torch.zeros(2 if rank == 1 else 3)}),
        "empty": _catch(gs.reduce_dict, {} if rank == 0 else {"x": 1}),
    }
    # nobody hangs and the group still works afterwards
    out["after"] = gs.all_reduce(1)
    gs.barrier()
    return out


@pytest.mark.timeout(120)
def test_mismatched_inputs_raise_on_every_rank() -> None:
    results = launch(_mismatches, 3)
    for out in results:
        assert out["after"] == 3
        for case in ("dtype", "trailing", "keys", "shapes", "empty"):
            assert out[case]["type"] == "MismatchError", (case, out[case])
        assert out["dtype"]["details"] == {
            0: "dtype torch.float32, shape [2]",
            1: "dtype torch.float64, shape [2]",
            2: "dtype torch.float64, shape [2]",
        }
        assert "first dimension" in out["dtype"]["message"]
        assert out["trailing"]["details"][2] == "dtype torch.float32, shape [1, 4]"
        assert sorted(out["keys"]["details"]) == [0, 1, 2]
        for rank in range(3):
            assert f"only_on_{rank}" in out["keys"]["details"][rank]
            assert f"only_on_{rank}" in out["keys"]["message"]
        assert list(out["shapes"]["details"]) == [1]
        assert "'v'" in out["shapes"]["details"][1]
        assert "'x'" in out["empty"]["details"][1]
    assert results[0]["keys"] == results[1]["keys"] == results[2]["keys"]


# --- launched gloo groups: barrier timeouts -------------------------------------------------


def _late_barrier(sleeper: int, timeout: float, signals: str) -> dict[str, Any]:
    gs.barrier()  # start together, so that only the sleeper can be late
    rank, others = gs.get_rank(), [r for r in range(gs.get_world_size()) if r != sleeper]
    deadline = time.monotonic() + 100
    while rank == sleeper and time.monotonic() < deadline:  # arrive once the others gave up
        if all(Path(signals, str(r)).exists() for r in others):
            break
        time.sleep(0.05)
    start = time.monotonic()
    try:
        gs.barrier(timeout=timeout)
        outcome: dict[str, Any] = {"type": None}
    except gs.GatherTimeout as exc:
        outcome = {
            "type": type(exc).__name__,
            "ranks": exc.ranks,
            "timeout": exc.timeout,
            "is_timeout_error": isinstance(exc, TimeoutError),
            "message": str(exc),
        }
    outcome["waited"] = time.monotonic() - start
    Path(signals, str(rank)).touch()
    # the timeout broke nothing: the group still works
    gs.barrier(timeout=30)
    outcome["after"] = gs.all_reduce(1)
    return outcome


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sleeper", [0, 2])
def test_barrier_timeout_names_the_late_rank(sleeper: int, tmp_path: Path) -> None:
    results = launch(_late_barrier, 3, sleeper, 4.0, str(tmp_path))
    for rank, out in enumerate(results):
        # every rank, the sleeper included, raises the same verdict
        assert out["type"] == "GatherTimeout", (rank, out)
        assert out["ranks"] == [sleeper]
        assert out["timeout"] == 4.0
        assert out["is_timeout_error"]
        assert f"rank {sleeper} did not arrive" in out["message"]
        assert out["after"] == 3
        if rank != sleeper:
            assert out["waited"] >= 3.9


def _slow_but_in_time() -> bool:
    time.sleep(0.5 * gs.get_rank())
    gs.barrier(timeout=20)
    return True


@pytest.mark.timeout(120)
def _tensor_calls_with_a_timeout(case: str) -> dict[str, Any]:
    rank = gs.get_rank()
    calls = {
        "all_reduce": lambda: gs.all_reduce(rank + 1, timeout=3),
        "all_reduce_dict": lambda: gs.all_reduce_dict({"a": rank}, timeout=3),
        "reduce_dict": lambda: gs.reduce_dict({"a": float(rank)}, timeout=3),
        "all_gather_tensor": lambda: gs.all_gather_tensor(torch.ones(rank + 1), timeout=3),
        "broadcast_tensor": lambda: gs.broadcast_tensor(torch.ones(2), timeout=3),
    }
    out: dict[str, Any] = {}
    for name, call in calls.items():
        started = time.monotonic()
        try:
            if case == "late" and rank == 2:
                time.sleep(5)  # arrives after the others gave up
            elif case == "elsewhere" and rank == 2:  # in an object gather meanwhile
                call = lambda: gs.all_gather_object(rank, timeout=3)  # noqa: E731
            call()
            out[name] = ("ok", [], time.monotonic() - started)
        except gs.GatherError as exc:
            out[name] = (type(exc).__name__, getattr(exc, "ranks", []), time.monotonic() - started)
        gs.barrier(timeout=60)
    out["after"] = gs.all_reduce(rank + 1, timeout=30)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["late", "elsewhere"])
def test_tensor_collectives_with_a_timeout_name_the_ranks_in_time(case: str) -> None:
    """A rank that is late, or in an object gather, ends every tensor collective with a
    timeout on every rank within it (not the process group's timeout), naming it."""
    results = launch(_tensor_calls_with_a_timeout, 3, case)
    for rank, out in enumerate(results):
        assert out.pop("after") == 6
        for name, (error, ranks, seconds) in out.items():
            if case == "late":
                assert error == "GatherTimeout", (rank, name, error)
                assert ranks == [2], (rank, name, ranks)
            else:  # every rank sees the other call at the same step
                assert error == "MismatchError", (rank, name, error)
            assert seconds < 3 + 5 + 20, (rank, name, seconds)


def test_barrier_with_a_generous_timeout_passes() -> None:
    assert launch(_slow_but_in_time, 3) == [True, True, True]


# --- GPUs ----------------------------------------------------------------------------------


def _nccl_checks() -> dict[str, Any]:
    rank, world = gs.get_rank(), gs.get_world_size()
    device = gs.device()
    gathered = gs.all_gather_tensor(torch.full((rank + 1,), rank, device=device))
    gs.barrier()
    gs.barrier(timeout=30)
    return {
        "backend": gs.backend(),
        "device": str(device),
        "current": torch.cuda.current_device(),
        "sum": gs.all_reduce(torch.tensor([rank + 1.0], device=device)).cpu().tolist(),
        "sum_device": str(gs.all_reduce(torch.tensor([1.0], device=device)).device),
        "number": gs.all_reduce(rank + 1),
        "gathered": gathered.cpu().tolist(),
        "gathered_device": str(gathered.device),
        "dict": gs.all_reduce_dict({"a": rank + 1}, op="sum"),
        "world": world,
    }


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs CUDA GPUs; none here")
def test_collectives_under_nccl() -> None:
    world = min(torch.cuda.device_count(), 2)
    results = gs.launch(_nccl_checks, nproc_per_node=world, backend="nccl")
    total = world * (world + 1) // 2
    for rank, out in enumerate(results):
        assert out["backend"] == "nccl"
        assert out["device"] == f"cuda:{rank}" == f"cuda:{out['current']}"
        assert out["sum"] == [float(total)]
        assert out["sum_device"] == f"cuda:{rank}"
        assert out["number"] == total
        assert out["gathered"] == [r for r in range(world) for _ in range(r + 1)]
        assert out["gathered_device"] == f"cuda:{rank}"
        assert out["dict"] == {"a": total}


def _gloo_on_a_gpu_machine() -> tuple[str, int]:
    torch.ones(1024, 1024, device="cuda")
    return str(gs.device()), gs.gpu_mem_usage()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here")
def test_gpu_mem_usage_under_gloo_with_cuda() -> None:
    device, mib = launch(_gloo_on_a_gpu_machine, 1)[0]
    assert device == "cpu"  # gloo computes on the CPU ...
    assert mib >= 4  # ... but the process's CUDA memory is still reported
