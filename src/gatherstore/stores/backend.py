"""What a backend implements: the primitives of a store, and the URL and options naming it.

A backend (``FileStore``, ``RedisStore``, ``FsspecStore``, a third party's)
subclasses ``Store`` and implements five primitives: an
all-or-nothing create-only write, a read that returns None when the key is
absent, exists, list and delete by name; it may override the others where it
does them faster (many writes or reads in flight, a ranged read, a prefix
delete).  It names its exceptions that mean "unreachable", which the store
maps to StoreUnavailableError at this boundary, and the URL and options that
reopen it, which make two stores equal, hash alike and pickle.

It declares what it can do (as zarr's ``supports_*``): whether others can write
there, whether only the job's own user can, whether values outlive the job,
whether they live in this node's RAM.  The core asks these, never a store's class.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from gatherstore._errors import StoreUnavailableError
from gatherstore._time import expired
from gatherstore.stores import failures
from gatherstore.stores._secrets import hide_password
from gatherstore.stores.layout import Buffer, nbytes

__all__ = ["PRIMITIVES", "Backend"]

_B = TypeVar("_B", bound="Backend")
#: The instance state ``Backend.__init__`` and ``Store.__init__`` declare.
_DECLARED = frozenset({"_sign", "_chunks"})

#: Every primitive, by how it names keys: one ``key``, a list of ``keys``, a list of
#: (key, value) ``pairs``, or a ``prefix`` (a view under a prefix forwards each by it).
PRIMITIVES = {
    "_write": "key",
    "_read": "key",
    "_exists": "key",
    "_list": "prefix",
    "_delete": "keys",
    "_delete_prefix": "prefix",
    "_replace": "key",
    "_write_many": "pairs",
    "_read_many": "keys",
    "_read_many_into": "pairs",
    "_read_head": "key",
}


class Backend(ABC):
    """The primitives of a key-value place for bytes, and its identity.

    Keys are ``/``-separated paths.  Subclasses implement ``_write``, ``_read``,
    ``_exists``, ``_list``, ``_delete`` and ``url`` (and may override the other
    primitives where the backend does them faster).
    """

    #: Largest value written in one piece; larger values are chunked.
    max_value_size: int = 1 << 62
    #: Backend exceptions that mean "cannot reach or write the store".
    unavailable_errors: tuple[type[BaseException], ...] = (OSError,)
    #: Seconds between checks for keys (``wait`` starts at an eighth of it and backs off).
    poll_interval: float = 0.005

    # --- what it can do (per class; an instance may refine it in ``__init__``) ------
    #: Whether processes outside the job can write here (then parts are signed).
    reachable_by_others: bool = True
    #: Whether only the job's own user can write its area (a private ``tmpdir``).
    is_private: bool = False
    #: Whether values outlive the job's processes (not ``tmpdir`` nor ``memory://``).
    persistent: bool = True

    def __init__(self) -> None:
        #: Whether parts are signed: None follows ``reachable_by_others``.
        self._sign: bool | None = None

    def __getattr__(self, name: str) -> Any:
        """Only for state ``__init__`` declares: a subclass that did not call it learns how."""
        if name in _DECLARED:
            raise TypeError(
                f"{type(self).__name__}.__init__ did not call super().__init__(): a store "
                f"declares its state ({name}) there; call it first in __init__"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def shares_memory_with_host(self) -> bool:
        """Whether values live in this node's RAM (files under /dev/shm): a gather's
        memory check counts them."""
        return False

    @property
    def supports_handover(self) -> bool:
        """Whether the processes of one host may hand parts for this store over as sealed
        memory instead of writing them here: only where the store's place is
        gatherstore's own choice in RAM, never a folder the user named."""
        return False

    @property
    def folder(self) -> str | None:
        """The folder on this host that holds the values, for a store that has one."""
        return None

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
        """``_write`` of each (key, buffers), in order, each while the deadline allows;
        backends that can keep a bounded number of writes in flight override it."""
        return [self._in_time(key) and self._write(key, buffers) for key, buffers in items]

    def _read_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        """Each key's whole value, or None when absent, one after another while the
        deadline allows; backends that can keep many reads in flight at once override it."""
        return [self._read(key) if self._in_time(key) else None for key in keys]

    def _read_many_into(self, items: Sequence[tuple[str, memoryview]]) -> list[int | None]:
        """Read each key's value into its view when the sizes match; per item the value's
        size (None: absent).  Backends override it to keep a bounded number of reads
        in flight, straight into the views."""
        sizes: list[int | None] = []
        for key, view in items:
            self._in_time(key)
            raw = self._read(key)
            sizes.append(None if raw is None else nbytes(raw))
            if raw is not None and nbytes(raw) == len(view):
                view[:] = memoryview(raw).cast("B")
        return sizes

    def _read_head(self, key: str, size: int) -> Buffer | None:
        """At least the first ``size`` bytes at ``key`` (more is fine; an empty value gives
        empty bytes), or None when absent.

        Backends that can read a range override it, so that ``discard`` never
        fetches a whole value to learn whether it is chunked.
        """
        return self._read(key)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the store is unusable afterwards."""

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- errors at the boundary ------------------------------------------------------
    def _mapped(self, action: str) -> contextlib.AbstractContextManager[None]:
        """Backend errors of ``action`` mapped to gatherstore's (see ``failures.mapped``)."""
        return failures.mapped(self, self.unavailable_errors, action, self._advice)

    def _advice(self, exc: BaseException) -> tuple[str, str] | None:
        """What a backend error means for this store and what fixes it, where the
        backend's own message would not say (e.g. a Redis that needs a password)."""
        return None

    def _unavailable(self, action: str, why: str) -> StoreUnavailableError:
        return failures.unavailable(self, action, why)

    def _in_time(self, key: str) -> bool:
        """True while the deadline in force allows more work on ``key``: one request of
        many must not outlive the call that made it (each request starts only in time).

        Raises:
            StoreUnavailableError: the deadline has passed.
        """
        if expired():
            raise self._unavailable(f"reach {key!r}", "no time left in the call's timeout")
        return True

    # --- identity ----------------------------------------------------------------------
    @property
    @abstractmethod
    def url(self) -> str:
        """The URL that reopens this store with ``gatherstore.open_store``."""

    def _options(self) -> dict[str, Any]:
        """Keyword options that, with ``url``, reopen an equal store."""
        return {}

    @property
    def sign_parts(self) -> bool:
        """Whether object parts written here are signed and verified."""
        return self.reachable_by_others if self._sign is None else self._sign

    @sign_parts.setter
    def sign_parts(self, value: bool) -> None:
        self._sign = value

    def _identity(self) -> tuple[Any, ...]:
        """What makes two stores the same place: class, URL, options, signing."""
        return (type(self), self.url, self._options(), self.sign_parts)

    def __eq__(self, other: object) -> bool:
        """Same class, URL and options mean the same store (one job area per store)."""
        if not isinstance(other, Backend):
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash((type(self), self.url))

    def __str__(self) -> str:
        return hide_password(self.url)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self}>"
