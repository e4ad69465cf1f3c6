"""A server process for the tests: started in its own session and folder, stopped for good.

``Service`` runs a server in its own process group and private folder,
waits until it answers real requests, and on stop terminates it (killing the
group after a grace period) and removes the folder; ``start`` retries
with fresh ports when the server exits at startup (a port taken in between).
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["ATTEMPTS", "HOST", "STARTUP_TIMEOUT", "Service", "free_ports", "start"]

HOST = "127.0.0.1"
STARTUP_TIMEOUT = 120.0
ATTEMPTS = 3  # starts with fresh ports when a server exits at startup


def free_ports(count: int = 1, host: str = HOST) -> list[int]:
    """Distinct ports on ``host`` (loopback by default) the kernel hands out for port 0."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


_S = TypeVar("_S", bound="Service")


class Service(abc.ABC):
    """A server process in its own session, owning a private directory removed on stop."""

    name = "server"
    grace = 5.0  # seconds between SIGTERM and SIGKILL
    url: str

    def __init__(self, argv: list[str], directory: Path, env: dict[str, str] | None = None):
        self.directory = directory
        self._log = directory / "server.log"
        self.last_error: object = None
        with self._log.open("wb") as log:
            self.process = subprocess.Popen(
                argv,
                cwd=directory,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        atexit.register(self.stop)

    @abc.abstractmethod
    def probe(self) -> bool:
        """True once the server answers real requests."""

    @property
    @abc.abstractmethod
    def environ(self) -> dict[str, str]:
        """The environment variables that point gatherstore's test fixtures here."""

    def log_tail(self, limit: int = 3000) -> str:
        try:
            with self._log.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - limit))
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def _wait_ready(self) -> bool:
        """True when ready, False when the server exited. Raises RuntimeError on timeout."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while self.process.poll() is None:
            if self.probe():
                return True
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name} did not become ready within {STARTUP_TIMEOUT:.0f} s "
                    f"(last probe error: {self.last_error!r}); its log ends with:\n"
                    + self.log_tail()
                )
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        """Terminate, kill the process group after a grace period, remove the directory."""
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start(make: Callable[[Path], _S], workdir: str | None, attempts: int) -> _S:
    """Start in a fresh directory under ``workdir`` and wait until ready; retry with fresh
    ports when the server exits early (a port taken in between)."""
    code, tail = None, ""
    for _ in range(attempts):
        directory = Path(tempfile.mkdtemp(prefix="gatherstore-", dir=workdir))
        try:
            service = make(directory)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        try:
            if service._wait_ready():
                return service
        except BaseException:
            service.stop()
            raise
        code, tail = service.process.returncode, service.log_tail()
        service.stop()
    raise RuntimeError(
        f"{service.name} exited at startup with code {code}; its log ends with:\n{tail}"
    )
