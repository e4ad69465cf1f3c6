"""Any fsspec filesystem: ``memory://``, ``file://``, ``s3://``, ``gs://``, ``az://``, ...

Object stores (``s3://``, ``gs://``, ``az://``, ...) publish a value with one
PUT, so a reader never sees part of it: values above 16 MiB are chunked by
the base class into 16 MiB objects, each one create-only PUT written 4 at a
time, and the manifest, written last and create-only, publishes the value.
Create-only is the server's: ``If-None-Match: *`` on S3, ``ifGenerationMatch=0``
on GCS (gcsfs), ``overwrite=False`` on Azure (adlfs); a backend whose
``pipe_file`` knows no ``mode="create"`` gets a check before its PUT, which
two racing writers of one key could both pass (gatherstore's own keys have one
writer each).  Other filesystems (``memory://``, local, ...) write a temp file
and move it into place after the same check.

On S3 the fast path of ``_s3`` receives GET bodies straight into the value's
buffer and skips hashes that TLS-less test endpoints do not need.

Inside a store deadline (see ``gatherstore._time.deadline``) every
request of an asynchronous filesystem (s3fs, gcsfs, adlfs) is cancelled when
the call's time is up (object PUTs are 16 MiB at most for that); S3 clients
also get connect/read timeouts and a retry budget of their own
(``config_kwargs``, unless given).  Synchronous filesystems cannot be
cancelled: their calls end when the filesystem returns.  Every exception of
the filesystem and its HTTP and auth stacks (botocore, aiohttp, gcsfs,
google-auth, azure-core, fsspec's timeouts) becomes StoreUnavailableError,
also when the filesystem is created.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import fsspec
import fsspec.asyn

from gatherstore._errors import StoreUnavailableError
from gatherstore._time import MIN_TIMEOUT, time_left
from gatherstore.stores import _s3
from gatherstore.stores._s3 import fast_s3_options
from gatherstore.stores.base import Buffer, Store, describe_failure, hide_password, hide_secrets

__all__ = ["S3_CHUNK_SIZE", "FsspecStore", "fast_s3_options"]

_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}
_S3 = {"s3", "s3a"}
_STEP = 16 << 20  # bytes per write/ranged read of a large value
#: Largest object written in one PUT; larger values are chunked into objects this size.
S3_CHUNK_SIZE = 16 << 20


def _precondition_failed(exc: BaseException) -> bool:
    """Whether a write failed because the object exists (HTTP 412 to If-None-Match)."""
    if isinstance(exc, FileExistsError):
        return True
    cause = exc.__cause__
    response = getattr(cause, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in ("PreconditionFailed", "412")


def _backend_errors() -> tuple[type[BaseException], ...]:
    """OSError (fsspec's timeouts included) and the HTTP stacks' own roots, where installed."""
    errors: list[type[BaseException]] = [OSError, ConnectionError, TimeoutError]
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError, ClientError

        errors += [BotoCoreError, ClientError]
    with contextlib.suppress(ImportError):
        from aiohttp import ClientError as AiohttpError

        errors.append(AiohttpError)
    with contextlib.suppress(ImportError):
        from fsspec.exceptions import FSTimeoutError

        errors.append(FSTimeoutError)
    with contextlib.suppress(ImportError):  # gcsfs's HTTP errors and google-auth's
        from gcsfs.retry import HttpError
        from google.auth.exceptions import GoogleAuthError

        errors += [HttpError, GoogleAuthError]
    with contextlib.suppress(ImportError):  # adlfs's: azure-core's
        from azure.core.exceptions import AzureError

        errors.append(AzureError)
    return tuple(errors)


class FsspecStore(Store):
    """Values as files/objects of an fsspec filesystem under ``url``.

    ``storage_options`` (e.g. ``endpoint_url``, ``key``, ``secret`` for S3) go
    to fsspec; the usual environment (AWS_* variables, config files) applies.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        super().__init__()
        self.protocol = url.split("://", 1)[0] if "://" in url else "file"
        self._is_s3 = self.protocol in _S3
        options = (
            {"config_kwargs": _s3.S3_CONFIG, **storage_options} if self._is_s3 else storage_options
        )
        self.unavailable_errors = _backend_errors()
        try:
            self.fs, root = fsspec.core.url_to_fs(
                url, **(fast_s3_options(options) if self._is_s3 else options)
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"store URL {hide_password(url)!r} or its options are not valid: "
                f"{hide_secrets(str(exc))}"
            ) from None
        except self.unavailable_errors as exc:  # e.g. google-auth finding no credentials
            raise StoreUnavailableError(
                f"store {hide_password(url)} cannot be opened: {describe_failure(exc)}; check its "
                "credentials and options",
                store=hide_password(url),
            ) from None
        except ImportError:  # the filesystem's package: open_store says how to install it
            raise
        except Exception as exc:  # e.g. gcsfs's KeyError for a token without its fields
            raise ValueError(
                f"store URL {hide_password(url)!r} or its options are not valid: "
                f"{describe_failure(exc)}"
            ) from None
        self.root = root.rstrip("/")
        if self.protocol in _OBJECT_STORES and not self.root:
            raise ValueError(
                f"store URL {hide_password(url)!r} names no bucket; use e.g. s3://bucket/prefix"
            )
        self.storage_options = storage_options
        # memory:// lives inside one process: nobody else writes there, nothing outlives it
        self.reachable_by_others = self.persistent = self.protocol != "memory"
        self._object_store = self.protocol in _OBJECT_STORES
        if self._object_store:
            self.max_value_size = S3_CHUNK_SIZE

    @classmethod
    def _from_url(cls, url: str, **options: Any) -> Store:
        return cls(url, **options)

    @property
    def url(self) -> str:
        """``<protocol>://<root>``; a local folder is ``local://…``, since ``file://…``
        opens a ``FileStore``."""
        return f"{'local' if self.protocol == 'file' else self.protocol}://{self.root}"

    def _options(self) -> dict[str, Any]:
        return dict(self.storage_options)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _key(self, path: str) -> str:
        """The key at a path the filesystem lists, ``_path`` undone.  A store at the top of
        its filesystem (``memory://``) has the root ``""``, and its paths are ``/<key>``."""
        return path[len(self.root) :].lstrip("/")

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``self.fs.<method>(...)``, cancelled at the deadline on asynchronous filesystems."""
        if time_left() is None or not getattr(self.fs, "async_impl", False):
            return getattr(self.fs, method)(*args, **kwargs)
        return self._call_async(method, getattr(self.fs, f"_{method}"), *args, **kwargs)

    def _call_async(self, what: str, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``await func(...)`` on the filesystem's event loop, cancelled at the deadline."""
        left = time_left()
        if left is not None and left <= MIN_TIMEOUT:
            raise TimeoutError(f"{what}: the call's timeout is over")
        # fsspec's sync() cancels the request and raises; a filesystem method that
        # swallows the cancellation (e.g. answering "no such file") still ends here
        result = fsspec.asyn.sync(self.fs.loop, func, *args, timeout=left, **kwargs)
        if left is not None and time_left() == MIN_TIMEOUT:
            raise TimeoutError(f"{what}: no answer within the call's timeout")
        return result

    def _write(self, key: str, buffers: Sequence[Buffer]) -> bool:
        path = self._path(key)
        if self._object_store:  # at most S3_CHUNK_SIZE bytes in one create-only PUT
            return self._put_object(key, path, buffers)
        if self._exists(key):
            return False
        target = f"{path}.tmp-{uuid.uuid4().hex}"
        self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        f = self.fs.open(target, "wb")
        # block by block: a buffered file copies what it is given, all of it at once
        step = getattr(f, "blocksize", 0) or _STEP
        try:
            for buf in buffers:
                view = memoryview(buf).cast("B")
                for start in range(0, len(view), step):
                    f.write(view[start : start + step])
            f.close()
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()
                self.fs.rm_file(target)
            raise
        if self._exists(key):
            self.fs.rm_file(target)
            return False
        self.fs.mv(target, path)
        return True

    def _put_object(self, key: str, path: str, buffers: Sequence[Buffer]) -> bool:
        """A value in one create-only PUT, cancelled at the deadline (a check first where
        the filesystem's ``pipe_file`` knows no ``mode="create"``)."""
        data = b"".join(memoryview(b).cast("B") for b in buffers)
        try:
            try:
                self._call("pipe_file", path, data, mode="create")
            except TypeError:  # an older filesystem without create-only writes
                if self._exists(key):
                    return False
                self._call("pipe_file", path, data)
        except Exception as exc:
            if _precondition_failed(exc) and self._exists(key):
                return False
            raise
        return True

    def _replace(self, key: str, buffers: Sequence[Buffer]) -> None:
        data = b"".join(memoryview(b).cast("B") for b in buffers)
        path = self._path(key)
        if self._object_store:
            self._call("pipe_file", path, data)
            return
        target = f"{path}.tmp-{uuid.uuid4().hex}"
        self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        self.fs.pipe_file(target, data)
        self.fs.mv(target, path)

    def _write_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        if not self._object_store:
            return super()._write_many(items)
        return _s3.in_flight(
            lambda item: self._put_object(item[0], self._path(item[0]), item[1]), items
        )

    def _read_many_into(self, items: Sequence[tuple[str, memoryview]]) -> list[int | None]:
        if not self._is_s3:
            return super()._read_many_into(items)

        def fetch(item: tuple[str, memoryview]) -> int | None:
            key, view = item
            try:
                size: int = self._call_async(
                    "read", _s3.get_object_into, self.fs, self._path(key), view
                )
            except _s3.ABSENT:
                return None
            return size

        return _s3.in_flight(fetch, items)

    def _read_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        """On object stores, up to ``_s3.MANY_IN_FLIGHT`` GETs at once on the filesystem's event
        loop (small values do not wait for each other); a value past one ranged GET is
        then read in ranges."""
        if not (self._object_store and getattr(self.fs, "async_impl", False)) or len(keys) < 2:
            return super()._read_many(keys)
        paths = [self._path(key) for key in keys]
        firsts = self._call_async("read", _s3.cat_many, self.fs, paths, _s3.MANY_IN_FLIGHT, _STEP)
        return [
            None if first is None else self._read_ranges(path, first)
            for path, first in zip(paths, firsts, strict=True)
        ]

    def _read(self, key: str) -> Buffer | None:
        """The value in one writable buffer, so arrays and tensors decode without copies."""
        path = self._path(key)
        try:
            if self._object_store:
                return self._read_ranges(path)
            with self.fs.open(path, "rb") as f:
                size = getattr(f, "size", None)
                if not isinstance(size, int):
                    return bytearray(f.read())
                out = bytearray(size)
                view, pos = memoryview(out), 0
                while pos < len(out):
                    n = f.readinto(view[pos:])
                    if not n:
                        break
                    pos += n
        except _s3.ABSENT:
            return None
        return out if pos == len(out) else out[:pos]

    def _read_ranges(self, path: str, first: bytes | None = None) -> bytearray:
        """An object in one preallocated buffer, by ranged GETs of ``_STEP`` bytes
        (``first``: the first range, read already).

        A whole-object GET holds the body two or three times over while it is
        joined and copied; this holds one buffer plus one range.  A small object
        still costs one request.
        """
        if first is None:
            first = self._head(path, _STEP)
        if len(first) < _STEP:
            return bytearray(first)
        out = bytearray(self._call("size", path))
        out[:_STEP] = first
        del first
        for start in range(_STEP, len(out), _STEP):
            piece = self._call("cat_file", path, start=start, end=min(start + _STEP, len(out)))
            out[start : start + len(piece)] = piece
        return out

    def _read_head(self, key: str, size: int) -> Buffer | None:
        try:
            return self._head(self._path(key), size)
        except _s3.ABSENT:
            return None

    def _head(self, path: str, size: int) -> bytes:
        """The first ``size`` bytes of the object at ``path``, by a ranged read; an empty
        object (damage: stored values have a header) gives empty bytes."""
        try:
            head: bytes = self._call("cat_file", path, start=0, end=size)
        except _s3.ABSENT:
            raise
        except Exception as exc:
            if not _s3.no_range(exc):
                raise
            self.fs.invalidate_cache(path)
            if self._call("size", path) != 0:
                raise
            return b""
        return head

    def _exists(self, key: str) -> bool:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        return bool(self._call("isfile", path))

    def _list(self, prefix: str) -> Iterable[str]:
        top = self._path(prefix.rstrip("/"))
        self.fs.invalidate_cache(top)
        if not self._call("exists", top):
            return []
        paths = self._call("find", top)
        return [self._key(p) for p in paths if ".tmp-" not in p.rsplit("/", 1)[-1]]

    def _delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` in order; on S3 the first on its own, then the rest in batches of
        one request each (``discard`` passes a manifest first, then its chunks)."""
        if self._is_s3 and len(keys) > 2:
            self._delete(keys[:1])
            rest = [self._path(k) for k in keys[1:]]
            for i in range(0, len(rest), _s3.DELETE_BATCH):
                self._call_async(
                    "delete", _s3.delete_objects, self.fs, rest[i : i + _s3.DELETE_BATCH]
                )
            return
        for key in keys:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                self._call("rm_file", self._path(key))

    def _delete_prefix(self, prefix: str) -> None:
        keys = list(self._list(prefix))
        if keys:
            with contextlib.suppress(FileNotFoundError):
                self._call("rm", [self._path(k) for k in keys])
        top = self._path(prefix.rstrip("/"))
        if prefix and not self._object_store:
            with contextlib.suppress(FileNotFoundError, OSError):
                if self.fs.isdir(top):
                    self.fs.rm(top, recursive=True)
