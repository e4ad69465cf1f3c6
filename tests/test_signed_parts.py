"""Signed parts: a part altered, or written without the job's key, is refused unread."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from wrapping import Over

import gatherstore as gs
from gatherstore.stores import Store

_unpickled: list[str] = []


def _record(path: str) -> str:
    """Called when a Sentinel is unpickled: leaves a trace in this process and on disk."""
    _unpickled.append(path)
    if path:
        Path(path).touch()
    return "unpickled"


class Sentinel:
    """An object whose unpickling is observable (even in another process)."""

    def __init__(self, path: str = "") -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (_record, (self.path,))


def test_signed_by_default_on_shared_stores(tmp_path: Path) -> None:
    assert gs.open_store(f"file://{tmp_path}").sign_parts
    assert gs.open_store("redis://127.0.0.1:1/0").sign_parts
    assert not gs.open_store("tmpdir").sign_parts
    assert not gs.open_store(f"file://{tmp_path}", sign=False).sign_parts


# --- end to end: one rank's part is altered in the store ------------------------------------

_RANK1_PART = re.compile(r"(^|/)call-\d+/1$")


def _flipped(key: str, buffers: Sequence[Any]) -> Sequence[Any]:
    """Rank 1's object parts with one payload byte flipped; everything else unchanged."""
    if not _RANK1_PART.search(key):
        return buffers
    data = bytearray(b"".join(memoryview(b).cast("B") for b in buffers))
    data[-1] ^= 0xFF
    return [data]


class Tampering(Over):
    """A store that alters rank 1's parts on their way to the store under it."""

    def _write(self, key: str, buffers: Sequence[Any]) -> bool:
        return super()._write(key, _flipped(key, buffers))


def _tampered_job(store: Store, trace: str) -> tuple[str, int | None, str | None]:
    rank = gs.get_rank()
    obj = {"rank": rank, "sentinel": Sentinel(trace) if rank == 1 else None}
    try:
        gs.gather_object(obj, store=store, timeout=60)
    except gs.IntegrityError as exc:
        assert "signature check" in str(exc) and "rank 1" in str(exc), str(exc)
        return "IntegrityError", exc.rank, exc.key
    return "ok", None, None


def _all_gather_tampered_job(store: Store) -> str:
    try:
        gs.all_gather_object({"rank": gs.get_rank()}, store=store, timeout=60)
    except gs.GatherError as exc:
        return type(exc).__name__
    return "no error"


@pytest.fixture(params=["file", "redis"])
def tampering_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Store, Any]:
    """(a signed store that alters rank 1's parts, a function listing what is left in it)."""
    if request.param == "file":
        root = tmp_path / "shared"
        root.mkdir()
        store = Tampering(gs.open_store(f"file://{root}"))
        return store, lambda: sorted(p.name for p in root.rglob("*"))
    url = request.getfixturevalue("gatherstore_redis_url")
    prefix = f"signed-{os.urandom(8).hex()}/"
    store = Tampering(gs.open_store(url, key_prefix=prefix))
    return store, lambda: sorted(store.list())


@pytest.mark.timeout(120)
def test_altered_part_fails_on_the_reader_with_rank_and_key(
    tampering_store: tuple[Store, Any], tmp_path: Path
) -> None:
    store, leftovers = tampering_store
    assert store.sign_parts
    trace = str(tmp_path / "unpickled-on-some-rank")
    results = gs.launch(_tampered_job, nproc_per_node=3, backend="gloo", args=(store, trace))
    kind, rank, key = results[0]
    assert kind == "IntegrityError" and rank == 1
    assert key is not None and re.search(r"call-1/1$", key), key
    assert results[1:] == [("ok", None, None), ("ok", None, None)]
    assert not os.path.exists(trace), "nothing of the altered part may be unpickled"
    assert leftovers() == []


@pytest.mark.timeout(120)
def test_altered_part_fails_every_rank_of_an_all_gather(
    tampering_store: tuple[Store, Any],
) -> None:
    store, leftovers = tampering_store
    results = gs.launch(_all_gather_tampered_job, nproc_per_node=3, backend="gloo", args=(store,))
    assert results == ["IntegrityError", "RemoteRankError", "IntegrityError"]
    assert leftovers() == []
