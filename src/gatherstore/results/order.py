"""The keys of a result set: samples named by an ``int`` or a ``str``, and their order.

Ints come first, in numeric order, then strs, in code-point order; a set may mix
them.  Integers of any kind with ``__index__`` (numpy and 0-d torch integers)
count as ints; ``bool`` does not (``True`` would be sample 1).  Runs of int
keys are held as int64 arrays, which sort, merge and compare at numpy's speed.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "Key",
    "Keys",
    "check_key",
    "digest",
    "order_key",
    "pack",
    "sort_keys",
    "stored_mask",
    "unpack",
]

Key = int | str
#: Keys as stored and merged: an int64 array when every key is an int that fits.
Keys = np.ndarray | list[Key]

_INT64 = (-(1 << 63), (1 << 63) - 1)


def check_key(key: Any) -> Key:
    """``key`` as a result set's key: a str, or an int (of any integer type).

    Raises:
        TypeError: anything else (``bool``, floats, tuples, ...), named.
    """
    if type(key) is int or type(key) is str:  # the common cases, fast
        return key
    if isinstance(key, str):
        return str(key)
    if not isinstance(key, bool):
        try:
            return operator.index(key)
        except TypeError:
            pass
    raise TypeError(
        f"a result set's key is an int or a str (a sample's index or id), not "
        f"{type(key).__name__} {key!r}"
    )


def order_key(key: Key) -> tuple[int, Any]:
    """What keys sort by: ints first, then strs."""
    return (1, key) if isinstance(key, str) else (0, key)


def pack(keys: Sequence[Key]) -> Keys:
    """``keys`` as an int64 array when all are ints that fit, else as a list."""
    ints = [k for k in keys if type(k) is int]
    if len(ints) == len(keys) and (not ints or _INT64[0] <= min(ints) <= max(ints) <= _INT64[1]):
        return np.fromiter(ints, dtype=np.int64, count=len(ints))
    return list(keys)


def unpack(keys: Keys) -> list[Key]:
    """Stored keys as Python ints and strs."""
    return keys.tolist() if isinstance(keys, np.ndarray) else list(keys)


def sort_keys(keys: Iterable[Any]) -> Keys:
    """The distinct keys of ``keys``, checked, in key order (``range``s and int arrays fast).

    Raises:
        TypeError: a key is not an int or a str.
    """
    if isinstance(keys, range):
        array = np.arange(keys.start, keys.stop, keys.step, dtype=np.int64)
        return np.unique(array)
    if isinstance(keys, np.ndarray) and keys.dtype.kind in "iu":
        return np.unique(keys.astype(np.int64, copy=False))
    checked = pack([check_key(k) for k in keys])
    if isinstance(checked, np.ndarray):
        return np.unique(checked)
    return sorted(set(checked), key=order_key)


def stored_mask(wanted: Keys, stored: Iterable[Keys]) -> np.ndarray:
    """Which keys of ``wanted`` (distinct, in key order) are among the ``stored`` keys."""
    batches = list(stored)
    if isinstance(wanted, np.ndarray):
        ints = [b if isinstance(b, np.ndarray) else _ints_of(b) for b in batches]
        done = np.concatenate(ints) if ints else np.empty(0, np.int64)
        return np.isin(wanted, done)
    seen: set[Key] = set()
    for batch in batches:
        seen.update(unpack(batch))
    return np.fromiter((k in seen for k in wanted), dtype=bool, count=len(wanted))


def _ints_of(keys: list[Key]) -> np.ndarray:
    """The int keys of a mixed list that fit int64 (only those can be in an int64 array)."""
    ints = [k for k in keys if type(k) is int and _INT64[0] <= k <= _INT64[1]]
    return np.asarray(ints, dtype=np.int64)


def digest(keys: Keys) -> str:
    """A digest of sorted keys, to find ranks that passed different ones."""
    if isinstance(keys, np.ndarray):
        return hashlib.blake2b(keys.tobytes(), digest_size=16).hexdigest()
    return hashlib.blake2b(repr(keys).encode(), digest_size=16).hexdigest()
