"""Stand-in for ``vis4d.data.datasets.util``, which binds ``broadcast`` by name: rank 0 loads
dataset annotations once and shares them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vis4d.common.distributed import broadcast, get_rank


def load_on_rank_zero(load: Callable[[], Any]) -> Any:
    return broadcast(load() if get_rank() == 0 else None)
