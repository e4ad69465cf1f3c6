"""``tmpdir``: a private job folder under a node-local base, and the choice of that base.

The base is ``$GATHERSTORE_TMPDIR``, else ``/dev/shm`` (RAM: the fastest
route between the ranks of one machine) when this process can write there,
else the temp dir.  Whether one gather fits in ``/dev/shm`` is decided per
call, from every rank's sizes (see ``gatherstore.calls.fit``).
"""

from __future__ import annotations

import os
import tempfile
import urllib.parse
from typing import Any, ClassVar

from gatherstore import _config as config
from gatherstore._errors import StoreUnavailableError
from gatherstore.stores.base import Store
from gatherstore.stores.file import FileStore

__all__ = ["SHM", "TmpdirStore", "default_tmpdir_base"]

SHM = config.SHM


def default_tmpdir_base() -> str:
    """$GATHERSTORE_TMPDIR, else /dev/shm when writable, else the temp dir.

    Whether a gather fits in /dev/shm (its free space, and the RAM and memory
    cgroup its files are charged to) is decided per call, from every rank's
    sizes: one that does not fit goes to the temp dir instead.
    """
    explicit = config.tmpdir_base()
    if explicit:
        return explicit
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK):
        return SHM
    return tempfile.gettempdir()


class TmpdirStore(FileStore):
    """A private job directory under a node-local base (``tmpdir`` or ``tmpdir:///base``).

    The base defaults to ``default_tmpdir_base`` (/dev/shm when it has
    room).  Fine on one machine; across machines use ``file:///<shared dir>``.
    Parts are not signed by default: the job directory is mode 0700 on a
    local filesystem, reachable only by the job's own user, so the base must
    be a folder no other user can change (owned by the user or root, not
    writable by others unless sticky, on a path no other user controls): any
    other base is refused with StoreUnavailableError at the job's first use.
    """

    reachable_by_others = False
    is_private = True
    persistent = False  # the job's area goes with the job

    def __init__(self, base: str | os.PathLike[str] | None = None) -> None:
        self.explicit_base = base is not None
        super().__init__(base if base is not None else default_tmpdir_base())

    scheme: ClassVar[str] = "tmpdir"

    @classmethod
    def _from_url(cls, url: str, **options: Any) -> Store:
        if url == cls.scheme and not options:
            return cls()
        return super()._from_url(url, **options)

    def _open_root(self, create: bool) -> int:
        if self._area_of is None:
            self._refuse_missing_base()
        return super()._open_root(create)

    def _refuse_missing_base(self) -> None:
        """A base whose parent folder is missing is a typo or a machine without it, not
        a folder to create (the base itself is created, mode 0700, when missing).

        Raises:
            StoreUnavailableError: a folder above the base does not exist.
        """
        missing = next((p for p in reversed(self.root.parents) if not p.exists()), None)
        if missing is None:
            return
        from_env = not self.explicit_base and config.tmpdir_base() is not None
        where = f"GATHERSTORE_TMPDIR={self.root}" if from_env else f"the tmpdir base {self.root}"
        instead = "unset the variable" if from_env else "name another base"
        raise StoreUnavailableError(
            f"store {self}: {where} does not exist ({missing} is missing): create it "
            f"(`mkdir -m 700 -p {self.root}`) or {instead}",
            store=str(self),
        )

    @property
    def supports_handover(self) -> bool:
        """A tmpdir whose base is gatherstore's choice, in RAM (/dev/shm): a base the user
        named, in the URL or in ``GATHERSTORE_TMPDIR``, is a folder the parts go to as
        files, checked as such."""
        return (
            not self.explicit_base and config.tmpdir_base() is None and self.shares_memory_with_host
        )

    @property
    def url(self) -> str:
        return f"tmpdir://{urllib.parse.quote(str(self.root))}" if self.explicit_base else "tmpdir"
