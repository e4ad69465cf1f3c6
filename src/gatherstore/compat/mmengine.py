"""``mmengine.dist`` with objects gathered through gatherstore.

Same names, signatures, return values and serial answers as mmengine's;
object functions (``all_gather_object``, ``gather_object``,
``broadcast_object_list``, ``collect_results*``) go through gatherstore's
routes and stores on any process group, tensor functions through torch.distributed.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _take_tensors, _unflatten_dense_tensors

import gatherstore as gs
from gatherstore.compat._common import dir_store, gather_all, gather_to, own_copies
from gatherstore.compat._mmengine_utils import (
    barrier,
    cast_data_device,
    get_backend,
    get_comm_device,
    get_data_device,
    get_default_group,
    get_dist_info,
    get_local_group,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    infer_launcher,
    init_dist,
    init_local_group,
    is_distributed,
    is_main_process,
    master_only,
)
from gatherstore.compat._patching import Patch, patch_module

__all__ = [
    "all_gather_object",
    "all_reduce",
    "all_gather",
    "all_reduce_dict",
    "collect_results",
    "collect_results_cpu",
    "collect_results_gpu",
    "gather",
    "broadcast",
    "gather_object",
    "sync_random_seed",
    "broadcast_object_list",
    "get_dist_info",
    "init_dist",
    "init_local_group",
    "get_backend",
    "get_world_size",
    "get_rank",
    "get_local_size",
    "get_local_group",
    "get_local_rank",
    "is_main_process",
    "master_only",
    "barrier",
    "is_distributed",
    "get_default_group",
    "all_reduce_params",
    "get_data_device",
    "get_comm_device",
    "cast_data_device",
    "infer_launcher",
    "patch",
]

ProcessGroup = dist.ProcessGroup
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}


def _reduce_op(op: str) -> Any:
    try:
        return _OPS["sum" if op.lower() == "mean" else op.lower()]
    except KeyError:
        raise ValueError(
            f"reduce op should be one of {sorted(_OPS)} or 'mean', got {op!r}"
        ) from None


def _group(group: ProcessGroup | None) -> ProcessGroup | None:
    return get_default_group() if group is None else group


def all_reduce(data: Tensor, op: str = "sum", group: ProcessGroup | None = None) -> None:
    """Reduce ``data`` in place (sum, mean, product, min, max, band, bor, bxor)."""
    world = get_world_size(group)
    if world > 1:
        reduce_op = _reduce_op(op)
        on_device = data.to(get_comm_device(group))
        dist.all_reduce(on_device, reduce_op, _group(group))
        if op.lower() == "mean":
            on_device = torch.true_divide(on_device, world)
        data.copy_(on_device)


def all_gather(data: Tensor, group: ProcessGroup | None = None) -> list[Tensor]:
    """Every rank's ``data`` (same shapes), on ``data``'s device."""
    world = get_world_size(group)
    if world == 1:
        return [data]
    dev = get_comm_device(group)
    slots = [torch.empty_like(data, device=dev) for _ in range(world)]
    dist.all_gather(slots, data.to(dev), _group(group))
    return [s.to(data.device) for s in slots]


def gather(data: Tensor, dst: int = 0, group: ProcessGroup | None = None) -> list[Tensor | None]:
    """Every rank's ``data`` on ``dst``; an empty list elsewhere."""
    world = get_world_size(group)
    if world == 1:
        return [data]
    dev = get_comm_device(group)
    mine = get_rank(group) == dst
    slots = [torch.empty_like(data, device=dev) for _ in range(world)] if mine else []
    dist.gather(data.to(dev), slots, dst, _group(group))
    return [s.to(data.device) for s in slots]


def broadcast(data: Tensor, src: int = 0, group: ProcessGroup | None = None) -> None:
    """Copy ``src``'s ``data`` into every rank's ``data``, in place."""
    if get_world_size(group) > 1:
        on_device = data.to(get_comm_device(group)).contiguous()
        dist.broadcast(on_device, src, _group(group))
        if get_rank(group) != src:
            data.copy_(on_device)


def sync_random_seed(group: ProcessGroup | None = None) -> int:
    """Rank 0's ``np.random.randint(2**31)`` on every rank."""
    seed = np.random.randint(2**31)
    if get_world_size(group) == 1:
        return int(seed)
    value = torch.tensor(seed, dtype=torch.int32)
    broadcast(value, 0, group)
    return int(value.item())


def all_reduce_dict(
    data: dict[str, Tensor], op: str = "sum", group: ProcessGroup | None = None
) -> None:
    """Reduce every tensor of ``data`` in one collective; values replaced, key order kept."""
    assert isinstance(data, dict), f"data must be a dict, not {type(data).__name__}"
    if get_world_size(group) > 1:
        keys = sorted(data)
        flat = torch.cat([data[k].flatten() for k in keys])
        all_reduce(flat, op=op, group=group)
        pieces = torch.split(flat, [data[k].numel() for k in keys])
        for key, piece in zip(keys, pieces, strict=True):
            data[key] = piece.reshape(data[key].shape)


def all_reduce_params(
    params: list[Any] | Generator[Tensor, None, None],
    coalesce: bool = True,
    bucket_size_mb: int = -1,
    op: str = "sum",
    group: ProcessGroup | None = None,
) -> None:
    """Reduce parameters' data in place, in buckets by type (or of ``bucket_size_mb``)."""
    if get_world_size(group) == 1:
        return
    tensors = [p.data for p in params]
    if not coalesce:
        for tensor in tensors:
            all_reduce(tensor, op=op, group=group)
        return
    if bucket_size_mb > 0:
        buckets: Iterable[list[Tensor]] = _take_tensors(tensors, bucket_size_mb << 20)  # type: ignore[no-untyped-call]
    else:
        by_type: dict[str, list[Tensor]] = {}
        for tensor in tensors:
            by_type.setdefault(tensor.type(), []).append(tensor)
        buckets = by_type.values()
    for bucket in buckets:
        flat = _flatten_dense_tensors(bucket)  # type: ignore[no-untyped-call]
        all_reduce(flat, op=op, group=group)
        synced_all = _unflatten_dense_tensors(flat, bucket)  # type: ignore[no-untyped-call]
        for tensor, synced in zip(bucket, synced_all, strict=True):
            tensor.copy_(synced)


# --- objects: through gatherstore, on any process group --------------------------------
def all_gather_object(data: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``data`` in group-rank order, gathered through gatherstore's store
    (``[]`` on a rank outside ``group``, as mmengine returns there)."""
    if get_world_size(group) == 1:
        return [data]
    return gather_all(data, group)


def gather_object(data: Any, dst: int = 0, group: ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's ``data`` on ``dst`` (None elsewhere), through gatherstore's store.

    ``dst`` is a global rank: mmengine passes it on to torch's ``gather_object``, which
    takes it so (on a group whose ranks are not the job's first ones, mmengine's own
    fails, as it also compares ``dst`` with the rank in the group).
    """
    if get_world_size(group) == 1:
        return [data]
    return gather_to(data, dst, group)


def broadcast_object_list(data: list[Any], src: int = 0, group: ProcessGroup | None = None) -> None:
    """Replace every rank's list contents with global rank ``src``'s, through gatherstore
    (a rank outside ``group`` keeps its list, as in mmengine)."""
    assert isinstance(data, list), f"data must be a list, not {type(data).__name__}"
    if get_world_size(group) > 1:
        data[:] = gs.broadcast_object(data if gs.get_rank() == src else None, src, group=group)


def collect_results(
    results: list[Any], size: int, device: str = "cpu", tmpdir: str | None = None
) -> list[Any] | None:
    """Dataset-ordered results on rank 0 (None elsewhere); ``device`` picks the variant.

    Raises:
        NotImplementedError: ``device`` is not "cpu", "gpu" or "npu".
        AssertionError: ``tmpdir`` given with a "gpu"/"npu" device.
    """
    if device not in ("gpu", "cpu", "npu"):
        raise NotImplementedError(f"device must be 'cpu', 'gpu' or 'npu', but got {device!r}")
    if device == "cpu":
        return collect_results_cpu(results, size, tmpdir)
    assert tmpdir is None, f"tmpdir should be None when device is {device}"
    return collect_results_gpu(results, size)


def collect_results_cpu(
    result_part: list[Any], size: int, tmpdir: str | None = None
) -> list[Any] | None:
    """Dataset-ordered results on rank 0, through a store (``tmpdir``: a ``file://`` store there).

    gatherstore removes only its own job folder inside ``tmpdir``, never ``tmpdir``.
    """
    store = dir_store(tmpdir) if tmpdir is not None else None
    return _collect(result_part, size, store)


def collect_results_gpu(result_part: list[Any], size: int) -> list[Any] | None:
    """Dataset-ordered results on rank 0, through the default store (never GPU memory)."""
    return _collect(result_part, size, None)


def _collect(part: list[Any], size: int, store: str | None) -> list[Any] | None:
    if get_world_size() == 1:
        return part[:size]
    with own_copies():  # mmengine's results are unpickled on rank 0, its own too
        merged = gs.collect_results(part, None, order="interleaved", dst=0, store=store)
    if merged is None:
        return None
    return [r for r in merged if r is not None][:size]  # mmengine drops None results


def patch() -> Patch:
    """Make the installed ``mmengine.dist`` gather objects through gatherstore.

    Replaces its object functions everywhere mmengine bound them (e.g. the
    evaluator's ``collect_results``); tensor functions stay mmengine's.

    Raises:
        ImportError: mmengine is not installed.
    """
    names = (
        "all_gather_object",
        "gather_object",
        "broadcast_object_list",
        "collect_results",
        "collect_results_cpu",
        "collect_results_gpu",
    )
    return patch_module("mmengine.dist.dist", "mmengine", {n: globals()[n] for n in names})
