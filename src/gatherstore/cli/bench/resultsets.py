"""``gatherstore bench --result-sets [ADD,ITEMS]``: gs.ResultSet's figures and their
baselines, measured in the same run, through a ``file://`` store in a fresh folder
under the temp dir (``TMPDIR`` picks another disk).

- **add**: one process evaluates ADD bytes of detections image by image, each image's
  100 boxes made with numpy, and appends them to a list, or adds them to a result set;
  the loops take turns.  Twice: with nothing else in the loop (a producer that holds
  the interpreter all the time, so that the set's encoding in the background competes
  with it for the GIL: an upper bound), and with a model step off the interpreter, as
  evaluation loops have (a GPU's 1 ms per 16 images).  Reported: each loop's seconds,
  the overhead (the median of each add loop against the list loop just before it, and
  every pair), and how long the last values take to be durable after the loop.
- **gather**: W=4 ranks hold those detections (a DistributedSampler's split);
  ``rs.gather()`` after the adds against ``gs.gather_object`` of each rank's list,
  through the same store and through the default store; the destination's seconds.
- **items**: ITEMS bytes stored by 4 ranks, read back with ``items()`` in a fresh
  process: the growth of its peak RSS, and its rate.
- **export**: that set to one Parquet file, against ``pyarrow.parquet.write_table`` of
  the same rows in one Arrow table and against the disk (see
  ``gatherstore.cli.bench.exports``, which ``--export`` runs with more files).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from gatherstore.cli.bench import exports
from gatherstore.cli.bench.measure import PeakMemory, format_bytes
from gatherstore.cli.bench.payloads import BOXES, image_count, shard
from gatherstore.job.launch import launch

__all__ = ["main"]

#: Images per batch of the loop with a model step, and the seconds of that step: a GPU
#: that runs a detector at 16,000 images a second, faster than any there is.
BATCH, MODEL = 16, 0.001
_MODEL = f"with a {MODEL * 1e3:g} ms model step off the interpreter per {BATCH} images"


def _image(rng: np.random.Generator, image_id: int) -> dict[str, Any]:
    """One image's predictions, made as the bench's detections payload makes them."""
    corner = rng.random((BOXES, 2), dtype=np.float32) * 640
    extent = rng.random((BOXES, 2), dtype=np.float32) * 128 + 1
    return {
        "image_id": image_id,
        "boxes": np.concatenate([corner, corner + extent], axis=1),
        "scores": -np.sort(-rng.random(BOXES, dtype=np.float32)),
        "labels": rng.integers(0, 80, BOXES, dtype=np.int64),
        "file_name": f"val/{image_id:012d}.jpg",
    }


def _add_loops(url: str, images: int, repeats: int, model: float) -> dict[str, list[float]]:
    """In a process of its own: the list loop and the result-set loop, taking turns;
    with ``model``, each batch of :data:`BATCH` images also waits that many seconds off
    the interpreter, as a loop does while the GPU runs the model."""
    import gatherstore as gs

    out: dict[str, list[float]] = {"list": [], "add": [], "durable": []}
    for repeat in range(repeats):
        rng = np.random.default_rng(repeat)
        kept: list[Any] = []
        began = time.perf_counter()
        for i in range(images):
            if model and not i % BATCH:
                time.sleep(model)
            kept.append(_image(rng, i))
        out["list"].append(time.perf_counter() - began)
        del kept
        rs = gs.ResultSet(f"bench/add-{repeat}", store=url)
        rng = np.random.default_rng(repeat)
        began = time.perf_counter()
        for i in range(images):
            if model and not i % BATCH:
                time.sleep(model)
            rs.add(i, _image(rng, i))
        out["add"].append(time.perf_counter() - began)
        rs.flush()
        out["durable"].append(time.perf_counter() - began - out["add"][-1])
        rs.discard()
    return out


def _add_costs(url: str, images: int) -> dict[str, float]:
    """In a process of its own, seconds per value: of ``list.append``; of ``rs.add`` with
    no flush due (what the loop pays); of writing them as the writer's thread does, chunk
    by chunk of the default size, here in this thread (what that thread pays); and of
    encoding those chunks alone (about what it holds the interpreter for: the checksum
    and the write let go of it)."""
    import gatherstore as gs
    from gatherstore.results import layout

    rng = np.random.default_rng(0)
    values = [_image(rng, i) for i in range(images)]
    kept: list[Any] = []
    began = time.perf_counter()
    for value in values:
        kept.append(value)
    listed = time.perf_counter() - began
    rs = gs.ResultSet("bench/costs", store=url, flush_every=(1 << 40, "1TB", "3600s"))
    began = time.perf_counter()
    for i, value in enumerate(values):
        rs.add(i, value)
    added = time.perf_counter() - began
    rs.discard()
    rs = gs.ResultSet("bench/costs", store=url)
    assert rs._writer is not None  # open to write
    per_chunk = max(1, rs._writer.policy.nbytes // rs._write_chunk([(0, values[0])]))
    chunks: list[list[tuple[int | str, Any]]] = [
        list(enumerate(values[i : i + per_chunk], i)) for i in range(0, images, per_chunk)
    ]
    began = time.perf_counter()
    for chunk in chunks:
        rs._write_chunk(chunk)
    written = time.perf_counter() - began
    began = time.perf_counter()
    for chunk in chunks:
        layout.encode_chunk(chunk, "bench", None, "bench")
    encoded = time.perf_counter() - began
    rs.discard()
    seconds = {"list": listed, "add": added, "write": written, "encode": encoded}
    return {name: spent / images for name, spent in seconds.items()}


def _add_shard(url: str, name: str, images: int) -> None:
    """In a rank: add this rank's share of ``images`` detections to the set ``name``."""
    import gatherstore as gs

    rank, world = gs.get_rank(), gs.get_world_size()
    rs = gs.ResultSet(name, store=url)
    rng = np.random.default_rng(rank)
    for position in shard(images, rank, world):
        rs.add(position, _image(rng, position % images))
    rs.close()


def _gather_rank(url: str, images: int, repeats: int) -> dict[str, list[float]] | None:
    """In a rank: gather_object (same store, default store) and rs.gather, taking turns."""
    import torch.distributed as dist

    import gatherstore as gs

    rank, world = gs.get_rank(), gs.get_world_size()
    positions = shard(images, rank, world)
    rng = np.random.default_rng(rank)
    mine = [_image(rng, p % images) for p in positions]
    same_store = gs.open_store(url)
    times: dict[str, list[float]] = {"gather_object": [], "gather_object auto": [], "rs": []}
    for repeat in range(repeats):
        rs = gs.ResultSet(f"bench/gather-{repeat}", store=same_store)
        for position, image in zip(positions, mine, strict=True):
            rs.add(position, image)
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("gather_object", lambda: gs.gather_object(mine, store=same_store)),
            ("gather_object auto", lambda: gs.gather_object(mine)),
            ("rs", rs.gather),
        ]
        for label, call in calls:
            dist.barrier()
            began = time.perf_counter()
            got = call()
            times[label].append(time.perf_counter() - began)
            del got
        rs.discard()
    return times if rank == 0 else None


def _read(url: str, name: str) -> dict[str, float]:
    """In a process of its own: items() with its peak RSS."""
    import gatherstore as gs

    rs = gs.ResultSet(name, store=url, mode="r")
    count = 0
    began = time.perf_counter()
    with PeakMemory() as peak:
        for _ in rs.items():
            count += 1
    read = time.perf_counter() - began
    rs.close()
    return {"count": count, "read": read, "growth": peak.growth, "reset": peak.reset}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _adding(url: str, add_bytes: int, repeats: int) -> list[str]:
    images = image_count(add_bytes)
    costs = launch(_add_costs, args=(url, images))[0]
    lines = [
        f"add: {format_bytes(add_bytes)} of detections ({images} images)",
        f"  per value: list.append {costs['list'] * 1e6:.2f} us; rs.add "
        f"{costs['add'] * 1e6:.2f} us in the loop, and {costs['write'] * 1e6:.2f} us in the "
        f"writer's thread ({add_bytes / (costs['write'] * images) / 1e9:.2f} GB/s), of "
        f"which encoding, which holds the interpreter, {costs['encode'] * 1e6:.2f} us",
    ]
    for model, label in [(0.0, "numpy makes the boxes, nothing else"), (MODEL, _MODEL)]:
        added = launch(_add_loops, args=(url, images, repeats, model))[0]
        listed, adding = _median(added["list"]), _median(added["add"])
        held = costs["encode"] * images / listed
        # each add loop against the list loop just before it: a neighbour's load moves both
        pairs = sorted(a / b - 1 for a, b in zip(added["add"], added["list"], strict=True))
        lines += [
            f"  {label}:",
            f"    list.append loop  {listed:8.2f} s",
            f"    rs.add loop       {adding:8.2f} s  {_median(pairs):+.1%} (goal: at most +5%; "
            f"each pair {', '.join(f'{p:+.1%}' for p in pairs)}); durable "
            f"{_median(added['durable']):.2f} s after the loop",
            f"    the writer's encoding alone holds the interpreter for {held:.1%} of the "
            "list loop's time",
        ]
    return lines


def _gathering(url: str, add_bytes: int, repeats: int) -> list[str]:
    images = image_count(add_bytes)
    gathered = launch(_gather_rank, nproc_per_node=4, args=(url, images, repeats))[0]
    own, auto, rs = (_median(gathered[k]) for k in ("gather_object", "gather_object auto", "rs"))
    return [
        f"gather: W=4, {format_bytes(add_bytes)}; the destination's seconds",
        f"  gs.gather_object, same store   {own:6.2f} s",
        f"  gs.gather_object, auto         {auto:6.2f} s",
        f"  rs.gather                      {rs:6.2f} s  {rs / own:.2f}x the same store, "
        f"{rs / auto:.2f}x auto (goal: at most 1.2x)",
    ]


def _reading(url: str, base: str, items_bytes: int) -> list[str]:
    launch(_add_shard, nproc_per_node=4, args=(url, "bench/items", image_count(items_bytes)))
    os.sync()  # the set on disk first: no fsync timed below waits for its writeback
    read = launch(_read, args=(url, "bench/items"))[0]
    exported = exports.measure(url, "bench/items", base, [1], 1)
    return [
        f"items: {format_bytes(items_bytes)} stored by 4 ranks, read in 1 process",
        f"  {int(read['count'])} values in {read['read']:.2f} s "
        f"({items_bytes / read['read'] / 1e9:.2f} GB/s); peak RSS grew "
        f"{format_bytes(int(read['growth']))} (goal: at most 300 MiB)"
        + ("" if read["reset"] else " (peak not reset: an upper bound)"),
        f"export: that set to {format_bytes(exported['bytes'])} of Parquet",
        *exports.lines(exported),
    ]


def main(
    add_bytes: int,
    items_bytes: int,
    repeats: int,
    folder: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Run the measurements and print them with their goals; 0."""
    base = tempfile.mkdtemp(prefix="gatherstore-bench-results-", dir=folder)
    url = f"file://{base}/store"
    print(f"result sets: file:// store in {base}; medians of {repeats}", file=out, flush=True)
    try:
        print("\n".join(_adding(url, add_bytes, repeats)), file=out, flush=True)
        print("\n".join(_gathering(url, add_bytes, repeats)), file=out, flush=True)
        print("\n".join(_reading(url, base, items_bytes)), file=out, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0
