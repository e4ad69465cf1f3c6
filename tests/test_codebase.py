"""The codebase's shape: the layers of pyproject.toml's import-linter contracts hold (no
module imports upward, no package's modules import each other in a cycle, counting
imports made inside functions and under TYPE_CHECKING); and, as backstops, no module
grows past 600 lines, no function past 80, no more than 12 modules stand directly in the
package, only stores know the concrete store classes (the rest asks what a store can
do), and only the unit tests of pure pieces import private modules (the rest of the tests
goes through the public API)."""

from __future__ import annotations

import ast
import re
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


# --- the tests' seam ------------------------------------------------------------------------------
TESTS = ROOT / "tests"
#: What a test may import: the package, its public subpackages, the command's entry point
#: (pyproject.toml's ``[project.scripts]``); never a private module (a part named ``_...``).
PUBLIC = {"gatherstore", "gatherstore.stores", "gatherstore.cli.main"}
PUBLIC_TREES = {"gatherstore.testing", "gatherstore.compat"}
#: The bench's instruments, which tests use to measure or to make room and change nothing
#: of gatherstore: (module, name).
INSTRUMENTS = {
    ("gatherstore.cli.bench.measure", "PeakMemory"),  # a block's peak RSS growth
    ("gatherstore.cli.bench.clients", "fresh_bucket"),  # an S3 bucket, removed after
    ("gatherstore.cli.bench.metrics", "counted"),  # the collectives a block calls
}
#: The test modules that may import private modules: each is the unit test of one piece
#: that has no API of its own, named here with that piece.
UNIT_TESTS = {
    "_bench_jobs.py": "the bench's Redis clients, set up in a fresh process (test_bench.py)",
    "test_bench.py": "the bench: payloads, cases, runner, report, clients (cli.bench)",
    "test_bench_parts.py": "the bench's --parts reader and the batches it reads (routes.parts)",
    "test_chunks.py": "the codec: a long list encoded in chunks, rebuilt in order",
    "test_control_scale.py": "the control exchange (job.exchange, job.control)",
    "test_culprit.py": "the codec: the part of an object that cannot be pickled",
    "test_mappings.py": "this host's mappings and memory (host.mappings, host.memory)",
    "test_memfd.py": "the handover's memfds and socket, in one process (routes.handover)",
    "test_multihost.py": "the bench's two hosts and their bench (cli.bench.hosts, hostbench)",
    "test_plan.py": "the plan table: a call's route from what ranks agreed, the window",
    "test_progress.py": "a long gather's progress (routes.progress)",
    "test_public_api.py": "the package's table of public names, against the modules it names",
    "test_redaction.py": "secrets kept out of what is shown and published (pure functions)",
    "test_resultset_layout.py": "a result set's key order, names, flushes, merge, export columns",
    "test_serialize.py": "the codec: frames, records, digests, signatures, sizes",
    "test_services.py": "the test services' start-up (gatherstore.testing's SeaweedFS)",
    "test_settings.py": "the settings read from the environment, and timeouts (_config)",
    "test_slurm.py": "SLURM's variables and node lists (job.slurm)",
    "test_storage.py": "the codec: storage spans, records, the pinned staging of CUDA tensors",
    "test_store_cloud.py": "one store: fsspec's cloud filesystems, against emulators",
    "test_store_file.py": "one store: file://, tmpdir, fsspec's file and memory; writes",
    "test_store_redis.py": "one store: redis://, and its protocol client",
    "test_store_s3.py": "one store: s3:// through fsspec, and its request options",
    "test_wording.py": "the words of messages: counts, ranks, seconds, sizes, durations",
}
#: ``from gatherstore.x import y`` or ``import gatherstore.x`` in code that a test runs in
#: another process (``python -c``, a script it writes).
_IMPORT_IN_TEXT = re.compile(
    r"(?:^|;)\s*(?:from\s+(gatherstore[\w.]*)\s+import\s+(\w+)|import\s+(gatherstore[\w.]*))",
    re.MULTILINE,
)


def _named(module: str, name: str) -> tuple[str, str | None]:
    """What ``from module import name`` imports: the module ``module.name``, or the name
    ``name`` of ``module``."""
    path = PACKAGE.parent.joinpath(*module.split("."), name)
    if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
        return f"{module}.{name}", None
    return module, name


def _imports(tree: ast.Module) -> set[tuple[str, str | None]]:
    """(module, name or None) of every gatherstore import in ``tree``, in its code and in
    the code it writes out for other processes."""
    found: set[tuple[str, str | None]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(alias.name, None) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {_named(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for module, name, whole in _IMPORT_IN_TEXT.findall(node.value):
                found.add(_named(module, name) if module else (whole, None))
    return {(module, name) for module, name in found if module.split(".")[0] == "gatherstore"}


def _is_public(module: str, name: str | None) -> bool:
    """Whether a test may import ``name`` of ``module`` (None: the module itself)."""
    parts = module.split(".")
    if (module, name) in INSTRUMENTS:
        return True
    if any(part.startswith("_") for part in parts):
        return False
    return module in PUBLIC or ".".join(parts[:2]) in PUBLIC_TREES


def _private_imports() -> dict[str, list[str]]:
    """Each module of the tests (helpers too) that imports private modules, with those."""
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        imports = _imports(ast.parse(path.read_text()))
        private = sorted({module for module, name in imports if not _is_public(module, name)})
        if private:
            found[str(path.relative_to(TESTS))] = private
    return found


def test_tests_go_through_the_public_api() -> None:
    """Behaviour is tested as a user reaches it (``gatherstore``, ``gatherstore.stores``,
    ``gatherstore.testing``, ``gatherstore.compat``, the command); a private module is
    imported only by the unit test of its piece, listed in ``UNIT_TESTS``."""
    found = _private_imports()
    strays = {name: modules for name, modules in found.items() if name not in UNIT_TESTS}
    assert strays == {}, (
        "these tests import private modules: test the behaviour through the public API "
        "(gatherstore, its settings GATHERSTORE_*, store URLs, the command), or put the unit "
        f"test of one pure piece in a module of its own and add it to UNIT_TESTS: {strays}"
    )
    assert sorted(set(UNIT_TESTS) - set(found)) == [], "these import no private module now"
