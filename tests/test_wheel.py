"""The wheel is only the library: checked on a built wheel in a fresh virtual environment."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Run in the fresh environment: import, gather through tmpdir and Redis, report what is there.
_PROBE = """
import importlib.metadata, importlib.util, json, sys
import gatherstore as gs

def job(url):
    mine = {"rank": gs.get_rank(), "data": bytes(200_000)}
    via_tmpdir = gs.gather_object(mine, store="tmpdir")
    via_redis = gs.gather_object(mine, store=url)
    return None if via_tmpdir is None else [[p["rank"] for p in via_tmpdir],
                                            [p["rank"] for p in via_redis]]

if __name__ == "__main__":
    loaded = sorted(m for m in sys.modules if m.startswith("gatherstore"))
    out = {
        "gathered": gs.launch(job, nproc_per_node=2, backend="gloo", args=(sys.argv[1],))[0],
        "pytest11": [ep.name for ep in importlib.metadata.entry_points(group="pytest11")],
        "tqdm": importlib.util.find_spec("tqdm") is not None,
        "loaded_at_import": loaded,
    }
    try:
        import gatherstore.testing.services
        out["services"] = "importable"
    except ImportError as exc:
        out["services"] = str(exc)
    print(json.dumps(out))
"""


def _run(*command: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, cwd=cwd, check=False
    )
    assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", out, ROOT)  # fmt: skip
    (built,) = out.glob("gatherstore-*.whl")
    return built


@pytest.mark.timeout(300)
def test_wheel_holds_only_the_library(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
        (metadata,) = [n for n in names if n.endswith("METADATA")]
        entries = archive.read(entry_points).decode()
        requires = [
            line.split(":", 1)[1].strip()
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    assert "pytest11" not in entries, "the pytest plugin is opt-in"
    assert "[console_scripts]" in entries
    runtime = sorted(r.split(">")[0].split("=")[0] for r in requires if "extra ==" not in r)
    assert runtime == ["blake3", "cloudpickle", "fsspec", "numpy", "redis", "torch", "xxhash"]
    assert not [n for n in names if n.endswith(("services.py", "plugin.py"))
                and not n.startswith("gatherstore/testing/")]  # fmt: skip
    assert not any(n.startswith("tests/") for n in names)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fresh_environment_without_extras(
    wheel: Path, tmp_path: Path, gatherstore_redis_url: str
) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", "torch==2.13.0", wheel)
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    report = json.loads(_run(python, probe, gatherstore_redis_url, cwd=tmp_path))
    assert report["gathered"] == [[0, 1], [0, 1]]
    assert report["pytest11"] == [] and report["tqdm"] is False
    assert "gatherstore[testing]" in report["services"], "services need the testing extra"
    assert report["loaded_at_import"] == [
        "gatherstore",
        "gatherstore._config",
        "gatherstore._errors",
        "gatherstore._time",
        "gatherstore.stores",
        "gatherstore.stores._secrets",
        "gatherstore.stores.areas",
        "gatherstore.stores.backend",
        "gatherstore.stores.base",
        "gatherstore.stores.failures",
        "gatherstore.stores.layout",
        "gatherstore.stores.registry",
        "gatherstore.stores.waiting",
    ]
