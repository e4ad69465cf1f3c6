"""One rank's buffer of a result set, written as chunks by a background thread.

``add`` appends to a queue and returns: the loop that evaluates pays for a
check of the key, a glance at the value (a value that is not plain data is
pickled into nothing: see ``gatherstore.codec.culprit``), and an append; a
value that cannot be pickled raises ``TypeError`` there, naming where in it the
culprit is, and is not queued.  A daemon thread takes the values in the
order they came and hands them to ``write`` (which encodes, seals and puts one
chunk) once ``values`` wait, once they make about ``nbytes`` (how many values
that is, is learned from the chunks written so far), once the oldest has
waited ``seconds``, or when ``flush`` asks.  A failed write puts
its values back at the front: the next ``add`` raises the store's error once,
and a later flush writes them.  Values that passed ``add`` but still cannot be
encoded (changed since, or refused by the encoder itself) are dropped from
their chunk, the others written, and the next ``add`` or ``flush`` names them.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gatherstore import _config as config
from gatherstore import codec
from gatherstore._errors import GatherError, GatherTimeout
from gatherstore.results import order

__all__ = ["FlushEvery", "Unstorable", "Writer", "flush_policy", "picklable"]

#: Values in the first chunk, before bytes per value are known.
FIRST_CHUNK = 64
_SECONDS = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*s\s*", re.IGNORECASE)
_log = logging.getLogger("gatherstore")


@dataclass(frozen=True)
class FlushEvery:
    """When buffered values are written: after this many values, about this many bytes,
    or this many seconds, whichever comes first."""

    values: int
    nbytes: int
    seconds: float


def flush_policy(spec: Any = None) -> FlushEvery:
    """The flush triggers of ``flush_every``: an int (values), a size such as ``"8MB"``
    (bytes), a duration ``"30s"`` or a ``timedelta`` (seconds), or a tuple of them; each
    one not given is its setting's (``GATHERSTORE_FLUSH_VALUES`` / ``_BYTES`` / ``_SECONDS``);
    seconds are at most ``MAX_WAIT`` (24 days).

    Raises:
        ValueError: anything else, or a value that is not positive.
    """
    policy = FlushEvery(*config.flush_every())
    for item in spec if isinstance(spec, (tuple, list)) else [] if spec is None else [spec]:
        if isinstance(item, int) and not isinstance(item, bool) and item > 0:
            policy = replace(policy, values=item)
        elif isinstance(item, dt.timedelta) and item.total_seconds() > 0:
            policy = replace(policy, seconds=min(item.total_seconds(), config.MAX_WAIT))
        elif isinstance(item, str) and _SECONDS.fullmatch(item) and float(item.strip()[:-1]) > 0:
            policy = replace(policy, seconds=min(float(item.strip()[:-1]), config.MAX_WAIT))
        elif isinstance(item, str):
            try:
                policy = replace(policy, nbytes=config.parse_size(item))
            except ValueError:
                raise ValueError(_bad_flush(item)) from None
        else:
            raise ValueError(_bad_flush(item))
    return policy


def _bad_flush(item: Any) -> str:
    return (
        f"flush_every={item!r} is not valid: give a positive int (values), a size such as "
        "'8MB' (bytes), a duration '30s' or a datetime.timedelta (seconds), or a tuple of them"
    )


class Unstorable(Exception):
    """Raised by a chunk's ``write``: some values could not be stored (say, they cannot be
    pickled) and were dropped; the others were written (``nbytes``).  ``error`` is raised
    to the program by the next ``add`` or ``flush``."""

    def __init__(self, error: BaseException, nbytes: int) -> None:
        super().__init__(str(error))
        self.error, self.nbytes = error, nbytes


def picklable(items: list[tuple[Any, Any]], what: str) -> tuple[list[Any], TypeError]:
    """The (key, value) items whose values pickle, and the error naming the others."""
    good, bad = [], []
    for key, value in items:
        try:
            codec.encode(value)
            good.append((key, value))
        except Exception as exc:
            bad.append((key, exc))
    keys = ", ".join(repr(k) for k, _ in bad[:5]) + (", ..." if len(bad) > 5 else "")
    first = bad[0][1] if bad else None
    return good, TypeError(
        f"{what}: the values of keys {keys} cannot be pickled ({type(first).__name__}: "
        f"{first}); they were not stored"
    )


class Writer:
    """Buffers values and writes them as chunks from a daemon thread.

    ``write(items)`` writes one chunk and returns its bytes; ``what`` names the set
    in errors.
    """

    def __init__(self, write: Callable[[list[Any]], int], policy: FlushEvery, what: str) -> None:
        self._write, self.policy, self.what = write, policy, what
        # keys and values apart: an add allocates no tuple (which would feed the garbage
        # collector, whose passes over a loop's live objects cost more than the add)
        self._keys: deque[Any] = deque()
        self._values: deque[Any] = deque()
        self._cond = threading.Condition()
        self._threshold = min(policy.values, FIRST_CHUNK)
        self._per_value = 0.0
        self._popped = 0  # values taken from the queue and not put back
        self._durable = 0  # values written
        self._wanted = 0  # flush(): values to write before it returns
        self._error: BaseException | None = None
        self._retry = False  # whether the values of the failed write wait to be retried
        self._retry_at = 0.0
        self._nudged = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="gatherstore-results", daemon=True)
        self._thread.start()

    # --- the evaluation loop's side ------------------------------------------------------------
    def add(self, key: Any, value: Any) -> None:
        """Queue ``value`` under ``key``; raise a failed write's error (once).

        Raises:
            TypeError: ``key`` is not an int or a str, or ``value`` cannot be pickled
                (where in it the culprit is named; it is not queued).
            GatherError: the writer is closed, or the last write in the background failed
                (e.g. StoreUnavailableError; the values stay queued).
        """
        if type(key) is not int and type(key) is not str:  # the usual keys pass at once
            key = order.check_key(key)
        if self._error is not None or self._stop:
            self._raise_error()
        try:
            codec.check_picklable(value, "value")
        except Exception as exc:
            raise TypeError(
                f"{self.what}: the value of key {key!r} cannot be pickled, so it was not "
                f"added ({type(exc).__name__}: {exc})"
            ) from exc
        self._keys.append(key)
        values = self._values
        values.append(value)  # last: the thread takes as many values as there are
        if len(values) >= self._threshold and not self._nudged:
            self._nudged = True
            with self._cond:
                self._cond.notify_all()

    def _raise_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error
        if self._stop:
            raise GatherError(f"{self.what} is closed or discarded: open it again to add to it")

    def flush(self, timeout: float) -> None:
        """Return once every value queued before the call is written.

        Raises:
            GatherError: a write failed (e.g. StoreUnavailableError, IntegrityError), or
                the writer is closed.
            GatherTimeout: the values were not written within ``timeout`` seconds.
        """
        ends = time.monotonic() + timeout
        with self._cond:
            error, self._error = self._error, None  # a failed write is retried now
            if error is not None and not self._retry:  # values dropped: tell the program
                raise error
            target = self._popped + len(self._values)
            self._wanted = max(self._wanted, target)
            self._cond.notify_all()
            while self._durable < target:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                if not self._thread.is_alive():
                    raise GatherError(f"{self.what}: its writer is closed; nothing more is written")
                left = ends - time.monotonic()
                if left <= 0:
                    raise GatherTimeout(
                        f"{self.what}: {target - self._durable} values were not written within "
                        f"{timeout:g} s: the store is slow or frozen",
                        timeout=timeout,
                    )
                self._cond.wait(left)
            if self._error is not None and not self._retry:  # values dropped meanwhile
                error, self._error = self._error, None
                raise error

    def drain(self, timeout: float) -> None:
        """``flush``, errors logged instead of raised: for a stopping process."""
        try:
            self.flush(timeout)
        except Exception as exc:
            _log.warning("gatherstore: %s: values added last were not written: %s", self.what, exc)

    def close(self, *, drop: bool = False, timeout: float = 10.0) -> None:
        """Stop the thread once what is queued is written (``drop``: dropped instead)."""
        with self._cond:
            self._stop = True
            if drop:
                self._values.clear()
                self._keys.clear()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def queued(self) -> int:
        """Values added and not yet written."""
        return len(self._values) + self._popped - self._durable

    # --- the thread ----------------------------------------------------------------------------
    def _due(self, now: float, last: float) -> bool:
        waiting = len(self._values)
        if not waiting:
            return False
        if self._stop or self._wanted > self._popped:
            return True
        if self._error is not None and now < self._retry_at:
            return False
        return waiting >= self._threshold or now - last >= self.policy.seconds

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            with self._cond:
                while not self._due(now := time.monotonic(), last):
                    if self._stop:
                        return
                    self._cond.wait(max(last + self.policy.seconds - now, 0.01))
                count = min(len(self._values), self._threshold)
                keys = [self._keys.popleft() for _ in range(count)]
                items = list(zip(keys, [self._values.popleft() for _ in range(count)], strict=True))
                self._popped += count
                self._nudged = False
            self._write_one(items)
            last = time.monotonic()

    def _write_one(self, items: list[Any]) -> None:
        try:
            nbytes = self._write(items)
        except Unstorable as exc:  # written but for the values named: never retried
            with self._cond:
                self._durable += len(items)
                self._error, self._retry = exc.error, False
                self._cond.notify_all()
            return
        except BaseException as exc:
            with self._cond:
                self._keys.extendleft(reversed([k for k, _ in items]))  # first again, in order
                self._values.extendleft(reversed([v for _, v in items]))
                self._popped -= len(items)
                self._wanted = min(self._wanted, self._popped)
                self._error, self._retry = exc, True
                self._retry_at = time.monotonic() + self.policy.seconds
                self._cond.notify_all()
            return
        with self._cond:
            self._durable += len(items)
            self._learn(len(items), nbytes)
            self._cond.notify_all()

    def _learn(self, count: int, nbytes: int) -> None:
        """Values per chunk from the bytes per value seen so far."""
        per = nbytes / count
        self._per_value = per if not self._per_value else (self._per_value + per) / 2
        fit = math.floor(self.policy.nbytes / max(self._per_value, 1.0))
        self._threshold = max(1, min(self.policy.values, fit))
