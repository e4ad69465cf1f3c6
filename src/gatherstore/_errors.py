"""The exception hierarchy: one root, each error also a matching builtin.

Data travels as attributes (ranks, keys, store URL) so callers never parse
messages.
"""

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
    """Root of the errors of a call: what went wrong with a rank, the store, the data or
    memory, never the arguments (those raise ``ValueError`` or ``TypeError``).

    Raised as itself when a part arrived intact but cannot be rebuilt (the unpickler's
    error is its ``__cause__``), when a chunk of a part is gone, when another job that
    is alive writes a result set, and after a transfer over gatherstore's gloo group did
    not finish.

    Examples:
        >>> try:
        ...     merged = gs.gather_object(preds)
        ... except gs.GatherError as exc:  # every subclass below
        ...     log.error("evaluation lost: %s", exc)
    """


class GatherTimeout(GatherError, TimeoutError):
    """Some ranks (or store keys) did not deliver within the call's timeout.

    Attributes:
        ranks: the ranks that did not arrive, in ascending order.
        keys: the store keys still missing, when the wait was on a store.
        timeout: the timeout in seconds, when the call had one.

    Examples:
        >>> try:
        ...     gs.barrier(timeout=60)
        ... except gs.GatherTimeout as exc:
        ...     print("late or lost:", exc.ranks)
    """

    ranks: list[int]
    keys: list[str]
    timeout: float | None

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
    or called a different collective); replaces torch's raw ``RuntimeError``.

    Examples:
        >>> try:
        ...     total = gs.all_reduce(loss)
        ... except gs.ProcessGroupError:  # the job's group is broken: end the job
        ...     raise SystemExit(1)
    """


class RemoteRankError(GatherError, RuntimeError):
    """Another rank failed; every other rank raises this at once, so that nobody hangs.

    ``gs.launch`` raises it too when a child raised or died.

    Attributes:
        rank: the (first) failing rank.
        remote_message: that rank's error message.
        remote_traceback: that rank's traceback text ("" when unknown).
        ranks: every failing rank, in ascending order.

    Examples:
        >>> try:
        ...     gs.launch(evaluate, nproc_per_node=4)
        ... except gs.RemoteRankError as exc:
        ...     print(exc.rank, exc.remote_traceback)  # where it started, and its traceback
    """

    rank: int
    remote_message: str
    remote_traceback: str
    ranks: list[int]

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
    """The store is not visible from every rank (e.g. node-local /tmp, ``memory://``).

    Attributes:
        ranks: the ranks that cannot see rank 0's marker, in ascending order.
        store: the store URL (password hidden).

    Examples:
        >>> try:
        ...     gs.all_gather_object(part, store="file:///tmp/gather")  # /tmp of each node
        ... except gs.StoreNotSharedError as exc:
        ...     print(exc.store, "is not shared with ranks", exc.ranks)
    """

    ranks: list[int]
    store: str

    def __init__(self, message: str, *, ranks: Sequence[int], store: str) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.store = store


class IntegrityError(GatherError, ValueError):
    """A part failed its checksum or signature, is truncated, or has a foreign format.

    Attributes:
        rank: the rank whose part is bad, when known.
        key: the store key of the part, when known.

    Examples:
        >>> try:
        ...     merged = gs.gather_object(preds, store="redis://db:6379/0")
        ... except gs.IntegrityError as exc:
        ...     print("damaged part of rank", exc.rank, "at", exc.key)
    """

    rank: int | None
    key: str | None

    def __init__(self, message: str, *, rank: int | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.key = key


class StoreUnavailableError(GatherError, ConnectionError):
    """The store cannot be reached or written; the message keeps the backend's reason.

    Attributes:
        store: the store URL (password hidden).

    Examples:
        >>> try:
        ...     merged = gs.gather_object(preds, store="redis://db:6379/0")
        ... except gs.StoreUnavailableError as exc:
        ...     print("down:", exc.store)
    """

    store: str

    def __init__(self, message: str, *, store: str) -> None:
        super().__init__(message)
        self.store = store


class InsufficientMemoryError(GatherError, MemoryError):
    """The gathered parts would not fit in the receiving rank's available memory.

    Raised on every rank before any data moves (or while a part is unpickled, with
    128 MiB left); ``gs.gather_iter`` avoids it.

    Examples:
        >>> try:
        ...     merged = gs.gather_object(preds)
        ... except gs.InsufficientMemoryError:
        ...     merged = None  # gs.gather_iter reads the parts one at a time instead
    """


class MismatchError(GatherError, ValueError):
    """Ranks called a collective with inputs that do not agree (keys, dtypes, shapes),
    or made different calls at the same step.

    Attributes:
        details: what each rank had, by rank.

    Examples:
        >>> try:
        ...     totals = gs.all_reduce_dict(metrics)
        ... except gs.MismatchError as exc:
        ...     for rank, had in exc.details.items():
        ...         print(rank, had)
    """

    details: dict[int, str]

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
