"""The README's first example runs as written: a newcomer copies it into a file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_first_example_runs_verbatim(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    script = tmp_path / "evaluate.py"
    script.write_text(text[start : text.index("```", start)])
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=170, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "1000 predictions; first: {'id': 0, 'score': 0.0}" in result.stdout


def test_the_readme_gives_the_commands_ci_and_the_site_use() -> None:
    """The front page's test command is the one CI runs, and it says how to see the site."""
    readme = (ROOT / "README.md").read_text()
    assert "exec bash .ci/test" in (ROOT / ".ci" / "run").read_text()
    assert "\nbash .ci/test\n" in readme
    assert (
        "mkdocs serve" in readme and "mkdocs build --strict" in (ROOT / ".ci" / "test").read_text()
    )
