"""The stand-in packages of tests/standins (detectron2, vis4d, virtex) and a store that counts
what goes through it: what the compat modules are compared with and patched into."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from wrapping import Over

ROOT = str(Path(__file__).parent / "standins")
PACKAGES = ("detectron2", "vis4d", "virtex")


@contextlib.contextmanager
def standins() -> Iterator[None]:
    """Make the stand-ins importable (here and in processes started meanwhile), then forget them."""
    sys.path.insert(0, ROOT)
    try:
        yield
    finally:
        sys.path.remove(ROOT)
        for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES]:
            del sys.modules[name]


@pytest.fixture
def standin_packages() -> Iterator[None]:
    """:func:`standins` for one test (``pytestmark = pytest.mark.usefixtures(...)``)."""
    with standins():
        yield


class CountingStore(Over):
    """A store that counts the values this process writes through it."""

    writes = 0

    def _write(self, key: str, buffers: Sequence[Any]) -> bool:
        CountingStore.writes += 1
        return super()._write(key, buffers)
