"""Tensor collectives, the fast path: NCCL on GPU, gloo on CPU; numbers accepted too.

Each goes through the one entry (``gatherstore.calls.entry``).  Without a ``timeout``
an op waits as long as the process group does; with one, the ranks first meet on the
control plane (late ones are named) and the op ends within it.  Also the helpers the
dict reductions share (``gatherstore.calls.dicts``): the reduce ops, numbers in their
type, the device of the default group.
"""

import functools
import json
import random
import warnings
from typing import Any

import torch
import torch.distributed as dist

from gatherstore._config import Timeout
from gatherstore._errors import MismatchError
from gatherstore.calls.entry import check, group_rank, run
from gatherstore.job import topology
from gatherstore.routes.context import Context, process_group

__all__ = [
    "Number",
    "all_gather_tensor",
    "all_reduce",
    "as_number",
    "barrier",
    "broadcast_tensor",
    "comm_device",
    "reduce_op_of",
    "shared_random_seed",
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
#: The route a tensor collective's log line names.
_GROUP = "process group"


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


def barrier(timeout: Timeout = None, *, group: Any = None) -> None:
    """Wait until every rank arrives.

    Without a timeout this is the process group's barrier (``device_ids`` passed
    under NCCL).  With a timeout, ranks meet on gatherstore's gloo control group,
    which never trips the NCCL watchdog: the pattern for "rank 0 evaluates while
    the others wait".

    Args:
        timeout: how long the ranks wait for each other: seconds or a ``timedelta``;
            None: as long as the process group does.
        group: the members of that process group wait for each other (None: every
            rank); a rank outside it returns at once.

    Raises:
        ValueError: a bad ``timeout``.
        TypeError: ``group`` is not a process group.
        GatherTimeout: with a timeout, naming the ranks that did not arrive.

    Examples:
        >>> if gs.is_main_process():
        ...     evaluate(model)
        >>> gs.barrier(timeout=3600)  # the others wait for rank 0, for an hour at most
    """
    check("barrier", timeout=timeout, group=group)

    def body(ctx: Context) -> None:
        if timeout is not None:
            ctx.arrive()
            return
        with process_group("barrier"):
            if comm_device().type == "cuda":
                dist.barrier(group=group, device_ids=[comm_device().index or 0])
            else:
                dist.barrier(group=group)

    run("barrier", body, lambda: None, **_on(group, timeout))


def all_reduce(
    x: torch.Tensor | Number, op: str = "sum", *, group: Any = None, timeout: Timeout = None
) -> Any:
    """Reduce ``x`` over all ranks; every rank gets the result.

    A number is reduced in float64 (exact for integers up to 2**53), so ranks may mix
    ints and floats.

    Args:
        x: this rank's tensor or number (an int or a float).
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``.
        group: reduce over that process group's members (None: every rank).
        timeout: bounds the call: seconds or a ``timedelta``; None: the op waits as
            long as the process group does (see ``all_gather_tensor``).

    Returns:
        For a tensor, a new tensor on its own device (the input is not modified;
        ``"mean"`` of an integer tensor is floating point).  For a number, a number:
        an int when ``x`` is an int, the result is whole and ``op`` is not
        ``"mean"``, else a float.  A rank outside ``group`` gets ``x`` back.

    Raises:
        ValueError: unknown ``op`` or a bad ``timeout``.
        TypeError: ``x`` is neither a tensor nor a number, or ``group`` is not a
            process group.
        GatherTimeout / MismatchError: with a timeout, ranks that did not arrive, or
            are in another gatherstore call, named on every rank.
        ProcessGroupError: the process group failed (or, with a timeout, the op did
            not finish in time).

    Examples:
        >>> loss = gs.all_reduce(loss, op="mean")  # a tensor, on its device
        >>> correct = gs.all_reduce(correct)  # an int, summed
    """
    check("all_reduce", timeout=timeout, group=group)
    reduce_op = reduce_op_of(op)
    mean = op.lower() == "mean"
    if isinstance(x, torch.Tensor):
        tensor = x.detach().clone(memory_format=torch.contiguous_format)
        if mean and not tensor.is_floating_point():
            tensor = tensor.double()
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        tensor = torch.tensor(float(x), dtype=torch.float64)
    else:
        raise TypeError(f"all_reduce takes a tensor or a number, not {type(x).__name__}")

    def body(ctx: Context) -> torch.Tensor:
        if timeout is not None:
            ctx.arrive()
        moved = tensor.to(comm_device())
        reduce = functools.partial(dist.all_reduce, moved, op=reduce_op, group=group)
        ctx.run_op(functools.partial(reduce, async_op=True))
        reduced = moved.to(tensor.device)
        if mean:
            reduced /= ctx.world
        return reduced

    if not isinstance(x, torch.Tensor) and not topology.is_distributed():
        return float(x) if mean else x
    out = run("all_reduce", body, lambda: tensor, apart=lambda: tensor, **_on(group, timeout))
    if isinstance(x, torch.Tensor):
        return out
    return as_number(out.item(), as_int=isinstance(x, int) and not mean)


def as_number(value: float, *, as_int: bool) -> int | float:
    """A reduced number back in its type: int when asked for and whole, else float."""
    return int(value) if as_int and float(value).is_integer() else float(value)


def _meta(t: torch.Tensor) -> bytes:
    return json.dumps([str(t.dtype), list(t.shape)]).encode()


def all_gather_tensor(
    t: torch.Tensor | Number, *, group: Any = None, timeout: Timeout = None
) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0; first dims may differ.

    No padding is left in the result.

    Args:
        t: this rank's tensor, or a number; a number or 0-d tensor counts as one
            element.  Every rank's dtype and trailing dimensions must match.
        group: concatenate the tensors of that process group's members (None: every
            rank).
        timeout: without one, the op waits as long as the process group does; with
            one (seconds or a ``timedelta``) the whole call ends within it: ranks that
            do not arrive are named on every rank, and an op a rank leaves unfinished
            ends the wait in time.

    Returns:
        Every rank's tensor, in group-rank order (rank order on the default group),
        concatenated on the input's device.  A rank outside ``group`` gets a copy of
        its own tensor.

    Raises:
        ValueError: a bad ``timeout``.
        TypeError: ``group`` is not a process group.
        MismatchError: dtypes or trailing shapes differ (on every rank).
        GatherTimeout: ranks that did not arrive within ``timeout``, named.
        ProcessGroupError: the process group failed, or the op did not finish in time.

    Examples:
        >>> scores = gs.all_gather_tensor(batch_scores)  # every rank's rows, rank 0's first
    """
    check("all_gather_tensor", timeout=timeout, group=group)
    tensor = torch.as_tensor(t)
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)

    def body(ctx: Context) -> torch.Tensor:
        metas = [json.loads(m) for m in ctx.send(_meta(tensor))]
        return _gathered(ctx, tensor, metas)

    return run("all_gather_tensor", body, tensor.clone, apart=tensor.clone, **_on(group, timeout))


def _gathered(ctx: Context, tensor: torch.Tensor, metas: list[Any]) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated, once ``metas`` (every rank's dtype and shape)
    are known.

    Raises:
        MismatchError: dtypes or trailing shapes differ (on every rank).
    """
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
    ctx.run_op(functools.partial(dist.all_gather, slots, padded, group=ctx.group, async_op=True))
    return torch.cat([s[:n] for s, n in zip(slots, sizes, strict=True)]).to(tensor.device)


def broadcast_tensor(
    t: torch.Tensor | None,
    src: int | None = None,
    *,
    group: Any = None,
    group_src: int | None = None,
    timeout: Timeout = None,
) -> torch.Tensor:
    """``src``'s tensor on every rank; its dtype and shape travel too.

    Args:
        t: the tensor to send, on ``src``; the other ranks may pass None (or a tensor,
            whose device the result takes).
        src: the global rank whose ``t`` is sent.
        group: broadcast over that process group's members (None: every rank).
        group_src: the rank within ``group`` whose ``t`` is sent.  As in torch, give
            ``src`` or ``group_src``, not both; neither: the group's first rank (rank 0
            of the default group).
        timeout: as in ``all_gather_tensor``.

    Returns:
        ``src``'s tensor, on the device of this rank's ``t`` (this rank's device for
        the process group when ``t`` is None).  A rank outside ``group`` gets ``t``
        back.

    Raises:
        ValueError: the source rank passed None, ``src`` and ``group_src`` both given,
            a source that is not a rank of the group, or a bad ``timeout``.
        TypeError: ``group`` is not a process group.
        GatherTimeout / ProcessGroupError: as in ``all_gather_tensor``.

    Examples:
        >>> mask = gs.broadcast_tensor(make_mask() if gs.is_main_process() else None)
    """
    check("broadcast_tensor", timeout=timeout, group=group)
    root = group_rank("broadcast_tensor", group, ("src", src), ("group_src", group_src))

    def serial() -> torch.Tensor:
        if t is None:
            raise ValueError("broadcast_tensor: the source rank passed None; give it a tensor")
        return t

    def body(ctx: Context) -> torch.Tensor:
        payload = _meta(t) if ctx.rank == root and t is not None else b""
        metas = ctx.send(payload)
        if not metas[root]:
            raise ValueError(f"broadcast_tensor: source rank {root} passed None; give it a tensor")
        dtype_name, shape = json.loads(metas[root])
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        dev = comm_device()
        if ctx.rank == root and t is not None:
            buf = t.detach().to(dev).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=dev)
        send = functools.partial(dist.broadcast, buf, group=group, group_src=root)
        ctx.run_op(functools.partial(send, async_op=True))
        return buf.to(t.device if t is not None else dev)

    return run("broadcast_tensor", body, serial, apart=lambda: t, **_on(group, timeout))


def _on(group: Any, timeout: Timeout) -> dict[str, Any]:
    """The entry's arguments of a tensor collective on ``group``: the process group's
    own op, bounded only with a ``timeout``; no store to sweep."""
    return {"timeout": timeout, "bounded": False, "sweep": False, "route": _GROUP, "group": group}


def shared_random_seed(*, group: Any = None) -> int:
    """A random integer, the same on every rank of ``group``: its first rank's.

    Args:
        group: the process group whose first rank's seed every member gets (None: the
            default group).

    Returns:
        An integer in [0, 2**31).  A rank outside ``group`` gets one of its own.

    Raises:
        TypeError: ``group`` is not a process group.
        GatherTimeout: ranks that did not arrive within ``GATHERSTORE_TIMEOUT``, named.
        MismatchError: ranks were in different gatherstore calls.
        RemoteRankError: the job's rendezvous store went away (its host ended).

    Examples:
        >>> torch.manual_seed(gs.shared_random_seed())  # the same augmentations everywhere
    """
    check("shared_random_seed", group=group)
    seed = random.SystemRandom().randrange(2**31)

    def body(ctx: Context) -> int:
        return int(ctx.send(str(seed).encode())[0])

    return run("seed", body, lambda: seed, sweep=False, group=group, apart=lambda: seed)
