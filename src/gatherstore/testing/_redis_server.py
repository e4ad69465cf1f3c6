"""A throwaway ``redis-server`` for the tests, under pytest-redis's executor."""

from __future__ import annotations

import atexit
import contextlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import redis
from mirakuru.exceptions import AlreadyRunning
from pytest_redis.executor import RedisExecutor

from gatherstore.testing._process import ATTEMPTS, HOST, STARTUP_TIMEOUT, free_ports

__all__ = ["RedisService", "start_redis"]


class RedisService:
    """A ``redis-server`` on ``host`` (127.0.0.1) without persistence; ``.url`` is
    ``redis://…/0``, ``.unix_url`` the same server over its unix socket."""

    name = "redis-server"

    def __init__(self, executor: RedisExecutor, directory: Path) -> None:
        self.executor, self.directory = executor, directory
        self.host, self.port = str(executor.host), int(executor.port)
        self.url = f"redis://{self.host}:{self.port}/0"
        self.unix_url = f"unix://{executor.unixsocket}"
        assert executor.process is not None, "start the executor first"
        #: The server process (its ``pid`` is what tests freeze or kill).
        self.process: subprocess.Popen[bytes] = executor.process
        atexit.register(self.stop)

    @property
    def environ(self) -> dict[str, str]:
        """The environment variables that point gatherstore's test fixtures here."""
        return {
            "GATHERSTORE_TEST_REDIS_URL": self.url,
            "GATHERSTORE_TEST_REDIS_UNIX_URL": self.unix_url,
        }

    def log_tail(self, limit: int = 3000) -> str:
        """The end of the server's log."""
        log = self.directory / f"redis-server.{self.port}.log"
        return log.read_bytes()[-limit:].decode(errors="replace") if log.exists() else ""

    def stop(self) -> None:
        """Stop the server (SIGKILL if it ignores SIGTERM) and remove its directory."""
        atexit.unregister(self.stop)
        with contextlib.suppress(Exception):
            self.executor.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_redis(
    *, port: int | None = None, host: str = HOST, workdir: str | None = None
) -> RedisService:
    """Start a throwaway ``redis-server`` on ``port`` (default: a free one) of ``host``,
    the address it binds (default 127.0.0.1; another host's address to serve other machines).

    Raises:
        RuntimeError: ``redis-server`` is missing, exits, or does not answer in time.
    """
    executable = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin")
    if executable is None:
        raise RuntimeError(
            "redis-server is not on PATH nor in /usr/bin; run stores/install "
            "or `apt-get install redis-server`"
        )
    last: BaseException | None = None
    for _ in range(1 if port else ATTEMPTS):
        directory = Path(tempfile.mkdtemp(prefix="gatherstore-", dir=workdir))
        executor = RedisExecutor(
            executable,
            databases=16,
            redis_timeout=0,  # never drop idle clients
            loglevel="warning",
            host=host,
            port=port or free_ports(1, host)[0],
            startup_timeout=int(STARTUP_TIMEOUT),
            datadir=directory,
        )
        try:
            executor.start()
        except AlreadyRunning as exc:  # another server took the port in between
            last = exc
            shutil.rmtree(directory, ignore_errors=True)
            continue
        except Exception as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise RuntimeError(f"redis-server did not start: {exc}") from exc
        service = RedisService(executor, directory)
        # over the server's unix socket: protected mode refuses non-loopback clients
        with contextlib.closing(redis.Redis(unix_socket_path=executor.unixsocket)) as client:
            client.config_set("save", "")  # no snapshots: the data is thrown away
            if host != HOST:  # protected mode refuses clients from other addresses
                client.config_set("protected-mode", "no")
        return service
    raise RuntimeError(f"redis-server could not get a free port: {last}")
