"""The Store: a place for bytes, with everything but a backend's primitives written once.

A backend implements the primitives of ``Backend``.  Chunking
(in the layout of ``layout``, checked on every read), ``wait``, exact
prefix deletes, deletes by name, scoped views, a job area's default life and
pickling are written here, once; every call maps the backend's errors (see
``failures``) and is refused once the deadline in force has passed (see
``deadline``: no store call outlives the collective that makes it).
"""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from gatherstore._errors import GatherError
from gatherstore._time import END_JOB_TIMEOUT, deadline
from gatherstore.stores import failures, layout
from gatherstore.stores._secrets import describe_failure, hide_password, hide_secrets
from gatherstore.stores.areas import JOB_AREA, JobArea, job_directory, job_keys
from gatherstore.stores.backend import PRIMITIVES, Backend
from gatherstore.stores.failures import KeyExistsError
from gatherstore.stores.layout import (
    CHUNKS,
    HEADER_SIZE,
    Buffer,
    ChunksRead,
    Damaged,
    Layout,
    nbytes,
)
from gatherstore.stores.waiting import wait_for

__all__ = [
    "CHUNKS",
    "HEADER_SIZE",
    "JOB_AREA",
    "JobArea",
    "Buffer",
    "KeyExistsError",
    "Store",
    "describe_failure",
    "hide_password",
    "hide_secrets",
    "job_directory",
    "job_keys",
]


class Store(Backend):
    """A key-value place for bytes that every rank of a job can reach.

    ``gs.open_store`` opens one from a URL; the object collectives take one as
    ``store=``.  Keys are ``/``-separated paths; values are written once
    (create-only), whole or not at all, and chunked where the backend takes smaller
    values.  A backend subclasses it and implements the primitives of ``Backend``
    (calling ``super().__init__()`` first in its own ``__init__``); everything a caller
    uses is written here, once (see "A store of your own").

    Examples:
        >>> store = gs.open_store("file:///nfs/scratch/gather")
        >>> store.put("run-1/preds", b"...")
        3
        >>> bytes(store.get("run-1/preds"))
        b'...'
        >>> store.list("run-1")
        ['run-1/preds']
        >>> store.delete("run-1")
    """

    def __init__(self) -> None:
        super().__init__()
        #: Chunk keys of the values ``get`` read, until ``discard`` deletes them.
        self._chunks = ChunksRead()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "Store":
        """Open the store a URL names; ``gs.open_store`` calls it with the class the
        URL's scheme is registered to.

        Args:
            url: the store's URL.
            **options: the store's own options; ``sign=True`` or ``False`` overrides
                whether parts are signed (default: when processes outside the job can
                reach the store).

        Returns:
            The store.
        """
        sign = options.pop("sign", None)
        store = cls._from_url(url, **options)
        if sign is not None:
            store.sign_parts = bool(sign)
        return store

    @classmethod
    def _from_url(cls, url: str, **options: Any) -> "Store":
        raise NotImplementedError(f"{cls.__name__} cannot be opened from a URL")

    # --- job hooks (see gatherstore.job.session) ----------------------------------------
    def prepare_job(self, job_id: str) -> str:
        """On rank 0, at a job's first use of the store: create what the job needs.

        Args:
            job_id: the job's id, the same on every rank.

        Returns:
            A locator of the job's area, which every rank passes to ``join_job``.
        """
        return job_keys(job_id)

    def join_job(self, locator: str) -> "Store":
        """On every rank: the store the job uses.

        Args:
            locator: what ``prepare_job`` returned on rank 0.

        Returns:
            The job's area: here, a view of this store under ``locator``.
        """
        return self.scoped(locator)

    def end_job(self, locator: str) -> None:
        """On rank 0, when the job ends: remove what ``prepare_job`` created.

        Bounded by the deadline in force, else by ``END_JOB_TIMEOUT`` seconds.

        Args:
            locator: what ``prepare_job`` returned.
        """
        with deadline(END_JOB_TIMEOUT):
            self.delete(locator)

    def job_areas(self) -> Iterator[JobArea]:
        """Every job area this store holds, a job's or not yet judged (``gatherstore gc``).

        Yields:
            Each area: here the prefixes ``gatherstore/<job>/``.
        """
        keys = self.list(f"{JOB_AREA}/")
        for job in sorted({key.split("/")[1] for key in keys if key.count("/") >= 2}):
            yield JobArea(job_keys(job), f"{self}/{job_keys(job)}", job, None)

    def holds_area(self, locator: str) -> bool:
        """Whether anything of a job area is left (after ``end_job``).

        Args:
            locator: the area's locator.

        Returns:
            True while a key of the area is left.
        """
        return bool(self.list(locator))

    def remove_area(self, locator: str) -> bool:
        """Remove the job area of a job that is gone (``gatherstore gc``), with whatever
        it left there (keys its index does not name too).

        Args:
            locator: the area's locator.

        Returns:
            Whether the area is gone.
        """
        self.end_job(locator)
        if self.holds_area(locator):
            self.delete(locator)
        return not self.holds_area(locator)

    def area_facts(self, locator: str) -> dict[str, Any]:
        """What ``gatherstore check`` shows of a job area (a folder's mode, say).

        Args:
            locator: the area's locator.

        Returns:
            Facts by name, JSON-friendly; none by default.
        """
        return {}

    # --- the API written once ---------------------------------------------------------
    _check_key = staticmethod(layout.check_key)

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> int:
        """Write a value at ``key``, create-only and all-or-nothing: a reader sees the
        whole value or nothing.

        Args:
            key: where, a ``/``-separated path.
            data: bytes, or a sequence of buffers written back to back.

        Returns:
            The number of payload bytes written.

        Raises:
            KeyExistsError: ``key`` already exists.
            StoreUnavailableError: the store cannot be written.
        """
        self._check_key(key)
        buffers: Sequence[Buffer] = (
            [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        )
        total = sum(nbytes(b) for b in buffers)
        with self._mapped(f"write {key!r}"):
            if total + HEADER_SIZE <= self.max_value_size:
                if not self._write(key, [layout.header(layout.INLINE, total, 0), *buffers]):
                    raise failures.exists(self, key)
                return total
            return self._put_chunked(key, buffers, total)

    def replace(self, key: str, data: bytes) -> None:
        """Write a small value at ``key``, replacing the one there: for bookkeeping such as
        a job's heartbeat, never for parts (which are create-only).

        Args:
            key: where.
            data: the value, at most what the store writes in one piece.

        Raises:
            ValueError: ``data`` is larger than the store writes in one piece.
            StoreUnavailableError: the store cannot be written.
        """
        self._check_key(key)
        if len(data) + HEADER_SIZE > self.max_value_size:
            raise ValueError(f"replace() takes values up to {self.max_value_size} bytes")
        with self._mapped(f"write {key!r}"):
            self._replace(key, [layout.header(layout.INLINE, len(data), 0), data])

    def _put_chunked(self, key: str, buffers: Sequence[Buffer], total: int) -> int:
        if self._exists(key):
            raise failures.exists(self, key)
        folder = layout.chunk_folder(key)
        try:
            runs = list(layout.split(buffers, self.max_value_size))
            names = [f"{folder}{i:08d}" for i in range(len(runs))]
            written = self._write_many(list(zip(names, runs, strict=True)))
            for name, wrote in zip(names, written, strict=True):
                if not wrote:
                    raise failures.exists(self, name)
            sizes = [sum(len(v) for v in run) for run in runs]
            if not self._write(key, layout.manifest(total, sizes, folder)):
                raise failures.exists(self, key)
        except BaseException:
            with contextlib.suppress(Exception):
                self._delete_prefix(folder)
            raise
        return total

    def _layout_of(self, key: str, raw: Buffer) -> Layout:
        """The layout of the value ``raw`` read at ``key``.

        Raises:
            IntegrityError: it is not laid out as gatherstore writes it.
        """
        try:
            return layout.layout_of(key, raw)
        except Damaged as exc:
            raise failures.damaged(self, key, str(exc)) from None

    def get(self, key: str) -> Buffer | None:
        """The value at ``key``.

        Args:
            key: where.

        Returns:
            The value (zero-copy where the backend allows), or None when absent.

        Raises:
            IntegrityError: the value or one of its chunks is damaged or missing.
        """
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        """The values at ``keys``, read together: backends keep their requests in flight
        at once, and every chunk of every chunked value is read in one go.

        Args:
            keys: where.

        Returns:
            The values, in the order of ``keys``; None where absent.

        Raises:
            IntegrityError: a value or one of its chunks is damaged or missing.
        """
        for key in keys:
            self._check_key(key)
        action = f"read {keys[0]!r}" if len(keys) == 1 else f"read {len(keys)} values"
        with self._mapped(action):
            out: list[Buffer | None] = []
            places: list[tuple[str, memoryview]] = []
            owners: list[str] = []
            for key, raw in zip(keys, self._read_many(keys), strict=True):
                if raw is None:
                    out.append(None)
                    continue
                value = self._layout_of(key, raw)
                # discard need not read the manifest again
                self._chunks.remember(key, [chunk for chunk, _ in value.chunks])
                if value.inline is not None:
                    out.append(value.inline)
                    continue
                whole = layout.writable(value.total)
                view, pos = memoryview(whole), 0
                for chunk, size in value.chunks:
                    places.append((chunk, view[pos : pos + size]))
                    owners.append(key)
                    pos += size
                out.append(whole)
            got = self._read_many_into(places) if places else []
            for key, (chunk, place), n in zip(owners, places, got, strict=True):
                self._check_chunk(key, chunk, len(place), n)
            return out

    def _check_chunk(self, key: str, chunk: str, size: int, got: int | None) -> None:
        """Raise when a chunk of ``key`` is gone (``got`` None) or not ``size`` bytes."""
        if got is None:
            raise GatherError(
                f"value {key!r} in store {self} lost its chunk {chunk!r}: deleted, "
                "or it expired (raise the store's ttl)"
            )
        if got != size:
            why = f"truncated: chunk {chunk!r} has {got} of {size} bytes"
            raise failures.damaged(self, key, why)

    def iter_chunks(self, key: str) -> Iterator[memoryview]:
        """Stream the value at ``key`` chunk by chunk (one chunk in memory at a time).

        Args:
            key: where.

        Yields:
            The value's chunks, in order (the whole value when it is not chunked).

        Raises:
            KeyError: ``key`` is absent.
            IntegrityError: the value or one of its chunks is damaged or missing.
        """
        self._check_key(key)
        with self._mapped(f"read {key!r}"):
            raw = self._read(key)
            if raw is None:
                raise KeyError(f"no key {key!r} in store {self}")
            value = self._layout_of(key, raw)
            if value.inline is not None:
                yield value.inline
                return
            for chunk, size in value.chunks:
                got = self._read(chunk)
                self._check_chunk(key, chunk, size, None if got is None else nbytes(got))
                assert got is not None
                yield memoryview(got).cast("B")

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value.

        Args:
            key: where.

        Returns:
            True when the value is there, whole (a value is written all or nothing).
        """
        with self._mapped(f"check {key!r}"):
            return self._exists(self._check_key(key))

    def list(self, prefix: str = "") -> list[str]:
        """The keys under ``prefix``.

        Args:
            prefix: the start of the keys; "" for every key.

        Returns:
            The keys, sorted, without the chunks of chunked values.
        """
        with self._mapped(f"list {prefix!r}"):
            return sorted(
                k for k in self._list(prefix) if not any(p.endswith(CHUNKS) for p in k.split("/"))
            )

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Block until every key exists.

        Args:
            keys: the keys to wait for.
            timeout: seconds.

        Raises:
            GatherTimeout: some keys are still missing after ``timeout`` seconds;
                ``keys`` lists them.
        """
        wait_for(self.exists, keys, timeout, self.poll_interval, self)

    def discard(self, key: str) -> None:
        """Delete the value at ``key`` and its chunks, by name.

        Unlike ``delete`` it lists nothing, so it costs the same in a store that holds
        millions of other keys (a Redis ``SCAN`` walks them all).  Keys under ``key/``
        are left alone.  An absent key is not an error, and a damaged one goes with
        everything under ``<key>.chunks/``.

        Args:
            key: where.
        """
        self._check_key(key)
        with self._mapped(f"delete {key!r}"):
            known = self._chunks.pop(key)
            if known is not None:  # read by get: its chunks are known
                self._delete([key, *known])
                return
            head = self._read_head(key, HEADER_SIZE)
            if head is None:
                return
            try:
                raw = self._read(key) if layout.chunked_head(head) else None
                chunks = [] if raw is None else layout.layout_of(key, raw).chunks
            except Damaged:  # its chunks, if any, are somewhere in its folder
                self._delete([key])
                self._delete_prefix(f"{key}{CHUNKS}/")
                return
            # the manifest first: readers see all or nothing
            self._delete([key, *(chunk for chunk, _ in chunks)])

    def discard_many(self, keys: Sequence[str]) -> None:
        """``discard`` of every key; values this store read with ``get`` or ``get_many``
        (their chunks are known) go in one backend delete.

        Args:
            keys: where.
        """
        for key in keys:
            self._check_key(key)
        read = self._chunks
        known = [key for key in keys if key in read]
        with self._mapped(f"delete {len(known)} values"):
            names = [n for key in known for n in (key, *(read.pop(key) or []))]
            if names:
                self._delete(names)  # each manifest before its chunks
        for key in keys:
            if key not in known:
                self.discard(key)

    def delete(self, prefix: str) -> None:
        """Delete the key ``prefix`` (with its chunks) and every key under ``prefix/``.

        Exact: ``delete("a")`` never touches ``a-b`` or ``ab``.

        Args:
            prefix: the key, or folder, to delete; "" for everything in the store.
        """
        base = prefix.rstrip("/")
        with self._mapped(f"delete {prefix!r}"):
            if base:
                self._delete([base])
                self._delete_prefix(f"{base}{CHUNKS}/")
            self._delete_prefix(f"{base}/" if base else "")

    def scoped(self, prefix: str) -> "Store":
        """A view of this store in which every key lives under ``prefix``.

        Args:
            prefix: the folder of the view's keys.

        Returns:
            A store whose key ``k`` is this store's ``<prefix>/k``.
        """
        return ScopedStore(self, prefix)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reopen, (type(self), self.url, self._options(), self._sign))


def _reopen(cls: type[Store], url: str, options: dict[str, Any], sign: bool | None) -> Store:
    return cls.from_url(url, **options, **({} if sign is None else {"sign": sign}))


# A view of a store whose keys all live under a prefix (what ``Store.scoped`` returns).
#
# Every primitive is the parent's, forwarded by how it names keys (see
# ``backend.PRIMITIVES``), so a new primitive cannot be missed: the module refuses to
# load while one is not forwarded.  What the parent can do is the view's too; only
# whether parts are signed is the view's own.


def _forward(name: str) -> Any:
    """Primitive ``name`` of a view under a prefix: the parent's, with the prefix added to
    every key it names (see ``PRIMITIVES``), and removed from those it lists."""
    shape = PRIMITIVES[name]

    def forwarded(self: "ScopedStore", keys: Any, *rest: Any) -> Any:
        p = self.prefix
        if shape in ("key", "prefix"):
            keys = p + keys
        elif shape == "keys":
            keys = [p + key for key in keys]
        else:
            keys = [(p + key, value) for key, value in keys]
        out = getattr(self.parent, name)(keys, *rest)
        return (key[len(p) :] for key in out) if name == "_list" else out

    forwarded.__name__ = forwarded.__qualname__ = name
    return forwarded


def _parents(name: str) -> Any:
    """An attribute of a view under a prefix that is its parent's."""
    return property(lambda self: getattr(self.parent, name))


class ScopedStore(Store):
    """A view of a parent store whose keys all live under a prefix: every primitive is
    the parent's (by ``PRIMITIVES``, so none can be missed), and so is what
    the parent can do; only whether parts are signed is the view's own."""

    def __init__(self, parent: Store, prefix: str) -> None:
        super().__init__()
        self.parent = parent
        self.prefix = prefix.strip("/") + "/"
        self.sign_parts = parent.sign_parts

    _write = _forward("_write")
    _read = _forward("_read")
    _exists = _forward("_exists")
    _list = _forward("_list")
    _delete = _forward("_delete")
    _delete_prefix = _forward("_delete_prefix")
    _replace = _forward("_replace")
    _write_many = _forward("_write_many")
    _read_many = _forward("_read_many")
    _read_many_into = _forward("_read_many_into")
    _read_head = _forward("_read_head")

    max_value_size = _parents("max_value_size")
    unavailable_errors = _parents("unavailable_errors")
    poll_interval = _parents("poll_interval")
    reachable_by_others = _parents("reachable_by_others")
    is_private = _parents("is_private")
    persistent = _parents("persistent")
    shares_memory_with_host = _parents("shares_memory_with_host")
    supports_handover = _parents("supports_handover")
    folder = _parents("folder")

    @property
    def url(self) -> str:
        return self.parent.url

    def __str__(self) -> str:
        return f"{self.parent} [{self.prefix}]"

    def close(self) -> None:
        self.parent.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (ScopedStore, (self.parent, self.prefix))

    def _identity(self) -> tuple[Any, ...]:
        return (*self.parent._identity(), self.prefix)


_unforwarded = sorted(set(PRIMITIVES) - set(vars(ScopedStore)))
if _unforwarded:  # pragma: no cover - a primitive added to the table but not here
    raise TypeError(f"ScopedStore does not forward {_unforwarded}")
