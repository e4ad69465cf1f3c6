"""The "stream" route: parts sent point to point, in fixed-size chunks, over gloo.

What ``auto`` uses across nodes when no shared store is configured.  Unlike
the padded collective (``W x largest`` on every receiver), each sender sends
only its own part, chunk by chunk, to the destination, which receives every
chunk straight into the buffer of the part it returns:

- the destination holds what it returns plus nothing else (chunks land in place);
- a sender holds its serialised part plus one chunk;
- the destination takes parts in rank order, so ``gather_iter`` yields each
  part as soon as it is in.

Every send and receive waits at most for the time the call has left: a rank
that is killed or frozen makes the waiting side raise ``GatherTimeout``
(or ``RemoteRankError`` when its connection closed) naming it, instead of
hanging on the process group's own timeout, and marks gatherstore's gloo group
broken (later calls that need it refuse at once).

When the destination stops early (a ``gather_iter`` closed or dropped, a part
that cannot be rebuilt, a sender that stalled), it tells the senders through
the ``gatherstore.routes.halt.Halt`` keys of the call on the rendezvous store, and takes the one
chunk each of them may have in flight: they are released at once, with the
destination's reason (naming the rank that stalled, or returning quietly after
an early close), and the group stays usable.
"""

from __future__ import annotations

import datetime as _dt
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gatherstore import _config as config
from gatherstore import codec
from gatherstore._errors import GatherError, GatherTimeout, RemoteRankError, seconds
from gatherstore._time import Deadline
from gatherstore.job import control, gloo
from gatherstore.job import state as job
from gatherstore.routes.base import Plan, Route
from gatherstore.routes.context import Context
from gatherstore.routes.halt import RELEASE_GRACE, Halt
from gatherstore.routes.progress import Progress, wanted

__all__ = [
    "CHUNK",
    "StreamRoute",
    "broadcast_chunked",
    "receive",
    "send",
]

#: Bytes per point-to-point message (``GATHERSTORE_STREAM_CHUNK``).
CHUNK = config.STREAM_CHUNK


def chunk_count(size: int) -> int:
    """How many chunks a part of ``size`` bytes travels in."""
    return -(-size // CHUNK)


def _wait(post: Callable[[], Any], peer: int, deadline: Deadline, what: str, late: str) -> None:
    """Post one point-to-point op and wait for it until ``deadline``.

    Raises:
        GatherTimeout: ``peer`` did not do its side in time (``late`` says what).
        RemoteRankError: ``peer``'s connection closed: its process died or left.
    """
    error = "timed out"
    try:
        work = post()
        left = deadline.ends - time.monotonic()
        if left > 0 and work.wait(timeout=_dt.timedelta(seconds=left)):
            return
    except RuntimeError as exc:  # gloo: "Connection closed by peer", "Timed out ..."
        if not deadline.passed() and "timed out" not in str(exc).lower():
            error = str(exc).splitlines()[0]
    how_on = gloo.mark_broken(what, f"rank {peer} {late}")
    if error == "timed out":
        raise GatherTimeout(
            f"{what}: rank {peer} {late} within {seconds(deadline.timeout)} s; it is busy, "
            f"stuck or gone; {how_on}",
            ranks=[peer],
            timeout=deadline.timeout,
        ) from None
    raise RemoteRankError(
        peer, f"its connection closed mid-transfer ({error}); {how_on}", context=what
    ) from None


def _chunks(segments: list[memoryview], size: int) -> Iterator[torch.Tensor]:
    """The concatenation of ``segments`` in chunks of ``CHUNK`` bytes, each copied into
    one reused buffer (valid until the next chunk is drawn)."""
    chunk = torch.empty(min(CHUNK, size), dtype=torch.uint8)
    out = chunk.numpy()
    fill = 0
    for segment in segments:
        view = memoryview(segment).cast("B")
        while len(view):
            n = min(len(view), len(out) - fill)
            out[fill : fill + n] = view[:n]
            fill, view = fill + n, view[n:]
            if fill == len(out):
                yield chunk
                fill = 0
    if fill:
        yield chunk[:fill]


def _into(part: bytearray) -> Iterator[torch.Tensor]:
    """Views of ``part``, chunk by chunk, to receive into in place."""
    if part:
        whole = torch.frombuffer(part, dtype=torch.uint8)
        for start in range(0, len(part), CHUNK):
            yield whole[start : start + CHUNK]


def send(
    segments: list[memoryview],
    size: int,
    dst: int,
    group: Any,
    halt: Halt,
    *,
    deadline: Deadline,
    what: str,
) -> dict[str, Any] | None:
    """Send the ``size`` bytes of ``segments`` to ``dst``, chunk by chunk.

    Returns None once ``dst`` took every chunk, or ``dst``'s reason when it stopped early.

    Raises:
        GatherTimeout: ``dst`` did not take a chunk before ``deadline``.
        RemoteRankError: ``dst``'s connection closed.
    """
    rank = job.group_state().rank
    for chunk in _chunks(segments, size):
        if not halt.claim(rank):
            return halt.reason(rank)
        # dst may be stopping for another rank's sake: it then takes this chunk, or (after
        # a timeout of its own) closes the connection and says why on the store
        late = f"did not take the part of rank {rank}"
        post = functools.partial(group.send, [chunk], dst, 0)
        try:
            _wait(post, dst, deadline.later(RELEASE_GRACE), what, late)
        except GatherError:
            reason = halt.reason(rank, wait=RELEASE_GRACE)
            if reason is None:
                raise
            return reason
    if size:
        halt.done(rank)
    return None


def receive(
    size: int, rank: int, group: Any, taken: dict[int, int], *, deadline: Deadline, what: str
) -> bytearray:
    """``rank``'s part of ``size`` bytes, received chunk by chunk in place (``taken``
    counts the chunks in).

    Raises:
        GatherTimeout: the sender did not deliver in time; names it.
        RemoteRankError: the sender's connection closed; names it.
    """
    part = bytearray(size)
    late = "did not stream its part of the call"
    for piece in _into(part):
        post = functools.partial(group.recv, [piece], rank, 0)
        _wait(post, rank, deadline, what, late)
        taken[rank] += 1
    return part


def broadcast_chunked(
    segments: list[memoryview] | None,
    size: int,
    src: int,
    group: Any,
    *,
    deadline: Deadline,
    what: str,
) -> bytearray | None:
    """``src``'s part on every rank, chunk by chunk: ``src`` passes its ``segments`` and
    gets None; the others get the ``size`` bytes, received in place.

    Raises:
        GatherTimeout: a chunk did not go through before ``deadline``; names ``src``.
    """
    part = None if segments is not None else bytearray(size)
    pieces = _chunks(segments, size) if segments is not None else _into(part or bytearray())
    late = "did not stream its part of the call"
    for piece in pieces:
        left = _dt.timedelta(seconds=max(deadline.left(), 0.001))
        post = functools.partial(gloo.broadcast_op(piece, src), group, left)
        _wait(post, src, deadline, what, late)
    return part


# --- the route ------------------------------------------------------------------------------
def _limits(ctx: Context) -> dict[str, Any]:
    return {"deadline": ctx.deadline, "what": ctx.what}


def _segments(ctx: Context) -> list[memoryview]:
    frame = ctx.take_frame()
    return [] if frame is None else frame.seal(None).segments


class StreamRoute(Route):
    """Parts point to point in chunks over gatherstore's gloo group (see the module)."""

    need = "store"  # the destination holds what it returns; a sender its part and a chunk

    def __str__(self) -> str:
        return "stream"

    def gather(self, ctx: Context, plan: Plan, dst: int, *, lazy: bool) -> Iterator[Any] | None:
        """Send this rank's part to ``dst``; on ``dst``, every part in rank order as it
        arrives (its own object in place).

        Raises:
            GatherTimeout / RemoteRankError: a rank that stalled or died, named; on a
                sender also the destination's reason for stopping early.
        """
        group = gloo.group()
        halt = Halt(control.step(), deadline=ctx.deadline, what=ctx.what)
        if ctx.rank == dst:
            parts = _gathered(ctx, plan, dst, group, halt)
            if lazy:
                ctx.reading = True  # its consumer's reading ends the call
                return parts
            return iter(list(parts))
        reason = send(_segments(ctx), plan.sizes[ctx.rank], dst, group, halt, **_limits(ctx))
        ctx.lap("send")
        ctx.finish()
        if reason is not None and reason["kind"] != "closed":
            raise _halted(reason, dst, ctx)
        return None

    def broadcast(self, ctx: Context, plan: Plan, src: int) -> Any:
        out = _part_from(ctx, plan, src)
        ctx.finish()
        return out

    def all_gather(self, ctx: Context, plan: Plan) -> list[Any]:
        """Every rank's part on every rank, one broadcast per rank.

        A part that cannot be rebuilt here does not stop this rank from taking part in
        the broadcasts after it (the others would wait for it): its error is raised
        once they are done.
        """
        out: list[Any] = []
        failed: GatherError | None = None
        segments = _segments(ctx)
        for src in range(ctx.world):
            try:
                out.append(_part_from(ctx, plan, src, segments))
            except GatherError as exc:
                if isinstance(exc, (GatherTimeout, RemoteRankError)):  # the transfer failed
                    raise
                failed = failed or exc
        ctx.finish()
        if failed is not None:
            raise failed
        return out


def _halted(reason: dict[str, Any], dst: int, ctx: Context) -> GatherError:
    """A sender's error for a destination that stopped early for ``reason``."""
    if reason["kind"] == "timeout":
        return GatherTimeout(
            f"{ctx.what}: rank {dst} stopped the gather: {reason['message']}",
            ranks=reason["ranks"],
            timeout=ctx.deadline.timeout,
        )
    return RemoteRankError(reason["rank"], reason["message"], context=ctx.what)


def _gathered(ctx: Context, plan: Plan, dst: int, group: Any, halt: Halt) -> Iterator[Any]:
    incoming = plan.total - plan.sizes[dst]
    progress = Progress(ctx.what, ctx.world - 1, incoming, enabled=wanted(ctx.progress, incoming))
    taken = dict.fromkeys(range(ctx.world), 0)
    reason: dict[str, Any] | None = None
    try:
        for rank in range(ctx.world):
            if rank == dst:
                yield plan.own
                continue
            part = receive(plan.sizes[rank], rank, group, taken, **_limits(ctx))
            progress.update(len(part))
            yield codec.decode(memoryview(part), rank=rank, where=ctx.what)
    except GeneratorExit:
        reason = {"kind": "closed"}
        raise
    except GatherTimeout as exc:
        reason = {"kind": "timeout", "ranks": exc.ranks, "message": str(exc)}
        raise
    except RemoteRankError as exc:  # a sender died
        reason = {"kind": "failed", "ranks": exc.ranks, "rank": exc.rank, "message": str(exc)}
        raise
    except BaseException as exc:
        message = f"{type(exc).__name__}: {exc}"
        reason = {"kind": "failed", "rank": dst, "message": message}
        raise
    finally:
        progress.close()
        if reason is not None:
            _release(ctx, plan, group, halt, reason, taken)
        ctx.finish()


def _release(
    ctx: Context, plan: Plan, group: Any, halt: Halt, reason: dict[str, Any], taken: dict[int, int]
) -> None:
    """Stop the senders whose parts were not taken whole, and take the chunk each has
    in flight, so that they return at once and the group stays in step.

    A sender that stalled or died (named in ``reason``) is told too, should it wake,
    but its chunk is not taken: the group is broken already.
    """
    sizes = plan.sizes
    named = set(reason.get("ranks", ()))
    unfinished = {
        r: chunk_count(sizes[r])
        for r in range(ctx.world)
        if r != ctx.rank and taken[r] < chunk_count(sizes[r])
    }
    try:
        posted = halt.stop(reason, unfinished)
        if reason["kind"] == "timeout":  # gloo closed every connection of this rank
            return
        scratch = torch.empty(min(CHUNK, max(sizes, default=0)), dtype=torch.uint8)
        ends = max(ctx.deadline.ends, time.monotonic() + RELEASE_GRACE)
        deadline = Deadline(ctx.deadline.timeout, ends)
        for rank, count in posted.items():
            if rank in named:  # it died, or its chunk is awaited already: the group is broken
                continue
            for _ in range(count - taken[rank]):
                size = min(CHUNK, sizes[rank] - taken[rank] * CHUNK)
                post = functools.partial(group.recv, [scratch[:size]], rank, 0)
                late = "did not finish the chunk it had in flight"
                _wait(post, rank, deadline, ctx.what, late)
                taken[rank] += 1
    except GatherError:  # the senders left end at their deadline; the group is marked broken
        return


def _part_from(ctx: Context, plan: Plan, src: int, segments: list[memoryview] | None = None) -> Any:
    """``src``'s part on this rank, broadcast chunk by chunk (``src``: its own object;
    ``segments``: its encoded part, when taken already)."""
    if ctx.rank == src and segments is None:
        segments = _segments(ctx)
    part = broadcast_chunked(
        segments if ctx.rank == src else None,
        plan.sizes[src],
        src,
        gloo.group(),
        **_limits(ctx),
    )
    if part is None:
        return plan.own
    return codec.decode(memoryview(part), rank=src, where=ctx.what)
