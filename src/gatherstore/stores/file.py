"""Local and shared filesystems: ``tmpdir`` (a private job directory) and ``file://``.

Values are files; a write goes to a temp file with vectored writes and is
published with ``link`` (atomic and create-only, on NFS too).  Values are read
into private memory (one copy, no memory map): a file another process
truncates or rewrites after it was read cannot change what was verified, nor
kill the reader with SIGBUS, and arrays decoded from it stay valid after the
file is deleted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import urllib.parse
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from .base import Buffer, Store, hide_password, job_directory

__all__ = ["FileStore", "TmpdirStore", "default_tmpdir_base"]

_TMP = ".tmp-"
_ABSENT = (FileNotFoundError, NotADirectoryError, IsADirectoryError)  # no value at a key
_ATTEMPTS = 50  # tries to create a value's directory while deletes prune it
_READ_STEP = 1 << 30  # bytes per read() call (Linux returns at most ~2 GiB per call)
_IOV_MAX = 1024
_SHM = "/dev/shm"


def default_tmpdir_base() -> str:
    """$GATHERSTORE_TMPDIR, else /dev/shm when writable, else the temp dir.

    Whether a gather fits in /dev/shm (its free space, and the RAM and memory
    cgroup its files are charged to) is decided per call, from every rank's
    sizes: one that does not fit goes to the temp dir instead.
    """
    explicit = os.environ.get("GATHERSTORE_TMPDIR")
    if explicit:
        return explicit
    if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK):
        return _SHM
    return tempfile.gettempdir()


def write_all(fd: int, buffers: Sequence[Buffer]) -> None:
    """Write ``buffers`` back to back with ``writev``, handling partial writes."""
    views = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while written and views:
            if written >= len(views[0]):
                written -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][written:]
                written = 0


class FileStore(Store):
    """Values as files under a directory every rank can see (``file:///shared/dir``).

    At a job's first use rank 0 creates ``<dir>/gatherstore-<job>-*`` (mode
    0700); the job works there and removes only that directory at its end.
    The directory the user passed is never removed.
    """

    unavailable_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)
    reachable_by_others: ClassVar[bool] = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()

    scheme: ClassVar[str] = "file"

    @classmethod
    def _from_url(cls, url: str, **options: Any) -> Store:
        """``<scheme>:///abs/path`` (percent-encoded: ``file:///my%20dir`` is ``/my dir``).

        Raises:
            ValueError: options given, a host other than localhost, a query, or a
                relative path.
        """
        example = f"{cls.scheme}:///shared/dir"
        if options:
            raise ValueError(f"{cls.__name__} takes no options; got {sorted(options)}")
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"{hide_password(url)!r}: give an absolute path, e.g. {example}")
        if parts.query or parts.fragment:
            raise ValueError(
                f"{hide_password(url)!r}: a {cls.scheme} URL takes no '?' or '#'; e.g. {example}"
            )
        return cls(urllib.parse.unquote(parts.path))

    @property
    def url(self) -> str:
        return f"file://{urllib.parse.quote(str(self.root))}"

    def _path(self, key: str) -> Path:
        return self.root / key

    def _write(self, key: str, buffers: Sequence[Buffer]) -> bool:
        path = self._path(key)
        if path.exists():
            return False
        tmp = path.parent / f"{_TMP}{uuid.uuid4().hex}"
        for attempt in range(_ATTEMPTS):
            try:
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except (FileNotFoundError, FileExistsError):
                # a concurrent delete pruned a directory that was empty a moment ago;
                # each prune needs an empty directory, so retrying makes progress
                if attempt == _ATTEMPTS - 1:
                    raise
        try:
            try:
                write_all(fd, buffers)
            finally:
                os.close(fd)
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return True

    def _read(self, key: str) -> Buffer | None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except _ABSENT:
            return None
        try:
            buf = bytearray(os.fstat(fd).st_size)
            view, pos = memoryview(buf), 0
            while pos < len(buf):
                n = os.readv(fd, [view[pos : pos + _READ_STEP]])
                if not n:  # truncated meanwhile: the store layer reports it
                    return buf[:pos]
                pos += n
            return buf
        finally:
            os.close(fd)

    def _read_head(self, key: str, size: int) -> Buffer | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read(size)
        except _ABSENT:
            return None

    def _exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def _list(self, prefix: str) -> Iterable[str]:
        top = self._path(prefix) if prefix else self.root
        for dirpath, _, files in os.walk(top):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if not name.startswith(_TMP):
                    yield name if rel == "." else f"{rel}/{name}"

    def _delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            path = self._path(key)
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(path)
            self._prune(path.parent)

    def _prune(self, directory: Path) -> None:
        """Remove ``directory`` and its parents below the root while they are empty."""
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError:  # not empty (or already gone): the parents are not empty either
                return
            directory = directory.parent

    def _delete_prefix(self, prefix: str) -> None:
        top = self._path(prefix) if prefix else self.root
        if not top.is_dir():
            return
        if top == self.root:
            for child in list(top.iterdir()):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
        else:
            shutil.rmtree(top, ignore_errors=True)
            self._prune(top.parent)

    def prepare_job(self, job_id: str) -> str:
        with self._mapped("create a job directory"):
            self.root.mkdir(parents=True, exist_ok=True)
            return tempfile.mkdtemp(prefix=job_directory(job_id), dir=self.root)

    def join_job(self, locator: str) -> Store:
        store = FileStore(locator)
        store.sign_parts = self.sign_parts
        return store

    def end_job(self, locator: str) -> None:
        path = Path(locator)
        if path.parent == self.root and path.name.startswith(job_directory()):
            shutil.rmtree(path, ignore_errors=True)


class TmpdirStore(FileStore):
    """A private job directory under a node-local base (``tmpdir`` or ``tmpdir:///base``).

    The base defaults to :func:`default_tmpdir_base` (/dev/shm when it has
    room).  Fine on one machine; across machines use ``file:///<shared dir>``.
    Parts are not signed by default: the job directory is mode 0700 on a
    local filesystem, reachable only by the job's own user.
    """

    reachable_by_others: ClassVar[bool] = False

    def __init__(self, base: str | os.PathLike[str] | None = None) -> None:
        self.explicit_base = base is not None
        super().__init__(base if base is not None else default_tmpdir_base())

    scheme: ClassVar[str] = "tmpdir"

    @classmethod
    def _from_url(cls, url: str, **options: Any) -> Store:
        if url == cls.scheme and not options:
            return cls()
        return super()._from_url(url, **options)

    @property
    def url(self) -> str:
        return f"tmpdir://{urllib.parse.quote(str(self.root))}" if self.explicit_base else "tmpdir"
