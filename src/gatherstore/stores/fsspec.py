"""Any fsspec filesystem: ``memory://``, ``file://``, ``s3://``, ``gs://``, ``az://``, ...

Object stores publish a value with one PUT (or one multipart upload, which
becomes visible only when completed), so a reader never sees part of it;
filesystems write a temp file and move it into place.

Inside a store deadline (see :func:`gatherstore.stores.base.deadline`) every
request of an asynchronous filesystem (s3fs, gcsfs, adlfs) is cancelled when
the call's time is up (S3 values up to 16 MiB go up in one PUT for that); S3
clients also get connect/read timeouts and a retry budget of their own
(``config_kwargs``, unless given), which bound the streamed writes of larger
values.  Every exception of the filesystem and its HTTP
stack (botocore, aiohttp, fsspec's timeouts) becomes StoreUnavailableError.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import fsspec

from .base import MIN_TIMEOUT, Buffer, Store, time_left

__all__ = ["FsspecStore"]

_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}
_CREATE_ONLY = {"s3", "s3a"}
_ABSENT = (FileNotFoundError, IsADirectoryError)  # no value at a key
_STEP = 16 << 20  # bytes per write/ranged read of a large value
#: botocore settings for S3 unless the caller passes ``config_kwargs``: a frozen
#: endpoint fails a request within seconds instead of botocore's 60 s x 5 attempts.
_S3_CONFIG = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2}}


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
    return tuple(errors)


class FsspecStore(Store):
    """Values as files/objects of an fsspec filesystem under ``url``.

    ``storage_options`` (e.g. ``endpoint_url``, ``key``, ``secret`` for S3) go
    to fsspec; the usual environment (AWS_* variables, config files) applies.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.protocol = url.split("://", 1)[0] if "://" in url else "file"
        defaults = {"config_kwargs": _S3_CONFIG} if self.protocol in _CREATE_ONLY else {}
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **{**defaults, **storage_options})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"store URL {url!r} or its options are not valid: {exc}") from None
        self.root = root.rstrip("/")
        if self.protocol in _OBJECT_STORES and not self.root:
            raise ValueError(f"store URL {url!r} names no bucket; use e.g. s3://bucket/prefix")
        self.storage_options = storage_options
        self.unavailable_errors = _backend_errors()  # type: ignore[misc]
        self.reachable_by_others = self.protocol != "memory"  # type: ignore[misc]
        self._object_store = self.protocol in _OBJECT_STORES

    @classmethod
    def _from_url(cls, url: str, **options: Any) -> Store:
        return cls(url, **options)

    @property
    def url(self) -> str:
        return f"{self.protocol}://{self.root}"

    def _options(self) -> dict[str, Any]:
        return dict(self.storage_options)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``self.fs.<method>(...)``, cancelled at the deadline on asynchronous filesystems."""
        left = time_left()
        if left is None or not getattr(self.fs, "async_impl", False):
            return getattr(self.fs, method)(*args, **kwargs)
        if left <= MIN_TIMEOUT:
            raise TimeoutError(f"{method}: the call's timeout is over")
        # fsspec's sync() cancels the request and raises; a filesystem method that
        # swallows the cancellation (e.g. answering "no such file") still ends here
        result = getattr(self.fs, method)(*args, timeout=left, **kwargs)
        if time_left() == MIN_TIMEOUT:
            raise TimeoutError(f"{method}: no answer within the call's timeout")
        return result

    def _write(self, key: str, buffers: Sequence[Buffer]) -> bool:
        path = self._path(key)
        if self._exists(key):
            return False
        if self.protocol in _CREATE_ONLY and sum(memoryview(b).nbytes for b in buffers) <= _STEP:
            return self._put_object(key, path, buffers)
        target = path if self._object_store else f"{path}.tmp-{uuid.uuid4().hex}"
        if not self._object_store:
            self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        # s3fs's "xb" sends If-None-Match: * (PUT or multipart completion): create-only
        f = self.fs.open(target, "xb" if self.protocol in _CREATE_ONLY else "wb")
        # block by block: a buffered file copies what it is given, all of it at once
        step = getattr(f, "blocksize", 0) or _STEP
        try:
            for buf in buffers:
                view = memoryview(buf).cast("B")
                for start in range(0, len(view), step):
                    f.write(view[start : start + step])
            f.close()  # an object becomes visible only here, whole
        except BaseException as exc:
            with contextlib.suppress(Exception):
                discard = getattr(f, "discard", None)
                if discard is not None:
                    discard()  # aborts a multipart upload
                f.close()
                if not self._object_store:
                    self.fs.rm_file(target)
            if self._object_store and _precondition_failed(exc) and self._exists(key):
                return False
            raise
        if not self._object_store:
            if self._exists(key):
                self.fs.rm_file(target)
                return False
            self.fs.mv(target, path)
        return True

    def _put_object(self, key: str, path: str, buffers: Sequence[Buffer]) -> bool:
        """A small value in one create-only PUT (If-None-Match: *), cancelled at the deadline."""
        views = [memoryview(b).cast("B") for b in buffers]
        try:
            self._call("pipe_file", path, b"".join(views), mode="create")
        except Exception as exc:
            if _precondition_failed(exc) and self._exists(key):
                return False
            raise
        return True

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
        except _ABSENT:
            return None
        return out if pos == len(out) else out[:pos]

    def _read_ranges(self, path: str) -> bytearray:
        """An object in one preallocated buffer, by ranged GETs of ``_STEP`` bytes.

        A whole-object GET holds the body two or three times over while it is
        joined and copied; this holds one buffer plus one range.  A small object
        still costs one request.
        """
        first = self._call("cat_file", path, start=0, end=_STEP)
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
            head: bytes = self._call("cat_file", self._path(key), start=0, end=size)
        except _ABSENT:
            return None
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
        start = len(self.root) + 1 if self.root else 0
        return [p[start:] for p in self._call("find", top) if ".tmp-" not in p.rsplit("/", 1)[-1]]

    def _delete(self, keys: Sequence[str]) -> None:
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
