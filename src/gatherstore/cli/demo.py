"""``gatherstore demo``: the main job — a sharded evaluation's predictions, gathered on rank 0.

Each of N local processes holds the detector-like predictions of a
DistributedSampler split (rank r: images r, r+N, ...; see
``gatherstore.cli.bench.payloads``) and sends a CRC-32 per prediction ahead
over the process group.  Rank 0 gathers everything in dataset order with
``gatherstore.collect_results`` (or, with ``stream``, part by part with
``gatherstore.gather_iter`` behind a progress bar) and verifies the count,
the order and every checksum.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from gatherstore._config import ROUTES
from gatherstore._errors import IntegrityError, counted
from gatherstore.calls import objects
from gatherstore.calls.tensors import barrier
from gatherstore.cli.bench import payloads
from gatherstore.cli.bench.baselines import torch_all_gather_object
from gatherstore.cli.bench.measure import PeakMemory, format_bytes
from gatherstore.job import topology
from gatherstore.job.launch import launch
from gatherstore.results import collect as results
from gatherstore.stores.registry import open_store

__all__ = ["DemoConfig", "describe_store", "run", "summary"]


@dataclass
class DemoConfig:
    """The demo's settings: processes, total bytes of predictions, store spec, streaming."""

    nproc: int = 4
    nbytes: int = 64 << 20
    store: str = "tmpdir"
    stream: bool = False
    seed: int = 0
    compare: bool = False


def describe_store(spec: str) -> str:
    """``spec`` as shown to users: the store's URL, with the directory of tmpdir/file stores.

    Raises:
        ValueError / ImportError: the spec names no store gatherstore can open.
    """
    if spec in ROUTES:
        return spec
    with open_store(spec) as store:
        return f"{store} ({store.folder})" if store.folder else str(store)


def _check(image: dict[str, Any], position: int, expected: int) -> None:
    if image["image_id"] != position:
        raise IntegrityError(
            f"demo: dataset position {position} holds image {image['image_id']}; "
            "the interleaved order was not restored"
        )
    if payloads.digest(image) != expected:
        raise IntegrityError(f"demo: the CRC-32 of image {position} does not match its sender's")


def _verify(gathered: list[Any], digests: list[np.ndarray], n_images: int) -> None:
    """Count, order (image_id == position) and the sender's CRC-32 of every prediction."""
    world = len(digests)
    if len(gathered) != n_images:
        raise IntegrityError(f"demo: rank 0 got {len(gathered)} predictions, expected {n_images}")
    for position, image in enumerate(gathered):
        _check(image, position, int(digests[position % world][position // world]))


def _stream(preds: list[Any], cfg: DemoConfig, n_images: int, digests: list[Any] | None) -> None:
    """gather_iter (progress on rank 0's terminal), verifying each part as it arrives."""
    parts = objects.gather_iter(preds, store=cfg.store)
    if digests is None:
        return
    world = len(digests)
    count = 0
    for rank, part in enumerate(parts):
        for k, image in enumerate(part):
            position = rank + k * world
            if position < n_images:  # beyond: the sampler's padding
                _check(image, position, int(digests[rank][k]))
                count += 1
    if count != n_images:
        raise IntegrityError(f"demo: rank 0 got {count} predictions, expected {n_images}")


def _rank_main(cfg: DemoConfig, n_images: int) -> dict[str, Any]:
    """One rank of the demo: make predictions, gather them on rank 0, verify there."""
    rank, world = topology.get_rank(), topology.get_world_size()
    preds = payloads.detections(n_images, rank, world, cfg.seed)
    mine = np.fromiter((payloads.digest(p) for p in preds), dtype=np.uint32, count=len(preds))
    digests = objects.gather_object(mine, store="collective")
    gc.collect()
    barrier()
    with PeakMemory() as mem:
        start = time.perf_counter()
        if cfg.stream:
            _stream(preds, cfg, n_images, digests)
        else:
            gathered = results.collect_results(preds, size=n_images, store=cfg.store)
        seconds = time.perf_counter() - start
    if digests is not None and not cfg.stream:
        assert gathered is not None
        _verify(gathered, digests, n_images)
        del gathered
    out: dict[str, Any] = {"rank": rank, "seconds": seconds, "peak": mem.growth}
    out["images"] = len(preds)
    if cfg.compare:
        out["torch"] = _torch_all_gather_object(preds)
    return out


def _torch_all_gather_object(preds: list[Any]) -> dict[str, float]:
    """The same predictions through ``torch.distributed.all_gather_object``: seconds, peak."""
    gc.collect()
    barrier()
    with PeakMemory() as mem:
        start = time.perf_counter()
        everyone = torch_all_gather_object(preds)
        seconds = time.perf_counter() - start
    del everyone
    return {"seconds": seconds, "peak": mem.growth}


def run(cfg: DemoConfig, out: TextIO = sys.stdout) -> None:
    """Run the demo in ``cfg.nproc`` local gloo processes and print a summary to ``out``.

    Raises:
        RemoteRankError: a rank failed (verification included); carries its message.
        ValueError / ImportError: ``cfg.store`` names no store gatherstore can open.
    """
    where = describe_store(cfg.store)
    n_images = payloads.image_count(cfg.nbytes)
    ranks = launch(_rank_main, nproc_per_node=cfg.nproc, backend="gloo", args=(cfg, n_images))
    out.write(summary(cfg, where, n_images, ranks))


def summary(cfg: DemoConfig, where: str, n_images: int, ranks: list[dict[str, Any]]) -> str:
    """What the demo prints: its ranks and store, the gather's time, rate and peak memory
    per rank (``ranks``: what each rank returned), and torch's with ``cfg.compare``."""
    seconds = ranks[0]["seconds"]
    nbytes = n_images * payloads.IMAGE_BYTES
    how = "gather_iter, verified part by part" if cfg.stream else "collect_results"
    peaks = ", ".join(f"rank {r['rank']} +{format_bytes(r['peak'])}" for r in ranks)
    text = (
        f"gatherstore demo: {counted(cfg.nproc, 'rank')} (gloo), store {where}\n"
        f"gathered {n_images:,} predictions ({format_bytes(nbytes)} of arrays, "
        f"{counted(cfg.nproc, 'part')}) on rank 0 with {how} in {seconds:.3f} s: "
        f"{nbytes / seconds / 2**20:,.1f} MiB/s\n"
        "verified: count, order (image_id == position), CRC-32 of every prediction\n"
        f"peak memory growth: {peaks}\n"
    )
    if cfg.compare:
        theirs = ranks[0]["torch"]["seconds"]
        torch_peaks = ", ".join(
            f"rank {r['rank']} +{format_bytes(r['torch']['peak'])}" for r in ranks
        )
        text += (
            f"torch.distributed.all_gather_object, same predictions, same run: {theirs:.3f} s "
            f"({theirs / seconds:.1f}x gatherstore's time)\n"
            f"its peak memory growth: {torch_peaks}\n"
        )
    return text
