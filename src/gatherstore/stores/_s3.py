"""The S3 fast path of FsspecStore: fewer copies, fewer hashes, requests in flight.

Each GET's body is received straight into the value's buffer (through
aiohttp's stream, piece by piece), instead of s3fs's HEAD, joined pieces and
copy.  Measured on SeaweedFS this beat one multipart upload plus ranged GETs,
with s3fs and with obstore alike.  Against an ``http://`` endpoint the payload
is not hashed for the SigV4 signature (TLS is absent anyway, and gatherstore
signs and verifies every part itself), and botocore computes no per-request
CRC32 unless the service requires one.  Chunk PUTs and GETs run a few at once
in threads; whole values (parts, small as a rule) many at once on the
filesystem's event loop; deletes go a thousand to one DeleteObjects request.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = [
    "ABSENT",
    "DELETE_BATCH",
    "IN_FLIGHT",
    "MANY_IN_FLIGHT",
    "S3_CONFIG",
    "cat_many",
    "delete_objects",
    "fast_s3_options",
    "get_object_into",
    "in_flight",
    "no_range",
]

ABSENT = (FileNotFoundError, IsADirectoryError)  # what a filesystem raises for no value
#: botocore settings for S3 unless the caller passes ``config_kwargs``: a frozen
#: endpoint fails a request within seconds instead of botocore's 60 s x 5 attempts.
S3_CONFIG = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2}}
IN_FLIGHT = 4  # S3 chunk PUTs or GETs at once per store call
MANY_IN_FLIGHT = 32  # GETs of whole values (parts, small as a rule) at once
DELETE_BATCH = 1000  # keys per S3 DeleteObjects request (the API's limit)

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
    SHA-256 of the payload either (botocore hashes every byte otherwise); a
    connection pool as large as the GETs sent at once (botocore's holds 10).
    """
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", MANY_IN_FLIGHT)
    for name in _CHECKSUM_SETTINGS:
        config.setdefault(name, "when_required")
    if _endpoint(options).startswith("http://"):
        config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
    return {**options, "config_kwargs": config}


def in_flight(work: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """``work`` of every item, ``IN_FLIGHT`` at once, each in the caller's context
    (its store deadline included); results in order, the first error raised."""
    if len(items) <= 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="gatherstore-s3") as pool:
        futures = [pool.submit(contextvars.copy_context().run, work, item) for item in items]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


async def get_object_into(fs: Any, path: str, view: memoryview) -> int:
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


async def cat_many(fs: Any, paths: list[str], limit: int, step: int) -> list[bytes | None]:
    """The first ``step`` bytes of every object (None where absent), ``limit`` GETs at once."""
    gate = asyncio.Semaphore(limit)

    async def first(path: str) -> bytes | None:
        async with gate:
            try:
                head: bytes = await fs._cat_file(path, start=0, end=step)
            except ABSENT:
                return None
            except Exception as exc:
                if not no_range(exc) or await fs._size(path) != 0:
                    raise
                return b""
            return head

    return list(await asyncio.gather(*(first(path) for path in paths)))


async def delete_objects(fs: Any, paths: list[str]) -> None:
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


_RANGE_NOT_SATISFIABLE = 416


def no_range(exc: Exception) -> bool:
    """Whether a ranged read may have failed for want of a range: S3 answers one of an
    empty object with InvalidRange, which s3fs raises as EINVAL; GCS and Azure with
    HTTP 416, which gcsfs and the Azure SDK raise with that status."""
    if isinstance(exc, OSError):
        return exc.errno == errno.EINVAL
    status = getattr(exc, "code", None) or getattr(exc, "status_code", None)
    return status == _RANGE_NOT_SATISFIABLE


def _s3fs_core() -> Any:
    """s3fs's core module (its retry wrapper), or None without s3fs."""
    try:
        import s3fs.core
    except ImportError:  # pragma: no cover - s3:// needs s3fs anyway
        return None
    return s3fs.core
