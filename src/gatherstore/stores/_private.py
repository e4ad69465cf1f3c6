"""Folders that stay the job's own: trusted bases, areas opened by descriptor, safe removal.

A tmpdir job area is unsigned: whoever can replace it reads and swaps the
job's parts.  So its base must be a folder no other user can change (owned
by the user or root, and not writable by group or others unless sticky, like
``/dev/shm``), and so must every folder and symlink on the way to it.  Areas
are then opened with ``O_NOFOLLOW`` relative to the base's descriptor and
worked on through their own descriptor, so a path swapped later changes
nothing; a rank that opens an area checks that it is the one the job created.
A base or an area that fails these checks is refused with StoreUnavailableError,
whose message says how to get a private base.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from gatherstore._errors import StoreUnavailableError

__all__ = [
    "DIRECTORY",
    "check_area",
    "check_opened",
    "created",
    "describe_owner",
    "open_directory",
    "refuse_untrusted",
    "remove_tree",
    "untrusted",
]

#: Flags that open a folder without following a symlink in its last component.
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_MAX_LINKS = 40  # symlinks followed on the way to a base, as the kernel allows
#: (device, inode) of the job areas this process created, by locator, until their job ends.
created: dict[str, tuple[int, int]] = {}


def describe_owner(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` where the user has no name here."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _unsafe(path: Path, st: os.stat_result) -> str | None:
    """Why another user could change the folder ``path`` (``st``: its lstat), or None."""
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return (
            f"{path} is owned by {describe_owner(st.st_uid)}, not by you "
            f"({describe_owner(uid)}) or root"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        who = "group and others" if st.st_mode & stat.S_IWOTH else "its group"
        mode = f"{stat.S_IMODE(st.st_mode):o}"
        return f"{path} is writable by {who} (mode {mode}) without the sticky bit"
    return None


def untrusted(path: Path) -> str | None:
    """Why another user could change what ``path`` (absolute) names, or None when no one
    but the user and root can: every folder on the way is checked, and every symlink
    must belong to the user or root.  A missing last component is fine (it is created)."""
    current, pending, links = Path("/"), list(path.parts[1:]), 0
    why = _unsafe(current, os.lstat(current))
    while why is None and pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = current.parent
            continue
        candidate = current / name
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            return None if not pending else f"{candidate} does not exist"
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if st.st_uid not in (os.geteuid(), 0):
                return f"{candidate} is a symlink owned by {describe_owner(st.st_uid)}"
            if links > _MAX_LINKS:
                return f"{path} has more than {_MAX_LINKS} symlinks on its way"
            target = Path(os.readlink(candidate))
            if target.is_absolute():
                current = Path("/")
            pending = [*target.parts[1 if target.is_absolute() else 0 :], *pending]
            continue
        if not stat.S_ISDIR(st.st_mode):
            return f"{candidate} is not a folder"
        why = _unsafe(candidate, st)
        current = candidate
    return why


def check_opened(path: Path, fd: int) -> str | None:
    """``_unsafe`` of the folder open at ``fd``: what was checked is what was opened."""
    return _unsafe(path, os.fstat(fd))


def refuse_untrusted(store: object, base: Path, why: str | None) -> None:
    """Refuse the base folder ``base`` of ``store`` when ``why`` says another user could
    change it (``untrusted``, ``check_opened``).

    Raises:
        StoreUnavailableError: ``why`` is not None.
    """
    if why is not None:
        raise StoreUnavailableError(
            f"store {store}: the base folder {base} is not private to you: {why}. "
            "Another user could replace the job's folder and read or swap its parts. "
            "Use a base only you can change: e.g. `mkdir -m 700 /dev/shm/$USER-gather` "
            "and GATHERSTORE_TMPDIR=/dev/shm/$USER-gather (or tmpdir:///dev/shm/"
            "$USER-gather); or `chmod go-w` the folder named, if it is yours",
            store=str(store),
        )


def check_area(
    store: object, base: Path, locator: str, st: os.stat_result, *, private: bool
) -> None:
    """Refuse a job folder (``st``: its fstat) that is not the one rank 0 created, as far
    as this process can tell: the very folder in rank 0's process, and in a ``private``
    base a private folder of the user's.

    Raises:
        StoreUnavailableError: the folder at ``locator`` was replaced.
    """
    made = created.get(locator)
    foreign = st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077
    if (made is not None and made != (st.st_dev, st.st_ino)) or (private and foreign):
        raise StoreUnavailableError(
            f"store {store}: the job folder {locator} is not the one this job created "
            f"(owned by {describe_owner(st.st_uid)}, mode "
            f"{stat.S_IMODE(st.st_mode):o}): it was replaced. Use a base folder that only "
            f"you can change instead of {base} (e.g. `mkdir -m 700 "
            "/dev/shm/$USER-gather`), and check who else can write there",
            store=str(store),
        )


def open_directory(name: str, dir_fd: int) -> int:
    """Open the folder ``name`` inside the folder at ``dir_fd``, never through a symlink.

    Raises:
        OSError: it is absent, not a folder, or a symlink (``ELOOP``/``ENOTDIR``).
    """
    return os.open(name, DIRECTORY, dir_fd=dir_fd)


def remove_tree(
    name: str, dir_fd: int, identity: tuple[int, int] | None = None, owner: int | None = None
) -> bool:
    """Remove the folder ``name`` inside the folder at ``dir_fd`` with everything in it,
    through descriptors (no symlink is followed): only that very folder when ``identity``
    (device, inode) is given, only a folder of ``owner`` (a uid) when that is.

    Returns:
        Whether it is gone (False: it is someone else's, another folder, or stays).
    """
    try:
        fd = open_directory(name, dir_fd)
    except FileNotFoundError:
        return True
    except OSError:  # a symlink or a file: not a folder gatherstore made
        return False
    try:
        st = os.fstat(fd)
        if owner not in (None, st.st_uid) or identity not in (None, (st.st_dev, st.st_ino)):
            return False
        for _, dirs, files, inner in os.fwalk(".", topdown=False, dir_fd=fd):
            for entry in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry, dir_fd=inner)
            for entry in dirs:
                try:
                    os.rmdir(entry, dir_fd=inner)
                except NotADirectoryError:  # a symlink to a folder: the link goes
                    os.unlink(entry, dir_fd=inner)
                except OSError:  # gone, or filled meanwhile: the rmdir below says
                    continue
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True
