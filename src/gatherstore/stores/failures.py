"""How a store's failures reach the caller: gatherstore's errors, mapped once at the boundary.

A backend's own exceptions (redis-py's, botocore's, an ``OSError``) become
StoreUnavailableError naming the store and the action, with the backend's
message but not its traceback; a value that is not laid out as gatherstore
writes it is an IntegrityError; a create-only write that finds its key is a
KeyExistsError.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from gatherstore._errors import GatherError, IntegrityError, StoreUnavailableError
from gatherstore._time import expired
from gatherstore.stores._secrets import describe_failure

__all__ = ["KeyExistsError", "damaged", "exists", "mapped", "unavailable"]


class KeyExistsError(GatherError, FileExistsError):
    """A create-only put found the key already there."""


def unavailable(store: object, action: str, why: str, fix: str = "") -> StoreUnavailableError:
    """The error of ``store`` failing to do ``action`` (e.g. "read 'k'") because of ``why``;
    ``fix`` says what to do (by default: check the store's health)."""
    fix = fix or "check that it is reachable, responsive, writable and not full"
    return StoreUnavailableError(
        f"store {store} failed to {action}: {why}; {fix}", store=str(store)
    )


#: A store's own reading of a backend error: (what happened, what to do), or None.
Advice = Callable[[BaseException], "tuple[str, str] | None"]


@contextlib.contextmanager
def mapped(
    store: object,
    errors: tuple[type[BaseException], ...],
    action: str,
    advice: Advice = lambda exc: None,
) -> Iterator[None]:
    """Run ``action`` on ``store``: ``errors`` (its backend's) become StoreUnavailableError,
    whose message keeps the cause (or what ``advice`` makes of it) and whose traceback
    drops the backend's own frames (see ``describe_failure``); past the deadline, nothing
    runs.

    Raises:
        StoreUnavailableError: the deadline in force has passed, or the backend failed.
    """
    if expired():
        raise unavailable(store, action, "no time left in the call's timeout")
    try:
        yield
    except GatherError:
        raise
    except errors as exc:
        why, fix = advice(exc) or (describe_failure(exc), "")
        raise unavailable(store, action, why, fix) from None


def damaged(store: object, key: str, why: str) -> IntegrityError:
    """The error of a value at ``key`` in ``store`` that is ``why`` (e.g. "truncated: …")."""
    return IntegrityError(f"value {key!r} in store {store} is {why}", key=key)


def exists(store: object, key: str) -> KeyExistsError:
    """The error of a create-only write of ``key`` that found it in ``store``."""
    return KeyExistsError(
        f"key {key!r} already exists in store {store}; parts are create-only — "
        "delete it first or use a new key"
    )
