"""The Store ABC: a place for bytes, with everything but five primitives written once.

A backend implements an all-or-nothing create-only write, a read that returns
None when the key is absent, exists, list and delete.  Chunking, manifests,
``wait``, exact prefix deletes, deletes by name, scoped views, error mapping, pickling and the
password-free ``str`` live here, and so does the *deadline*: object collectives
run their store work inside :func:`deadline`, and each backend bounds its
socket and request timeouts by :func:`time_left`, so that no store call
outlives the collective's ``timeout`` (a frozen server ends in
StoreUnavailableError, not in a 60 s socket timeout).

Every stored value starts with a 64-byte header: an inline value carries its
payload after it; a value larger than ``max_value_size`` is written as chunks
under ``<key>.chunks/`` first and its header (the manifest, listing the chunk
sizes) last, so a reader never sees a partial value.
"""

from __future__ import annotations

import contextlib
import struct
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

from .._errors import GatherError, GatherTimeout, StoreUnavailableError
from ._secrets import describe_failure, hide_password, hide_secrets
from .deadline import END_JOB_TIMEOUT, deadline, expired
from .layout import CHUNKED as _CHUNKED
from .layout import CHUNKS, HEADER_SIZE, Buffer
from .layout import HEADER as _HEADER
from .layout import INLINE as _INLINE
from .layout import MAGIC as _MAGIC
from .layout import header as _header
from .layout import nbytes as _nbytes
from .layout import split as _split
from .layout import writable as _writable

__all__ = [
    "CHUNKS",
    "HEADER_SIZE",
    "JOB_AREA",
    "Buffer",
    "KeyExistsError",
    "Store",
    "describe_failure",
    "hide_password",
    "hide_secrets",
    "job_directory",
    "job_keys",
]

_LAYOUTS_KEPT = 256  # chunk layouts remembered between get and discard
#: Every job area is named after this: ``gatherstore/<job>/`` keys in key-value and
#: object stores, ``gatherstore-<job>-*`` directories in filesystem stores.
JOB_AREA = "gatherstore"


def job_keys(job_id: str) -> str:
    """The key prefix of a job's area in a key-value or object store."""
    return f"{JOB_AREA}/{job_id}/"


def job_directory(job_id: str | None = None) -> str:
    """The name prefix of a job's directory in a filesystem store (of any job's: None)."""
    return f"{JOB_AREA}-" if job_id is None else f"{JOB_AREA}-{job_id}-"


class KeyExistsError(GatherError, FileExistsError):
    """A create-only put found the key already there."""


class Store(ABC):
    """A key-value place for bytes that every rank of a job can reach.

    Keys are ``/``-separated paths.  Subclasses implement ``_write``, ``_read``,
    ``_exists``, ``_list`` and ``_delete`` (and may override ``_delete_prefix`` and
    ``_read_head`` where the backend does them faster).
    """

    #: Largest value written in one piece; larger values are chunked.
    max_value_size: ClassVar[int] = 1 << 62
    #: Backend exceptions that mean "cannot reach or write the store".
    unavailable_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)
    #: Whether processes outside the job can write here (then parts are signed).
    reachable_by_others: ClassVar[bool] = True
    #: Whether ranks on other nodes can see the store (False: check at first use).
    poll_interval: ClassVar[float] = 0.005

    # --- primitives -------------------------------------------------------------
    @abstractmethod
    def _write(self, key: str, buffers: Sequence[Buffer]) -> bool:
        """Write the concatenation of ``buffers`` at ``key`` all-or-nothing.

        Returns False (writing nothing) when ``key`` already exists.
        """

    @abstractmethod
    def _read(self, key: str) -> Buffer | None:
        """The whole value at ``key``, or None when absent."""

    @abstractmethod
    def _exists(self, key: str) -> bool:
        """Whether ``key`` exists."""

    @abstractmethod
    def _list(self, prefix: str) -> Iterable[str]:
        """Every key that starts with ``prefix`` (``""`` or ending in ``/``)."""

    @abstractmethod
    def _delete(self, keys: Sequence[str]) -> None:
        """Delete these exact keys; absent ones are ignored."""

    def _delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix`` (ending in ``/``)."""
        keys = list(self._list(prefix))
        if keys:
            self._delete(keys)

    def _replace(self, key: str, buffers: Sequence[Buffer]) -> None:
        """Write ``buffers`` at ``key`` whether or not it exists.  Backends override it to
        replace the value in one step; this default leaves a moment without one."""
        self._delete([key])
        self._write(key, buffers)

    def _write_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        """``_write`` of each (key, buffers), in order; backends that can keep a bounded
        number of writes in flight override it."""
        return [self._write(key, buffers) for key, buffers in items]

    def _read_many_into(self, items: Sequence[tuple[str, memoryview]]) -> list[int | None]:
        """Read each key's value into its view when the sizes match; per item the value's
        size (None: absent).  Backends override it to keep a bounded number of reads
        in flight, straight into the views."""
        sizes: list[int | None] = []
        for key, view in items:
            raw = self._read(key)
            sizes.append(None if raw is None else _nbytes(raw))
            if raw is not None and _nbytes(raw) == len(view):
                view[:] = memoryview(raw).cast("B")
        return sizes

    def _read_head(self, key: str, size: int) -> Buffer | None:
        """At least the first ``size`` bytes at ``key`` (more is fine), or None when absent.

        Backends that can read a range override it, so that ``discard`` never
        fetches a whole value to learn whether it is chunked.
        """
        return self._read(key)

    @property
    @abstractmethod
    def url(self) -> str:
        """The URL that reopens this store with :func:`gatherstore.open_store`."""

    def _options(self) -> dict[str, Any]:
        """Keyword options that, with ``url``, reopen an equal store."""
        return {}

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Store:
        """Open the store a URL names (see :func:`gatherstore.open_store`).

        ``sign=True/False`` overrides whether parts are signed
        (default: when processes outside the job can reach the store).
        """
        sign = options.pop("sign", None)
        store = cls._from_url(url, **options)
        if sign is not None:
            store.sign_parts = bool(sign)
        return store

    @classmethod
    def _from_url(cls, url: str, **options: Any) -> Store:
        raise NotImplementedError(f"{cls.__name__} cannot be opened from a URL")

    @property
    def sign_parts(self) -> bool:
        """Whether object parts written here are signed and verified."""
        return bool(self.__dict__.get("_sign", self.reachable_by_others))

    @sign_parts.setter
    def sign_parts(self, value: bool) -> None:
        self.__dict__["_sign"] = value

    # --- job hooks (see gatherstore._session) ----------------------------------------
    def prepare_job(self, job_id: str) -> str:
        """On rank 0, at a job's first use: create what the job needs; return a locator."""
        return job_keys(job_id)

    def join_job(self, locator: str) -> Store:
        """On every rank: the store the job uses, given rank 0's locator."""
        return self.scoped(locator)

    def end_job(self, locator: str) -> None:
        """On rank 0, when the job ends: remove what ``prepare_job`` created.

        Bounded by the deadline in force, else by ``END_JOB_TIMEOUT`` seconds.
        """
        with deadline(END_JOB_TIMEOUT):
            self.delete(locator)

    # --- the API written once ---------------------------------------------------------
    @contextlib.contextmanager
    def _mapped(self, action: str) -> Iterator[None]:
        """Map backend errors to gatherstore's, once: the message keeps the cause, the
        traceback drops the backend's own frames (see :func:`describe_failure`)."""
        if expired():
            raise self._unavailable(action, "no time left in the call's timeout")
        try:
            yield
        except GatherError:
            raise
        except self.unavailable_errors as exc:
            raise self._unavailable(action, describe_failure(exc)) from None

    def _unavailable(self, action: str, why: str) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"store {self} failed to {action}: {why}; check that it is reachable, "
            "responsive, writable and not full",
            store=str(self),
        )

    @staticmethod
    def _check_key(key: str) -> str:
        if (
            not key
            or key.startswith("/")
            or key.endswith("/")
            or any(part in ("", ".", "..") or part.endswith(CHUNKS) for part in key.split("/"))
        ):
            raise ValueError(
                f"store key {key!r} is not valid: use non-empty '/'-separated names, "
                f"without '.', '..' or names ending in {CHUNKS!r}"
            )
        return key

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> int:
        """Write ``data`` (bytes, or a sequence of buffers written back to back) at ``key``.

        Create-only and all-or-nothing: a reader sees the whole value or nothing.

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
        total = sum(_nbytes(b) for b in buffers)
        with self._mapped(f"write {key!r}"):
            if total + HEADER_SIZE <= self.max_value_size:
                if not self._write(key, [_header(_INLINE, total, 0), *buffers]):
                    raise self._exists_error(key)
                return total
            return self._put_chunked(key, buffers, total)

    def replace(self, key: str, data: bytes) -> None:
        """Write a small value at ``key``, replacing the one there: for bookkeeping such as
        a job's heartbeat, never for parts (which are create-only).

        Raises:
            ValueError: ``data`` is larger than the store writes in one piece.
            StoreUnavailableError: the store cannot be written.
        """
        self._check_key(key)
        if len(data) + HEADER_SIZE > self.max_value_size:
            raise ValueError(f"replace() takes values up to {self.max_value_size} bytes")
        with self._mapped(f"write {key!r}"):
            self._replace(key, [_header(_INLINE, len(data), 0), data])

    def _put_chunked(self, key: str, buffers: Sequence[Buffer], total: int) -> int:
        if self._exists(key):
            raise self._exists_error(key)
        chunk_dir = f"{key}{CHUNKS}/{uuid.uuid4().hex}/"
        try:
            runs = list(_split(buffers, self.max_value_size))
            names = [f"{chunk_dir}{i:08d}" for i in range(len(runs))]
            written = self._write_many(list(zip(names, runs, strict=True)))
            for name, wrote in zip(names, written, strict=True):
                if not wrote:
                    raise self._exists_error(name)
            sizes = [sum(len(v) for v in run) for run in runs]
            manifest = struct.pack(f"<{len(sizes)}Q", *sizes) + chunk_dir.encode()
            if not self._write(key, [_header(_CHUNKED, total, len(sizes)), manifest]):
                raise self._exists_error(key)
        except BaseException:
            with contextlib.suppress(Exception):
                self._delete_prefix(chunk_dir)
            raise
        return total

    def _exists_error(self, key: str) -> KeyExistsError:
        return KeyExistsError(
            f"key {key!r} already exists in store {self}; parts are create-only — "
            "delete it first or use a new key"
        )

    def _parse(self, key: str, raw: Buffer) -> tuple[int, int, int, memoryview]:
        view = memoryview(raw).cast("B")
        if len(view) < HEADER_SIZE:
            raise self._corrupt(key, "shorter than its header")
        magic, kind, total, count = _HEADER.unpack_from(view)
        if magic != _MAGIC or kind not in (_INLINE, _CHUNKED):
            raise self._corrupt(key, "not written by this version of gatherstore's store layer")
        body = view[HEADER_SIZE:]
        if kind == _INLINE and len(body) != total:
            raise self._corrupt(key, f"truncated: {len(body)} of {total} bytes")
        return kind, total, count, body

    def _corrupt(self, key: str, why: str) -> GatherError:
        from .._errors import IntegrityError

        return IntegrityError(f"value {key!r} in store {self} is {why}", key=key)

    def _chunk_layout(self, key: str, count: int, body: memoryview) -> list[tuple[str, int]]:
        sizes = struct.unpack_from(f"<{count}Q", body)
        chunk_dir = bytes(body[8 * count :]).decode()
        return [(f"{chunk_dir}{i:08d}", n) for i, n in enumerate(sizes)]

    def get(self, key: str) -> Buffer | None:
        """The value at ``key`` (zero-copy where the backend allows), or None when absent.

        Raises:
            IntegrityError: the value or one of its chunks is damaged or missing.
        """
        self._check_key(key)
        with self._mapped(f"read {key!r}"):
            raw = self._read(key)
            if raw is None:
                return None
            kind, total, count, body = self._parse(key, raw)
            if kind == _INLINE:
                return body
            layout = self._chunk_layout(key, count, body)
            layouts = self._layouts()
            if len(layouts) >= _LAYOUTS_KEPT:  # values read but never discarded here
                layouts.clear()
            layouts[key] = [chunk for chunk, _ in layout]  # discard reads it no more
            out = _writable(total)
            view, pos, places = memoryview(out), 0, []
            for chunk, size in layout:
                places.append((chunk, view[pos : pos + size]))
                pos += size
            for (chunk, place), n in zip(places, self._read_many_into(places), strict=True):
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
            raise self._corrupt(key, f"truncated: chunk {chunk!r} has {got} of {size} bytes")

    def _layouts(self) -> dict[str, list[str]]:
        """Chunk keys of the values ``get`` read, until ``discard`` deletes them."""
        layouts: dict[str, list[str]] = self.__dict__.setdefault("_read_layouts", {})
        return layouts

    def iter_chunks(self, key: str) -> Iterator[memoryview]:
        """Stream the value at ``key`` chunk by chunk (one chunk in memory at a time).

        Raises:
            KeyError: ``key`` is absent.
        """
        self._check_key(key)
        with self._mapped(f"read {key!r}"):
            raw = self._read(key)
            if raw is None:
                raise KeyError(f"no key {key!r} in store {self}")
            kind, _, count, body = self._parse(key, raw)
            if kind == _INLINE:
                yield body
                return
            yield from self._iter_chunk_values(key, count, body)

    def _iter_chunk_values(self, key: str, count: int, body: memoryview) -> Iterator[memoryview]:
        for chunk_key, size in self._chunk_layout(key, count, body):
            raw = self._read(chunk_key)
            self._check_chunk(key, chunk_key, size, None if raw is None else _nbytes(raw))
            assert raw is not None
            yield memoryview(raw).cast("B")

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a complete value."""
        with self._mapped(f"check {key!r}"):
            return self._exists(self._check_key(key))

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` (chunks hidden), sorted."""
        with self._mapped(f"list {prefix!r}"):
            return sorted(
                k for k in self._list(prefix) if not any(p.endswith(CHUNKS) for p in k.split("/"))
            )

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Block until every key exists.

        Raises:
            GatherTimeout: some keys are still missing after ``timeout`` seconds;
                ``keys`` lists them.
        """
        missing = list(keys)
        deadline = time.monotonic() + timeout
        delay = self.poll_interval / 8
        while True:
            missing = [k for k in missing if not self.exists(k)]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise GatherTimeout(
                    f"store {self}: keys {missing} did not appear within {timeout:g} s",
                    keys=missing,
                    timeout=timeout,
                )
            time.sleep(delay)
            delay = min(delay * 2, self.poll_interval * 20)

    def discard(self, key: str) -> None:
        """Delete the value at ``key`` and its chunks, by name.

        Unlike :meth:`delete` it lists nothing, so it costs the same in a store
        that holds millions of other keys (a Redis ``SCAN`` walks them all).
        Keys under ``key/`` are left alone.  An absent key is not an error.
        """
        self._check_key(key)
        with self._mapped(f"delete {key!r}"):
            known = self._layouts().pop(key, None)
            if known is not None:  # read by get: its chunks are known
                self._delete([key, *known])
                return
            head = self._read_head(key, HEADER_SIZE)
            if head is None:
                return
            chunks: list[str] = []
            if bytes(memoryview(head).cast("B")[:9]) == _MAGIC + bytes([_CHUNKED]):
                raw = self._read(key)
                if raw is None:  # gone meanwhile (e.g. its TTL ran out)
                    return
                try:
                    _, _, count, body = self._parse(key, raw)
                    chunks = [chunk for chunk, _ in self._chunk_layout(key, count, body)]
                except (GatherError, struct.error, UnicodeDecodeError):  # a damaged manifest
                    self._delete_prefix(f"{key}{CHUNKS}/")
            self._delete([key, *chunks])  # the manifest first: readers see all or nothing

    def delete(self, prefix: str) -> None:
        """Delete the key ``prefix`` (with its chunks) and every key under ``prefix/``.

        Exact: ``delete("a")`` never touches ``a-b`` or ``ab``.
        """
        base = prefix.rstrip("/")
        with self._mapped(f"delete {prefix!r}"):
            if base:
                self._delete([base])
                self._delete_prefix(f"{base}{CHUNKS}/")
            self._delete_prefix(f"{base}/" if base else "")

    def scoped(self, prefix: str) -> Store:
        """A view of this store in which every key lives under ``prefix``."""
        from .scoped import ScopedStore

        return ScopedStore(self, prefix)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the store is unusable afterwards."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __str__(self) -> str:
        return hide_password(self.url)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reopen, (type(self), self.url, self._options(), self.__dict__.get("_sign")))

    def _identity(self) -> tuple[Any, ...]:
        """What makes two stores the same place: class, URL, options, signing."""
        return (type(self), self.url, self._options(), self.sign_parts)

    def __eq__(self, other: object) -> bool:
        """Same class, URL and options mean the same store (one job area per store)."""
        if not isinstance(other, Store):
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash((type(self), self.url))


def _reopen(cls: type[Store], url: str, options: dict[str, Any], sign: bool | None) -> Store:
    return cls.from_url(url, **options, **({} if sign is None else {"sign": sign}))
