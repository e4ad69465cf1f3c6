"""Headless Chromium driven through chromedriver's W3C WebDriver HTTP API (no client
library): open a page, run a script in it, read what it returns.

Debian's ``chromium`` and ``chromium-driver`` packages provide both programs; .ci/test
installs them.  Outside CI a machine without them skips the tests that need them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

#: Flags that keep a headless Chromium quiet and self-contained (no network of its own).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _programs() -> tuple[str, str]:
    """Chromium and chromedriver, or a skip (a failure in CI) naming what is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        missing = "chromium" if chromium is None else "chromedriver"
        reason = f"{missing} not found: apt-get install chromium chromium-driver (.ci/test does)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return chromium, driver


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Browser:
    """One WebDriver session of headless Chromium."""

    def __init__(self, port: int, session: str) -> None:
        self._base = f"http://127.0.0.1:{port}/session/{session}"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return _request(method, self._base + path, body)

    def open(self, url: str) -> None:
        self._call("POST", "/url", {"url": url})

    def run(self, script: str, *args: Any) -> Any:
        """The value ``script`` (a function body) returns, JSON-converted."""
        return self._call("POST", "/execute/sync", {"script": script, "args": list(args)})


def _request(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.load(reply)["value"]
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"WebDriver {method} {url}: {exc.read().decode()[:2000]}") from None


@contextlib.contextmanager
def chromium(width: int = 1280, height: int = 900) -> Iterator[Browser]:
    """A headless Chromium window of ``width`` x ``height`` CSS pixels, with a fresh
    profile; everything is stopped and removed afterwards."""
    binary, driver = _programs()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="gatherstore-chromium-") as profile:
        process = subprocess.Popen(
            [driver, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            _wait_ready(port, process)
            options = {
                "binary": binary,
                "args": [*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"],
            }
            capabilities = {"alwaysMatch": {"goog:chromeOptions": options}}
            created = _request(
                "POST", f"http://127.0.0.1:{port}/session", {"capabilities": capabilities}
            )
            session = created["sessionId"]
            try:
                yield Browser(port, session)
            finally:
                _request("DELETE", f"http://127.0.0.1:{port}/session/{session}")
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"chromedriver exited with code {process.returncode}")
        try:
            if _request("GET", f"http://127.0.0.1:{port}/status").get("ready"):
                return
        except (OSError, RuntimeError):
            pass
        time.sleep(0.1)
    raise RuntimeError("chromedriver did not become ready within 30 s")
