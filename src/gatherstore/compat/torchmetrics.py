"""torchmetrics with each metric's whole state synced in one gather through gatherstore.

torchmetrics' ``Metric._sync_dist`` runs a padded ``all_gather`` (after a
barrier and a shape exchange) per state tensor, and for list states per
element: ``MeanAveragePrecision`` does it per image and state, then gathers
its segmentation masks with ``all_gather_object``.  A rank with fewer or no
elements runs fewer collectives, and the job hangs.  ``patch()`` sends every
state of a rank as one object through gatherstore (its routes, stores,
errors and clean-up), then applies each state's ``dist_reduce_fx`` exactly as
torchmetrics does after its own gather.  ``patch(compute_on=0)`` gathers the
states on rank 0 only, computes there, and gives every rank rank 0's result.
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import gatherstore as gs
from gatherstore.compat._common import gather_all
from gatherstore.compat._patching import Patch, _import, patch_methods
from gatherstore.compat._raising import Raising

__all__ = ["dist_sync_fn", "patch"]

_PIP = "torchmetrics"
#: MeanAveragePrecision's states of RLE tuples, which its own ``_sync_dist`` gathers.
_MASKS = frozenset({"detection_mask", "groundtruth_mask"})

# the active patch's handle and compute_on; what each replacement replaced ("originals",
# torchmetrics' own _wrap_compute as "wrap"); the _sync_dist replacements ("ours")
_state: dict[str, Any] = {"handle": None, "compute_on": None, "originals": {}, "wrap": None}
_state["ours"] = ()
# id(metric) -> every rank's states, gathered by compute_on before its compute syncs
_gathered: dict[int, list[Any]] = {}


def dist_sync_fn(tensor: Tensor, group: Any = None) -> list[Tensor]:
    """Every rank's ``tensor`` in rank order, on ``tensor``'s device; shapes may differ.

    For ``Metric(dist_sync_fn=dist_sync_fn)`` without ``patch()``: one gatherstore
    gather per state tensor (``patch()`` sends a whole metric in one).  This
    rank's entry is ``tensor`` itself, so autograd reaches it as with
    torchmetrics' own gather.

    Raises:
        RemoteRankError / GatherTimeout: as ``gs.all_gather_object``.
    """
    parts = gather_all(tensor.detach(), group, copies=False)
    me = gs.get_rank(group)
    return [tensor if r == me else p.to(tensor.device) for r, p in enumerate(parts)]


# --- one rank's states, and every rank's merged ---------------------------------------------
def _states(metric: Any, whole: bool, keep: frozenset[str]) -> dict[str, Any]:
    """The states this rank sends, prepared as torchmetrics prepares them for its gather.

    ``"cat"`` lists are concatenated first.  A list with other items than tensors
    is sent only when ``whole`` (the metric's class syncs through this module) or
    named in ``keep``; otherwise it stays as it is, for the class's own
    ``_sync_dist`` to handle, as torchmetrics leaves it.  Non-list, non-tensor
    values stay too.
    """
    from torchmetrics.utilities.data import dim_zero_cat

    out: dict[str, Any] = {}
    for attr, reduce_fx in metric._reductions.items():
        value = getattr(metric, attr)
        if isinstance(value, Tensor):
            out[attr] = value
        elif isinstance(value, list):
            if not (whole or attr in keep or all(isinstance(v, Tensor) for v in value)):
                continue
            out[attr] = (
                [dim_zero_cat(value)] if reduce_fx is dim_zero_cat and len(value) > 1 else value
            )
    return out


@dataclass
class _Packed:
    """A list state's tensors of one dtype, sent as one flat tensor and their shapes: one
    buffer to pickle instead of one per tensor (MAP has several per image)."""

    flat: Tensor
    shapes: list[tuple[int, ...]]

    def unpacked(self, device: Any) -> list[Tensor]:
        """The tensors again (views into the received buffer), on ``device``."""
        pieces = torch.split(self.flat.to(device), [math.prod(shape) for shape in self.shapes])
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes, strict=True)]


def _sendable(value: Any) -> Any:
    """A state as sent: tensors detached, a list of same-dtype tensors packed."""
    if isinstance(value, Tensor):
        return value.detach()
    kinds = {(v.dtype, v.device) if isinstance(v, Tensor) else None for v in value}
    if len(value) > 1 and len(kinds) == 1 and None not in kinds:
        flat = torch.cat([v.detach().reshape(-1) for v in value])
        return _Packed(flat, [tuple(v.shape) for v in value])
    return [v.detach() if isinstance(v, Tensor) else v for v in value]


def _prepared(metric: Any, whole: bool, keep: frozenset[str]) -> tuple[dict[str, Any], Any]:
    """This rank's states, and what it sends (or a Raising if preparing them failed)."""
    try:
        own = _states(metric, whole, keep)
        return own, {attr: _sendable(value) for attr, value in own.items()}
    except Exception as exc:
        return {}, Raising(exc)


def _interleaved(lists: Sequence[list[Any]], me: int, device: Any) -> list[Any]:
    """Item 0 of every rank in rank order, then item 1, ... (torchmetrics' order); lists
    may differ in length.  Other ranks' tensors move to ``device``."""
    longest = max((len(items) for items in lists), default=0)
    return [
        items[i] if r == me or not isinstance(items[i], Tensor) else items[i].to(device)
        for i in range(longest)
        for r, items in enumerate(lists)
        if i < len(items)
    ]


def _list_device(metric: Any, items: list[Any]) -> Any:
    for item in items:
        if isinstance(item, Tensor):
            return item.device
    return torch.device("cpu") if metric.compute_on_cpu else metric.device


def _merge(metric: Any, parts: list[Any], me: int) -> None:
    """Set every sent state to its synced value: tensors stacked, lists interleaved, then
    ``dist_reduce_fx`` applied, as torchmetrics does after its gather."""
    from torchmetrics.utilities.data import dim_zero_cat

    for attr, value in parts[me].items():
        reduce_fx = metric._reductions[attr]
        values = [part[attr] for part in parts]
        if isinstance(value, Tensor):
            synced: Any = torch.stack(
                [v if r == me else v.to(value.device) for r, v in enumerate(values)]
            )
        else:
            device = _list_device(metric, value)
            lists = [v.unpacked(device) if isinstance(v, _Packed) else v for v in values]
            synced = _interleaved(lists, me, device)
            if not synced and reduce_fx is not dim_zero_cat:
                setattr(metric, attr, [])
                continue
            if not synced:  # no rank has data: torchmetrics concatenates its empty stand-ins
                empty = torch.tensor([], device=metric.device, dtype=metric.dtype)
                synced = [empty] * len(parts)
        setattr(metric, attr, reduce_fx(synced) if reduce_fx is not None else synced)


# --- the replacements ------------------------------------------------------------------------
def _defaults() -> tuple[Any, ...]:
    """The ``dist_sync_fn`` values that mean "torchmetrics' own gather"."""
    from torchmetrics.utilities.distributed import gather_all_tensors

    return (None, gather_all_tensors, dist_sync_fn)


def _sync_dist_replacing(keep: frozenset[str]) -> Callable[..., Any]:
    """A ``_sync_dist`` for a class whose own still runs for a ``dist_sync_fn`` of the
    user's; ``keep``: list states it always sends whole."""

    def _sync_dist(self: Any, dist_sync_fn: Any = None, process_group: Any = None) -> None:
        """Every state of every rank in one gatherstore gather, then reduced."""
        if dist_sync_fn not in _defaults():
            original = _state["originals"][_sync_dist]
            return original(self, dist_sync_fn, process_group)  # type: ignore[no-any-return]
        parts = _gathered.pop(id(self), None)
        group = process_group or self.process_group
        if parts is None:
            own, sent = _prepared(self, type(self)._sync_dist is _sync_dist, keep)
            parts = gather_all(sent, group, copies=False)
            parts[gs.get_rank(group)] = own
        _merge(self, parts, gs.get_rank(group))
        return None

    return _sync_dist


def _gather_tuple_list(list_to_gather: list[Any], process_group: Any = None) -> list[Any]:
    """MeanAveragePrecision's gather of mask tuples, in one gatherstore gather; lists may
    differ in length."""
    return _interleaved(gather_all(list_to_gather, process_group), -1, None)


def _syncs_here(metric: Any) -> bool:
    """Whether compute() would sync through this module on every rank of its process group."""
    return bool(
        metric._computed is None
        and metric._to_sync
        and metric._should_unsync  # False inside forward(): dist_sync_on_step syncs every rank
        and metric.dist_sync_fn in _defaults()
        and type(metric)._sync_dist in _state["ours"]
        and metric.distributed_available_fn()
    )


def _compute_on(metric: Any, wrapped: Callable[..., Any], root: int, args: Any, kwargs: Any) -> Any:
    """Gather the states on ``root`` (a rank of the metric's process group) only; it runs
    torchmetrics' compute, every rank of the group gets its result (tensors that were on an
    accelerator move to this rank's metric device)."""
    group = metric.process_group
    own, sent = _prepared(metric, True, frozenset())
    parts = gs.gather_object(sent, group=group, group_dst=root)
    if parts is None:
        value, on_device = gs.broadcast_object(None, group=group, group_src=root)
        flags = iter(on_device)
        value = _tensors_map(value, lambda t: t.to(metric.device) if next(flags) else t)
    else:
        try:
            if isinstance(sent, Raising):
                raise sent.error
            parts[root] = own
            _gathered[id(metric)] = parts
            value = wrapped(*args, **kwargs)
            flagged: list[bool] = []
            _tensors_map(value, lambda t: flagged.append(t.device.type != "cpu"))
            outcome: Any = (value, flagged)
        except Exception as exc:
            outcome = Raising(exc)
        finally:
            _gathered.pop(id(metric), None)
        gs.broadcast_object(outcome, group=group, group_src=root)
    if metric.compute_with_cache:
        metric._computed = value
    return value


def _tensors_map(value: Any, fn: Callable[[Tensor], Any]) -> Any:
    from lightning_utilities import apply_to_collection

    return apply_to_collection(value, Tensor, fn)


def _computing_on(metric: Any, wrapped: Callable[..., Any]) -> Callable[..., Any]:
    """``metric``'s compute: torchmetrics' ``wrapped``, or compute_on's path while a
    ``patch(compute_on=...)`` is active and compute() syncs."""

    @functools.wraps(wrapped)
    def compute(*args: Any, **kwargs: Any) -> Any:
        handle, root = _state["handle"], _state["compute_on"]
        if root is None or handle is None or not handle.active or not _syncs_here(metric):
            return wrapped(*args, **kwargs)
        return _compute_on(metric, wrapped, root, args, kwargs)

    return compute


def _wrap_compute(self: Any, compute: Callable[..., Any]) -> Callable[..., Any]:
    """``Metric._wrap_compute`` under ``patch(compute_on=...)``."""
    return _computing_on(self, _state["wrap"](self, compute))


def _rewrap_existing(metric_class: type) -> None:
    """Give metrics made before the patch the compute_on path: their compute was
    wrapped per instance by torchmetrics' ``Metric.__init__``."""
    theirs = _state["wrap"](None, lambda: None).__code__
    seen: dict[type, bool] = {}
    for obj in gc.get_objects():
        kind = type(obj)
        if kind not in seen:
            seen[kind] = issubclass(kind, metric_class)
        compute = obj.__dict__.get("compute") if seen[kind] else None
        if getattr(compute, "__code__", None) is theirs:
            obj.__dict__["compute"] = _computing_on(obj, compute)  # type: ignore[arg-type]


def patch(compute_on: int | None = None) -> Patch:
    """Make every ``torchmetrics.Metric`` sync its whole state in one gatherstore gather.

    Replaces ``Metric._sync_dist`` and ``MeanAveragePrecision._sync_dist`` and
    ``_gather_tuple_list`` (on the classes, so metrics made before the patch
    sync this way too).  ``compute_on=None``: every rank gets the synced states
    and computes, as torchmetrics does.  ``compute_on=r``: only rank ``r`` (of each
    metric's ``process_group``: the global rank for the default group) receives the
    states and computes; every rank of the group gets its result (also replaces
    ``Metric._wrap_compute``, and rewraps the compute of live metrics).  A
    ``process_group`` of any kind syncs through gatherstore.
    ``unsync()``, ``sync_on_compute=False``, ``dist_sync_on_step`` and a
    ``dist_sync_fn`` of your own keep torchmetrics' meaning.  Calling it again
    with the same ``compute_on`` returns the active handle.

    Raises:
        ImportError: torchmetrics is not installed.
        ValueError: ``compute_on`` is not None or a rank number, or torchmetrics is
            already patched with another ``compute_on``.
    """
    if compute_on is not None and (type(compute_on) is not int or compute_on < 0):
        raise ValueError(f"compute_on={compute_on!r}: use None (every rank) or a rank number")
    current: Patch | None = _state["handle"]
    if current is not None and current.active:
        if _state["compute_on"] != compute_on:
            raise ValueError(
                f"torchmetrics is already patched with compute_on={_state['compute_on']!r}; "
                f"undo() that patch before patch(compute_on={compute_on!r})"
            )
        return current
    metric_class = _import("torchmetrics.metric", _PIP).Metric
    map_class = _import("torchmetrics.detection.mean_ap", _PIP).MeanAveragePrecision
    metric_sync, map_sync = _sync_dist_replacing(frozenset()), _sync_dist_replacing(_MASKS)
    methods: dict[str, Any] = {"_sync_dist": metric_sync}
    if compute_on is not None:
        methods["_wrap_compute"] = _wrap_compute
    # only these two classes: a subclass's own _sync_dist (CompositionalMetric's, yours) stays
    handle = patch_methods("torchmetrics.metric", _PIP, "Metric", methods, overrides=False)
    handle.swap(map_class, "_sync_dist", map_sync)
    handle.swap(map_class, "_gather_tuple_list", staticmethod(_gather_tuple_list))
    originals = {vars(owner)[name]: original for owner, name, original in handle.swapped}
    _state.update(handle=handle, compute_on=compute_on, originals=originals)
    _state.update(wrap=originals.get(_wrap_compute), ours=(metric_sync, map_sync))
    if compute_on is not None:
        _rewrap_existing(metric_class)
    return handle
