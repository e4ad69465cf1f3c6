"""The store conformance suite, for gatherstore's stores and third-party ones.

Subclass ``StoreTests`` in a test module and pytest runs every check.  The subclass
provides a ``store`` fixture (a fresh, empty store) and four hooks that reach the
backend *without* the Store API, so that each check sees what is really stored, and
damages (truncates, alters, replaces, deletes) values that are really stored:

```python
class TestMyStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        return MyStore(tmp_path)

    def raw_keys(self, store):  # every key in the backend, sorted
        return sorted(my_backend_listing(store))

    def raw_get(self, store, key):  # the bytes at key, or None
        return my_backend_read(store, key)

    def raw_set(self, store, key, data):  # write key, or replace its bytes
        my_backend_write(store, key, data)

    def raw_delete(self, store, key):  # remove key; an absent key is fine
        my_backend_remove(store, key)
```

The hooks name keys as the store does, relative to its root: ``part`` and its
chunks ``part.chunks/<id>/<n>``.  ``raw_set`` replaces a file's bytes in place
where the backend has files, as another process rewriting it would.  Checks a
store fails while its bug is open go in ``known_failures``: they run as strict xfails.
"""

from __future__ import annotations

import pickle
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any, ClassVar

try:
    import pytest
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "gatherstore.testing needs pytest: pip install 'gatherstore[testing]'"
    ) from exc

from gatherstore._errors import GatherError, GatherTimeout, IntegrityError, StoreUnavailableError
from gatherstore._time import deadline
from gatherstore.stores.base import CHUNKS, HEADER_SIZE, KeyExistsError, Store
from gatherstore.stores.registry import open_store
from gatherstore.testing._damage import DAMAGE, LARGE, SMALL
from gatherstore.testing._threads import started

__all__ = ["StoreTests"]


class StoreTests:
    """Checks every byte store must pass (see the module docstring for the hooks)."""

    #: Chunk size the suite forces to exercise chunking (kept small for speed).
    chunk_size = 1024
    #: {test name: the open bug that fails it}: strict xfails, so that the fix is noticed.
    known_failures: ClassVar[dict[str, str]] = {}

    @pytest.fixture(autouse=True)
    def _known_failure(self, request: pytest.FixtureRequest) -> None:
        bug = self.known_failures.get(request.node.name)
        if bug is not None:
            request.applymarker(pytest.mark.xfail(strict=True, reason=bug))

    def raw_keys(self, store: Store) -> list[str]:  # pragma: no cover - must override
        """Every key present in the backend, sorted, found without the Store API."""
        raise NotImplementedError

    def raw_get(self, store: Store, key: str) -> bytes | None:  # pragma: no cover
        """The bytes stored at ``key`` (None: absent), read without the Store API."""
        raise NotImplementedError

    def raw_set(self, store: Store, key: str, data: bytes) -> None:  # pragma: no cover
        """Write ``data`` at ``key``, replacing what is there, without the Store API."""
        raise NotImplementedError

    def raw_delete(self, store: Store, key: str) -> None:  # pragma: no cover
        """Remove ``key`` (absent: nothing happens) without the Store API."""
        raise NotImplementedError

    @pytest.fixture
    def chunked(self, store: Store) -> Store:
        """``store`` with a small maximum value size, so values are chunked."""
        store.max_value_size = self.chunk_size
        return store

    def _chunks_of(self, store: Store, key: str) -> list[str]:
        """The raw keys of ``key``'s chunks, in order."""
        return [k for k in self.raw_keys(store) if k.startswith(f"{key}{CHUNKS}/") and k[-1] != "/"]

    # --- values land in the backend, and what the backend holds is what is read -------------
    @pytest.mark.parametrize("size", [0, 1, 1023 - HEADER_SIZE, 1024 - HEADER_SIZE, 1024, 5000])
    def test_round_trip_at_chunk_boundaries(self, chunked: Store, size: int) -> None:
        data = bytes(i % 251 for i in range(size))
        assert chunked.put("part", data) == size
        value = chunked.get("part")
        assert value is not None and bytes(value) == data
        assert b"".join(bytes(c) for c in chunked.iter_chunks("part")) == data
        chunks = self._chunks_of(chunked, "part")
        self._only(chunked, {"part"})
        raw = self.raw_get(chunked, "part") or b""
        if size + HEADER_SIZE <= self.chunk_size:  # inline: the header, then the payload
            assert chunks == [] and len(raw) == HEADER_SIZE + size and raw[HEADER_SIZE:] == data
        else:  # the chunks hold the payload, in order
            stored = [self.raw_get(chunked, k) or b"" for k in chunks]
            assert all(len(c) <= self.chunk_size for c in stored)
            assert b"".join(stored) == data

    def test_get_reads_what_the_backend_holds(self, store: Store) -> None:
        """A value another client wrote is read; one it changed is read changed (no cache
        hides it: the checksums above the store see it); one it removed is gone."""
        store.put("a", b"original")
        raw = self.raw_get(store, "a")
        assert raw is not None and raw.endswith(b"original") and len(raw) == HEADER_SIZE + 8
        self.raw_set(store, "b", raw)
        assert store.exists("b") and store.list() == ["a", "b"]
        assert bytes(store.get("b") or b"") == b"original"
        self.raw_set(store, "a", raw[:-8] + b"ORIGINAL")
        assert bytes(store.get("a") or b"") == b"ORIGINAL"
        assert b"".join(bytes(c) for c in store.iter_chunks("a")) == b"ORIGINAL"
        self.raw_delete(store, "b")
        assert store.get("b") is None and not store.exists("b") and store.list() == ["a"]

    def test_buffers_written_back_to_back(self, store: Store) -> None:
        store.put("k", [b"ab", bytearray(b"cd"), memoryview(b"ef")])
        assert bytes(store.get("k") or b"") == b"abcdef"
        assert (self.raw_get(store, "k") or b"").endswith(b"abcdef")

    def test_missing_key_gives_none(self, store: Store) -> None:
        assert store.get("nope") is None
        assert not store.exists("nope")
        with pytest.raises(KeyError):
            list(store.iter_chunks("nope"))

    def test_create_only(self, chunked: Store) -> None:
        chunked.put("k", b"first")
        before = self.raw_get(chunked, "k")
        with pytest.raises(KeyExistsError):
            chunked.put("k", b"second")
        with pytest.raises(KeyExistsError):
            chunked.put("k", b"x" * LARGE)
        assert bytes(chunked.get("k") or b"") == b"first"
        assert self.raw_keys(chunked) == ["k"] and self.raw_get(chunked, "k") == before

    def test_failed_put_leaves_nothing(self, chunked: Store, monkeypatch: Any) -> None:
        real = chunked._write_many
        landed: list[list[str]] = []

        def failing(items: Any) -> list[bool]:  # the first two chunks land, then a failure
            real(items[:2])
            landed.append(self.raw_keys(chunked))
            raise OSError("disk went away")

        monkeypatch.setattr(chunked, "_write_many", failing)
        with pytest.raises(StoreUnavailableError, match="disk went away"):
            chunked.put("k", b"y" * LARGE)
        monkeypatch.undo()
        assert len([k for k in landed[0] if k[-1] != "/"]) == 2, landed  # cleanup had work
        assert chunked.get("k") is None
        assert self.raw_keys(chunked) == []

    def test_invalid_keys_are_refused(self, store: Store) -> None:
        calls: list[Callable[[str], Any]] = [
            lambda key: store.put(key, b"v"),
            store.get,
            store.exists,
            store.discard,
            lambda key: list(store.iter_chunks(key)),
        ]
        for key in ["", "/abs", "a//b", "a/../b", "dir/", "x.chunks", "a/x.chunks/b"]:
            for call in calls:
                with pytest.raises(ValueError, match="not valid"):
                    call(key)
        assert self.raw_keys(store) == []

    def test_reader_never_sees_partial_value(self, chunked: Store) -> None:
        data = bytes(range(256)) * 40
        seen: list[bytes] = []
        polling, stop = threading.Event(), threading.Event()

        def read() -> None:
            while not stop.is_set():
                value = chunked.get("big")
                if value is not None:
                    seen.append(bytes(value))
                    return
                polling.set()

        thread, errors = started(read, polling)
        assert polling.wait(30)  # the reader is reading before the write begins
        chunked.put("big", data)
        thread.join(timeout=30)
        stop.set()
        assert errors == [] and seen == [data]

    # --- wait ---------------------------------------------------------------------------------
    def test_wait(self, store: Store) -> None:
        """``wait`` returns once every key exists (written by any client), not before."""
        store.put("early", b"v")
        store.wait(["early"], timeout=0)
        store.wait([], timeout=0)
        returned = threading.Event()
        thread, errors = started(lambda: store.wait(["early", "late", "later"], 60), returned)
        try:
            store.put("late", b"v")
            assert not returned.wait(0.3), f"wait returned before 'later' existed: {errors}"
            self.raw_set(store, "later", self.raw_get(store, "early") or b"")  # another client
            assert returned.wait(30), "wait did not see a key another client wrote"
        finally:
            thread.join(60)
        assert errors == []

    def test_wait_timeout_names_missing_keys(self, store: Store) -> None:
        store.put("here", b"v")
        with pytest.raises(GatherTimeout) as info:
            store.wait(["here", "gone-1", "gone-2"], timeout=0.3)
        assert info.value.keys == ["gone-1", "gone-2"]
        assert info.value.timeout == 0.3
        assert isinstance(info.value, TimeoutError)
        assert str(store) in str(info.value)

    # --- listing and deleting -----------------------------------------------------------------
    def _only(self, store: Store, keys: set[str]) -> None:
        """Assert the backend holds exactly ``keys`` and their chunks."""
        raw = [k for k in self.raw_keys(store) if k[-1] != "/"]
        assert {k.split(CHUNKS + "/")[0] for k in raw} == keys, raw

    def test_exact_prefix_delete(self, chunked: Store) -> None:
        for key in ["a/x", "a/y/z", "a-b/x", "ab", "abc", "b/a"]:
            chunked.put(key, b"v" * 2000)
        chunked.delete("a")
        assert chunked.list() == ["a-b/x", "ab", "abc", "b/a"]
        chunked.delete("a-b/")
        chunked.delete("ab")
        assert chunked.list() == ["abc", "b/a"]
        self._only(chunked, {"abc", "b/a"})

    def test_discard_deletes_one_value_by_name(self, chunked: Store, monkeypatch: Any) -> None:
        for key in ["a", "a-b", "ab", "b/a", "small"]:
            chunked.put(key, b"v" * (LARGE if key != "small" else 10))

        def no_listing(*_: Any) -> None:
            raise AssertionError("discard must not list keys")

        monkeypatch.setattr(chunked, "_list", no_listing)
        monkeypatch.setattr(chunked, "_delete_prefix", no_listing)
        chunked.discard("a")  # chunked: the manifest names its chunks
        chunked.discard("small")
        chunked.discard("never-written")
        monkeypatch.undo()
        assert chunked.list() == ["a-b", "ab", "b/a"]
        self._only(chunked, {"a-b", "ab", "b/a"})
        for key in ["a-b", "ab", "b/a"]:
            chunked.discard(key)
        assert self.raw_keys(chunked) == []

    def test_list(self, chunked: Store) -> None:
        for key in ["p/1", "p/2", "q/1"]:
            chunked.put(key, b"v")
        chunked.put("q/big", b"v" * LARGE)  # its chunks are not listed
        assert chunked.list("p/") == ["p/1", "p/2"]
        assert chunked.list("q/") == ["q/1", "q/big"]
        assert chunked.list() == ["p/1", "p/2", "q/1", "q/big"]

    def test_scoped_isolation(self, store: Store) -> None:
        one, two = store.scoped("job-1"), store.scoped("job-2")
        one.put("k", b"one")
        two.put("k", b"two")
        assert bytes(one.get("k") or b"") == b"one"
        assert bytes(two.get("k") or b"") == b"two"
        assert one.list() == ["k"]
        self._only(store, {"job-1/k", "job-2/k"})
        one.delete("")
        assert one.get("k") is None
        assert bytes(two.get("k") or b"") == b"two"
        assert self.raw_keys(store) == ["job-2/k"]

    def test_nothing_left_after_delete(self, chunked: Store) -> None:
        chunked.put("job/big", b"z" * 10_000)
        chunked.put("job/small", b"z")
        chunked.delete("job")
        assert self.raw_keys(chunked) == []

    # --- damage, done to values really stored -------------------------------------------------
    @pytest.mark.parametrize(("size", "target", "damage"), DAMAGE)
    def test_damaged_value_is_reported(
        self, chunked: Store, size: int, target: str, damage: Callable[[bytes], bytes]
    ) -> None:
        chunked.put("k", b"d" * size)
        chunked.put("ok", b"o")  # read together with the damaged one by get_many
        key = "k" if target == "value" else self._chunks_of(chunked, "k")[0]
        self.raw_set(chunked, key, damage(self.raw_get(chunked, key) or b""))
        reads: list[Callable[[str], Any]] = [
            chunked.get,
            lambda k: chunked.get_many(["ok", k]),
            lambda k: b"".join(chunked.iter_chunks(k)),
        ]
        for read in reads:
            with pytest.raises(IntegrityError) as info:
                read("k")
            assert str(chunked) in str(info.value)
            assert getattr(info.value, "key", "k") == "k"
        chunked.discard_many(["ok", "k"])  # a damaged value goes with all its chunks
        assert self.raw_keys(chunked) == []

    def test_a_lost_chunk_is_not_reported_as_tampering(self, chunked: Store) -> None:
        chunked.put("part", b"x" * LARGE)
        self.raw_delete(chunked, self._chunks_of(chunked, "part")[2])  # e.g. its TTL ran out
        for read in (chunked.get, lambda k: list(chunked.iter_chunks(k))):
            with pytest.raises(GatherError, match="expired") as info:
                read("part")
            assert not isinstance(info.value, IntegrityError)
        chunked.discard("part")
        assert self.raw_keys(chunked) == []

    def test_values_read_are_private_memory(self, chunked: Store) -> None:
        """What a reader verifies must not change under it: a read is its own copy,
        which neither another read, nor a rewrite or removal of the value, changes."""
        for size in (SMALL, LARGE):
            key = f"v{size}"
            chunked.put(key, b"a" * size)
            first, second = chunked.get(key), chunked.get(key)
            assert first is not None and second is not None
            view = memoryview(first).cast("B")
            if view.readonly:
                with pytest.raises(TypeError):
                    view[0] = ord("b")
            else:
                view[0] = ord("b")
            assert bytes(second) == b"a" * size
            stored = [key, *self._chunks_of(chunked, key)]
            for raw_key in stored:  # rewritten in place, as another process would
                self.raw_set(chunked, raw_key, b"z" * len(self.raw_get(chunked, raw_key) or b""))
            assert bytes(second) == b"a" * size
            for raw_key in stored:
                self.raw_delete(chunked, raw_key)
            assert bytes(second) == b"a" * size

    # --- deadlines, pickling, URLs --------------------------------------------------------------
    def test_calls_past_the_deadline_fail_naming_the_store(self, store: Store) -> None:
        store.put("k", b"v")
        calls: list[Callable[[], Any]] = [
            lambda: store.get("k"),
            lambda: store.put("j", b"v"),
            store.list,
            lambda: store.exists("k"),
            lambda: list(store.iter_chunks("k")),
            lambda: store.wait(["k"], timeout=10),
            lambda: store.discard("k"),
            lambda: store.delete("k"),
        ]
        with deadline(0.0):
            for call in calls:
                with pytest.raises(StoreUnavailableError) as info:
                    call()
                assert info.value.store == str(store)
        assert bytes(store.get("k") or b"") == b"v"  # outside the deadline all is well again
        assert self.raw_keys(store) == ["k"]

    def test_pickled_and_reopened_stores_are_equal(self, store: Store) -> None:
        store.put("k", b"v")
        default = store.sign_parts
        for sign in (default, not default):
            store.sign_parts = sign
            clone: Any = pickle.loads(pickle.dumps(store))
            assert clone == store and hash(clone) == hash(store)  # == compares the class too
            assert clone.sign_parts == sign
            assert bytes(clone.get("k") or b"") == b"v"
        assert clone != pickle.loads(pickle.dumps(store.scoped("x")))
        store.sign_parts = default
        view = store.scoped("job")
        view.put("s", b"w")
        copy: Any = pickle.loads(pickle.dumps(view))
        assert copy == view and copy != store.scoped("other")
        assert bytes(copy.get("s") or b"") == b"w"
        reopened = open_store(store.url, **store._options())
        assert reopened == store
        assert bytes(reopened.get("k") or b"") == b"v"
        parts = urllib.parse.urlsplit(store.url)
        assert parts.password is None or (
            parts.password not in str(store) and "***" in str(store)
        ), "str(store) must hide the password"
