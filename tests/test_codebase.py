"""The codebase's shape: the layers of pyproject.toml's import-linter contracts hold (no
module imports upward, no package's modules import each other in a cycle, counting
imports made inside functions and under TYPE_CHECKING); and, as backstops, no module
grows past 600 lines, no function past 80, no more than 12 modules stand directly in the
package, and only stores know the concrete store classes (the rest asks what a store can
do)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gatherstore"
MAX_LINES = 600
MAX_FUNCTION = 80
MAX_FLAT = 12
#: The concrete stores, known by name only inside ``gatherstore.stores``.
CONCRETE = {"FileStore", "TmpdirStore", "RedisStore", "FsspecStore", "MemoryStore"}


def _sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}


def test_the_layers_hold() -> None:
    """lint-imports with the contracts of pyproject.toml (grimp reads every import), in a
    process of its own: it configures logging, which this process's tests capture."""
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, "
        "no_cache=True, no_logo=True))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"cut these along their concepts: {long}"


def test_no_function_is_over_80_lines() -> None:
    long = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({n} lines)"
        for path, tree in _sources().items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION  # type: ignore[operator]
    ]
    assert long == [], f"split these into steps a reader can hold: {long}"


def test_few_modules_stand_directly_in_the_package() -> None:
    flat = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(flat) <= MAX_FLAT, f"put these in the package of their concept: {flat}"


def test_only_stores_know_the_concrete_stores() -> None:
    """Outside ``gatherstore.stores`` the code asks a store what it can do
    (``supports_handover``, ``shares_memory_with_host``, ``persistent``, ...)."""
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.id}"
        for path, tree in _sources().items()
        if "stores" not in path.relative_to(PACKAGE).parts[:1]
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and node.id in CONCRETE
    ]
    assert found == []
