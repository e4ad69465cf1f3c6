"""Local and shared filesystems: ``file://`` (and ``tmpdir``, its private kind: see ``tmpdir``).

Values are files; a write goes to a temp file with vectored writes and is
published with ``link`` (atomic and create-only, on NFS too).  Every file is
reached relative to a descriptor of the store's folder (a job area is opened
with ``O_NOFOLLOW`` inside its base): a folder renamed or replaced after it
was opened cannot redirect the job (see ``_private``).  A value is read into
private memory (see ``_fileio``): arrays decoded from it stay valid, and what was
verified, after its file is rewritten, truncated or deleted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from gatherstore._config import SHM
from gatherstore._errors import StoreUnavailableError
from gatherstore.host.writes import write_all
from gatherstore.stores import _fileio as fileio
from gatherstore.stores import _private as private
from gatherstore.stores._secrets import describe_failure
from gatherstore.stores.base import Buffer, JobArea, Store, hide_password, job_directory

__all__ = ["FileStore"]

_TMP = ".tmp-"
_ABSENT = (FileNotFoundError, NotADirectoryError, IsADirectoryError)  # no value at a key
_ATTEMPTS = 50  # tries to create a value's folder while deletes prune it (see stores.waiting)
_FILE = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_JOB_DIR = re.compile(re.escape(job_directory()) + r"([0-9a-f]{16})-.+")
_logger = logging.getLogger("gatherstore")
_opening = threading.RLock()  # an area opens its base inside


class FileStore(Store):
    """Values as files under a directory every rank can see (``file:///shared/dir``).

    At a job's first use rank 0 creates ``<dir>/gatherstore-<job>-*`` (mode
    0700); the job works there and removes only that directory at its end.
    The directory the user passed is created when missing, with the folders above it
    (logged at INFO), and never removed.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(root).absolute()
        self._fd: int | None = None
        self._area_of: tuple[FileStore, str] | None = None  # a job area: (its base, its name)

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

    @property
    def folder(self) -> str | None:
        return str(self.root)

    @property
    def shares_memory_with_host(self) -> bool:
        """Whether the folder is in this node's RAM (under /dev/shm)."""
        shm = Path(SHM)
        return self.root == shm or shm in self.root.parents

    def _advice(self, exc: BaseException) -> tuple[str, str] | None:
        """A folder's failure, with a folder's fix."""
        base = self._area_of[0].root if self._area_of is not None else self.root
        fix = f"check that {base} exists, is a folder this user can write to, and has room"
        return describe_failure(exc), fix

    # --- the folder's descriptor ---------------------------------------------------------
    def _dir(self, create: bool = False) -> int:
        """The descriptor of the store's folder, opened at first use (and created then when
        ``create``; else a missing folder raises FileNotFoundError)."""
        if self._fd is None:
            with _opening:
                if self._fd is None:
                    self._fd = self._open_root(create)
        return self._fd

    def _open_root(self, create: bool) -> int:
        if self._area_of is not None:  # never through a symlink, and only the job's own
            base, name = self._area_of
            fd = private.open_directory(name, base._dir())
            try:
                private.check_area(
                    base, base.root, str(self.root), os.fstat(fd), private=base.is_private
                )
            except BaseException:
                os.close(fd)
                raise
            return fd
        if self.is_private:
            private.refuse_untrusted(self, self.root, private.untrusted(self.root))
        flags = private.DIRECTORY & ~getattr(os, "O_NOFOLLOW", 0)  # the user's own folder
        try:
            fd = os.open(self.root, flags)
        except FileNotFoundError:
            if not create:
                raise
            self._create_root()
            fd = os.open(self.root, flags)
        if self.is_private:
            try:
                private.refuse_untrusted(self, self.root, private.check_opened(self.root, fd))
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _create_root(self) -> None:
        """Create the missing folder of the store, and the missing folders above it, and
        say so (INFO on the ``gatherstore`` logger): a mistyped path makes new folders."""
        missing = [p for p in (*reversed(self.root.parents), self.root) if not p.exists()]
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700 if self.is_private else 0o777)
        if missing:
            _logger.info(
                "store %s: created the missing folder%s %s",
                self,
                "s" if len(missing) > 1 else "",
                ", ".join(map(str, missing)),
            )

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit
            return

    # --- the primitives ------------------------------------------------------------------
    def _write(self, key: str, buffers: Sequence[Buffer]) -> bool:
        if self._exists(key):
            return False
        try:
            self._publish(key, buffers, _link)
        except FileExistsError:
            return False
        return True

    def _replace(self, key: str, buffers: Sequence[Buffer]) -> None:
        self._publish(key, buffers, _replace)

    def _publish(
        self, key: str, buffers: Sequence[Buffer], publish: Callable[[str, str, int], None]
    ) -> None:
        """Write ``buffers`` to a new temp file beside ``key``, then ``publish(temp, key,
        folder)`` it there (create-only, or replacing): a reader sees the whole value or
        none."""
        fd = self._dir(create=True)
        parent, _, _ = key.rpartition("/")
        tmp = f"{parent}/{_TMP}{uuid.uuid4().hex}" if parent else f"{_TMP}{uuid.uuid4().hex}"
        for attempt in range(_ATTEMPTS):
            try:
                self._makedirs(parent)
                out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE, 0o600, dir_fd=fd)
                break
            except (FileNotFoundError, FileExistsError):
                # a concurrent delete pruned a directory that was empty a moment ago;
                # each prune needs an empty directory, so retrying makes progress
                if attempt == _ATTEMPTS - 1:
                    raise
        try:
            try:
                write_all(out, [memoryview(b) for b in buffers])
            finally:
                os.close(out)
            publish(tmp, key, fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=fd)

    def _makedirs(self, relative: str) -> None:
        """Create the folder ``relative`` and its parents inside the store's folder."""
        done = ""
        for name in relative.split("/") if relative else ():
            done = f"{done}/{name}" if done else name
            with contextlib.suppress(FileExistsError):
                os.mkdir(done, 0o700, dir_fd=self._dir())

    def _open(self, key: str) -> int | None:
        """A descriptor of the file at ``key`` (never through a symlink), None when absent."""
        try:
            return os.open(key, os.O_RDONLY | _FILE, dir_fd=self._dir())
        except _ABSENT:
            return None
        except OSError as exc:  # ELOOP: a symlink where a value belongs is no value
            if exc.errno == getattr(os, "ELOOP", -1):
                return None
            raise

    def _read(self, key: str) -> Buffer | None:
        """The value in private memory (see ``_fileio``: never a mapping of the file)."""
        fd = self._open(key)
        if fd is None:
            return None
        try:
            return fileio.read_whole(fd)
        finally:
            os.close(fd)

    def _read_head(self, key: str, size: int) -> Buffer | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)

    def _exists(self, key: str) -> bool:
        try:
            st = os.stat(key, dir_fd=self._dir(), follow_symlinks=False)
        except _ABSENT:
            return False
        return stat.S_ISREG(st.st_mode)

    def _list(self, prefix: str) -> Iterable[str]:
        top = prefix.rstrip("/") or "."
        try:
            walk = list(os.fwalk(top, dir_fd=self._dir()))
        except _ABSENT:
            return []
        keys = []
        for dirpath, _, files, _ in walk:
            rel = os.path.normpath(dirpath)
            keys += [
                name if rel == "." else f"{rel}/{name}"
                for name in files
                if not name.startswith(_TMP)
            ]
        return keys

    def _delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(key, dir_fd=self._dir())
            self._prune(key.rpartition("/")[0])

    def _prune(self, relative: str) -> None:
        """Remove the folder ``relative`` and its parents inside the store while empty."""
        while relative:
            try:
                os.rmdir(relative, dir_fd=self._dir())
            except OSError:  # not empty (or already gone): the parents are not empty either
                return
            relative = relative.rpartition("/")[0]

    def _delete_prefix(self, prefix: str) -> None:
        try:
            fd = self._dir()
        except FileNotFoundError:
            return
        top = prefix.rstrip("/")
        if not top:
            for entry in list(os.scandir(fd)):
                if entry.is_dir(follow_symlinks=False):
                    private.remove_tree(entry.name, fd)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=fd)
            return
        parent, _, name = top.rpartition("/")
        try:
            parent_fd = private.open_directory(parent, fd) if parent else os.dup(fd)
        except _ABSENT:
            return
        try:
            private.remove_tree(name, parent_fd)
        finally:
            os.close(parent_fd)
        self._prune(parent)

    # --- job areas -----------------------------------------------------------------------
    def prepare_job(self, job_id: str) -> str:
        with self._mapped("create a job directory"):
            fd = self._dir(create=True)
            while True:
                name = f"{job_directory(job_id)}{secrets.token_hex(4)}"
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    break
                except FileExistsError:
                    continue
            area = private.open_directory(name, fd)
            try:
                st = os.fstat(area)
            finally:
                os.close(area)
            locator = str(self.root / name)
            private.created[locator] = (st.st_dev, st.st_ino)
            return locator

    def join_job(self, locator: str) -> Store:
        path = Path(locator)
        store = FileStore(locator)
        store._area_of = (self if path.parent == self.root else type(self)(path.parent), path.name)
        store.sign_parts = self.sign_parts
        # not there yet: a network filesystem's cache may show it late (opened at first use)
        with (
            self._mapped(f"open the job directory {locator}"),
            contextlib.suppress(FileNotFoundError),
        ):
            store._dir()
        return store

    def __reduce__(self) -> tuple[Any, ...]:
        """A job area pickles as its base and name: unpickled, it is joined again (see
        ``join_job``), with the no-symlink and ownership checks of its first opening."""
        if self._area_of is None:
            return super().__reduce__()
        base, name = self._area_of
        return (_rejoin, (base, name, self.sign_parts))

    def job_areas(self) -> Iterator[JobArea]:
        """The folders ``gatherstore-*`` of this user in the base (never a symlink)."""
        try:
            children = sorted(self.root.iterdir())
        except FileNotFoundError:
            return
        uid = os.geteuid()
        for path in children:
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            if not path.name.startswith(job_directory()) or not stat.S_ISDIR(st.st_mode):
                continue
            if st.st_uid != uid:
                continue
            named = _JOB_DIR.fullmatch(path.name)
            job = named.group(1) if named else None
            yield JobArea(str(path), str(path), job, st.st_mtime if named else None)

    def holds_area(self, locator: str) -> bool:
        return os.path.lexists(locator)

    def remove_area(self, locator: str) -> bool:
        self.end_job(locator)
        return not self.holds_area(locator)

    def area_facts(self, locator: str) -> dict[str, Any]:
        return {"mode": oct(os.stat(locator, follow_symlinks=False).st_mode & 0o777)}

    def end_job(self, locator: str) -> None:
        """Remove the job folder ``locator`` (only a folder of this user's, named like a job
        folder, directly in this base; in the creating process only the very folder it
        created, wherever it was moved within the base).

        Raises:
            StoreUnavailableError: the folder at ``locator`` is not the one the job created;
                the job's own folder is removed, the other is left alone.
        """
        path = Path(locator)
        if path.parent != self.root or not path.name.startswith(job_directory()):
            return
        created = private.created.pop(locator, None)
        try:
            fd = self._dir()
        except (OSError, StoreUnavailableError):
            return
        owner = os.geteuid() if self.is_private else None
        if private.remove_tree(path.name, fd, created, owner) or created is None:
            return
        for entry in os.scandir(fd):  # the job's folder was moved aside: remove it there
            st = entry.stat(follow_symlinks=False)
            if (st.st_dev, st.st_ino) == created:
                private.remove_tree(entry.name, fd, created)
        message = (
            f"store {self}: the job folder {locator} was replaced by another folder, left "
            f"alone; use a base folder only you can change instead of {self.root}"
        )
        _logger.warning("%s", message)
        raise StoreUnavailableError(message, store=str(self))


def _rejoin(base: FileStore, name: str, sign: bool) -> Store:
    """The job area ``name`` of ``base``, opened as ``join_job`` opens it."""
    area = base.join_job(str(base.root / name))
    area.sign_parts = sign
    return area


def _link(tmp: str, key: str, fd: int) -> None:
    """Publish ``tmp`` at ``key``, create-only (FileExistsError when it exists; on NFS too)."""
    os.link(tmp, key, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)


def _replace(tmp: str, key: str, fd: int) -> None:
    """Publish ``tmp`` at ``key``, replacing what is there."""
    os.replace(tmp, key, src_dir_fd=fd, dst_dir_fd=fd)
