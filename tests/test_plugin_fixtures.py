"""The README's plugin example, verbatim: a user's evaluation tested against a real Redis."""

from __future__ import annotations

from typing import Any

import pytest

import gatherstore as gs


def evaluate(store_url: str) -> Any:
    preds = [{"id": i * gs.get_world_size() + gs.get_rank()} for i in range(50)]
    return gs.collect_results(preds, size=100, store=store_url)


@pytest.mark.timeout(120)
def test_evaluation_gathers_through_redis(gatherstore_redis_url: str, gatherstore_run: Any) -> None:
    merged, nothing = gatherstore_run(evaluate, 2, gatherstore_redis_url)
    assert [p["id"] for p in merged] == list(range(100)) and nothing is None
