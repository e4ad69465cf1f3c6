"""``gatherstore bench --export [SIZE]``: ``ResultSet.export`` to Parquet against pyarrow's
Parquet writer alone and against the disk, all measured in the same run, through a
``file://`` store in a fresh folder under the temp dir (``TMPDIR`` picks another disk).

4 ranks store SIZE bytes of detections (the bench's images: an int, three small
arrays and a str a value, each rank a DistributedSampler's share).  A fresh process
(pyarrow loaded first, as a program that exports has it) then times, to ``fsync``:

- **export**: the set to one file, to 2 and to one file per core (``files=N``);
- **write_table**: ``pyarrow.parquet.write_table`` of the same rows, already in one
  Arrow table in memory (the export read back), with the export's options
  (uncompressed, no dictionary): the most a one-file export can do here, since
  pyarrow encodes a file on one thread;
- **disk**: a raw sequential write of as many bytes, in 16 MiB writes.

Each measurement is the median of its repeats; the repeats take turns, so that a
neighbour's load moves them all alike.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from gatherstore.cli.bench import payloads
from gatherstore.cli.bench.measure import format_bytes
from gatherstore.job.launch import launch

__all__ = ["GOAL", "disk_rate", "fsync", "main", "measure"]

#: The most an export to one file may take over write_table of the same rows.
GOAL = 0.10
_BLOCK = 16 << 20
_NAME = "bench/export"


def fsync(path: Path) -> None:
    """Make the file ``path`` (a folder: each of its files) durable."""
    for each in sorted(path.iterdir()) if path.is_dir() else [path]:
        fd = os.open(each, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def disk_rate(folder: str, nbytes: int) -> float:
    """Bytes per second this folder's disk writes: ``nbytes`` in 16 MiB writes, to fsync."""
    block = np.random.default_rng(0).integers(0, 256, _BLOCK, dtype=np.uint8).tobytes()
    path = Path(folder, "disk-rate")
    blocks = max(1, nbytes // _BLOCK)
    began = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(blocks):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - began
    path.unlink()
    return blocks * _BLOCK / seconds


def _timed(path: Path, write: Any, *args: Any, **kwargs: Any) -> float:
    """Seconds ``write(*args, **kwargs)`` takes to write ``path``, to fsync; then ``path``
    is removed."""
    began = time.perf_counter()
    write(*args, **kwargs)
    fsync(path)
    seconds = time.perf_counter() - began
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    return seconds


def _measure(url: str, name: str, folder: str, files: list[int], repeats: int) -> dict[str, Any]:
    """In a process of its own: the seconds of each export (``files``), of write_table and
    of the disk, ``repeats`` times in turn; and the bytes of the one-file export."""
    import pyarrow.parquet as pq

    import gatherstore as gs

    rs = gs.ResultSet(name, store=url, mode="r")
    first = Path(folder, "first.parquet")
    rs.export(first)  # reads the set once (the page cache), and gives write_table its rows
    table, nbytes = pq.read_table(first), first.stat().st_size
    first.unlink()
    seconds: dict[str, list[float]] = {"write_table": [], "disk": []}
    for _ in range(repeats):
        for n in files:
            target = Path(folder, f"export-{n}.parquet")
            seconds.setdefault(f"export {n}", []).append(_timed(target, rs.export, target, files=n))
        target = Path(folder, "write_table.parquet")
        plain = {"compression": "none", "use_dictionary": False}  # as the export writes
        seconds["write_table"].append(_timed(target, pq.write_table, table, target, **plain))
        seconds["disk"].append(nbytes / disk_rate(folder, nbytes))
    rs.close()
    return {"bytes": nbytes, "rows": table.num_rows, "seconds": seconds}


def measure(url: str, name: str, folder: str, files: list[int], repeats: int) -> dict[str, Any]:
    """The figures of the set ``name`` at ``url`` (see ``_measure``), from a fresh process:
    ``bytes``, ``rows`` and each measurement's median ``seconds``."""
    found: dict[str, Any] = launch(_measure, args=(url, name, folder, files, repeats))[0]
    found["seconds"] = {k: statistics.median(v) for k, v in found["seconds"].items()}
    return found


def lines(found: dict[str, Any]) -> list[str]:
    """The figures of ``measure``, a line each: seconds, GB/s, and each export against
    write_table (the goal: one file at most :data:`GOAL` over it) and the disk."""
    nbytes, seconds = found["bytes"], found["seconds"]
    write, disk = seconds["write_table"], seconds["disk"]

    def line(label: str, took: float) -> str:
        return f"  {label:<48}{took:7.2f} s  {nbytes / took / 1e9:5.2f} GB/s"

    out = [
        line("pq.write_table, the same rows in one Arrow table", write),
        line("the disk, a raw sequential write", disk),
    ]
    for label, took in seconds.items():
        if label.startswith("export "):
            n = int(label.split()[1])
            if n == 1:
                against = f"{took / write - 1:+.1%} over write_table (goal: at most +{GOAL:.0%})"
            else:
                against = f"{write / took:.2f}x write_table's rate"
            files = "1 file" if n == 1 else f"{n} files"
            out.append(
                f"{line(f'export, {files}', took)}  {against}; {disk / took:.0%} of the disk"
            )
    return out


def _store(url: str, name: str, images: int) -> None:
    """In a rank: add this rank's share of ``images`` detections to the set ``name``."""
    import gatherstore as gs

    rank, world = gs.get_rank(), gs.get_world_size()
    with gs.ResultSet(name, store=url) as rs:
        mine = payloads.detections(images, rank, world)
        for position, image in zip(payloads.shard(images, rank, world), mine, strict=True):
            rs.add(position, image)


def main(nbytes: int, repeats: int, folder: str | None = None, out: TextIO = sys.stdout) -> int:
    """Store ``nbytes`` of detections, measure, print the figures; 0."""
    base = tempfile.mkdtemp(prefix="gatherstore-bench-export-", dir=folder)
    url = f"file://{base}/store"
    files = sorted({1, 2, os.cpu_count() or 1})
    try:
        launch(_store, nproc_per_node=4, args=(url, _NAME, payloads.image_count(nbytes)))
        os.sync()  # the set on disk first: no fsync timed below waits for its writeback
        found = measure(url, _NAME, base, files, repeats)
        print(
            f"export: {format_bytes(nbytes)} of detections stored by 4 ranks, "
            f"{found['rows']} values, {format_bytes(found['bytes'])} of Parquet; file:// "
            f"store in {base}; medians of {repeats}, to fsync",
            file=out,
        )
        print("\n".join(lines(found)), file=out, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0
