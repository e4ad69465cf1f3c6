"""The codebase's shape: no module imports one that imports it back, even through others;
and, as a backstop, no module grows past 600 lines (one concept decides where a module
ends, not a count: a module this long holds more than one)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The library modules ``name`` imports at module level (not inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parts, node.module] if node.module else parts)
            if node.level == 0:
                base = node.module or ""
            named = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            found |= named or {base}
    return (found & modules.keys()) - {name}


def test_no_module_is_over_600_lines() -> None:
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"cut these along their concepts: {long}"


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        seen = set()
        while stack:
            name, trail = stack.pop()
            for nxt in graph[name]:
                if nxt == start:
                    cycles.append(" -> ".join([*trail, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert cycles == []
