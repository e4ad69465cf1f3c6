"""The plugin example of docs/testing.md: a user's evaluation tested against a real Redis.

This is the page's example with type annotations, run in the suite's own session;
``test_docs`` and ``test_services`` run the page's text itself, and
:func:`test_this_is_the_documented_example` keeps the two the same.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

import gatherstore as gs

PAGE = Path(__file__).resolve().parents[1] / "docs" / "testing.md"


def evaluate(store_url: str) -> Any:
    preds = [{"id": i * gs.get_world_size() + gs.get_rank()} for i in range(50)]
    return gs.collect_results(preds, size=100, store=store_url)


@pytest.mark.timeout(120)
def test_evaluation_gathers_through_redis(gatherstore_redis_url: str, gatherstore_run: Any) -> None:
    merged, nothing = gatherstore_run(evaluate, 2, gatherstore_redis_url)
    assert [p["id"] for p in merged] == list(range(100)) and nothing is None


def _functions(source: str) -> dict[str, str]:
    """The functions of ``source`` without annotations or decorators, as AST dumps."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            node.returns, node.decorator_list = None, []
            for arg in node.args.args:
                arg.annotation = None
            found[node.name] = ast.dump(node)
    return found


def test_this_is_the_documented_example() -> None:
    blocks = [block.split("```")[0] for block in PAGE.read_text().split("```python\n")[1:]]
    documented = next(block for block in blocks if "def test_evaluation_gathers" in block)
    mine = _functions(Path(__file__).read_text())
    page = _functions(documented)
    assert set(page) == {"evaluate", "test_evaluation_gathers_through_redis"}
    assert {name: mine[name] for name in page} == page
