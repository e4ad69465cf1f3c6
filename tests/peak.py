"""What storing one large part costs in memory, for the stores' tests."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from gatherstore.cli.bench.measure import PeakMemory
from gatherstore.stores import Store


def round_trip_growth(store: Store, size: int, seed: int) -> tuple[int, int]:
    """How much this process's peak memory grew to ``put`` one random ``size``-byte part
    into ``store`` and to ``get`` it back (checked byte for byte); the part is deleted.

    Skips the test where the peak cannot be reset (``/proc/self/clear_refs``).
    """
    part = np.random.default_rng(seed).integers(0, 255, size=size, dtype=np.uint8)
    crc = zlib.crc32(part.data)
    try:
        with PeakMemory() as put:
            store.put("part", part.data)
        if not put.reset:
            pytest.skip("/proc/self/clear_refs is not writable here")
        del part
        with PeakMemory() as get:
            value = store.get("part")
        assert value is not None and zlib.crc32(value) == crc
        del value
    finally:
        store.delete("")
    return put.growth, get.growth
