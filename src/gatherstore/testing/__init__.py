"""The store conformance suite, for gatherstore's stores and third-party ones.

Subclass :class:`StoreTests` in a test module, provide a ``store`` fixture
(a fresh, empty store) and ``raw_keys`` (every key really present in the
backend, bypassing the Store API), and pytest runs every check::

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store(self, tmp_path):
            return MyStore(tmp_path)

        def raw_keys(self, store):
            return sorted(my_backend_listing(store))
"""

from __future__ import annotations

import pickle
import threading
import urllib.parse
from typing import Any

try:
    import pytest
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "gatherstore.testing needs pytest: pip install 'gatherstore[testing]'"
    ) from exc

from .._errors import GatherError, GatherTimeout, IntegrityError, StoreUnavailableError
from ..stores.base import CHUNKS, HEADER_SIZE, KeyExistsError, Store
from ..stores.deadline import deadline
from ..stores.registry import open_store

__all__ = ["StoreTests"]


class StoreTests:
    """Checks every byte store must pass."""

    #: Chunk size the suite forces to exercise chunking (kept small for speed).
    chunk_size = 1024

    def raw_keys(self, store: Store) -> list[str]:  # pragma: no cover - must override
        """Every key present in the backend, found without the Store API."""
        raise NotImplementedError

    @pytest.fixture
    def chunked(self, store: Store) -> Store:
        """``store`` with a small maximum value size, so values are chunked."""
        store.max_value_size = self.chunk_size  # type: ignore[misc]
        return store

    @pytest.mark.parametrize("size", [0, 1, 1023 - HEADER_SIZE, 1024 - HEADER_SIZE, 1024, 5000])
    def test_round_trip_at_chunk_boundaries(self, chunked: Store, size: int) -> None:
        data = bytes(i % 251 for i in range(size))
        assert chunked.put("part", data) == size
        assert bytes(chunked.get("part") or b"x") == data if size else chunked.get("part") == b""
        assert b"".join(bytes(c) for c in chunked.iter_chunks("part")) == data

    def test_buffers_written_back_to_back(self, store: Store) -> None:
        store.put("k", [b"ab", bytearray(b"cd"), memoryview(b"ef")])
        assert bytes(store.get("k") or b"") == b"abcdef"

    def test_missing_key_gives_none(self, store: Store) -> None:
        assert store.get("nope") is None
        assert not store.exists("nope")
        with pytest.raises(KeyError):
            list(store.iter_chunks("nope"))

    def test_create_only(self, chunked: Store) -> None:
        chunked.put("k", b"first")
        with pytest.raises(KeyExistsError):
            chunked.put("k", b"second")
        with pytest.raises(KeyExistsError):
            chunked.put("k", b"x" * 5000)
        assert bytes(chunked.get("k") or b"") == b"first"

    def test_failed_put_leaves_nothing(self, chunked: Store, monkeypatch: Any) -> None:
        real = chunked._write_many
        calls: list[str] = []

        def failing(items: Any) -> list[bool]:  # the first two chunks land, then a failure
            room = max(2 - len(calls), 0)
            calls.extend(key for key, _ in items)
            if len(calls) > 2:
                real(items[:room])
                raise OSError("disk went away")
            return real(items)

        monkeypatch.setattr(chunked, "_write_many", failing)
        with pytest.raises(Exception, match="disk went away"):
            chunked.put("k", b"y" * 5000)
        monkeypatch.undo()
        assert chunked.get("k") is None
        assert self.raw_keys(chunked) == []

    def test_invalid_keys_are_refused(self, store: Store) -> None:
        for key in ["", "/abs", "a//b", "a/../b", "dir/", "x.chunks"]:
            with pytest.raises(ValueError):
                store.put(key, b"v")

    def test_reader_never_sees_partial_value(self, chunked: Store) -> None:
        data = bytes(range(256)) * 40
        seen: list[bytes] = []
        stop = threading.Event()

        def reader() -> None:
            while not stop.is_set():
                value = chunked.get("big")
                if value is not None:
                    seen.append(bytes(value))
                    return

        thread = threading.Thread(target=reader)
        thread.start()
        chunked.put("big", data)
        thread.join(timeout=30)
        stop.set()
        assert seen and all(v == data for v in seen)

    def test_wait(self, store: Store) -> None:
        timer = threading.Timer(0.2, store.put, args=("late", b"v"))
        timer.start()
        store.wait(["late"], timeout=10)
        timer.join()

    def test_wait_timeout_names_missing_keys(self, store: Store) -> None:
        store.put("here", b"v")
        with pytest.raises(GatherTimeout) as info:
            store.wait(["here", "gone-1", "gone-2"], timeout=0.3)
        assert info.value.keys == ["gone-1", "gone-2"]
        assert isinstance(info.value, TimeoutError)

    def test_exact_prefix_delete(self, chunked: Store) -> None:
        for key in ["a/x", "a/y/z", "a-b/x", "ab", "abc", "b/a"]:
            chunked.put(key, b"v" * 2000)
        chunked.delete("a")
        assert chunked.list() == ["a-b/x", "ab", "abc", "b/a"]
        chunked.delete("a-b/")
        chunked.delete("ab")
        assert chunked.list() == ["abc", "b/a"]

    def test_discard_deletes_one_value_by_name(self, chunked: Store, monkeypatch: Any) -> None:
        for key in ["a", "a-b", "ab", "b/a", "small"]:
            chunked.put(key, b"v" * (5000 if key != "small" else 10))

        def no_listing(*_: Any) -> None:
            raise AssertionError("discard must not list keys")

        monkeypatch.setattr(chunked, "_list", no_listing)
        monkeypatch.setattr(chunked, "_delete_prefix", no_listing)
        chunked.discard("a")  # chunked: the manifest names its chunks
        chunked.discard("small")
        chunked.discard("never-written")
        monkeypatch.undo()
        assert chunked.list() == ["a-b", "ab", "b/a"]
        for key in ["a-b", "ab", "b/a"]:
            chunked.discard(key)
        assert self.raw_keys(chunked) == []

    def test_list(self, store: Store) -> None:
        for key in ["p/1", "p/2", "q/1"]:
            store.put(key, b"v")
        assert store.list("p/") == ["p/1", "p/2"]

    def test_scoped_isolation(self, store: Store) -> None:
        one, two = store.scoped("job-1"), store.scoped("job-2")
        one.put("k", b"one")
        two.put("k", b"two")
        assert bytes(one.get("k") or b"") == b"one"
        assert bytes(two.get("k") or b"") == b"two"
        assert one.list() == ["k"]
        one.delete("")
        assert one.get("k") is None
        assert bytes(two.get("k") or b"") == b"two"

    def test_nothing_left_after_delete(self, chunked: Store) -> None:
        chunked.put("job/big", b"z" * 10_000)
        chunked.put("job/small", b"z")
        chunked.delete("job")
        assert self.raw_keys(chunked) == []

    def test_damaged_value_is_reported(self, store: Store) -> None:
        with pytest.raises(IntegrityError):
            store._parse("k", b"not a gatherstore value" * 4)

    def test_calls_past_the_deadline_fail_naming_the_store(self, store: Store) -> None:
        store.put("k", b"v")
        with deadline(0.0):
            for call in (lambda: store.get("k"), lambda: store.put("j", b"v"), store.list):
                with pytest.raises(StoreUnavailableError) as info:
                    call()
                assert info.value.store == str(store)
        assert bytes(store.get("k") or b"") == b"v"  # outside the deadline all is well again

    def test_values_read_are_private_memory(self, chunked: Store) -> None:
        """What a reader verifies must not change under it: a read is its own copy."""
        for size in (100, 5000):
            chunked.put(f"v{size}", b"a" * size)
            first, second = chunked.get(f"v{size}"), chunked.get(f"v{size}")
            assert first is not None and second is not None
            view = memoryview(first).cast("B")
            if not view.readonly:
                view[0] = ord("b")
                assert bytes(memoryview(second)[:1]) == b"a"

    def test_a_lost_chunk_is_not_reported_as_tampering(self, chunked: Store) -> None:
        chunked.put("part", b"x" * 5000)
        chunk = next(k for k in chunked._list("") if CHUNKS in k)
        chunked._delete([chunk])  # e.g. its TTL ran out
        with pytest.raises(GatherError, match="expired") as info:
            chunked.get("part")
        assert not isinstance(info.value, IntegrityError)

    def test_pickle_and_url_round_trip(self, store: Store) -> None:
        store.put("k", b"v")
        clone: Any = pickle.loads(pickle.dumps(store))
        assert type(clone) is type(store)
        assert str(clone) == str(store)
        assert bytes(clone.get("k") or b"") == b"v"
        reopened = open_store(store.url, **store._options())
        assert bytes(reopened.get("k") or b"") == b"v"
        parts = urllib.parse.urlsplit(store.url)
        assert parts.password is None or (
            parts.password not in str(store) and "***" in str(store)
        ), "str(store) must hide the password"
