"""Routes over the process group: parts padded to the largest over gatherstore's gloo
group (``CollectiveRoute``), and tiny parts that rode on the call's status exchange
(``InlineRoute``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from gatherstore import codec
from gatherstore._errors import GatherError
from gatherstore.job import gloo
from gatherstore.job.session import after_failure
from gatherstore.routes.base import Plan, Route
from gatherstore.routes.context import Context

__all__ = ["CollectiveRoute", "InlineRoute"]


class CollectiveRoute(Route):
    """Pickled parts over gatherstore's gloo group, padded to the largest part."""

    need = "collective"

    def __str__(self) -> str:
        return "collective"

    def all_gather(self, ctx: Context, plan: Plan) -> list[Any]:
        slots = [torch.empty(plan.longest, dtype=torch.uint8) for _ in plan.sizes]
        _transfer(ctx, gloo.all_gather_op(slots, _packed(ctx, plan.longest)))
        return _decoded(ctx, plan, slots)

    def gather(self, ctx: Context, plan: Plan, dst: int, *, lazy: bool) -> Iterator[Any] | None:
        if ctx.rank != dst:
            _transfer(ctx, gloo.gather_op(None, _packed(ctx, plan.longest), dst))
            ctx.finish()
            return None
        slots = [torch.empty(plan.longest, dtype=torch.uint8) for _ in plan.sizes]
        _transfer(ctx, gloo.gather_op(slots, slots[dst], dst))
        return iter(_decoded(ctx, plan, slots))

    def broadcast(self, ctx: Context, plan: Plan, src: int) -> Any:
        buf = _packed(ctx, plan.sizes[src])
        _transfer(ctx, gloo.broadcast_op(buf, src))
        try:
            if ctx.rank == src:
                return plan.own
            return codec.decode(buf.numpy().data[: plan.sizes[src]], rank=src, where=ctx.what)
        finally:
            ctx.finish()


class InlineRoute(Route):
    """Parts that rode on the call's status exchange: ``"auto"``'s tiny gathers (every
    part at most :data:`INLINE_TOTAL` over the world size), which then take one
    exchange of the control plane instead of an exchange, a gloo op and a second
    exchange.  ``parts``: every rank's sealed part (on the ranks that receive)."""

    need = "collective"

    def __init__(self, parts: Sequence[memoryview] | None) -> None:
        self.parts = parts

    def __str__(self) -> str:
        return "auto (inline)"

    def all_gather(self, ctx: Context, plan: Plan) -> list[Any]:
        return self._decoded(ctx, plan)

    def gather(self, ctx: Context, plan: Plan, dst: int, *, lazy: bool) -> Iterator[Any] | None:
        if ctx.rank != dst:
            ctx.finish()
            return None
        return iter(self._decoded(ctx, plan))

    def broadcast(self, ctx: Context, plan: Plan, src: int) -> Any:
        raise AssertionError("a broadcast's parts do not ride on its status exchange")

    def _decoded(self, ctx: Context, plan: Plan) -> list[Any]:
        """Every part's object, this rank's own in place; then the call ends."""
        assert self.parts is not None
        try:
            return [
                plan.own if r == ctx.rank else codec.decode(part, rank=r, where=ctx.what)
                for r, part in enumerate(self.parts)
            ]
        finally:
            ctx.finish()


def _transfer(ctx: Context, start: gloo.Start) -> None:
    """Run one gloo op on gatherstore's group within the call's deadline."""
    try:
        gloo.transfer(start, what=ctx.what, deadline=ctx.deadline)
    except GatherError as exc:
        after_failure(exc)
        raise
    ctx.lap("transfer")


def _packed(ctx: Context, size: int) -> torch.Tensor:
    """This rank's sealed frame in a ``size``-byte tensor (the padding is never read)."""
    out = torch.empty(size, dtype=torch.uint8)
    frame = ctx.take_frame()
    if frame is not None:
        frame.seal(None).copy_into(out.numpy().data)
    return out


def _decoded(ctx: Context, plan: Plan, slots: list[torch.Tensor]) -> list[Any]:
    """Every slot's object, this rank's own in place; then the call ends (its DEBUG line
    counts the decoding as reading)."""
    try:
        return [
            plan.own
            if r == ctx.rank
            else codec.decode(slot.numpy().data[: plan.sizes[r]], rank=r, where=ctx.what)
            for r, slot in enumerate(slots)
        ]
    finally:
        ctx.finish()
