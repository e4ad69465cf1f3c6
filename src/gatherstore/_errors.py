"""The exception hierarchy: one root, each error also a matching builtin.

Data travels as attributes (ranks, keys, store URL) so callers never parse
messages.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The public errors (re-exported by the package); ``first_line``, ``seconds``, ``counted``
#: and ``ranks_named`` help the modules that raise them.
__all__ = [
    "GatherError",
    "GatherTimeout",
    "InsufficientMemoryError",
    "IntegrityError",
    "MismatchError",
    "ProcessGroupError",
    "RemoteRankError",
    "StoreNotSharedError",
    "StoreUnavailableError",
]


class GatherError(Exception):
    """Root of every error gatherstore raises."""


class GatherTimeout(GatherError, TimeoutError):
    """Some ranks (or keys) did not deliver within the timeout.

    Attributes:
        ranks: the ranks that did not arrive, in ascending order.
        keys: the store keys still missing, when the wait was on a store.
        timeout: the timeout in seconds.
    """

    def __init__(
        self,
        message: str,
        *,
        ranks: Sequence[int] = (),
        keys: Sequence[str] = (),
        timeout: float | None = None,
    ) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.keys = list(keys)
        self.timeout = timeout


class ProcessGroupError(GatherError, RuntimeError):
    """The process group itself failed in a tensor collective (a rank died, stopped,
    or called a different collective); replaces torch's raw RuntimeError."""


class RemoteRankError(GatherError, RuntimeError):
    """Another rank failed; every rank raises this so that nobody hangs.

    Attributes:
        rank: the (first) failing rank.
        remote_message: that rank's error message.
        remote_traceback: that rank's traceback text, when known.
        ranks: every failing rank.
    """

    def __init__(
        self,
        rank: int,
        remote_message: str,
        *,
        remote_traceback: str = "",
        ranks: Sequence[int] = (),
        context: str = "",
    ) -> None:
        self.rank = rank
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.ranks = sorted(ranks) if ranks else [rank]
        where = f" in {context}" if context else ""
        text = f"rank {rank} failed{where}: {remote_message}"
        if len(self.ranks) > 1:
            text += f" (failing ranks: {self.ranks})"
        if remote_traceback:
            text += f"\n\n--- traceback of rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class StoreNotSharedError(GatherError, RuntimeError):
    """The store is not visible from every rank (e.g. node-local /tmp, memory://).

    Attributes:
        ranks: the ranks that cannot see rank 0's marker.
        store: the store URL (password hidden).
    """

    def __init__(self, message: str, *, ranks: Sequence[int], store: str) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.store = store


class IntegrityError(GatherError, ValueError):
    """A part failed its checksum or signature, is truncated, or has a foreign format.

    Attributes:
        rank: the rank whose part is bad, when known.
        key: the store key of the part, when known.
    """

    def __init__(self, message: str, *, rank: int | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.key = key


class StoreUnavailableError(GatherError, ConnectionError):
    """The store cannot be reached or written.

    Attributes:
        store: the store URL (password hidden).
    """

    def __init__(self, message: str, *, store: str) -> None:
        super().__init__(message)
        self.store = store


class InsufficientMemoryError(GatherError, MemoryError):
    """The gathered parts would not fit in the receiving rank's available memory.

    Raised on every rank before any data moves; ``gather_iter`` avoids it.
    """


class MismatchError(GatherError, ValueError):
    """Ranks called a collective with inputs that do not agree (keys, dtypes, shapes).

    Attributes:
        details: per-rank description of what differs.
    """

    def __init__(self, message: str, *, details: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.details = dict(details or {})


def first_line(exc: BaseException) -> str:
    """The first line of an error, the failing rank's own for a RemoteRankError."""
    text = (
        exc.remote_message if isinstance(exc, RemoteRankError) else f"{type(exc).__name__}: {exc}"
    )
    return (text.strip().splitlines() or [type(exc).__name__])[0]


def seconds(value: float) -> str:
    """A duration for a message, rounded: ``10`` for 9.99904, ``2.5``, ``0.25``, ``1800``
    (a timeout is often the time left, which no one wants to read to the microsecond)."""
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def counted(count: int, noun: str) -> str:
    """``1 rank``, ``4 ranks``: a count with its noun, singular for one (a message that
    says "1 ranks" reads as a bug)."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def ranks_named(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks [1, 2]``: the ranks a message names, singular for one."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def as_global_ranks(exc: GatherError, members: Sequence[int]) -> None:
    """Make the ranks of ``exc``, an error of a call on a process group whose members are
    the global ranks ``members`` (in group-rank order), global ranks: its ``rank`` and
    ``ranks`` become global ranks, and its message, which counts ranks within the group,
    says which global rank each is."""
    inside = range(len(members))
    named = [r for r in getattr(exc, "ranks", None) or [] if r in inside]
    rank = getattr(exc, "rank", None)
    if isinstance(rank, int) and rank in inside:
        named.append(rank)
        setattr(exc, "rank", members[rank])  # noqa: B010 (not every error has one)
    if hasattr(exc, "ranks"):
        setattr(exc, "ranks", [members[r] if r in inside else r for r in exc.ranks])  # noqa: B010
    which = ", ".join(f"{r} is global rank {members[r]}" for r in sorted(set(named)))
    note = f"ranks counted within the process group of global ranks {list(members)}"
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]} ({note}{': ' + which if which else ''})", *exc.args[1:])
