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

On S3 each GET's body is received straight into the value's buffer.  Measured
on SeaweedFS this beat one multipart upload plus ranged GETs, with s3fs and
with obstore alike.  Against an ``http://`` endpoint the payload is not hashed
for the SigV4 signature (TLS is absent anyway, and gatherstore signs and
verifies every part itself), and botocore computes no per-request CRC32 unless
the service requires one.

Inside a store deadline (see :func:`gatherstore.stores.deadline.deadline`) every
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

import asyncio
import contextlib
import contextvars
import errno
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import fsspec
import fsspec.asyn

from .._errors import StoreUnavailableError
from .base import Buffer, Store, describe_failure, hide_password, hide_secrets
from .deadline import MIN_TIMEOUT, time_left

__all__ = ["FsspecStore"]

_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}
_S3 = {"s3", "s3a"}
_ABSENT = (FileNotFoundError, IsADirectoryError)  # no value at a key
_STEP = 16 << 20  # bytes per write/ranged read of a large value
#: botocore settings for S3 unless the caller passes ``config_kwargs``: a frozen
#: endpoint fails a request within seconds instead of botocore's 60 s x 5 attempts.
_S3_CONFIG = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2}}
#: Largest object written in one PUT; larger values are chunked into objects this size.
S3_CHUNK_SIZE = 16 << 20
_IN_FLIGHT = 4  # S3 chunk PUTs or GETs at once per store call
_MANY_IN_FLIGHT = 32  # GETs of whole values (parts, small as a rule) at once
_DELETE_BATCH = 1000  # keys per S3 DeleteObjects request (the API's limit)
_T = TypeVar("_T")
_R = TypeVar("_R")


def _checksum_settings() -> tuple[str, ...]:
    """botocore's checksum settings (botocore >= 1.36 computes a CRC32 of every request)."""
    try:
        from botocore.config import Config
    except ImportError:
        return ()
    names = ("request_checksum_calculation", "response_checksum_validation")
    return tuple(n for n in names if n in getattr(Config, "OPTION_DEFAULTS", {}))


_CHECKSUM_SETTINGS = _checksum_settings()


def _endpoint(options: dict[str, Any]) -> str:
    client = options.get("client_kwargs") or {}
    return str(options.get("endpoint_url") or client.get("endpoint_url") or "")


def fast_s3_options(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs ``options`` plus the settings of the fast path (the caller's own win).

    No per-request CRC32 unless required; against an ``http://`` endpoint, no
    SHA-256 of the payload either (botocore hashes every byte otherwise).
    """
    config = dict(options.get("config_kwargs") or {})
    for name in _CHECKSUM_SETTINGS:
        config.setdefault(name, "when_required")
    if _endpoint(options).startswith("http://"):
        config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
    return {**options, "config_kwargs": config}


def _in_flight(work: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """``work`` of every item, ``_IN_FLIGHT`` at once, each in the caller's context
    (its store deadline included); results in order, the first error raised."""
    if len(items) <= 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(_IN_FLIGHT, thread_name_prefix="gatherstore-s3") as pool:
        futures = [pool.submit(contextvars.copy_context().run, work, item) for item in items]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


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


async def _get_object_into(fs: Any, path: str, view: memoryview) -> int:
    """GET the S3 object at ``path`` into ``view``; its size (``view`` is left alone when the
    sizes differ, and filled only in part when the body ends early: the caller checks).

    s3fs's ``cat_file`` first asks for the size (a HEAD), then collects the body in
    pieces, joins them into new bytes and leaves the copy into ``view`` to the caller;
    here one GET's body goes into ``view`` piece by piece as it arrives.  Retried like
    s3fs retries its own reads.
    """
    bucket, key, version = fs.split_path(path)
    version_kw = {"VersionId": version} if version else {}

    async def get() -> int:
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key, **version_kw)
        body = response["Body"]
        try:
            size = int(response.get("ContentLength", -1))
            if size != len(view):
                return size
            return await _body_into(body, view)
        finally:
            body.close()

    retry = getattr(_s3fs_core(), "_error_wrapper", None)
    return await (retry(get, retries=fs.retries) if retry else get())


async def _body_into(body: Any, view: memoryview) -> int:
    """Receive a response body into ``view``; the bytes received (at most ``len(view)``)."""
    stream = getattr(getattr(body, "raw_stream", None), "content", None)
    chunked = getattr(stream, "readchunk", None)  # aiohttp: one received piece, never joined
    pos = 0
    while pos < len(view):
        if chunked is not None:
            piece, http_chunk_end = await chunked()
        else:
            piece, http_chunk_end = await body.read(len(view) - pos), False
        if not piece:
            if http_chunk_end:
                continue
            break
        n = min(len(piece), len(view) - pos)
        view[pos : pos + n] = memoryview(piece)[:n]
        pos += n
    return pos


async def _cat_many(fs: Any, paths: list[str], limit: int, step: int) -> list[bytes | None]:
    """The first ``step`` bytes of every object (None where absent), ``limit`` GETs at once."""
    gate = asyncio.Semaphore(limit)

    async def first(path: str) -> bytes | None:
        async with gate:
            try:
                head: bytes = await fs._cat_file(path, start=0, end=step)
            except _ABSENT:
                return None
            except OSError as exc:
                if not _no_range(exc) or await fs._size(path) != 0:
                    raise
                return b""
            return head

    return list(await asyncio.gather(*(first(path) for path in paths)))


async def _delete_objects(fs: Any, paths: list[str]) -> None:
    """Delete S3 objects of one bucket with one DeleteObjects request; an object that is
    already gone is fine, any other refusal raises (s3fs's own bulk delete drops them)."""
    bucket = fs.split_path(paths[0])[0]
    objects = [{"Key": fs.split_path(path)[1]} for path in paths]
    for path in paths:
        fs.invalidate_cache(path)
    reply = await fs._call_s3(
        "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True}
    )
    errors = [e for e in reply.get("Errors") or [] if e.get("Code") != "NoSuchKey"]
    if errors:
        first = errors[0]
        raise PermissionError(
            f"S3 refused to delete {len(errors)} object(s), e.g. {first.get('Key')!r}: "
            f"{first.get('Code')} {first.get('Message', '')}".rstrip()
        )


def _no_range(exc: OSError) -> bool:
    """Whether a ranged read may have failed for want of a range: S3 answers one of an
    empty object with InvalidRange, which s3fs raises as EINVAL."""
    return exc.errno == errno.EINVAL


def _s3fs_core() -> Any:
    """s3fs's core module (its retry wrapper), or None without s3fs."""
    try:
        import s3fs.core
    except ImportError:  # pragma: no cover - s3:// needs s3fs anyway
        return None
    return s3fs.core


class FsspecStore(Store):
    """Values as files/objects of an fsspec filesystem under ``url``.

    ``storage_options`` (e.g. ``endpoint_url``, ``key``, ``secret`` for S3) go
    to fsspec; the usual environment (AWS_* variables, config files) applies.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.protocol = url.split("://", 1)[0] if "://" in url else "file"
        self._s3 = self.protocol in _S3
        options = {"config_kwargs": _S3_CONFIG, **storage_options} if self._s3 else storage_options
        self.unavailable_errors = _backend_errors()  # type: ignore[misc]
        try:
            self.fs, root = fsspec.core.url_to_fs(
                url, **(fast_s3_options(options) if self._s3 else options)
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
        self.reachable_by_others = self.protocol != "memory"  # type: ignore[misc]
        self._object_store = self.protocol in _OBJECT_STORES
        if self._object_store:
            self.max_value_size = S3_CHUNK_SIZE  # type: ignore[misc]

    @classmethod
    def _from_url(cls, url: str, **options: Any) -> Store:
        return cls(url, **options)

    @property
    def url(self) -> str:
        """``<protocol>://<root>``; a local folder is ``local://…``, since ``file://…``
        opens a :class:`~.file.FileStore`."""
        return f"{'local' if self.protocol == 'file' else self.protocol}://{self.root}"

    def _options(self) -> dict[str, Any]:
        return dict(self.storage_options)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

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
        return _in_flight(
            lambda item: self._put_object(item[0], self._path(item[0]), item[1]), items
        )

    def _read_many_into(self, items: Sequence[tuple[str, memoryview]]) -> list[int | None]:
        if not self._s3:
            return super()._read_many_into(items)

        def fetch(item: tuple[str, memoryview]) -> int | None:
            key, view = item
            try:
                size: int = self._call_async(
                    "read", _get_object_into, self.fs, self._path(key), view
                )
            except _ABSENT:
                return None
            return size

        return _in_flight(fetch, items)

    def _read_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        """On object stores, up to ``_MANY_IN_FLIGHT`` GETs at once on the filesystem's event
        loop (small values do not wait for each other); a value past one ranged GET is
        then read in ranges."""
        if not (self._object_store and getattr(self.fs, "async_impl", False)) or len(keys) < 2:
            return super()._read_many(keys)
        paths = [self._path(key) for key in keys]
        firsts = self._call_async("read", _cat_many, self.fs, paths, _MANY_IN_FLIGHT, _STEP)
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
        except _ABSENT:
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
        except _ABSENT:
            return None

    def _head(self, path: str, size: int) -> bytes:
        """The first ``size`` bytes of the object at ``path``, by a ranged read; an empty
        object (damage: stored values have a header) gives empty bytes."""
        try:
            head: bytes = self._call("cat_file", path, start=0, end=size)
        except _ABSENT:
            raise
        except OSError as exc:
            self.fs.invalidate_cache(path)
            if not _no_range(exc) or self._call("size", path) != 0:
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
        start = len(self.root) + 1 if self.root else 0
        return [p[start:] for p in self._call("find", top) if ".tmp-" not in p.rsplit("/", 1)[-1]]

    def _delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` in order; on S3 the first on its own, then the rest in batches of
        one request each (``discard`` passes a manifest first, then its chunks)."""
        if self._s3 and len(keys) > 2:
            self._delete(keys[:1])
            rest = [self._path(k) for k in keys[1:]]
            for i in range(0, len(rest), _DELETE_BATCH):
                self._call_async("delete", _delete_objects, self.fs, rest[i : i + _DELETE_BATCH])
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
