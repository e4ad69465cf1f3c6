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
that is killed or frozen makes the waiting side raise :class:`GatherTimeout`
(or :class:`RemoteRankError` when its connection closed) naming it, instead of
hanging on the process group's own timeout, and marks gatherstore's gloo group
broken (later calls that need it refuse at once).

When the destination stops early (a ``gather_iter`` closed or dropped, a part
that cannot be rebuilt, a sender that stalled), it tells the senders through
the :class:`~gatherstore._halt.Halt` keys of the call on the rendezvous store, and takes the one
chunk each of them may have in flight: they are released at once, with the
destination's reason (naming the rank that stalled, or returning quietly after
an early close), and the group stays usable.
"""

from __future__ import annotations

import datetime as _dt
import functools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import _config as config
from . import _control as control
from . import _gloo as gloo
from . import _serialize as serialize
from ._errors import GatherError, GatherTimeout, RemoteRankError
from ._halt import RELEASE_GRACE, Halt
from ._progress import Progress, wanted

if TYPE_CHECKING:
    from ._call import Call

__all__ = [
    "CHUNK",
    "all_from",
    "broadcast_chunked",
    "part_from",
    "gather_to",
    "receive",
    "send",
]

#: Bytes per point-to-point message (``GATHERSTORE_STREAM_CHUNK``).
CHUNK = config.STREAM_CHUNK


def chunk_count(size: int) -> int:
    """How many chunks a part of ``size`` bytes travels in."""
    return -(-size // CHUNK)


def _wait(
    post: Callable[[], Any], peer: int, deadline: float, what: str, timeout: float, late: str
) -> None:
    """Post one point-to-point op and wait for it until ``deadline``.

    Raises:
        GatherTimeout: ``peer`` did not do its side in time (``late`` says what).
        RemoteRankError: ``peer``'s connection closed: its process died or left.
    """
    error = "timed out"
    try:
        work = post()
        left = deadline - time.monotonic()
        if left > 0 and work.wait(timeout=_dt.timedelta(seconds=left)):
            return
    except RuntimeError as exc:  # gloo: "Connection closed by peer", "Timed out ..."
        if time.monotonic() < deadline and "timed out" not in str(exc).lower():
            error = str(exc).splitlines()[0]
    how_on = gloo.mark_broken(what, f"rank {peer} {late}")
    if error == "timed out":
        raise GatherTimeout(
            f"{what}: rank {peer} {late} within {timeout:g} s; it is busy, stuck or gone; {how_on}",
            ranks=[peer],
            timeout=timeout,
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
    deadline: float,
    what: str,
    timeout: float,
) -> dict[str, Any] | None:
    """Send the ``size`` bytes of ``segments`` to ``dst``, chunk by chunk.

    Returns None once ``dst`` took every chunk, or ``dst``'s reason when it stopped early.

    Raises:
        GatherTimeout: ``dst`` did not take a chunk before ``deadline``.
        RemoteRankError: ``dst``'s connection closed.
    """
    rank = dist.get_rank()
    for chunk in _chunks(segments, size):
        if not halt.claim(rank):
            return halt.reason(rank)
        # dst may be stopping for another rank's sake: it then takes this chunk, or (after
        # a timeout of its own) closes the connection and says why on the store
        late = f"did not take the part of rank {rank}"
        post = functools.partial(dist.isend, chunk, dst, group=group)
        try:
            _wait(post, dst, deadline + RELEASE_GRACE, what, timeout, late)
        except GatherError:
            reason = halt.reason(rank, wait=RELEASE_GRACE)
            if reason is None:
                raise
            return reason
    if size:
        halt.done(rank)
    return None


def receive(size: int, rank: int, group: Any, taken: dict[int, int], **limits: Any) -> bytearray:
    """``rank``'s part of ``size`` bytes, received chunk by chunk in place (``taken``
    counts the chunks in).

    Raises:
        GatherTimeout: the sender did not deliver in time; names it.
        RemoteRankError: the sender's connection closed; names it.
    """
    part = bytearray(size)
    late = "did not stream its part of the call"
    for piece in _into(part):
        _wait(functools.partial(dist.irecv, piece, rank, group=group), rank, **limits, late=late)
        taken[rank] += 1
    return part


def broadcast_chunked(
    segments: list[memoryview] | None,
    size: int,
    src: int,
    group: Any,
    *,
    deadline: float,
    what: str,
    timeout: float,
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
        post = functools.partial(dist.broadcast, piece, src, group=group, async_op=True)
        _wait(post, src, deadline, what, timeout, late)
    return part


# --- one object collective's use of the route ------------------------------------------
def _limits(call: Call) -> dict[str, Any]:
    return {"deadline": call.ends_at, "what": call.what, "timeout": call.timeout}


def _segments(call: Call) -> list[memoryview]:
    return [] if call.frame is None else call.frame.seal(None).segments


def gather_to(call: Call, dst: int) -> Iterator[Any] | None:
    """Send this rank's part to ``dst``; on ``dst``, every part in rank order as it
    arrives (its own object in place).

    Raises:
        GatherTimeout / RemoteRankError: a rank that stalled or died, named; on a
            sender also the destination's reason for stopping early.
    """
    group = gloo.group()
    halt = Halt(control.step(), deadline=call.ends_at, what=call.what)
    if call.rank == dst:
        return _gathered(call, dst, group, halt)
    reason = send(_segments(call), call.sizes[call.rank], dst, group, halt, **_limits(call))
    call.frame = None
    call.finish()
    if reason is not None and reason["kind"] != "closed":
        raise _halted(reason, dst, call)
    return None


def _halted(reason: dict[str, Any], dst: int, call: Call) -> GatherError:
    """A sender's error for a destination that stopped early for ``reason``."""
    if reason["kind"] == "timeout":
        return GatherTimeout(
            f"{call.what}: rank {dst} stopped the gather: {reason['message']}",
            ranks=reason["ranks"],
            timeout=call.timeout,
        )
    return RemoteRankError(reason["rank"], reason["message"], context=call.what)


def _gathered(call: Call, dst: int, group: Any, halt: Halt) -> Iterator[Any]:
    incoming = call.total - call.sizes[dst]
    progress = Progress(
        call.what, call.world - 1, incoming, enabled=wanted(call.progress, incoming)
    )
    taken = dict.fromkeys(range(call.world), 0)
    reason: dict[str, Any] | None = None
    try:
        for rank in range(call.world):
            if rank == dst:
                yield call.own
                continue
            part = receive(call.sizes[rank], rank, group, taken, **_limits(call))
            progress.update(len(part))
            yield serialize.decode(memoryview(part), rank=rank, where=call.what)
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
            _release(call, group, halt, reason, taken)
        call.finish()


def _release(
    call: Call, group: Any, halt: Halt, reason: dict[str, Any], taken: dict[int, int]
) -> None:
    """Stop the senders whose parts were not taken whole, and take the chunk each has
    in flight, so that they return at once and the group stays in step.

    A sender that stalled or died (named in ``reason``) is told too, should it wake,
    but its chunk is not taken: the group is broken already.
    """
    named = set(reason.get("ranks", ()))
    unfinished = {
        r: chunk_count(call.sizes[r])
        for r in range(call.world)
        if r != call.rank and taken[r] < chunk_count(call.sizes[r])
    }
    try:
        posted = halt.stop(reason, unfinished)
        if reason["kind"] == "timeout":  # gloo closed every connection of this rank
            return
        scratch = torch.empty(min(CHUNK, max(call.sizes, default=0)), dtype=torch.uint8)
        deadline = max(call.ends_at, time.monotonic() + RELEASE_GRACE)
        for rank, count in posted.items():
            if rank in named:  # it died, or its chunk is awaited already: the group is broken
                continue
            for _ in range(count - taken[rank]):
                size = min(CHUNK, call.sizes[rank] - taken[rank] * CHUNK)
                post = functools.partial(dist.irecv, scratch[:size], rank, group=group)
                late = "did not finish the chunk it had in flight"
                _wait(post, rank, deadline, call.what, call.timeout, late)
                taken[rank] += 1
    except GatherError:  # the senders left end at their deadline; the group is marked broken
        return


def part_from(call: Call, src: int) -> Any:
    """``src``'s part on this rank, broadcast chunk by chunk (``src``: its own object)."""
    part = broadcast_chunked(
        _segments(call) if call.rank == src else None,
        call.sizes[src],
        src,
        gloo.group(),
        **_limits(call),
    )
    if part is None:
        return call.own
    return serialize.decode(memoryview(part), rank=src, where=call.what)


def all_from(call: Call) -> list[Any]:
    """Every rank's part on every rank, one broadcast per rank.

    A part that cannot be rebuilt here does not stop this rank from taking part in
    the broadcasts after it (the others would wait for it): its error is raised
    once they are done.
    """
    out: list[Any] = []
    failed: GatherError | None = None
    for src in range(call.world):
        try:
            out.append(part_from(call, src))
        except GatherError as exc:
            if isinstance(exc, (GatherTimeout, RemoteRankError)):  # the transfer failed
                raise
            failed = failed or exc
    if failed is not None:
        raise failed
    return out
