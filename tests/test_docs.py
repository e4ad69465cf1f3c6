"""Every Python block of the documentation site runs, and its shell commands parse.

The site also stays true to the code: every GATHERSTORE_* variable in src/ is on the
settings page, every public exception has a row (meaning, remedy, attributes) in the
errors table, every path of the repository a page cites exists, and every public
function's docstring (the API reference) lists what it raises.

The ```python blocks of a page (``docs/**/*.md``) run in order, in one fresh folder per
page, each in a subprocess with a timeout: a block that launches processes or talks to
Redis or S3 does so for real.  An HTML comment on the line before a block says how to
run it (several options may be combined)::

    <!-- docs-test: OPTION ... -->

- no comment: ``python block.py``, which must exit 0;
- ``file=NAME``: the block is not run but written to NAME in the page's folder (a
  module or a ``conftest.py`` that the page's later blocks use); it must compile;
- ``pytest``: the block is a test module, run by pytest in the page's folder (so a
  ``file=conftest.py`` block before it applies); it must pass;
- ``torchrun=N``: run under ``torchrun --nproc_per_node N`` instead of python;
- ``expect="TEXT"``: TEXT must appear in what the block prints (stdout or stderr).

Blocks name services by placeholders, replaced before they run:
``redis://localhost:6379/0`` by the URL of the ``gatherstore_redis_url`` fixture;
``s3://eval-results/`` by a fresh bucket of the ``gatherstore_s3`` endpoint, whose
credentials and endpoint the block finds in ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` and ``AWS_ENDPOINT_URL``; ``file:///nfs/scratch/gather`` by
a folder inside the page's.  Blocks run without the variables of a launcher (RANK,
MASTER_PORT, ...) or of gatherstore (GATHERSTORE_*), as in a fresh shell; a page whose
test module uses the ``gatherstore_redis_url`` fixture gets the session's server in
``GATHERSTORE_TEST_REDIS_URL``.

```bash blocks are not run; each ``gatherstore COMMAND ...`` in them is parsed by the
command's own argument parser, and its flags, like those of every ``gatherstore
COMMAND`` in inline code (the command tables), must be that command's flags, spelled
out (argparse would take an abbreviation).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import inspect
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gatherstore.cli import main as _cli
from gatherstore.cli.bench.clients import fresh_bucket

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
BLOCK_TIMEOUT = 300  # seconds for one block (a launch of several processes under load)

_FENCE = re.compile(
    r"(?:^<!-- docs-test:(?P<options>[^\n]*?)-->\n)?"
    r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```$",
    re.MULTILINE | re.DOTALL,
)
#: A docs-test comment not right before a ```python fence (it would be ignored).
_STRAY = re.compile(r"^<!-- docs-test:[^\n]*-->\n(?!```python\n)", re.MULTILINE)
_OPTIONS = {"file", "pytest", "torchrun", "expect"}
REDIS = "redis://localhost:6379/0"
S3_BUCKET = "s3://eval-results/"
SHARED_DIR = "file:///nfs/scratch/gather"
#: What a launcher or gatherstore's settings would put in a block's environment.
_LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Block:
    """One fenced block of a page."""

    page: Path
    line: int
    lang: str
    body: str
    options: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, with its docs-test options."""
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start("lang")) + 1
        options: dict[str, str] = {}
        for word in shlex.split(match.group("options") or ""):
            name, _, value = word.partition("=")
            options[name] = value
        body = textwrap.dedent(match.group("body"))
        found.append(Block(page, line, match.group("lang"), body, options))
    return found


def _python_pages() -> list[Path]:
    return [page for page in PAGES if any(b.lang == "python" for b in blocks(page))]


def test_every_marker_is_known_and_precedes_a_python_block() -> None:
    problems = []
    for page in PAGES:
        for stray in _STRAY.finditer(page.read_text()):
            problems.append(f"{page}: {stray.group()!r} is not right before a ```python fence")
        for block in blocks(page):
            unknown = set(block.options) - _OPTIONS
            if unknown:
                problems.append(f"{block}: unknown docs-test options {sorted(unknown)}")
            if block.options and block.lang != "python":
                problems.append(f"{block}: docs-test options on a {block.lang or 'plain'} block")
    assert problems == []
    assert len(_python_pages()) >= 10  # the guides have examples


def _environment(page_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER and not k.startswith("GATHER")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["HOME"] = str(page_dir)  # nothing a block writes lands outside its folder
    return env


def _command(block: Block, path: Path) -> list[str]:
    if "pytest" in block.options:
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path.name]
    if "torchrun" in block.options:
        n = block.options["torchrun"]
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", path.name]
    return [sys.executable, path.name]


def _run(block: Block, page_dir: Path, env: dict[str, str], number: int) -> None:
    """Run one block in ``page_dir`` (or write it there, for ``file=``)."""
    if "file" in block.options:
        target = page_dir / block.options["file"]
        target.write_text(block.body)
        compile(block.body, str(block), "exec")  # a syntax error names the block
        return
    prefix = "test_" if "pytest" in block.options else ""
    path = page_dir / f"{prefix}block{number}_line{block.line}.py"
    path.write_text(block.body)
    result = subprocess.run(
        _command(block, path),
        cwd=page_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{block} failed:\n{output[-4000:]}"
    expected = block.options.get("expect")
    assert expected is None or expected in output, f"{block} did not print {expected!r}:\n{output}"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("page", _python_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_python_blocks_run(page: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    text = page.read_text()
    env = _environment(tmp_path)
    replace: dict[str, str] = {SHARED_DIR: f"file://{tmp_path}/shared"}
    with contextlib.ExitStack() as stack:
        if REDIS in text:
            replace[REDIS] = request.getfixturevalue("gatherstore_redis_url")
        if S3_BUCKET in text:
            endpoint = request.getfixturevalue("gatherstore_s3")
            bucket = stack.enter_context(fresh_bucket(endpoint.storage_options, "docs"))
            replace[S3_BUCKET] = f"s3://{bucket}/"
            env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = endpoint.key, endpoint.secret
            env["AWS_ENDPOINT_URL"] = endpoint.endpoint_url
        if "gatherstore_redis_url" in text:  # a test module's fixture: the same server
            env["GATHERSTORE_TEST_REDIS_URL"] = request.getfixturevalue("gatherstore_redis_url")
        for number, block in enumerate(b for b in blocks(page) if b.lang == "python"):
            for placeholder, real in replace.items():
                block.body = block.body.replace(placeholder, real)
            _run(block, tmp_path, env, number)


# --- shell commands --------------------------------------------------------------------------
def _subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _gatherstore_commands(text: str) -> Iterator[str]:
    """Each ``gatherstore ...`` command line of a shell block's text (continuations joined,
    up to the end of its line, a ``;``, ``&&``, ``|`` or ``#``)."""
    for line in text.replace("\\\n", " ").splitlines():
        for match in re.finditer(r"(?:^|[\s;&|])gatherstore\s+([^;&|#]*)", line):
            yield match.group(1).strip()


def _check_parses(where: str, command: str) -> list[str]:
    parsers = _subcommands()
    argv = shlex.split(command)
    if not argv or argv[0] not in parsers:
        return [f"{where}: `gatherstore {command}`: no command {argv[:1]}"]
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            parsers[argv[0]].parse_args(argv[1:])
    except SystemExit:
        return [f"{where}: `gatherstore {command}` does not parse"]
    return []


def _check_flags(where: str, span: str) -> list[str]:
    parsers = _subcommands()
    match = re.match(r"gatherstore\s+(\w+)(.*)", span)
    if match is None:
        return []
    name, rest = match.groups()
    if name not in parsers:
        return [f"{where}: `{span}`: gatherstore has no command {name!r}"]
    known = {flag for action in parsers[name]._actions for flag in action.option_strings}
    flags = re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)
    return [
        f"{where}: `{span}`: {flag} is not a flag of {name}" for flag in flags if flag not in known
    ]


def test_gatherstore_commands_in_the_docs_parse() -> None:
    problems = []
    checked = 0
    for page in [*PAGES, ROOT / "README.md"]:
        text = page.read_text()
        for block in blocks(page):
            if block.lang in ("bash", "sh", "console"):
                for command in _gatherstore_commands(block.body):
                    if command and not command.startswith(("--help", "-h", "--version")):
                        problems += _check_parses(str(block), command)
                        problems += _check_flags(str(block), f"gatherstore {command}")
                        checked += 1
        prose = _FENCE.sub("", text)
        for span in re.findall(r"`(gatherstore [^`]+)`", prose):
            problems += _check_flags(str(page.relative_to(ROOT)), span)
            checked += 1
    assert problems == []
    assert checked >= 10


def test_repository_paths_the_docs_name_exist() -> None:
    """Test modules, stand-ins and scripts the pages cite (`tests/...`, `stores/...`, `.ci/...`)
    are in the repository: a renamed test leaves no stale reference."""
    cited = set()
    for page in [*PAGES, ROOT / "README.md"]:
        cited |= set(
            re.findall(r"(?<![\w/.(])((?:tests|stores|\.ci)/[\w./*-]*\w)", page.read_text())
        )
    assert len(cited) >= 10
    assert sorted(path for path in cited if not any(ROOT.glob(path))) == []


def test_the_repository_has_one_address() -> None:
    """pyproject.toml's Repository URL is the site's repo_url and what the install
    commands of the getting-started page clone and pip-install."""
    declared = re.search(
        r'^Repository = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE
    )
    assert declared is not None
    url = declared.group(1)
    assert f"\nrepo_url: {url}\n" in (ROOT / "mkdocs.yml").read_text()
    page = (DOCS / "getting-started.md").read_text()
    assert f"git clone {url} " in page and f"@ git+{url}'" in page
    assert sorted(set(re.findall(r"https://github\.com/[\w./-]*\w", page))) == [url]


# --- settings ---------------------------------------------------------------------------------
_VARIABLE = re.compile(r"\bGATHERSTORE_[A-Z0-9_]*[A-Z0-9]\b")


def _settings_table() -> str:
    """_config's docstring, the table of the library's settings, read from its source."""
    source = (ROOT / "src" / "gatherstore" / "_config.py").read_text()
    return ast.get_docstring(ast.parse(source), clean=False) or ""


def _settings_page() -> str:
    """The settings page as the site shows it: its text, with _config's docstring where
    the page renders it."""
    text = (DOCS / "settings.md").read_text()
    assert "::: gatherstore._config" in text, "the settings page renders _config's table"
    return text.replace("::: gatherstore._config", _settings_table())


def test_every_environment_variable_is_on_the_settings_page() -> None:
    """Every GATHERSTORE_* name in src/ (what os.environ is asked for, and what error
    messages and docstrings tell users to set) is on the settings page; every variable of
    _config's table is read by the library."""
    table = _settings_table()
    read: dict[str, set[str]] = {}
    for source in (ROOT / "src" / "gatherstore").rglob("*.py"):
        code = source.read_text()
        if source.name == "_config.py":  # its docstring is the table itself
            code = code.replace(table, "")
        for name in _VARIABLE.findall(code):
            read.setdefault(name, set()).add(str(source.relative_to(ROOT)))
    page = _settings_page()
    missing = {name: sorted(where) for name, where in read.items() if f"`{name}`" not in page}
    assert missing == {}, "add these to _config's table or the settings page"
    listed = set(_VARIABLE.findall(table))
    assert listed - set(read) == set(), "_config's table lists variables nothing reads"
    assert {"GATHERSTORE_STORE", "GATHERSTORE_TIMEOUT", "GATHERSTORE_TEST_REDIS_URL"} <= set(read)


# --- errors -----------------------------------------------------------------------------------
#: A section of a Google-style docstring, and a name it documents.
_SECTION = re.compile(r"^(\w+):\n((?:(?: {4}.*)?\n)+)", re.MULTILINE)
_ENTRY = re.compile(r"^ {4}(\*{0,2}\w+)(?: \(.*\))?:", re.MULTILINE)


def _sections(obj: object) -> dict[str, str]:
    """The sections of ``obj``'s docstring by title, each section's lines indented."""
    doc = inspect.getdoc(obj) or ""
    return {m.group(1): m.group(2) for m in _SECTION.finditer(doc + "\n")}


def _attributes(cls: type) -> list[str]:
    """The names under ``Attributes:`` in ``cls``'s docstring."""
    return _ENTRY.findall(_sections(cls).get("Attributes", ""))


def test_every_public_exception_is_in_the_errors_table() -> None:
    """Each exception of gatherstore and gatherstore.stores has a row on the guarantees page
    (what it means, what to do) that names every attribute its docstring lists."""
    import gatherstore as gs
    from gatherstore import stores

    rows = {
        match.group(1).rsplit(".", 1)[-1]: match.group(0)
        for match in re.finditer(
            r"^\| `([\w.]+)` \|.*$", (DOCS / "guarantees.md").read_text(), re.M
        )
    }
    errors = {
        getattr(module, name)
        for module in (gs, stores)
        for name in module.__all__
        if isinstance(getattr(module, name), type)
        and issubclass(getattr(module, name), BaseException)
    }
    assert len(errors) >= 10
    problems = []
    for error in sorted(errors, key=lambda e: e.__name__):
        row = rows.get(error.__name__)
        if row is None:
            problems.append(f"{error.__name__}: no row")
            continue
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if len(cells) != 5 or not all(cells[1:4]):
            problems.append(f"{error.__name__}: a row needs its builtin, meaning and remedy")
        elif not issubclass(error, getattr(builtins, cells[1].strip("`"), ())):
            problems.append(f"{error.__name__} is not a {cells[1]}")
        problems += [
            f"{error.__name__}: attribute .{name} is not in its row"
            for name in _attributes(error)
            if f"`.{name}`" not in row
        ]
    assert problems == []


# --- API reference ----------------------------------------------------------------------------
#: Public functions that raise nothing of their own, and why (all the others list ``Raises:``).
NEVER_RAISE = {
    "backend": "reads the process group's backend, or None",
    "get_rank": "reads the process group, or answers 0",
    "get_world_size": "reads the process group, or answers 1",
    "is_distributed": "whether a process group exists",
    "is_main_process": "compares get_rank() with 0",
    "rank_zero_only": "a decorator: the function it wraps raises its own errors, on rank 0",
}


def test_every_public_function_lists_what_it_raises() -> None:
    """The API reference states each function's errors: a ``Raises:`` section, or an entry in
    NEVER_RAISE whose function has no ``raise`` of its own; every error a section names is a
    builtin or gatherstore's."""
    import ast

    import gatherstore as gs

    functions = {
        name: getattr(gs, name) for name in gs.__all__ if inspect.isfunction(getattr(gs, name))
    }
    assert len(functions) >= 30
    problems = []
    for name, fn in sorted(functions.items()):
        doc = inspect.getdoc(fn) or ""
        if name in NEVER_RAISE:
            raises = [
                n
                for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn))))
                if isinstance(n, ast.Raise)
            ]
            if raises or "Raises:" in doc:
                problems.append(f"{name} is in NEVER_RAISE but raises")
            continue
        section = doc.partition("\nRaises:\n")[2]
        if not section:
            problems.append(f"{name}: no Raises: section")
        for line in section.splitlines():
            names = re.match(r"\s{4}([A-Z]\w*(?: / [A-Z]\w*)*):", line)
            for error in names.group(1).split(" / ") if names else ():
                known = getattr(builtins, error, None) or getattr(gs, error, None)
                if not (isinstance(known, type) and issubclass(known, BaseException)):
                    problems.append(f"{name}: Raises: {error} is not an exception")
    assert problems == []
    assert set(NEVER_RAISE) <= set(functions)


#: Public names whose docstrings do not yet meet the standard below, with what they lack.
UNFINISHED: dict[str, str] = {}


def _lacks(name: str, obj: object) -> list[str]:
    """What the docstring of ``obj`` lacks: its parameters under ``Args:`` and what it
    returns under ``Returns:`` (or ``Yields:``); or what it has that ``help()`` and
    editors would show raw: mkdocs link markup."""
    problems = []
    # a link's target is a dotted name; ``obj['results'][2]`` is an index
    if re.search(r"\]\[[A-Za-z_][\w.]*\]", inspect.getdoc(obj) or ""):
        problems.append(f"{name}: mkdocs link markup")
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return problems  # raised by gatherstore, not made by callers: see its Attributes
    sections = _sections(obj)
    signature = inspect.signature(obj)
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    listed = set(_ENTRY.findall(sections.get("Args", "")))
    problems += [
        f"{name}: parameter {stars.get(p.kind, '')}{p.name} is not under Args"
        for p in signature.parameters.values()
        if p.name != "self" and f"{stars.get(p.kind, '')}{p.name}" not in listed
    ]
    returns = signature.return_annotation
    if (
        inspect.isroutine(obj)
        and returns not in (None, "None", inspect.Signature.empty)
        and not {"Returns", "Yields"} & set(sections)
    ):
        problems.append(f"{name}: no Returns section")
    return problems


def _example_lacks(name: str, obj: object) -> list[str]:
    """An ``Examples:`` section of ``>>>`` lines that compile, or what is wrong with it."""
    lines = textwrap.dedent(_sections(obj).get("Examples", "")).splitlines()
    code = "\n".join(line[4:] for line in lines if line.startswith((">>>", "...")))
    if not code:
        return [f"{name}: no Examples section of >>> lines"]
    try:
        compile(code, f"{name} example", "exec")
    except SyntaxError as exc:
        return [f"{name}: its example does not compile: {exc}"]
    return []


def test_the_reference_documents_every_parameter_and_gives_an_example() -> None:
    """Each public name of ``gatherstore`` documents its parameters and what it returns
    and shows an example; so do the methods of ``Store`` and ``ResultSet``, but the
    example.  The docstrings read the same in ``help()``, an editor and on the site."""
    import gatherstore as gs

    problems = []
    for name in sorted(set(gs.__all__) - {"__version__"}):
        obj = getattr(gs, name)
        found = _lacks(name, obj) + _example_lacks(name, obj)
        if name in UNFINISHED:
            assert found, f"{name} meets the standard now: remove it from UNFINISHED"
        else:
            problems += found
    for cls in (gs.Store, gs.ResultSet):
        for name in vars(cls) if cls.__name__ not in UNFINISHED else ():
            method = getattr(cls, name)
            if not name.startswith("_") and inspect.isroutine(method):
                problems += _lacks(f"{cls.__name__}.{name}", method)
    assert problems == []
