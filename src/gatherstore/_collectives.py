"""Tensor collectives, the fast path: NCCL on GPU, gloo on CPU; numbers accepted too."""

from __future__ import annotations

import contextlib
import functools
import json
import random
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import _control as control
from . import _topology as topology
from ._config import Timeout, to_seconds
from ._errors import GatherError, MismatchError, RemoteRankError

__all__ = [
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_dict",
    "barrier",
    "broadcast_tensor",
    "one_rank_only",
    "rank_zero_only",
    "reduce_dict",
    "shared_random_seed",
]

F = TypeVar("F", bound=Callable[..., Any])
Number = int | float

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
_warned: set[tuple[int, int]] = set()


@contextlib.contextmanager
def _process_group(what: str) -> Iterator[None]:
    """Report the process group's own failures as a GatherError, not a raw torch error."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, GatherError):
            raise
        cause = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise GatherError(
            f"{what}: the process group failed: {cause}; "
            "another rank died, stopped, or called a different collective (tensor collectives "
            "wait for the process group's timeout; object collectives name the rank)"
        ) from exc


def _op(op: str) -> Any:
    try:
        return _OPS[op.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"op={op!r} is not supported: use one of {sorted(_OPS)}") from None


def _comm_device() -> torch.device:
    """Where tensors must live for the default group; warns about a wrong CUDA device."""
    dev = topology.device()
    if dev.type == "cuda":
        current = torch.cuda.current_device()
        key = (current, dev.index or 0)
        if current != dev.index and key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"the current CUDA device is cuda:{current} but this rank's local rank "
                f"expects {dev}; NCCL collectives may hang or corrupt memory — call "
                "torch.cuda.set_device(gs.get_local_rank()) before the first collective "
                "(gs.launch and gs.init_from_env do this)",
                RuntimeWarning,
                stacklevel=3,
            )
    return dev


def barrier(timeout: Timeout = None) -> None:
    """Wait until every rank arrives.

    Without a timeout this is the process group's barrier (``device_ids`` passed
    under NCCL).  With a timeout, ranks meet on gatherstore's gloo control group,
    which never trips the NCCL watchdog: the pattern for "rank 0 evaluates while
    the others wait".

    Raises:
        GatherTimeout: with a timeout, naming the ranks that did not arrive.
    """
    if not topology.is_distributed():
        return
    if timeout is None:
        if _comm_device().type == "cuda":
            with _process_group("barrier"):
                dist.barrier(device_ids=[_comm_device().index or 0])
        else:
            with _process_group("barrier"):
                dist.barrier()
        return
    control.exchange(b"", timeout=to_seconds(timeout), what="barrier")


def all_reduce(x: torch.Tensor | Number, op: str = "sum") -> Any:
    """Reduce ``x`` over all ranks; every rank gets the result.

    ``op`` is "sum", "mean", "max", "min" or "product".  A tensor comes back as
    a new tensor on its own device (the input is not modified; "mean" of an
    integer tensor is floating point).  A number comes back as a number: it is
    reduced in float64 (exact for integers up to 2**53), so ranks may mix ints
    and floats; an int comes back as an int when the result is whole and
    ``op`` is not "mean".

    Raises:
        ValueError: unknown ``op``.
        TypeError: ``x`` is neither a tensor nor a number.
    """
    reduce_op = _op(op)
    mean = op.lower() == "mean"
    if isinstance(x, torch.Tensor):
        tensor = x.detach().clone(memory_format=torch.contiguous_format)
        if mean and not tensor.is_floating_point():
            tensor = tensor.double()
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        if not topology.is_distributed():
            return float(x) if mean else x
        tensor = torch.tensor(float(x), dtype=torch.float64)
    else:
        raise TypeError(f"all_reduce takes a tensor or a number, not {type(x).__name__}")
    if topology.is_distributed():
        moved = tensor.to(_comm_device())
        with _process_group("all_reduce"):
            dist.all_reduce(moved, op=reduce_op)
        tensor = moved.to(tensor.device)
        if mean:
            tensor /= topology.get_world_size()
    if isinstance(x, torch.Tensor):
        return tensor
    return _number(tensor.item(), as_int=isinstance(x, int) and not mean)


def _number(value: float, *, as_int: bool) -> int | float:
    """A reduced number back in its type: int when asked for and whole, else float."""
    return int(value) if as_int and float(value).is_integer() else float(value)


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


def _agree(values: dict[str, tuple[torch.Tensor, str]], what: str) -> list[dict[str, Any]]:
    """Every rank's {key: [shape, kind]}, after checking that keys and shapes agree.

    Raises:
        MismatchError: keys or shapes differ (the same error on every rank).
    """
    mine = {k: [list(t.shape), kind] for k, (t, kind) in values.items()}
    if not topology.is_distributed():
        return [mine]
    raw = json.dumps(mine, sort_keys=True).encode()
    views = [json.loads(b) for b in control.exchange(raw, timeout=to_seconds(None), what=what)]
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


def all_reduce_dict(d: Mapping[str, Any], op: str = "mean") -> dict[str, Any]:
    """Reduce every value of ``d`` in one flattened collective, keys sorted.

    Values are tensors or numbers; each comes back in its own type and shape
    (numbers as in :func:`all_reduce`; integer tensors as floating point under
    "mean"), in a new dict with sorted keys.

    Raises:
        ValueError: unknown ``op``.
        MismatchError: ranks' keys or shapes differ (names them, on every rank).
    """
    return _reduce_dict(d, op, dst=None)


def reduce_dict(d: Mapping[str, Any], average: bool = True, dst: int = 0) -> dict[str, Any]:
    """Reduce ``d`` onto ``dst`` (mean or sum); other ranks get ``d`` back unchanged.

    Raises:
        MismatchError: as :func:`all_reduce_dict`.
    """
    return _reduce_dict(d, "mean" if average else "sum", dst=dst)


def _reduce_dict(d: Mapping[str, Any], op: str, dst: int | None) -> dict[str, Any]:
    reduce_op = _op(op)
    mean = op.lower() == "mean"
    keys = sorted(d)
    values = {k: _as_tensor(d[k]) for k in keys}
    views = _agree(values, "all_reduce_dict" if dst is None else "reduce_dict")
    if not keys:
        return {}
    # the same dtype on every rank, whatever each rank passed: promote over all of them
    dtypes = {_dtype_of(view[k][1]) for view in views for k in keys}
    dtype = functools.reduce(torch.promote_types, sorted(dtypes, key=str))
    if dtype.is_floating_point and any(not dt.is_floating_point for dt in dtypes):
        dtype = torch.promote_types(dtype, torch.float64)  # integers stay exact up to 2**53
    elif mean and not dtype.is_floating_point:
        dtype = torch.float64
    if topology.is_distributed():
        dev = _comm_device()
        flat = torch.cat([t.reshape(-1).to(dev, dtype) for t, _ in values.values()])
        with _process_group("all_reduce_dict" if dst is None else "reduce_dict"):
            if dst is None:
                dist.all_reduce(flat, op=reduce_op)
            else:
                dist.reduce(flat, dst=dst, op=reduce_op)
        if dst is not None and topology.get_rank() != dst:
            return dict(d)
        if mean:
            flat /= topology.get_world_size()
    else:
        flat = torch.cat([t.reshape(-1).to(dtype) for t, _ in values.values()])
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
            out[key] = _number(chunk.item(), as_int=all_int and not mean)
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


def _meta(t: torch.Tensor) -> bytes:
    return json.dumps([str(t.dtype), list(t.shape)]).encode()


def all_gather_tensor(t: torch.Tensor | Number) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0; first dims may differ.

    A number or 0-d tensor counts as one element.  No padding is left in the
    result, which lives on the input's device.

    Raises:
        MismatchError: dtypes or trailing shapes differ (on every rank).
    """
    tensor = torch.as_tensor(t)
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if not topology.is_distributed():
        return tensor.clone()
    metas = [
        json.loads(m)
        for m in control.exchange(_meta(tensor), timeout=to_seconds(None), what="all_gather_tensor")
    ]
    dtypes = {m[0] for m in metas}
    trailing = {tuple(m[1][1:]) for m in metas}
    if len(dtypes) > 1 or len(trailing) > 1 or any(len(m[1]) == 0 for m in metas):
        details = {r: f"dtype {m[0]}, shape {m[1]}" for r, m in enumerate(metas)}
        raise MismatchError(
            f"all_gather_tensor: ranks passed tensors whose dtype or trailing shape differ — "
            f"{details}; only the first dimension may differ between ranks",
            details=details,
        )
    sizes = [m[1][0] for m in metas]
    longest = max(sizes)
    dev = _comm_device()
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=dev)
    padded[: tensor.shape[0]] = tensor
    slots = [torch.empty_like(padded) for _ in sizes]
    with _process_group("all_gather_tensor"):
        dist.all_gather(slots, padded)
    return torch.cat([s[:n] for s, n in zip(slots, sizes, strict=True)]).to(tensor.device)


def broadcast_tensor(t: torch.Tensor | None, src: int = 0) -> torch.Tensor:
    """``src``'s tensor on every rank; other ranks may pass None (shape travels too)."""
    if not topology.is_distributed():
        if t is None:
            raise ValueError("broadcast_tensor: the source rank passed None; give it a tensor")
        return t
    rank = topology.get_rank()
    payload = _meta(t) if rank == src and t is not None else b""
    metas = control.exchange(payload, timeout=to_seconds(None), what="broadcast_tensor")
    if not metas[src]:
        raise ValueError(f"broadcast_tensor: source rank {src} passed None; give it a tensor")
    dtype_name, shape = json.loads(metas[src])
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    dev = _comm_device()
    if rank == src and t is not None:
        buf = t.detach().to(dev).contiguous()
    else:
        buf = torch.empty(shape, dtype=dtype, device=dev)
    with _process_group("broadcast_tensor"):
        dist.broadcast(buf, src=src)
    target = t.device if t is not None else dev
    return buf.to(target)


def shared_random_seed() -> int:
    """A random integer in [0, 2**31), the same on every rank."""
    seed = random.SystemRandom().randrange(2**31)
    if not topology.is_distributed():
        return seed
    values = control.exchange(str(seed).encode(), timeout=to_seconds(None), what="seed")
    return int(values[0])


def rank_zero_only(fn: F) -> F:
    """Run ``fn`` on global rank 0 only; elsewhere return None."""
    return one_rank_only(0)(fn)


def one_rank_only(
    rank: int = 0, with_barrier: bool = False, timeout: Timeout = None
) -> Callable[[F], F]:
    """Decorator: run on ``rank`` only (None elsewhere), then optionally wait for it.

    With ``with_barrier`` the other ranks wait on the control plane (never the
    NCCL watchdog) for at most ``timeout`` seconds (None: the library default);
    if the function raises on ``rank``, the others raise
    :class:`RemoteRankError` instead of waiting forever.

    Raises:
        GatherTimeout: with ``with_barrier``, ranks that did not arrive in time, named.
        RemoteRankError: on the other ranks, when the function raised on ``rank``.
    """
    seconds = to_seconds(timeout)

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not with_barrier or not topology.is_distributed():
                return fn(*args, **kwargs) if topology.get_rank() == rank else None
            result, failure = None, b""
            try:
                if topology.get_rank() == rank:
                    result = fn(*args, **kwargs)
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}".encode()
                control.exchange(failure, timeout=seconds, what="one_rank_only")
                raise
            reported = control.exchange(failure, timeout=seconds, what="one_rank_only")
            if reported[rank]:
                raise RemoteRankError(rank, reported[rank].decode(), context=fn.__name__)
            return result

        return wrapper  # type: ignore[return-value]

    return decorate
