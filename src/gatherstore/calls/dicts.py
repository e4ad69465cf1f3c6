"""Reducing dicts of tensors and numbers in one flattened collective."""

import functools
import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gatherstore._config import Timeout
from gatherstore._errors import MismatchError
from gatherstore.calls.entry import check, group_rank, run
from gatherstore.calls.tensors import as_number, comm_device, reduce_op_of
from gatherstore.routes.context import Context

__all__ = ["all_reduce_dict", "reduce_dict"]


def _as_tensor(value: Any) -> tuple[torch.Tensor, str]:
    """A dict value as a tensor, and its kind: "int", "float" or the tensor's dtype."""
    if isinstance(value, torch.Tensor):
        return value.detach(), str(value.dtype)
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.tensor(value, dtype=torch.int64), "int"
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64), "float"
    tensor = torch.as_tensor(value)
    return tensor, str(tensor.dtype)


def _agree(values: dict[str, tuple[torch.Tensor, str]], ctx: Context) -> list[dict[str, Any]]:
    """Every rank's {key: [shape, kind]}, after checking that keys and shapes agree.

    Raises:
        MismatchError: keys or shapes differ (the same error on every rank).
    """
    mine = {k: [list(t.shape), kind] for k, (t, kind) in values.items()}
    raw = json.dumps(mine, sort_keys=True).encode()
    views = [json.loads(b) for b in ctx.send(raw)]
    what = ctx.what
    common = set.intersection(*(set(v) for v in views))
    details = {}
    for rank, view in enumerate(views):
        extra = sorted(set(view) - common)
        shaped = sorted(k for k in common if view[k][0] != views[0][k][0])
        if extra or shaped:
            details[rank] = f"keys only here: {extra}; shapes differing from rank 0: {shaped}"
    if details:
        raise MismatchError(
            f"{what}: ranks passed dicts that differ — {details}; every rank must reduce the "
            "same keys with the same shapes",
            details=details,
        )
    return views


def all_reduce_dict(
    d: Mapping[str, Any], op: str = "mean", *, group: Any = None, timeout: Timeout = None
) -> dict[str, Any]:
    """Reduce every value of ``d`` in one flattened collective, keys sorted.

    Args:
        d: this rank's values by key: tensors or numbers, the same keys and shapes on
            every rank.
        op: ``"mean"``, ``"sum"``, ``"max"``, ``"min"`` or ``"product"``, as in
            ``all_reduce``.
        group: reduce over that process group's members (None: the default group).
        timeout: as in ``all_reduce``.

    Returns:
        A new dict with sorted keys, each value reduced in its own type and shape
        (numbers as in ``all_reduce``; integer tensors as floating point under
        ``"mean"``).  A rank outside ``group`` gets ``d`` back, in a new dict.

    Raises:
        ValueError: unknown ``op`` or a bad ``timeout``.
        TypeError: ``group`` is not a process group.
        MismatchError: ranks' keys or shapes differ (names them, on every rank).
        GatherTimeout / ProcessGroupError: as in ``all_reduce``.

    Examples:
        >>> metrics = gs.all_reduce_dict({"loss": loss, "accuracy": accuracy})
    """
    return _reduce_dict(d, op, None, timeout, group)


def reduce_dict(
    d: Mapping[str, Any],
    average: bool = True,
    dst: int | None = None,
    *,
    group: Any = None,
    group_dst: int | None = None,
    timeout: Timeout = None,
) -> dict[str, Any]:
    """Reduce ``d`` onto ``dst`` (mean or sum); other ranks get ``d`` back unchanged.

    Args:
        d: this rank's values by key: tensors or numbers, the same keys and shapes on
            every rank.
        average: the mean over the ranks; False: the sum.
        dst: the global rank that gets the reduced values.
        group: reduce over that process group's members (None: the default group).
        group_dst: the rank within ``group`` that gets the reduced values.  As in
            torch, give ``dst`` or ``group_dst``, not both; neither: the group's first
            rank (rank 0 of the default group).
        timeout: as in ``all_reduce``.

    Returns:
        On ``dst``, a new dict with sorted keys, the values reduced as in
        ``all_reduce_dict``; elsewhere, and on a rank outside ``group``, ``d`` in a new
        dict.

    Raises:
        ValueError: ``dst`` and ``group_dst`` both given, a root that is not a rank of
            the group, or a bad ``timeout``.
        TypeError: ``group`` is not a process group.
        MismatchError / GatherTimeout / ProcessGroupError: as
            ``all_reduce_dict``.

    Examples:
        >>> logged = gs.reduce_dict({"loss": loss, "tokens": tokens}, average=False)
        >>> if gs.is_main_process():
        ...     print(logged)
    """
    check("reduce_dict", group=group)
    root = group_rank("reduce_dict", group, ("dst", dst), ("group_dst", group_dst))
    return _reduce_dict(d, "mean" if average else "sum", root, timeout, group)


def _reduce_dict(
    d: Mapping[str, Any], op: str, dst: int | None, timeout: Timeout, group: Any
) -> dict[str, Any]:
    """``d`` reduced onto ``dst`` (a rank of ``group``; None: onto every rank)."""
    what = "all_reduce_dict" if dst is None else "reduce_dict"
    check(what, timeout=timeout, group=group)
    reduce_op = reduce_op_of(op)
    mean = op.lower() == "mean"
    keys = sorted(d)
    values = {k: _as_tensor(d[k]) for k in keys}

    def body(ctx: Context) -> tuple[list[dict[str, Any]], torch.Tensor | None]:
        views = _agree(values, ctx)
        if not keys:
            return views, None
        dev = comm_device()
        flat = torch.cat(
            [t.reshape(-1).to(dev, _common_dtype(views, keys, mean)) for t, _ in values.values()]
        )
        if dst is None:
            start = functools.partial(dist.all_reduce, flat, op=reduce_op, group=group)
        else:
            start = functools.partial(dist.reduce, flat, op=reduce_op, group=group, group_dst=dst)
        ctx.run_op(functools.partial(start, async_op=True))
        if dst is not None and ctx.rank != dst:
            return views, None
        if mean:
            flat /= ctx.world
        return views, flat

    def serial() -> tuple[list[dict[str, Any]], torch.Tensor | None]:
        views = [{k: [list(t.shape), kind] for k, (t, kind) in values.items()}]
        if not keys:
            return views, None
        dtype = _common_dtype(views, keys, mean)
        return views, torch.cat([t.reshape(-1).to(dtype) for t, _ in values.values()])

    views, flat = run(
        what,
        body,
        serial,
        timeout=timeout,
        bounded=False,
        sweep=False,
        route="process group",
        group=group,
        apart=lambda: ([], None),
    )
    if not keys:
        return {}
    if flat is None:  # off ``dst``
        return dict(d)
    return _unpacked(d, keys, values, views, flat, mean)


def _common_dtype(views: list[dict[str, Any]], keys: list[str], mean: bool) -> torch.dtype:
    """The same dtype on every rank, whatever each rank passed: promoted over all of them."""
    dtypes = {_dtype_of(view[k][1]) for view in views for k in keys}
    dtype = functools.reduce(torch.promote_types, sorted(dtypes, key=str))
    if dtype.is_floating_point and any(not dt.is_floating_point for dt in dtypes):
        dtype = torch.promote_types(dtype, torch.float64)  # integers stay exact up to 2**53
    elif mean and not dtype.is_floating_point:
        dtype = torch.float64
    return dtype


def _unpacked(
    d: Mapping[str, Any],
    keys: list[str],
    values: dict[str, tuple[torch.Tensor, str]],
    views: list[dict[str, Any]],
    flat: torch.Tensor,
    mean: bool,
) -> dict[str, Any]:
    """Each key's reduced value from ``flat``, in its own type and shape."""
    out: dict[str, Any] = {}
    offset = 0
    for key in keys:
        tensor, kind = values[key]
        chunk = flat[offset : offset + tensor.numel()].reshape(tensor.shape)
        offset += tensor.numel()
        original = d[key]
        if isinstance(original, torch.Tensor):
            keep = torch.promote_types(original.dtype, torch.float32) if mean else original.dtype
            out[key] = chunk.to(original.device, keep)
        elif kind in ("int", "float"):
            all_int = all(view[key][1] == "int" for view in views)
            out[key] = as_number(chunk.item(), as_int=all_int and not mean)
        else:
            out[key] = chunk.item() if chunk.numel() == 1 else chunk.cpu()
    return out


def _dtype_of(kind: str) -> torch.dtype:
    if kind == "int":
        return torch.int64
    if kind == "float":
        return torch.float64
    dtype = getattr(torch, kind.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype
