"""The bench's torchmetrics case: ``MeanAveragePrecision``'s sync and compute in W gloo
processes, unpatched, patched, and patched with ``compute_on=0``.

Each rank updates a fresh metric with N images (10 detections and 5 ground-truth
boxes each, 3 classes, pycocotools backend), then ``sync()`` (timed, then undone)
and ``compute()`` (timed, peak RSS growth, torch.distributed collectives and
gatherstore calls counted).  MAP needs torchvision's box conversion: the installed
torchvision, else the stand-in in a source checkout's ``tests/standins``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gatherstore
from gatherstore._errors import RemoteRankError
from gatherstore.cli.bench.cases import TORCHMETRICS, Case
from gatherstore.cli.bench.measure import PeakMemory, format_bytes
from gatherstore.job.launch import launch

__all__ = ["Calls", "counted", "run", "table"]

_COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "scatter",
    "scatter_object_list",
)
_GATHERS = ("all_gather_object", "gather_object", "broadcast_object", "gather_iter")
_DETECTIONS, _TRUTHS, _CLASSES = 10, 5, 3


@dataclass
class Calls:
    """Calls made inside ``counted``: how many and seconds spent, by name."""

    counts: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def total(self, prefix: str) -> int:
        """Calls whose name starts with ``prefix`` ("torch." or "gs.")."""
        return sum(n for name, n in self.counts.items() if name.startswith(prefix))


def _counting(fn: Callable[..., Any], label: str, calls: Calls) -> Callable[..., Any]:
    def counting(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            calls.counts[label] = calls.counts.get(label, 0) + 1
            calls.seconds[label] = calls.seconds.get(label, 0.0) + time.perf_counter() - start

    return counting


@contextlib.contextmanager
def counted() -> Iterator[Calls]:
    """Count and time torch.distributed's collectives and gatherstore's object calls
    made inside the block, by whoever makes them through the module attributes."""
    calls = Calls()
    targets = [(dist, "torch.", name) for name in _COLLECTIVES]
    targets += [(gatherstore, "gs.", name) for name in _GATHERS]
    saved = [(module, name, getattr(module, name)) for module, _, name in targets]
    for (module, prefix, name), (_, _, original) in zip(targets, saved, strict=True):
        setattr(module, name, _counting(original, prefix + name, calls))
    try:
        yield calls
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _use_torchvision() -> None:
    """Put the tests' torchvision stand-in on sys.path when no torchvision is installed
    (before torchmetrics is imported: it checks once)."""
    if importlib.util.find_spec("torchvision") is None:
        standins = Path(__file__).resolve().parents[4] / "tests" / "standins"
        if (standins / "torchvision").is_dir():
            sys.path.insert(0, str(standins))


def _images(rank: int, count: int, seed: int) -> Iterator[tuple[Any, Any]]:
    """``count`` images of (predictions, targets), the same for the same (rank, seed)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    for _ in range(count):
        corner = torch.rand(_DETECTIONS, 2, generator=g) * 560
        boxes = torch.cat([corner, corner + 16 + torch.rand(_DETECTIONS, 2, generator=g) * 64], 1)
        truth = boxes[:_TRUTHS] + torch.randn(_TRUTHS, 4, generator=g) * 6
        scores = torch.rand(_DETECTIONS, generator=g)
        labels = torch.randint(0, _CLASSES, (_DETECTIONS,), generator=g)
        pred = {"boxes": boxes, "scores": scores, "labels": labels}
        yield [pred], [{"boxes": truth, "labels": labels[:_TRUTHS].clone()}]


def _filled(make: Callable[[], Any], rank: int, images: int, seed: int) -> Any:
    metric = make()
    for preds, target in _images(rank, images, seed):
        metric.update(preds, target)
    return metric


def _worker(patched: bool, compute_on: int | None, images: int, repeats: int) -> dict[str, Any]:
    """One rank: warm up, then per repeat a timed sync() (undone) and a measured compute()."""
    _use_torchvision()
    from torchmetrics.detection.mean_ap import MeanAveragePrecision

    from gatherstore.compat import torchmetrics as compat

    rank = gatherstore.get_rank()
    handle = compat.patch(compute_on=compute_on) if patched else None

    def make() -> Any:
        return MeanAveragePrecision(backend="pycocotools")

    _filled(make, rank, 2, -1).compute()
    out: dict[str, list[Any]] = {k: [] for k in ("sync", "compute", "peak", "torch", "gs", "map")}
    for repeat in range(repeats):
        metric = _filled(make, rank, images, repeat)
        if compute_on is None:
            dist.barrier()
            start = time.perf_counter()
            metric.sync()
            out["sync"].append(time.perf_counter() - start)
            metric.unsync()
        gc.collect()
        dist.barrier()
        with PeakMemory() as mem, counted() as calls:
            start = time.perf_counter()
            result = metric.compute()
            out["compute"].append(time.perf_counter() - start)
        if compute_on is not None:
            out["sync"].append(calls.seconds.get("gs.gather_object", 0.0))
        out["peak"].append(mem.growth)
        out["torch"].append(calls.total("torch."))
        out["gs"].append(calls.total("gs."))
        out["map"].append(float(result["map"]))
        del metric, result
    if handle is not None:
        handle.undo()
    return out


def _summary(ranks: list[dict[str, Any]], compute_on: int | None) -> dict[str, Any]:
    """Medians over repeats of the slowest rank (sync with compute_on: rank 0's gather)."""
    repeats = range(len(ranks[0]["compute"]))

    def slowest(key: str) -> float:
        return float(statistics.median(max(r[key][i] for r in ranks) for i in repeats))

    peaks = [max(r["peak"]) for r in ranks]
    return {
        "sync_s": statistics.median(ranks[0]["sync"])
        if compute_on is not None
        else slowest("sync"),
        "compute_s": slowest("compute"),
        "dst_peak": peaks[0],
        "other_peak": max(peaks[1:], default=0),
        "torch_calls": max(r["torch"][-1] for r in ranks),
        "gs_calls": max(r["gs"][-1] for r in ranks),
        "map": ranks[0]["map"][-1],
        "same_map": all(len({r["map"][i] for r in ranks}) == 1 for i in repeats),
    }


def run(
    chosen: list[Case], worlds: list[int], images: int, repeats: int, timeout: float
) -> list[Any]:
    """Each chosen case for each world size, in fresh processes; one record each."""
    records = []
    for world in worlds:
        for case in chosen:
            record: dict[str, Any] = {"kind": TORCHMETRICS, "case": case.name, "impl": case.impl}
            record.update(world=world, images=images, repeats=repeats, error=None)
            patched, compute_on = case.options["patched"], case.options["compute_on"]
            try:
                ranks = launch(
                    _worker,
                    nproc_per_node=world,
                    backend="gloo",
                    args=(patched, compute_on, images, repeats),
                    timeout=timeout,
                )
                record.update(_summary(ranks, compute_on))
            except RemoteRankError as exc:
                record["error"] = exc.remote_message.splitlines()[0]
            records.append(record)
    return records


_COLUMNS = [
    *("case", "W", "images/rank", "sync s", "compute s", "rank 0 peak", "other peak"),
    *("torch.distributed calls", "gatherstore calls", "mAP"),
]


def _row(r: dict[str, Any]) -> list[str]:
    head = [f"{r['case']} ({r['impl']})", str(r["world"]), str(r["images"])]
    if r["error"] is not None:
        return [*head, f"failed: {r['error']}"]
    return [
        *head,
        f"{r['sync_s']:.3f}",
        f"{r['compute_s']:.3f}",
        format_bytes(r["dst_peak"]),
        format_bytes(r["other_peak"]),
        str(r["torch_calls"]),
        str(r["gs_calls"]),
        f"{r['map']:.4f}" + ("" if r["same_map"] else " (ranks differ)"),
    ]


def table(records: list[dict[str, Any]]) -> str:
    """The MAP records as an aligned table, with how to read it."""
    rows = [_COLUMNS] + [_row(r) for r in records]
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) for row in rows]
    return "\n".join(
        [
            *lines,
            "",
            "MeanAveragePrecision (pycocotools) sync and compute; sync: metric.sync(), slowest",
            "rank (compute_on=0: rank 0's gather inside compute()); compute: compute(), sync",
            "included, slowest rank; peak: VmHWM growth during compute() (other = worst other",
            "rank); calls: per rank during compute(); medians over repeats; mAP: the last",
            "repeat's (every case updates with the same images).",
        ]
    )
