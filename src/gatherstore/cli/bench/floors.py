"""The floors of a gather, measured in the bench's own process beside its cases.

A gather to rank 0 can take no less than the slower of: a sender encoding its
part (pickling, and for CUDA tensors the copy to the host), and rank 0
decoding the other ranks' parts (verify, unpickle).  Both are measured here
from memory, without a store, on the same payloads the cases gather, as is
the checksum's rate (its share of the gather: rank 0's path digests one part
when it is sealed and every other part when it is verified).  For CUDA
payloads also the device-to-host rate of the encode, against a pinned
``copy_`` of the same bytes (the machine's ceiling) and ``Tensor.cpu()``.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gatherstore import codec
from gatherstore.cli.bench import payloads
from gatherstore.codec import digest as _digest

__all__ = ["measure"]


def _median(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` timed calls of ``fn``."""
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sealed(obj: Any) -> bytearray:
    frame = codec.encode(obj).seal(None)
    buf = bytearray(frame.nbytes)
    frame.copy_into(memoryview(buf))
    return buf


def _cuda_bytes(obj: Any) -> int:
    """Bytes of the CUDA storages ``obj``'s records hold (each storage once)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for record in obj
        for t in record.values()
        if isinstance(t, torch.Tensor) and t.is_cuda
    }
    return sum(storages.values())


def _device_rates(nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of ``nbytes`` from the GPU: pinned ``copy_`` (reused buffer) and ``.cpu()``."""
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pinned_copy() -> None:
        pinned.copy_(source, non_blocking=True)
        torch.cuda.synchronize()

    pinned_copy()
    return {
        "pinned_gbps": nbytes / _median(pinned_copy, repeats) / 1e9,
        "cpu_gbps": nbytes / _median(source.cpu, repeats) / 1e9,
    }


def measure(kind: str, nbytes: int, world: int, repeats: int) -> dict[str, Any]:
    """Seconds to encode rank 1's part and to decode ranks 1..W-1's parts from memory,
    medians of ``repeats``; the checksum's GB/s; for CUDA payloads the rates above."""
    parts = [payloads.make(kind, nbytes, rank, world) for rank in range(1, max(world, 2))]
    encode = _median(lambda: codec.encode(parts[0]).seal(None), repeats)
    sealed = [_sealed(part) for part in parts]

    def decode() -> None:
        for rank, buf in enumerate(sealed, 1):
            codec.decode(buf, rank=rank)

    decode_s = _median(decode, repeats)
    first = memoryview(sealed[0])
    digest = _median(lambda: _digest.digest([first], None, b""), repeats)
    out: dict[str, Any] = {
        "encode_s": encode,
        "decode_s": decode_s,
        "floor_s": max(encode, decode_s),
        "part_bytes": len(first),
        "checksum_gbps": len(first) / digest / 1e9,
    }
    if kind.startswith("cuda"):
        moved = _cuda_bytes(parts[0])
        out["d2h_gbps"] = moved / _median(lambda: codec.encode(parts[0]), repeats) / 1e9
        out.update(_device_rates(moved, repeats))
    return out
