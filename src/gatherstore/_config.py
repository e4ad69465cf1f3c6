"""Every setting of the library: its default, and the environment variable that overrides it.

| variable | default | what it sets |
| --- | --- | --- |
| ``GATHERSTORE_STORE`` | ``auto`` | the store object collectives use when none is passed |
| ``GATHERSTORE_TIMEOUT`` | 1800 | seconds a collective waits by default (at most 24 days) |
| ``GATHERSTORE_READ_AHEAD`` | 32MiB | bytes a reader reads ahead of its consumer |
| ``GATHERSTORE_AUTO_THRESHOLD`` | 128KiB | ``auto``: totals up to this go over the process group |
| ``GATHERSTORE_STREAM_CHUNK`` | 16MiB | bytes per message of the ``stream`` route |
| ``GATHERSTORE_TMPDIR`` | /dev/shm, else the temp dir | the base folder of ``tmpdir`` |
| ``GATHERSTORE_HANDOVER`` | 1 | off: ``tmpdir`` in RAM moves parts as files, not sealed memfds |
| ``GATHERSTORE_PART_CHUNK`` | 16MiB | most bytes per chunk of a long list handed over; 0: whole |
| ``GATHERSTORE_PROGRESS`` | on a terminal | on/off: show a long gather's progress |
| ``GATHERSTORE_HEARTBEAT`` | 30 | seconds between a job area's heartbeats |
| ``GATHERSTORE_PINNED`` | 128MiB | pinned memory per process for CUDA tensors, kept to shutdown |
| ``GATHERSTORE_FLUSH_VALUES`` | 100000 | a result set writes a chunk once this many values wait |
| ``GATHERSTORE_FLUSH_BYTES`` | 8MiB | ... or once the values waiting make about this many bytes |
| ``GATHERSTORE_FLUSH_SECONDS`` | 30 | ... or once a value has waited this long |
| ``GATHERSTORE_RESULTS_KEY`` | none | the signing key of result sets (text); unsigned when unset |
| ``GATHERSTORE_RESULTS_KEY_FILE`` | none | a file holding that key (read first) |

Sizes take units (``64MB``, ``1.5GiB``: binary).  Seconds longer than 24 days are
24 days (``MAX_WAIT``).  On/off settings take ``1``/``0``, ``true``/``false``,
``yes``/``no`` or ``on``/``off`` (any case); anything else raises ``ValueError`` at the
next call.  Variables read once are read when gatherstore is imported; the others
(store, timeout, tmpdir, handover, progress, heartbeat, the result sets' flushes and key)
each time they are used.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import math
import os
import re
import sys
import warnings

__all__ = [
    "AUTO_THRESHOLD",
    "ROUTES",
    "SHM",
    "DEFAULT_READ_AHEAD",
    "MAX_WAIT",
    "PART_CHUNK",
    "PINNED",
    "STREAM_CHUNK",
    "Timeout",
    "check_environment",
    "default_timeout",
    "flush_every",
    "handover",
    "heartbeat_interval",
    "parse_duration",
    "parse_size",
    "program_level",
    "progress",
    "read_ahead",
    "results_key",
    "store_spec",
    "tmpdir_base",
    "to_seconds",
]

#: The longest wait, in seconds, that gatherstore asks of the platform: 24 days.  A longer
#: timeout (``timeout=1e12``, ``GATHERSTORE_TIMEOUT=1e12``: "as long as it takes") is
#: clamped to it, so that every wait a call makes can take it: torch's c10d store client
#: polls its socket for an ``int`` of milliseconds (at most 2**31 - 1, 24.8 days; a
#: longer wait wraps around and may end at once, or spin), and beyond that Python's waits
#: (threads, sockets) and c10d's and gloo's deadlines, in nanoseconds of the steady clock,
#: overflow (past ``threading.TIMEOUT_MAX``, about 292 years).  The 20 hours left under
#: 2**31 ms are room for the grace periods a call adds to its timeout.
MAX_WAIT = 24 * 86400.0

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)


def parse_size(text: str, at_least: int = 1) -> int:
    """Bytes of a size such as ``64MB``, ``1GB``, ``1.5G``, ``512KiB`` or ``4096`` (binary units).

    Raises:
        ValueError: ``text`` is not a size of at least ``at_least`` bytes.
    """
    match = _SIZE.fullmatch(text)
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2).upper()]) if match else -1
    if nbytes < at_least:
        raise ValueError(f"{text!r} is not a size; use e.g. 64MB, 1GB or 4096 (bytes)")
    return nbytes


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds of a duration such as ``30s``, ``15m``, ``1h``, ``2d`` or ``1.5h``.

    Raises:
        ValueError: ``text`` is not a non-negative number followed by s, m, h, d or w.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw])\s*", text.lower())
    if match is None:
        raise ValueError(f"{text!r} is not a duration; use e.g. 30s, 15m, 1h or 2d")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def _size_setting(name: str, default: str, at_least: int = 1) -> int:
    """The size in the environment variable ``name``, else ``default``.

    Raises:
        ValueError: the variable holds no valid size; the message names it.
    """
    text = os.environ.get(name) or default
    try:
        return parse_size(text, at_least)
    except ValueError:
        raise ValueError(
            f"{name}={text!r} is not a size of at least {at_least} bytes: set it to e.g. "
            f"64MB, 1GB or 4096 (bytes), or unset it for the default {default}"
        ) from None


def _seconds_setting(name: str, default: float) -> float:
    """The positive number of seconds in the environment variable ``name``, else ``default``.

    Raises:
        ValueError: the variable holds no positive number; the message names it.
    """
    text = os.environ.get(name) or str(default)
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < math.inf:
        raise ValueError(
            f"{name}={text!r} is not a positive, finite number of seconds: set it to e.g. "
            f"600, or unset it for the default {default:g}"
        )
    return min(seconds, MAX_WAIT)


#: How an on/off setting may be spelled (any case): what each spelling means.
FLAGS = {"1": True, "true": True, "yes": True, "on": True,
         "0": False, "false": False, "no": False, "off": False}  # fmt: skip


def _flag_setting(name: str) -> bool | None:
    """The on/off setting in the environment variable ``name``; None when unset or empty.

    Raises:
        ValueError: the variable holds another spelling; the message names it and the
            spellings it takes.
    """
    text = os.environ.get(name, "")
    spelling = text.strip().lower()
    if not spelling:
        return None
    if spelling not in FLAGS:
        raise ValueError(
            f"{name}={text!r} is neither on nor off: set it to 1, true, yes or on (on), or "
            "to 0, false, no or off (off), in any case, or unset it for the default"
        )
    return FLAGS[spelling]


#: The node's shared memory (RAM), where ``tmpdir`` keeps its job folders when it can.
SHM = "/dev/shm"

#: What ``store=`` (and ``GATHERSTORE_STORE``) may name besides a store: the routes of the
#: object collectives (``gatherstore.routes.base``), which move parts without one.
ROUTES = ("auto", "collective", "stream")


#: Bytes a reader of stored parts reads ahead of its consumer by default
#: (``GATHERSTORE_READ_AHEAD`` overrides it, e.g. ``256MB``); never more than
#: ``READ_AHEAD_SHARE`` of the memory the check found free.  32 MiB keeps
#: 32 requests of small parts in flight and several chunks of big ones, and
#: stays a small share of what a gather returns.
DEFAULT_READ_AHEAD = _size_setting("GATHERSTORE_READ_AHEAD", "32MiB")
READ_AHEAD_SHARE = 8

#: Totals up to this many bytes go over the process group with ``store="auto"``.
#: Measured with 4 gloo ranks on one 2-core machine: at 64 KiB both routes take
#: ~10 ms; from 256 KiB on the tmpdir route is 2.5-4x faster (1 MiB: 37 ms vs 10 ms;
#: 256 MiB: 1.25 s vs 0.76 s).
AUTO_THRESHOLD = _size_setting("GATHERSTORE_AUTO_THRESHOLD", "128KiB", at_least=0)
#: Bytes per point-to-point message of the ``stream`` route.
STREAM_CHUNK = _size_setting("GATHERSTORE_STREAM_CHUNK", "16MiB")
#: Bytes a chunk of a part handed over aims at (0: parts go whole; see
#: ``gatherstore.codec.chunks``).
PART_CHUNK = _size_setting("GATHERSTORE_PART_CHUNK", "16MiB", at_least=0)
#: Bytes of pinned host memory a process stages CUDA tensors through, in two halves
#: (allocated at the first gather of a CUDA tensor, released at ``gs.shutdown()``).
PINNED = _size_setting("GATHERSTORE_PINNED", "128MiB", at_least=2)
_TIMEOUT, _HEARTBEAT = 1800.0, 30.0
_FLUSH_VALUES, _FLUSH_BYTES, _FLUSH_SECONDS = 100_000, "8MiB", 30.0


def store_spec() -> str | None:
    """The store named by ``GATHERSTORE_STORE``, if any."""
    return os.environ.get("GATHERSTORE_STORE") or None


def tmpdir_base() -> str | None:
    """The base folder of ``tmpdir`` named by ``GATHERSTORE_TMPDIR``, if any."""
    return os.environ.get("GATHERSTORE_TMPDIR") or None


def handover() -> bool:
    """``GATHERSTORE_HANDOVER``: off keeps ``tmpdir``'s parts in files even between the
    ranks of one machine (see ``gatherstore.routes.handover``); on or unset, True.

    Raises:
        ValueError: the variable is not spelled as on or off (see ``FLAGS``).
    """
    return _flag_setting("GATHERSTORE_HANDOVER") is not False


def progress() -> bool | None:
    """``GATHERSTORE_PROGRESS``: True (on), False (off), None when unset.

    Raises:
        ValueError: the variable is not spelled as on or off (see ``FLAGS``).
    """
    return _flag_setting("GATHERSTORE_PROGRESS")


def default_timeout() -> float:
    """Seconds a collective waits when its ``timeout`` is None: ``GATHERSTORE_TIMEOUT``,
    else 1800.  Read at each call, so that a value set after the import counts (the
    ranks of ``launch`` get its ``timeout`` so).

    Raises:
        ValueError: the variable holds no positive, finite number; the message names it.
    """
    return _seconds_setting("GATHERSTORE_TIMEOUT", _TIMEOUT)


def heartbeat_interval() -> float:
    """Seconds between a job area's heartbeats: ``GATHERSTORE_HEARTBEAT``, else 30.

    Raises:
        ValueError: the variable is not a positive number.
    """
    return _seconds_setting("GATHERSTORE_HEARTBEAT", _HEARTBEAT)


def flush_every() -> tuple[int, int, float]:
    """A result set's default flush triggers: (values, bytes, seconds) from
    ``GATHERSTORE_FLUSH_VALUES``, ``_BYTES`` and ``_SECONDS``.

    Raises:
        ValueError: a variable holds no positive value; the message names it.
    """
    text = os.environ.get("GATHERSTORE_FLUSH_VALUES") or str(_FLUSH_VALUES)
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(
            f"GATHERSTORE_FLUSH_VALUES={text!r} is not a positive integer: set it to e.g. "
            f"1000, or unset it for the default {_FLUSH_VALUES}"
        )
    return (
        int(text),
        _size_setting("GATHERSTORE_FLUSH_BYTES", _FLUSH_BYTES),
        _seconds_setting("GATHERSTORE_FLUSH_SECONDS", _FLUSH_SECONDS),
    )


def results_key() -> bytes | None:
    """The signing key of result sets: the bytes of the file ``GATHERSTORE_RESULTS_KEY_FILE``
    names, else the text of ``GATHERSTORE_RESULTS_KEY`` (UTF-8), else None.

    Raises:
        ValueError: the file cannot be read (the message names the variable, not the key).
    """
    path = os.environ.get("GATHERSTORE_RESULTS_KEY_FILE")
    if path:
        try:
            with open(path, "rb") as f:
                return f.read().strip()
        except OSError as exc:
            raise ValueError(
                f"GATHERSTORE_RESULTS_KEY_FILE={path!r} cannot be read ({exc.strerror}): "
                "point it at a file holding the key, readable by every rank"
            ) from None
    text = os.environ.get("GATHERSTORE_RESULTS_KEY")
    return text.encode() if text else None


def read_ahead(explicit: int | None, headroom: int) -> int:
    """The read-ahead budget in bytes: ``explicit`` (a call's ``read_ahead=``), else the
    default capped at 1/``READ_AHEAD_SHARE`` of ``headroom``; at least 1 byte
    (then parts are read one at a time, on demand).

    Raises:
        ValueError: ``explicit`` is negative or not an int.
    """
    if explicit is not None:
        if not isinstance(explicit, int) or isinstance(explicit, bool) or explicit < 0:
            raise ValueError(
                f"read_ahead={explicit!r} is not valid: give a number of bytes (0 or more)"
            )
        return max(explicit, 1)
    return max(min(DEFAULT_READ_AHEAD, headroom // READ_AHEAD_SHARE), 1)


Timeout = float | int | _dt.timedelta | None
"""What every ``timeout=`` of gatherstore takes: seconds (an int or a float) or a
``datetime.timedelta``, positive and finite; None for the default, ``GATHERSTORE_TIMEOUT``
(1800 s unless set).  A timeout longer than 24 days (``MAX_WAIT``) is 24 days.

Examples:
    >>> gs.gather_object(preds, timeout=600)
    >>> gs.gather_object(preds, timeout=datetime.timedelta(hours=2))
"""


def to_seconds(timeout: Timeout) -> float:
    """Seconds of a user timeout: a number, a timedelta, or None for the library default;
    at most ``MAX_WAIT`` (a longer one is clamped to what every wait can take).

    Raises:
        ValueError: the timeout is not a positive, finite number of seconds (NaN and
            infinity included) or has the wrong type.
    """
    if timeout is None:
        return default_timeout()
    if isinstance(timeout, _dt.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int) and not isinstance(timeout, bool):
        seconds = float(min(timeout, MAX_WAIT))  # an int too large for a float is finite
    elif isinstance(timeout, float):
        seconds = timeout
    else:
        raise ValueError(
            f"timeout={timeout!r} is not valid: give seconds (a number), a "
            "datetime.timedelta, or None for the default"
        )
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    if math.isinf(seconds):
        raise ValueError(
            f"timeout={timeout!r}: every gatherstore call has a deadline, so that a lost rank "
            "cannot hang the job; give a finite number of seconds (e.g. 86400 for a day), "
            "or None for the default (GATHERSTORE_TIMEOUT)"
        )
    return min(seconds, MAX_WAIT)


#: Every setting, as the table above lists them (``tests/test_settings.py`` keeps them equal).
SETTINGS = (
    "GATHERSTORE_STORE",
    "GATHERSTORE_TIMEOUT",
    "GATHERSTORE_READ_AHEAD",
    "GATHERSTORE_AUTO_THRESHOLD",
    "GATHERSTORE_STREAM_CHUNK",
    "GATHERSTORE_TMPDIR",
    "GATHERSTORE_HANDOVER",
    "GATHERSTORE_PART_CHUNK",
    "GATHERSTORE_PROGRESS",
    "GATHERSTORE_HEARTBEAT",
    "GATHERSTORE_PINNED",
    "GATHERSTORE_FLUSH_VALUES",
    "GATHERSTORE_FLUSH_BYTES",
    "GATHERSTORE_FLUSH_SECONDS",
    "GATHERSTORE_RESULTS_KEY",
    "GATHERSTORE_RESULTS_KEY_FILE",
)
#: The variables of the repository's ``docker-compose.yml``: no settings of the library, but
#: exported in the same shells.
_COMPOSE = ("GATHERSTORE_S3_KEY", "GATHERSTORE_S3_SECRET", "GATHERSTORE_PUBLISH_ADDR")
#: Variables under this prefix belong to test suites (the pytest plugin, the benchmark,
#: a project's own tests): never warned about.
TEST_PREFIX = "GATHERSTORE_TEST_"
_warned: set[str] = set()


def check_environment() -> None:
    """Check the environment's settings before a call sends anything (``calls.entry``,
    ``launch``): the on/off ones and the timeout at every call, as they are read at every
    call; and, once per process and name, warn (``UserWarning``) of a ``GATHERSTORE_*``
    variable that is no setting, naming the nearest one: a typo would otherwise change
    nothing, silently.

    Raises:
        ValueError: an on/off setting is spelled otherwise, or the timeout is no positive
            number (the message names it).
    """
    handover()
    progress()
    default_timeout()
    for name in sorted(os.environ):
        if name.startswith("GATHERSTORE_") and name not in _warned and not _known(name):
            _warned.add(name)
            warnings.warn(_unknown(name), UserWarning, stacklevel=program_level())


def program_level() -> int:
    """The ``stacklevel`` of a warning made here that points at the program's own call:
    the first frame outside gatherstore (and the ``with`` machinery it calls through)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and _internal(frame.f_globals.get("__name__", "")):
        level, frame = level + 1, frame.f_back
    return level


def _internal(module: str) -> bool:
    return module.startswith("gatherstore.") or module == "contextlib"


def _known(name: str) -> bool:
    return name in SETTINGS or name in _COMPOSE or name.startswith(TEST_PREFIX)


def _unknown(name: str) -> str:
    """What the warning about the unknown variable ``name`` says."""
    prefix = len("GATHERSTORE_")  # shared by all: only what follows tells them apart
    close = difflib.get_close_matches(name[prefix:], [s[prefix:] for s in SETTINGS + _COMPOSE])
    fix = (
        f"did you mean GATHERSTORE_{close[0]}?"
        if close
        else "the settings are " + ", ".join(SETTINGS)
    )
    return (
        f"{name} is set but is not a gatherstore setting, so it changes nothing: {fix} "
        f"(variables for tests start with {TEST_PREFIX})"
    )
