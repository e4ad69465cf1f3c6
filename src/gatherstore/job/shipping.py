"""What ``launch`` sends to its ranks and what they send back.

The function goes by reference when the rank can import it (a function of the main
script, which a spawned rank imports again, or of any importable module), so that a
traceback names the user's file and line; by value (cloudpickle) only otherwise:
lambdas, closures, functions defined under the ``__main__`` guard or in an interactive
session.  A failing rank reports the rank its error started on: a ``RemoteRankError``
that only relays another rank's failure names that rank, with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from gatherstore._errors import GatherTimeout, RemoteRankError

__all__ = ["Failure", "failure_of", "load_function", "ship_function"]


def _main_is_imported_again() -> bool:
    """Whether a spawned rank runs the main module again (as multiprocessing's spawn does
    for a script or ``python -m module``, not for ``python -c``, a notebook or a REPL)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return name != "__main__" and not name.endswith(".__main__")
    path = getattr(main, "__file__", None)
    return path is not None and os.path.splitext(os.path.basename(path))[0] != "ipython"


def ship_function(fn: Callable[..., Any]) -> tuple[bytes | None, bytes | None]:
    """``fn`` by reference (when a rank can import it) and by value (when that is needed
    or possible as a fallback): a rank loads the reference first."""
    reference = None
    if getattr(fn, "__module__", None) != "__main__" or _main_is_imported_again():
        try:
            reference = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError):
            reference = None
    try:
        value = cloudpickle.dumps(fn)
    except Exception:
        if reference is None:
            raise
        value = None  # only its reference ships (e.g. it refers to an unpicklable global)
    return reference, value


def load_function(reference: bytes | None, value: bytes | None) -> Callable[..., Any]:
    """The shipped function: by reference, else (defined where the rank does not run it,
    e.g. under the main guard) by value."""
    if reference is not None:
        try:
            fn: Callable[..., Any] = pickle.loads(reference)
            return fn
        except (AttributeError, ImportError):
            if value is None:
                raise
    assert value is not None
    fn = cloudpickle.loads(value)
    return fn


@dataclass(frozen=True)
class Failure:
    """A rank's failure as its launcher reports it.

    Attributes:
        origin: the rank the failure started on (this rank, or the one a
            ``RemoteRankError`` relays).
        message: that rank's error, ``Type: text``; only its text for a ``GatherTimeout``
            that names ranks (the launcher raises one again, naming those ranks).
        traceback: that rank's traceback text.
        late: the ranks that ``GatherTimeout`` names (they did not arrive in time).
        timeout: its timeout, in seconds.
    """

    origin: int
    message: str
    traceback: str
    late: tuple[int, ...] = ()
    timeout: float | None = None


def failure_of(exc: BaseException, rank: int) -> Failure:
    """What rank ``rank`` reports for ``exc``: its own error with the traceback from the
    user's function on, or the failure of the rank a ``RemoteRankError`` relays; a
    ``GatherTimeout`` keeps the ranks it names."""
    if isinstance(exc, RemoteRankError) and exc.rank != rank:
        return Failure(exc.rank, exc.remote_message, exc.remote_traceback)
    frames = exc.__traceback__
    if frames is not None and frames.tb_next is not None:
        frames = frames.tb_next  # launch's own frame, which only called the function
    text = "".join(traceback.format_exception(type(exc), exc, frames))
    if isinstance(exc, GatherTimeout) and exc.ranks:  # the failure is theirs: keep their names
        return Failure(rank, str(exc), text, tuple(exc.ranks), exc.timeout)
    return Failure(rank, f"{type(exc).__name__}: {exc}", text)
