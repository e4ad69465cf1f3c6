"""The conformance suite on the filesystem stores (tmpdir, file://) and fsspec's file/memory."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from fsspec_raw import FsspecRaw

from gatherstore.host.writes import write_all
from gatherstore.stores import Store
from gatherstore.stores.file import FileStore
from gatherstore.stores.fsspec import FsspecStore
from gatherstore.stores.tmpdir import TmpdirStore
from gatherstore.testing import StoreTests


def _files(root: Path) -> list[str]:
    return sorted(str(Path(d, f).relative_to(root)) for d, _, files in os.walk(root) for f in files)


class _OnDisk(StoreTests):
    """Raw access to a store whose values are files under ``store.root``."""

    def raw_get(self, store: Store, key: str) -> bytes | None:
        path = Path(store.root, key)  # type: ignore[attr-defined]
        return path.read_bytes() if path.is_file() else None

    def raw_set(self, store: Store, key: str, data: bytes) -> None:
        path = Path(store.root, key)  # type: ignore[attr-defined]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)  # in place: the same file, truncated and rewritten

    def raw_delete(self, store: Store, key: str) -> None:
        Path(store.root, key).unlink(missing_ok=True)  # type: ignore[attr-defined]


class TestFileStore(_OnDisk):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return FileStore(tmp_path)

    def raw_keys(self, store: Store) -> list[str]:
        root = store.root  # type: ignore[attr-defined]
        empty_dirs = [
            f"{Path(d).relative_to(root)}/" for d, dirs, files in os.walk(root) if not dirs + files
        ]
        return _files(root) + [d for d in empty_dirs if d != "./"]  # deletes prune directories


class TestTmpdirStore(TestFileStore):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return TmpdirStore(tmp_path)


class TestFsspecLocal(_OnDisk):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return FsspecStore(f"file://{tmp_path}")

    def raw_keys(self, store: Store) -> list[str]:
        return _files(Path(store.root))  # type: ignore[attr-defined]


class TestFsspecMemory(FsspecRaw):
    """memory:// through fsspec's own MemoryFileSystem (the raw hooks skip the Store)."""

    @pytest.fixture
    def store(self) -> Store:
        return FsspecStore(f"memory://conformance-{uuid.uuid4().hex}")


class TestFsspecMemoryTop(FsspecRaw):
    """``memory://`` with no root: the store is the whole of fsspec's in-process filesystem,
    emptied for each check (and given back after it), whose keys it lists as ``key``, not
    ``/key``."""

    @pytest.fixture
    def store(self) -> Iterator[Store]:
        fs = fsspec.filesystem("memory")
        files, dirs = dict(fs.store), list(fs.pseudo_dirs)
        fs.store.clear()
        fs.pseudo_dirs[:] = [""]
        try:
            yield FsspecStore("memory://")
        finally:
            fs.store.clear()
            fs.store.update(files)
            fs.pseudo_dirs[:] = dirs


def test_writes_race_deletes_that_prune_directories(tmp_path: Path) -> None:
    """A delete removes the directories it empties; a write racing it recreates them."""
    store = FileStore(tmp_path)
    errors: list[BaseException] = []

    def churn(n: int) -> None:
        try:
            for i in range(300):
                key = f"call-1/{n}" if i % 2 else f"call-1/deep/{n}/part"
                store.put(key, b"v" * 100)
                store.discard(key)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert list(tmp_path.iterdir()) == []


def test_the_folders_a_store_creates_are_named_at_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A mistyped path makes new folders: the store says which, once, when it makes them."""
    caplog.set_level(logging.INFO, logger="gatherstore")
    root = tmp_path / "new" / "deeper"
    store = FileStore(root)
    store.put("a", b"1")
    store.put("b", b"2")
    assert [r.getMessage() for r in caplog.records] == [
        f"store {store}: created the missing folders {tmp_path / 'new'}, {root}"
    ]
    caplog.clear()
    FileStore(root).put("c", b"3")  # there now: nothing to say
    tmpdir_base = TmpdirStore(tmp_path / "base")
    tmpdir_base.prepare_job("0123456789abcdef")
    assert [r.getMessage() for r in caplog.records] == [
        f"store {tmpdir_base}: created the missing folder {tmp_path / 'base'}"
    ]


def test_a_store_that_skips_the_base_init_is_told_how_to_fix_it(tmp_path: Path) -> None:
    class Forgetful(FileStore):
        def __init__(self, root: Path) -> None:  # no super().__init__()
            self.root = root

    with pytest.raises(TypeError, match=r"Forgetful.__init__ did not call super\(\).__init__"):
        Forgetful(tmp_path).sign_parts  # noqa: B018
    with pytest.raises(AttributeError):  # any other missing attribute stays an AttributeError
        Forgetful(tmp_path).nonexistent  # noqa: B018


def test_vectored_writes_cut_short_resume_where_they_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pipe read slowly, with a timer's signal interrupting the writer, cuts ``writev``
    short mid-buffer: ``write_all`` resumes there, and strided arrays go as their values."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (200, 3000), dtype=np.uint8)
    buffers = [memoryview(base[0].tobytes()), *base[1:100], *base[100:, ::2]]
    expected = b"".join(np.ascontiguousarray(b).tobytes() for b in buffers)
    short = []
    writev = os.writev

    def counted(fd: int, batch: list[Any]) -> int:
        written = writev(fd, batch)
        short.append(written < sum(memoryview(np.ascontiguousarray(b)).nbytes for b in batch))
        return written

    monkeypatch.setattr(os, "writev", counted)
    read, write = os.pipe()
    got = bytearray()

    def reader() -> None:
        while chunk := os.read(read, 4096):
            got.extend(chunk)
            time.sleep(0.0005)

    thread = threading.Thread(target=reader)
    thread.start()
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    try:
        write_all(write, buffers)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.close(write)
        thread.join(timeout=30)
        os.close(read)
    assert bytes(got) == expected
    assert any(short), "no write was cut short: the test did not exercise resuming"
