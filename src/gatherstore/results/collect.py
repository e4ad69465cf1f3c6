"""``collect_results``: the dataset-ordered results of a sharded evaluation on one rank."""

from collections.abc import Sequence
from typing import Any

from gatherstore._config import Timeout
from gatherstore.calls.entry import check, group_rank
from gatherstore.calls.objects import gather_prepared
from gatherstore.results.sampling import Order, by_index, check_results, ordered
from gatherstore.stores.base import Store

__all__ = ["collect_results"]


def collect_results(
    results: list[Any],
    size: int | None = None,
    *,
    order: Order = "interleaved",
    indices: Sequence[int] | None = None,
    dst: int | None = None,
    group: Any = None,
    group_dst: int | None = None,
    store: str | Store | None = None,
    timeout: Timeout = None,
    progress: bool | None = None,
    resume: str | None = None,
) -> list[Any] | None:
    """Gather every rank's ``results`` on ``dst`` in dataset order; None elsewhere.

    Results that are None are kept.

    Args:
        results: this rank's results, one per dataset item it held.
        size: the dataset's length: the sampler's padding beyond it is dropped.
        order: ``"interleaved"`` undoes a DistributedSampler split (rank r held items
            r, r+W, ...); ``"contiguous"`` concatenates shards in rank order.
        indices: one dataset index per result: the results are then placed by index,
            duplicates dropped.
        dst: the global rank that gets the results.
        group: gather over that process group's members (None: the default group), the
            shards in group-rank order.
        group_dst: the rank within ``group`` that gets the results.  As in torch, give
            ``dst`` or ``group_dst``, not both; neither: the group's first rank.
        store: where the parts go (None: the default store); see
            ``all_gather_object``.
        timeout: how long the whole call may take: seconds or a ``timedelta``; None:
            ``GATHERSTORE_TIMEOUT``.
        progress: show parts and bytes as they arrive on ``dst``; None: when stderr is
            a terminal and the gather is long, or as ``GATHERSTORE_PROGRESS=0/1`` says.
        resume: a ``ResultSet`` name, in ``store``, which must outlive the job: the
            results are kept in that set under their dataset indices as well, and
            ``dst`` gets every index below ``size`` from this run or an earlier one, so
            that a preempted evaluation continues on any number of ranks
            (``ResultSet(name).pending(range(size))`` says which indices are left).

    Returns:
        On ``dst``, every rank's results in dataset order; None on the other ranks,
        and at once on a rank outside ``group``.

    Raises:
        ValueError: bad arguments (on every rank), or, with ``indices``, a
            dataset index no rank returned (with ``resume``: no run stored).
        TypeError: ``results`` is not a list, or ``group`` is not a process group; or
            a result of this rank cannot be pickled (where in it is named): the other
            ranks raise ``RemoteRankError`` naming this one.
        GatherError: the errors of ``gather_object``; with ``resume``, those of
            ``ResultSet``.

    Examples:
        >>> sampler = DistributedSampler(dataset, shuffle=False)
        >>> preds = [predict(dataset[i]) for i in sampler]  # this rank's items
        >>> ordered = gs.collect_results(preds, size=len(dataset))  # on rank 0; None elsewhere
    """
    what = "collect_results"
    check(what, timeout=timeout, store=store, progress=progress, group=group)
    root = group_rank(what, group, ("dst", dst), ("group_dst", group_dst))
    if resume is not None:
        from gatherstore.results.collect_into import collect_into

        into = (resume, results, size, order, indices, root, store, timeout)
        return collect_into(*into, group=group)

    def payload() -> Any:
        check_results(results, indices, order)
        return (list(results), [int(i) for i in indices] if indices is not None else None)

    gathered = gather_prepared(payload, root, store, timeout, what, progress=progress, group=group)
    return None if gathered is None else _in_order(list(gathered), order, size, indices)


def _in_order(
    parts: list[Any], order: Order, size: int | None, indices: Sequence[int] | None
) -> list[Any]:
    """The gathered ``(results, indices)`` of every rank in dataset order: by their indices
    where ranks gave them, else as ``order`` says."""
    if indices is not None:
        return by_index(parts, size)
    return ordered([p[0] for p in parts], order, size)
