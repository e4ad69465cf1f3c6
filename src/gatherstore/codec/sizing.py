"""How much memory rebuilding an object will take on the rank that unpickles it.

The memory check must count what unpickling allocates, not the pickled bytes: a
list of small dicts takes several times its pickled size once rebuilt.  The
sender holds the very object the reader will rebuild, so it measures it: the
size of each Python object (``sys.getsizeof``, which counts the object's
header and its garbage-collector link), walked through containers and
instance dicts, with large containers sampled (their elements at evenly
spaced positions, scaled up to the whole) so that the cost stays bounded
whatever the object's size.  Objects reached twice count once, as the
unpickler shares them too (but numbers, which pickle writes by value, count at
every place).  Arrays and CPU tensors large enough to travel
out of band, or packed into columns (a run of records, a list of small arrays), come back as
views of the part's buffer: only their headers count (the part itself is
counted by the route's memory need).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from gatherstore.codec import records

__all__ = ["rebuilt_size"]

#: Elements of a container measured one by one; larger ones are sampled.
_SAMPLE = 24
#: Objects measured at most per estimate (the work stays bounded).
_BUDGET = 20_000
#: Bytes of a tensor object and its storage wrapper, without the data.
_TENSOR_HEADER = 400
#: What the process really grows by per byte counted: the allocator's size classes and
#: arenas, and the unpickler's memo and stack (measured 1.1-1.5x on lists of dicts,
#: strings, numbers and nested lists, in fresh processes).
_OVERHEAD = 1.5
_UNSHARED = (type(None), bool, int, float, complex)
_ATOMS = (str, bytes, bytearray)


def rebuilt_size(obj: Any, out_of_band_min: int = 4096) -> int:
    """Estimated bytes the unpickler allocates to rebuild ``obj``.

    Arrays and tensors of at least ``out_of_band_min`` bytes count their headers
    only (they become views of the received part).
    """
    walk = _Walk(out_of_band_min)
    return int(walk.size(obj, _BUDGET) * _OVERHEAD)


class _Walk:
    """One estimate: the objects already counted, and the out-of-band threshold."""

    def __init__(self, out_of_band_min: int) -> None:
        self.seen: set[int] = set()
        self.out_of_band_min = out_of_band_min
        self.columnar = False  # inside a list of records (see _records.pack)

    def size(self, obj: Any, budget: float) -> float:
        """Bytes of ``obj`` and what it holds, measuring at most about ``budget`` objects."""
        kind = type(obj)
        if kind in _UNSHARED:  # pickle writes these by value: each place gets its own
            small = obj is None or kind is bool or (kind is int and -5 <= obj <= 256)
            return 0.0 if small else float(sys.getsizeof(obj))
        if id(obj) in self.seen:
            return 0.0
        self.seen.add(id(obj))
        if kind in _ATOMS:
            return float(sys.getsizeof(obj))
        if kind is np.ndarray:
            return self._array(obj, budget)
        if isinstance(obj, torch.Tensor):
            data = obj.element_size() * obj.nelement()
            in_band = data < self.out_of_band_min and not self.columnar
            return _TENSOR_HEADER + (data if in_band else 0)
        if isinstance(obj, (list, tuple, set, frozenset, dict)):
            return sys.getsizeof(obj) + self._container(obj, budget)
        total = float(sys.getsizeof(obj))
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict) and budget > 1:
            total += self.size(state, budget - 1)
        for name in getattr(kind, "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name) and budget > 1:
                total += self.size(getattr(obj, name), budget / 4)
        return total

    def _container(self, obj: Any, budget: float) -> float:
        """What a container holds; a list of records or a long dict of them is packed,
        and its arrays become views (see ``gatherstore.codec.records.pack``)."""
        inside = self.columnar
        self.columnar = inside or (type(obj) in (list, dict) and records.columnar(obj))
        try:
            if isinstance(obj, dict):
                return self._elements(list(obj.items()), budget, pairs=True)
            return self._elements(obj if type(obj) is list else list(obj), budget)
        finally:
            self.columnar = inside

    def _array(self, array: np.ndarray[Any, Any], budget: float) -> float:
        header = float(sys.getsizeof(np.empty(0, array.dtype)))
        if array.dtype.hasobject:  # a container of Python objects: its elements count
            return header + 8 * array.size + self._elements(list(array.ravel()), budget)
        in_band = array.nbytes < self.out_of_band_min and not self.columnar
        return header + (array.nbytes if in_band else 0)

    def _elements(self, items: list[Any], budget: float, *, pairs: bool = False) -> float:
        """What ``items`` hold (a dict's: its (key, value) ``pairs``): every one, or an
        evenly spaced sample scaled to all."""
        count = len(items)
        if count == 0 or budget <= 1:
            return 0.0
        picked = items if count <= _SAMPLE else items[:: max(count // _SAMPLE, 1)][:_SAMPLE]
        share = (budget - 1) / (len(picked) * (2 if pairs else 1))
        if pairs:
            measured = sum(self.size(k, share) + self.size(v, share) for k, v in picked)
        else:
            measured = sum(self.size(item, share) for item in picked)
        return measured * count / len(picked)
