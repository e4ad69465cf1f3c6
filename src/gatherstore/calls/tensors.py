"""Tensor collectives, the fast path: NCCL on GPU, gloo on CPU; numbers accepted too.

Also the helpers the other tensor-path modules share (``gatherstore.calls.dicts``):
running one op with or without a timeout, the reduce ops, the device of the
default group.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import random
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from gatherstore._config import Timeout, to_seconds
from gatherstore._errors import GatherError, MismatchError, ProcessGroupError
from gatherstore._errors import seconds as format_seconds
from gatherstore.job import control, topology

__all__ = [
    "Number",
    "all_gather_tensor",
    "all_reduce",
    "arrive",
    "as_number",
    "barrier",
    "broadcast_tensor",
    "comm_device",
    "process_group",
    "reduce_op_of",
    "run_op",
    "shared_random_seed",
    "valid_timeout",
]

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
def process_group(what: str) -> Iterator[None]:
    """Report the process group's own failures as a ProcessGroupError (a GatherError and
    still a RuntimeError, as torch's was), not a raw torch error."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, GatherError):
            raise
        cause = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ProcessGroupError(
            f"{what}: the process group failed: {cause}; "
            "another rank died, stopped, or called a different collective (tensor collectives "
            "wait for the process group's timeout; object collectives name the rank)"
        ) from exc


def run_op(what: str, start: Callable[[], Any], seconds: float | None, ends: float = 0.0) -> None:
    """Run one tensor collective: ``start()`` launches it (``async_op=True``).

    Without a timeout (``seconds`` None) it waits as long as the process group does.
    With one, the op is waited on until ``ends`` (an absolute deadline, after the
    ranks met on the control plane, which names the late ones): a rank that dies or
    stalls mid-op then ends the wait in time.

    Raises:
        ProcessGroupError: the process group failed, or the op did not finish in time.
    """
    with process_group(what):
        work = start()
        if seconds is None:
            work.wait()
            return
        left = max(ends - time.monotonic(), 0.05)
        try:
            done = work.wait(timeout=_dt.timedelta(seconds=left))
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower() and time.monotonic() < ends:
                raise
            done = False
        if not done:
            raise ProcessGroupError(
                f"{what}: every rank arrived but the collective did not finish within "
                f"{format_seconds(seconds)} s; a rank died or stalled in it (the process group "
                "may be unusable now)"
            )


def valid_timeout(timeout: Timeout) -> float | None:
    """``timeout`` in seconds (None: the process group's own wait).

    Raises:
        ValueError: not a positive number of seconds or a timedelta.
    """
    return None if timeout is None else to_seconds(timeout)


def arrive(what: str, timeout: Timeout) -> tuple[float | None, float]:
    """With a ``timeout``: meet every rank on the control plane first (a rank that is
    late, or in another gatherstore call, is named on every rank); returns (the
    timeout in seconds or None, the absolute deadline)."""
    if timeout is None:
        return None, 0.0
    seconds = to_seconds(timeout)
    ends = time.monotonic() + seconds
    control.exchange(b"", timeout=seconds, what=what)
    return seconds, ends


def reduce_op_of(op: str) -> Any:
    try:
        return _OPS[op.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"op={op!r} is not supported: use one of {sorted(_OPS)}") from None


def comm_device() -> torch.device:
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


@control.serialized
def barrier(timeout: Timeout = None) -> None:
    """Wait until every rank arrives.

    Without a timeout this is the process group's barrier (``device_ids`` passed
    under NCCL).  With a timeout, ranks meet on gatherstore's gloo control group,
    which never trips the NCCL watchdog: the pattern for "rank 0 evaluates while
    the others wait".

    Raises:
        GatherTimeout: with a timeout, naming the ranks that did not arrive.
    """
    valid_timeout(timeout)
    if not topology.is_distributed():
        return
    if timeout is None:
        if comm_device().type == "cuda":
            with process_group("barrier"):
                dist.barrier(device_ids=[comm_device().index or 0])
        else:
            with process_group("barrier"):
                dist.barrier()
        return
    control.exchange(b"", timeout=to_seconds(timeout), what="barrier")


@control.serialized
def all_reduce(x: torch.Tensor | Number, op: str = "sum", *, timeout: Timeout = None) -> Any:
    """Reduce ``x`` over all ranks; every rank gets the result.

    ``op`` is "sum", "mean", "max", "min" or "product".  A tensor comes back as
    a new tensor on its own device (the input is not modified; "mean" of an
    integer tensor is floating point).  A number comes back as a number: it is
    reduced in float64 (exact for integers up to 2**53), so ranks may mix ints
    and floats; an int comes back as an int when the result is whole and
    ``op`` is not "mean".  ``timeout`` (seconds or a timedelta) bounds the call:
    see [`all_gather_tensor`][gatherstore.all_gather_tensor].

    Raises:
        ValueError: unknown ``op`` or a bad ``timeout``.
        TypeError: ``x`` is neither a tensor nor a number.
        GatherTimeout / MismatchError: with a timeout, ranks that did not arrive, or
            are in another gatherstore call, named on every rank.
        ProcessGroupError: the process group failed (or, with a timeout, the op did
            not finish in time).
    """
    valid_timeout(timeout)
    reduce_op = reduce_op_of(op)
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
        seconds, ends = arrive("all_reduce", timeout)
        moved = tensor.to(comm_device())
        start = functools.partial(dist.all_reduce, moved, op=reduce_op, async_op=True)
        run_op("all_reduce", start, seconds, ends)
        tensor = moved.to(tensor.device)
        if mean:
            tensor /= topology.get_world_size()
    if isinstance(x, torch.Tensor):
        return tensor
    return as_number(tensor.item(), as_int=isinstance(x, int) and not mean)


def as_number(value: float, *, as_int: bool) -> int | float:
    """A reduced number back in its type: int when asked for and whole, else float."""
    return int(value) if as_int and float(value).is_integer() else float(value)


def _meta(t: torch.Tensor) -> bytes:
    return json.dumps([str(t.dtype), list(t.shape)]).encode()


@control.serialized
def all_gather_tensor(t: torch.Tensor | Number, *, timeout: Timeout = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0; first dims may differ.

    A number or 0-d tensor counts as one element.  No padding is left in the
    result, which lives on the input's device.  Without ``timeout`` the op waits as
    long as the process group does; with one (seconds or a timedelta) the whole call
    ends within it: ranks that do not arrive are named on every rank, and an op a
    rank leaves unfinished ends the wait in time.

    Raises:
        ValueError: a bad ``timeout``.
        MismatchError: dtypes or trailing shapes differ (on every rank).
        GatherTimeout: ranks that did not arrive within ``timeout``, named.
        ProcessGroupError: the process group failed, or the op did not finish in time.
    """
    seconds = valid_timeout(timeout)
    ends = time.monotonic() + (seconds or 0.0)
    tensor = torch.as_tensor(t)
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if not topology.is_distributed():
        return tensor.clone()
    wait = to_seconds(None) if seconds is None else seconds
    metas = [
        json.loads(m)
        for m in control.exchange(_meta(tensor), timeout=wait, what="all_gather_tensor")
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
    dev = comm_device()
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=dev)
    padded[: tensor.shape[0]] = tensor
    slots = [torch.empty_like(padded) for _ in sizes]
    run_op(
        "all_gather_tensor",
        functools.partial(dist.all_gather, slots, padded, async_op=True),
        seconds,
        ends,
    )
    return torch.cat([s[:n] for s, n in zip(slots, sizes, strict=True)]).to(tensor.device)


@control.serialized
def broadcast_tensor(
    t: torch.Tensor | None, src: int = 0, *, timeout: Timeout = None
) -> torch.Tensor:
    """``src``'s tensor on every rank; other ranks may pass None (shape travels too).

    ``timeout``: as in [`all_gather_tensor`][gatherstore.all_gather_tensor].

    Raises:
        ValueError: the source rank passed None, or a bad ``timeout``.
        GatherTimeout / ProcessGroupError: as in
            [`all_gather_tensor`][gatherstore.all_gather_tensor].
    """
    seconds = valid_timeout(timeout)
    ends = time.monotonic() + (seconds or 0.0)
    if not topology.is_distributed():
        if t is None:
            raise ValueError("broadcast_tensor: the source rank passed None; give it a tensor")
        return t
    rank = topology.get_rank()
    payload = _meta(t) if rank == src and t is not None else b""
    wait = to_seconds(None) if seconds is None else seconds
    metas = control.exchange(payload, timeout=wait, what="broadcast_tensor")
    if not metas[src]:
        raise ValueError(f"broadcast_tensor: source rank {src} passed None; give it a tensor")
    dtype_name, shape = json.loads(metas[src])
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    dev = comm_device()
    if rank == src and t is not None:
        buf = t.detach().to(dev).contiguous()
    else:
        buf = torch.empty(shape, dtype=dtype, device=dev)
    start = functools.partial(dist.broadcast, buf, src=src, async_op=True)
    run_op("broadcast_tensor", start, seconds, ends)
    target = t.device if t is not None else dev
    return buf.to(target)


@control.serialized
def shared_random_seed() -> int:
    """A random integer in [0, 2**31), the same on every rank: rank 0's.

    Raises:
        GatherTimeout: ranks that did not arrive within ``GATHERSTORE_TIMEOUT``, named.
        MismatchError: ranks were in different gatherstore calls.
        RemoteRankError: the job's rendezvous store went away (its host ended).
    """
    seed = random.SystemRandom().randrange(2**31)
    if not topology.is_distributed():
        return seed
    values = control.exchange(str(seed).encode(), timeout=to_seconds(None), what="seed")
    return int(values[0])
