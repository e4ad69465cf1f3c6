"""A rank's local error, carried into a gather so that every rank raises together."""

from __future__ import annotations

from typing import NoReturn

__all__ = ["Raising"]


class Raising:
    """Stands for a value this rank failed to make.

    Pickling it (what a gather does to a rank's object) or converting it to an
    index with ``int()`` (what ``collect_results`` does with ``indices`` before
    any data moves) raises the error inside gatherstore's call: the rank that
    had it raises it, every other rank a ``RemoteRankError`` that names it,
    instead of this rank raising alone while the others wait in the gather.
    """

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __reduce__(self) -> NoReturn:
        raise self.error

    def __int__(self) -> NoReturn:
        raise self.error

    def __repr__(self) -> str:
        return f"Raising({self.error!r})"
