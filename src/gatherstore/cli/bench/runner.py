"""Run the bench: each (case, payload, size, world) in fresh processes, repeated, measured."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gatherstore._config import ROUTES
from gatherstore._errors import GatherError, RemoteRankError
from gatherstore.calls import objects
from gatherstore.cli.bench import baselines, payloads
from gatherstore.cli.bench.cases import BASELINE, Case
from gatherstore.cli.bench.measure import PeakMemory
from gatherstore.job import topology
from gatherstore.job.launch import launch
from gatherstore.stores.registry import open_store

__all__ = ["Plan", "run_cases"]

_WARMUP_BYTES = 1 << 16
Op = Callable[[Any, int], int]


@dataclass
class Plan:
    """What to run: ``sizes`` as (label, bytes), ``worlds``, ``payloads``, ``repeats``;
    ``map_images``: images per rank of the torchmetrics cases."""

    sizes: list[tuple[str, int]]
    worlds: list[int]
    payloads: list[str]
    repeats: int
    timeout: float
    map_images: int = 200


def _count(parts: list[Any] | None) -> int:
    return -1 if parts is None else len(parts)


def _gatherstore(case: Case, timeout: float) -> Op:
    store = case.store if case.store in ROUTES else open_store(case.store, **case.options)
    if case.op == "gather_iter":

        def stream(obj: Any, size: int) -> int:
            count = 0
            for part in objects.gather_iter(obj, store=store, timeout=timeout):
                del part  # before the next part is read: one part in memory
                count += 1
            return count if topology.get_rank() == 0 else -1

        return stream
    return lambda obj, size: _count(objects.gather_object(obj, store=store, timeout=timeout))


def _operation(case: Case, timeout: float) -> Op:
    """``op(obj, size)``: gather ``obj`` to rank 0; the number of items rank 0 got (else -1)."""
    if case.op == "all_gather_object":
        return lambda obj, size: len(baselines.torch_all_gather_object(obj))
    if case.op == "torch_gather_object":
        return lambda obj, size: _count(baselines.torch_gather_object(obj))
    if case.op == "mmengine":
        collect = baselines.mmengine_collect_results_cpu()[0]
        return lambda obj, size: _count(collect(obj if isinstance(obj, list) else [obj], size))
    return _gatherstore(case, timeout)


def _expected(case: Case, kind: str, nbytes: int, world: int) -> tuple[int, int]:
    """(size passed to the op, items rank 0 must receive)."""
    size = payloads.image_count(nbytes) if kind == "detections" else world
    return size, size if case.op == "mmengine" else world


def _worker(case: Case, kind: str, nbytes: int, repeats: int, workdir: str, timeout: float) -> Any:
    """One rank of one case: warm up, then ``repeats`` measured gathers of the payload."""
    os.chdir(workdir)  # mmengine's .dist_test goes here
    rank, world = topology.get_rank(), topology.get_world_size()
    op = _operation(case, timeout)
    warm = payloads.make(kind, _WARMUP_BYTES, rank, world)
    op(warm, _expected(case, kind, _WARMUP_BYTES, world)[0])
    del warm
    obj = payloads.make(kind, nbytes, rank, world)
    size, expected = _expected(case, kind, nbytes, world)
    times, peaks, reset, phases = [], [], True, []
    gpu = _GpuMemory(kind, rank)
    for _ in range(repeats):
        gc.collect()
        dist.barrier()
        with PeakMemory() as mem, _Phases() as calls:
            start = time.perf_counter()
            count = op(obj, size)
            times.append(time.perf_counter() - start)
        peaks.append(mem.growth)
        phases.append(calls.total())
        reset = reset and mem.reset
        if rank == 0 and count != expected:
            raise GatherError(f"{case.name}: rank 0 got {count} items, expected {expected}")
    measured = {"times": times, "peaks": peaks, "reset": reset, "phases": phases}
    return {**measured, **gpu.measured()}


class _Phases(logging.Handler, contextlib.AbstractContextManager["_Phases"]):
    """The seconds of each phase of the gatherstore calls made inside the ``with``
    (encode, agree, write, read...: the DEBUG line each call logs carries them)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.calls: list[dict[str, float]] = []
        self.logger = logging.getLogger("gatherstore")

    def emit(self, record: logging.LogRecord) -> None:
        phases = getattr(record, "gatherstore_phases", None)
        if phases is not None:
            self.calls.append(phases)

    def __enter__(self) -> _Phases:
        self.saved_level = self.logger.level
        self.logger.setLevel(logging.DEBUG)  # no handler prints DEBUG in a bench process
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.saved_level)

    def total(self) -> dict[str, float]:
        """Each phase's seconds, summed over the calls."""
        out: Counter[str] = Counter()
        for phases in self.calls:
            out.update(phases)
        return dict(out)


class _GpuMemory:
    """GPU memory a rank holds (its payload) and its peak beyond that during the gathers
    (CUDA payloads only)."""

    def __init__(self, kind: str, rank: int) -> None:
        self.device = payloads.cuda_device(rank) if kind.startswith("cuda") else None
        if self.device:
            torch.cuda.synchronize(self.device)
            self.held = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def measured(self) -> dict[str, int]:
        if not self.device:
            return {}
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        return {"gpu_held": self.held, "gpu_growth": peak - self.held}


def _summarise(ranks: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """Median over repeats of the slowest rank's time; peak growth per rank (max of repeats)."""
    per_repeat = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    seconds = statistics.median(per_repeat)
    peaks = [max(r["peaks"]) for r in ranks]
    phases = ranks[0]["phases"]
    out = {
        "seconds": seconds,
        "times": per_repeat,
        # the destination's phases, medians over repeats (a phase missing in one counts 0)
        "dst_phases": {
            name: statistics.median(p.get(name, 0.0) for p in phases)
            for name in dict.fromkeys(name for p in phases for name in p)
        },
        "gbps": nbytes / seconds / 1e9,
        "dst_peak": peaks[0],
        "other_peak": max(peaks[1:], default=0),
        "peak_reset": all(r["reset"] for r in ranks),
    }
    if "gpu_held" in ranks[0]:
        out["gpu_held"] = [r["gpu_held"] for r in ranks]
        out["gpu_growth"] = [r["gpu_growth"] for r in ranks]
    return out


def _worst(record: dict[str, Any]) -> int:
    return int(max(record["dst_peak"], record["other_peak"]))


def _ratios(records: list[dict[str, Any]]) -> None:
    """Time and worst-rank memory of each record relative to the baseline of its group."""
    group = ("payload", "size", "world")
    refs = {
        tuple(r[k] for k in group): r
        for r in records
        if r["case"] == BASELINE and r["error"] is None
    }
    for r in records:
        ref = refs.get(tuple(r[k] for k in group))
        done = ref is not None and r["error"] is None
        r["time_ratio"] = r["seconds"] / ref["seconds"] if done and ref else None
        r["mem_ratio"] = _worst(r) / _worst(ref) if done and ref and _worst(ref) else None


#: The ceilings a case's service is compared with: (its client library's defaults, the
#: fast settings). Where the defaults were measured more than one way (redis-py with and
#: without hiredis) the share is of the faster.
_SERVICE_CEILINGS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "shm": (("shm_gbps",), None),
    "redis": (("redis_default_gbps", "redis_default_hiredis_gbps"), "redis_fast_gbps"),
    "s3": (("s3_default_gbps",), "s3_fast_gbps"),
}


def _fractions(record: dict[str, Any], ceilings: dict[str, float | None]) -> None:
    """The case's GB/s as a share of the machine's and of its service's ceilings."""
    clients, fast = _SERVICE_CEILINGS.get(record.get("service") or "", ((), None))
    limits = {
        "memcpy": ceilings.get("memcpy_gbps"),
        "shm": ceilings.get("shm_gbps"),
        "pickle_dumps": ceilings.get("pickle_dumps_gbps"),
        "client": max((c for k in clients if (c := ceilings.get(k))), default=None),
        "fast": ceilings.get(fast) if fast else None,
    }
    for name, limit in limits.items():
        record[f"of_{name}"] = record["gbps"] / limit if limit and "gbps" in record else None


def _jobs(plan: Plan, cases: list[Case]) -> Iterator[tuple[int, str, int, str, Case]]:
    for world in plan.worlds:
        for label, nbytes in plan.sizes:
            for kind in plan.payloads:
                for case in cases:
                    yield world, label, nbytes, kind, case


def run_cases(
    plan: Plan,
    cases: list[Case],
    workdir: Path,
    ceilings: dict[str, float | None],
    progress: bool,
) -> list[dict[str, Any]]:
    """Every case of ``plan``, each in one ``gs.launch`` of fresh processes; one record each.

    A case that fails is recorded with its one-line ``error``; the others still run.
    """
    jobs = list(_jobs(plan, cases))
    records = []
    for i, (world, label, nbytes, kind, case) in enumerate(jobs):
        if progress:  # one line per case on stderr (the table or JSON goes to stdout)
            print(f"bench: case {i + 1}/{len(jobs)}: {case.name} {kind} {label} W={world}",
                  file=sys.stderr, flush=True)  # fmt: skip
        record: dict[str, Any] = {
            "kind": "case",
            "case": case.name,
            "store": case.store or None,
            "service": case.service or None,
            "impl": case.impl or "gatherstore",
            "payload": kind,
            "size": label,
            "bytes": nbytes,
            "world": world,
            "repeats": plan.repeats,
            "error": None,
        }
        started = time.perf_counter()
        try:
            ranks = launch(
                _worker,
                nproc_per_node=world,
                backend="gloo",
                args=(case, kind, nbytes, plan.repeats, str(workdir), plan.timeout),
                timeout=plan.timeout,
            )
            record.update(_summarise(ranks, nbytes))
            _fractions(record, ceilings)
        except RemoteRankError as exc:
            record["error"] = exc.remote_message.splitlines()[0]
        record["wall_s"] = time.perf_counter() - started  # processes' start and end included
        records.append(record)
    _ratios(records)
    return records
