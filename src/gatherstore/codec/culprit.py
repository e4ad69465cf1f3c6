"""Where in a rank's object the thing that cannot be pickled is, for the error that says so;
and whether it can be pickled at all, asked before it is encoded.

pickle's error names the type it met (``cannot pickle '_thread.lock' object``), not where
it sits in an object that may hold millions of items.  When encoding a part fails,
``named`` searches the object for the first thing that neither pickle nor cloudpickle
can serialise and adds its path to the error's message, the error otherwise kept (its
type, its first words, its traceback)::

    cannot pickle '_thread.lock' object — at obj['results'][2]['mask']: a <class
    '_thread.lock'>, which neither pickle nor cloudpickle can serialise; ...

The search runs only once encoding failed, never while a part encodes.  It goes down
from the object one step at a time, through list and tuple indices, dict keys (their
``repr``) and the attributes pickle writes (an instance's ``__dict__``, its
``__slots__``, a dataclass's fields, what its ``__getstate__`` returns), into a child
that fails on its own; a long container is halved until its failing item is found
(about 2 log2 n tries).  Each try pickles into nothing, arrays of numbers and tensors
left out (they pickle, and trying them would copy them), with the objects above it
already in the pickler's memo: a reference back to them (a cycle) fails nothing of its
own.  The search is bounded (``DEPTH`` steps, ``TRIES`` tries, ``SECONDS``); at a bound
the message says "somewhere in" the deepest path known to fail.  An error that the
object raises itself whenever it is pickled (a rank's own error carried into a gather,
so that every rank raises it) is left as its owner wrote it.

``check_picklable`` asks first, cheaply enough for every value an evaluation loop hands
over (``ResultSet.add``), so that a value that cannot be pickled fails there and not
later, in a thread that encodes many values at once.  Plain data passes at a glance:
numbers, strings, bytes, None, numpy's numbers, arrays of numbers and tensors, in dicts,
lists and tuples of up to ``GLANCE`` items each, ``GLANCE_DEPTH`` deep (a detection's
dict of arrays: about a microsecond).  Anything else is pickled into nothing by a
pickler each thread keeps (making one costs more than pickling a small value), arrays
and tensors left out as above; with cloudpickle only when plain pickle fails, as the
encoder does.  What the encoder does beyond pickling (records packed into columns, CUDA
tensors staged) is not tried: its own errors still name what it could not encode.
"""

from __future__ import annotations

import pickle
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import cloudpickle
import numpy as np
import torch

__all__ = [
    "DEPTH",
    "GLANCE",
    "GLANCE_DEPTH",
    "ROOT",
    "SECONDS",
    "TRIES",
    "Found",
    "check_picklable",
    "find",
    "locate",
    "named",
]

T = TypeVar("T")

#: Steps down from the object the search takes at most.
DEPTH = 40
#: Objects (or runs of a container's items) the search tries to pickle at most.
TRIES = 1000
#: Seconds the search takes at most (checked before each try).
SECONDS = 2.0
#: What a path calls the object itself (the name of the collectives' argument).
ROOT = "obj"
#: Items of a dict, list or tuple ``check_picklable`` looks at one by one; a longer one
#: is pickled instead.
GLANCE = 64
#: Containers in containers ``check_picklable`` looks at; deeper ones are pickled instead.
GLANCE_DEPTH = 4
#: Children tried one by one; a container with more is halved first.
_SPLIT = 8
#: Characters of a key's ``repr`` a path keeps.
_KEY = 40
_NOT_PICKLED = "neither pickle nor cloudpickle can serialise"
_FIX = "put something picklable in its place (convert it, or leave it out)"

#: How a step down is written: an item of a list or tuple, a dict's value, an attribute,
#: a dict's key, an element of a set, what an object's reduction gives as its state.
_INDEX, _VALUE, _ATTR, _KEY_OF, _ELEMENT, _STATE = range(6)


@dataclass(frozen=True)
class Found:
    """The search's answer: at ``path`` is ``what`` (e.g. ``a <class '_thread.lock'>``), or,
    when ``what`` is None, the culprit is somewhere in ``path`` (``stopped`` says why the
    search went no deeper)."""

    path: str
    what: str | None
    stopped: str = ""

    def __str__(self) -> str:
        if self.what is None:
            return (
                f"somewhere in {self.path} is something {_NOT_PICKLED} (the search for it "
                f"stopped: {self.stopped}); {_FIX}"
            )
        return f"at {self.path}: {self.what}, which {_NOT_PICKLED}; {_FIX}"


def named(encode: Callable[[Any], T], obj: Any) -> T:
    """``encode(obj)``; should it fail, its error names where in ``obj`` the culprit is
    (see ``locate``)."""
    try:
        return encode(obj)
    except Exception as exc:
        locate(exc, obj)
        raise


def locate(exc: Exception, obj: Any, root: str = ROOT) -> None:
    """Add to the message of ``exc``, which pickling ``obj`` raised, where in ``obj`` the
    culprit is (a path from ``root``): unless the object itself is (pickle's message
    names it already), the error is out of memory or recursion, its message is not its
    one argument (its own ``__str__`` would not show the path), or the object raises
    ``exc`` itself."""
    if isinstance(exc, (MemoryError, RecursionError)) or not _plain_message(exc):
        return
    kept = exc.__traceback__, exc.__context__, exc.__cause__, exc.__suppress_context__
    try:
        found = find(obj, exc, root=root)
    except Exception:  # the search runs the object's own code (reductions, reprs)
        found = None
    finally:  # a try that raised ``exc`` again gave it the search's frames
        exc.__traceback__, exc.__context__, exc.__cause__, exc.__suppress_context__ = kept
    if found is not None and found.path != root:
        exc.args = (f"{exc.args[0]} — {found}",)


def _plain_message(exc: Exception) -> bool:
    """Whether ``exc``'s message is its one argument, as for pickle's own errors."""
    return len(exc.args) == 1 and isinstance(exc.args[0], str) and str(exc) == exc.args[0]


def find(
    obj: Any,
    error: BaseException | None = None,
    *,
    depth: int = DEPTH,
    tries: int = TRIES,
    seconds: float = SECONDS,
    root: str = ROOT,
) -> Found | None:
    """Where in ``obj``, which neither pickle nor cloudpickle can pickle, the first thing
    that cannot be pickled is, as a path from ``root`` (see the module's docstring); None
    when pickling part of ``obj`` raises ``error`` itself (an error the object carries,
    not one of pickling)."""
    search = _Search(error, tries, seconds)
    path, node = root, obj
    try:
        for _ in range(depth):
            search.above.append(node)
            child = search.failing(_children(node, search))
            if child is None:
                if type(node) in (list, tuple, dict, set, frozenset):
                    return Found(path, None, "no single item of it fails on its own")
                return Found(path, _what(node))
            node, kind, key = child
            path += _step(kind, key)
        return Found(path, None, f"at a depth of {depth}")
    except _Bounded as bound:
        return Found(path, None, str(bound))
    except _Carried:
        return None


class _Bounded(Exception):
    """The search reached one of its bounds (the message says which)."""


class _Carried(Exception):
    """Pickling part of the object raised the very error being explained."""


class _Sink:
    """A file that keeps nothing (a try only asks whether pickling fails), and ends a try
    that runs past the search's deadline (pickle writes every 64 KiB)."""

    def __init__(self, deadline: float, seconds: float) -> None:
        self.deadline, self.seconds = deadline, seconds

    def check(self) -> None:
        """Raise ``_Bounded`` once the deadline is past."""
        if time.monotonic() > self.deadline:
            raise _Bounded(f"after {self.seconds:g} s")

    def write(self, data: Any) -> int:
        self.check()
        return len(data)


def _left_out(obj: Any) -> Any:
    """Arrays of numbers and tensors pickled as nothing: they do not fail (the encoder
    detaches tensors), and trying them would copy them."""
    kind = type(obj)
    if (kind is np.ndarray and not obj.dtype.hasobject) or kind is torch.Tensor:
        return (tuple, ())
    return NotImplemented


class _Plain(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        return _left_out(obj)


class _Cloud(cloudpickle.Pickler):  # type: ignore[misc]
    def reducer_override(self, obj: Any) -> Any:
        left = _left_out(obj)
        return super().reducer_override(obj) if left is NotImplemented else left


_ATOMS = frozenset({int, float, complex, str, bytes, bool, type(None)})


def check_picklable(obj: Any, root: str = ROOT) -> None:
    """Return when pickle or cloudpickle can pickle ``obj`` (see the module's docstring);
    nothing of it is kept.

    Raises:
        Exception: what pickling ``obj`` raised when neither can (e.g. ``TypeError:
            cannot pickle '_thread.lock' object``), its message naming the culprit by a
            path from ``root`` (e.g. ``value['mask']``).
    """
    if _at_a_glance(obj, 0):
        return
    plain = _probes.plain
    try:
        plain.dump(obj)
        return
    except Exception:
        pass  # whether cloudpickle can is what counts
    finally:
        plain.clear_memo()  # the pickler holds nothing of ``obj`` past the call
    try:
        _Cloud(_probes.sink, protocol=5, buffer_callback=_out_of_band).dump(obj)
    except Exception as exc:
        locate(exc, obj, root)
        raise


def _at_a_glance(obj: Any, depth: int) -> bool:
    """Whether ``obj`` is plain data (see the module's docstring): True only for what
    surely pickles, False when it takes pickling to tell.  An atom in a container is
    seen without a call, in loops (``all()`` over a generator costs twice as much)."""
    kind = type(obj)
    if kind in _ATOMS:
        return True
    if kind is np.ndarray:
        return not obj.dtype.hasobject
    if kind is not dict and kind is not list and kind is not tuple:
        return kind is torch.Tensor or isinstance(obj, (np.number, np.bool_))
    if depth >= GLANCE_DEPTH or len(obj) > GLANCE:
        return False
    atoms, deeper = _ATOMS, depth + 1
    if kind is dict:
        for key, value in obj.items():
            if type(key) not in atoms:
                return False
            if type(value) not in atoms and not _at_a_glance(value, deeper):
                return False
        return True
    for item in obj:  # noqa: SIM110 - see the docstring
        if type(item) not in atoms and not _at_a_glance(item, deeper):
            return False
    return True


def _out_of_band(_: Any) -> bool:
    return False  # a buffer is neither copied nor written


class _Probes(threading.local):
    """A thread's sink and plain pickler into it, made once, for ``check_picklable``."""

    def __init__(self) -> None:
        self.sink = _Sink(float("inf"), 0.0)
        self.plain = _Plain(self.sink, protocol=5, buffer_callback=_out_of_band)


_probes = _Probes()


class _Search:
    """One search's bounds, and the objects on its path (``above``)."""

    def __init__(self, error: BaseException | None, tries: int, seconds: float) -> None:
        self.error = error
        self.tries = tries
        self.left = tries
        self.sink = _Sink(time.monotonic() + seconds, seconds)
        self.above: list[Any] = []

    def failing(self, children: list[tuple[Any, int, Any]]) -> tuple[Any, int, Any] | None:
        """The first child that fails on its own, a long run of them halved first (a child
        that fails makes its half fail: when neither half does, no child fails on its
        own); None when none does."""
        lo, hi = 0, len(children)
        while hi - lo > _SPLIT:
            mid = (lo + hi) // 2
            if self.fails([child[0] for child in children[lo:mid]]):
                hi = mid
            elif self.fails([child[0] for child in children[mid:hi]]):
                lo = mid
            else:
                return None
        return next((child for child in children[lo:hi] if self.fails(child[0])), None)

    def fails(self, value: Any) -> bool:
        """Whether neither pickle nor cloudpickle can pickle ``value`` (a reference to an
        object above it on the path, in the memo already, is not a failure).

        Raises:
            _Bounded: no tries or time left.
            _Carried: pickling ``value`` raised the error being explained.
        """
        if self.left <= 0:
            raise _Bounded(f"after {self.tries} tries")
        self.sink.check()
        self.left -= 1
        failure: Exception | None = None
        for kind in (_Plain, _Cloud):
            pickler = kind(self.sink, protocol=5, buffer_callback=lambda _: False)
            pickler.memo = {id(obj): (i, obj) for i, obj in enumerate(self.above)}
            try:
                pickler.dump(value)
                return False
            except _Bounded:
                raise
            except Exception as exc:
                failure = exc
        if failure is self.error:
            raise _Carried
        return True


def _children(node: Any, search: _Search) -> list[tuple[Any, int, Any]]:
    """What pickling ``node`` pickles in turn, as (child, kind of step, key): the items
    of builtin containers; of other objects, the items of the list, tuple or dict they
    are, and the state their reduction gives.  Nothing of an object whose reduction
    fails: it is the culprit."""
    kind = type(node)
    if kind is list or kind is tuple:
        return [(value, _INDEX, i) for i, value in enumerate(node)]
    if kind is dict:
        values = [(value, _VALUE, key) for key, value in node.items()]
        return values + [(key, _KEY_OF, key) for key in node]
    if kind is set or kind is frozenset:
        return [(value, _ELEMENT, None) for value in node]
    try:
        reduced = node.__reduce_ex__(5)
    except Exception as exc:
        if exc is search.error:
            raise _Carried from None
        return []
    items: list[tuple[Any, int, Any]] = []
    if isinstance(node, (list, tuple)):
        items = [(value, _INDEX, i) for i, value in enumerate(node)]
    elif isinstance(node, dict):
        items = [(value, _VALUE, key) for key, value in node.items()]
    if isinstance(reduced, tuple) and len(reduced) > 2:
        items += _state(reduced[2])
    return items


def _state(state: Any) -> list[tuple[Any, int, Any]]:
    """The children in an object's pickled state: its attributes when the state is its
    ``__dict__``, or that and its ``__slots__`` (a pair of dicts), else the state whole."""
    if state is None:
        return []
    parts = [state]
    pair = type(state) is tuple and len(state) == 2
    if pair and all(p is None or type(p) is dict for p in state):
        parts = [p for p in state if p]
    if not all(type(p) is dict for p in parts):
        return [(state, _STATE, None)]
    return [(value, _ATTR, name) for part in parts for name, value in part.items()]


def _step(kind: int, key: Any) -> str:
    """How a path writes one step down."""
    if kind == _INDEX:
        return f"[{key}]"
    if kind == _VALUE:
        return f"[{_short(key)}]"
    if kind == _ATTR:
        return f".{key}" if isinstance(key, str) else f".__dict__[{_short(key)}]"
    if kind == _KEY_OF:
        return f" (its key {_short(key)})"
    return " (an element)" if kind == _ELEMENT else " (its pickled state)"


def _short(key: Any) -> str:
    """``key``'s ``repr``, cut to ``_KEY`` characters."""
    text = repr(key)
    return text if len(text) <= _KEY else text[: _KEY - 1] + "…"


def _what(node: Any) -> str:
    """What the culprit is, in a few words."""
    if isinstance(node, types.FunctionType):
        return "a lambda" if node.__name__ == "<lambda>" else f"the function {node.__qualname__}"
    if isinstance(node, type):
        return f"the class {node.__qualname__}"
    return f"a {type(node)!r}"
