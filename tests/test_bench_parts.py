"""``gatherstore bench --parts``: the destination's reader over every store, and the proxy
that gives a local S3 a remote round trip."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from gatherstore.cli import commands
from gatherstore.cli import main as _cli
from gatherstore.cli.bench import parts
from gatherstore.cli.bench.delay import DelayProxy
from gatherstore.routes.parts import BATCH_BYTES, PARTS_REQUESTED
from gatherstore.stores import Store, open_store
from gatherstore.testing.plugin import S3Endpoint


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(1 << 16):
            self.request.sendall(data)


@contextlib.contextmanager
def _echo_server() -> Iterator[str]:
    """A TCP echo server on loopback; its ``tcp://host:port``."""
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo) as server:
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"tcp://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()


def _receive(conn: socket.socket, nbytes: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < nbytes:
        chunk = conn.recv(nbytes - len(chunks))
        assert chunk, "the proxy closed the connection"
        chunks += chunk
    return bytes(chunks)


@pytest.mark.timeout(60)
def test_the_delay_proxy_holds_every_reply_and_keeps_its_bytes() -> None:
    delay = 0.05
    with _echo_server() as url, DelayProxy(url, delay) as proxy:
        address = urlsplit(proxy.url)
        assert address.scheme == "tcp" and address.port != urlsplit(url).port
        with socket.create_connection((address.hostname, address.port), timeout=10) as conn:
            for message in (b"ping", os.urandom(3 << 20)):  # one chunk; many, in order
                started = time.monotonic()
                conn.sendall(message)
                assert _receive(conn, len(message)) == message
                assert time.monotonic() - started >= delay  # a lower bound, not a speed
        process = proxy._process
    assert proxy._process is None and process is not None and process.poll() is not None


def test_the_delay_proxy_needs_a_host_and_port() -> None:
    with pytest.raises(ValueError, match="needs a URL with a host and a port"):
        DelayProxy("http://127.0.0.1", 0.01)


def test_s3_latency_is_given_in_milliseconds_with_parts() -> None:
    args = _cli._parser().parse_args(["bench", "--parts", "9", "--s3-latency", "20"])
    assert args.parts == 9 and args.s3_latency == pytest.approx(0.02)
    with pytest.raises(ValueError, match="--s3-latency goes with --parts W"):
        commands._bench(_cli._parser().parse_args(["bench", "--s3-latency", "20ms"]))


@pytest.mark.timeout(300)
def test_the_parts_bench_reads_every_store_with_both_readers(
    gatherstore_redis_url: str, gatherstore_s3: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every part comes back, in rank order, and is deleted (``read_back`` checks both);
    S3 is read once directly and once through the proxy; its bucket is removed."""
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setenv("GATHERSTORE_TEST_S3_KEY", gatherstore_s3.key)
    monkeypatch.setenv("GATHERSTORE_TEST_S3_SECRET", gatherstore_s3.secret)
    out = io.StringIO()
    code = parts.main(
        40,
        4 << 10,
        repeats=1,
        out=out,
        redis=gatherstore_redis_url,
        s3=gatherstore_s3.endpoint_url,
        s3_latency=0.002,
    )
    assert code == 0
    rows = [line.split(" | ") for line in out.getvalue().splitlines() if line.startswith("| gs.")]
    stores = [*parts.STORES, "gs.s3 +2 ms"]
    assert [row[0].lstrip("| ") for row in rows] == [s for s in stores for _ in parts.WINDOWS]
    assert [row[1] for row in rows] == list(parts.WINDOWS) * len(stores)
    assert "note:" not in out.getvalue()
    fs = s3fs.S3FileSystem(**gatherstore_s3.storage_options, skip_instance_cache=True)
    assert not [b for b in fs.ls("") if "gatherstore-bench-" in b]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("part_bytes", "requests"),
    [(64 << 10, [16, 16, 1]), (5 << 20, [1, 1, 1, 1])],
    ids=["small parts in batches", "large parts one per request"],
)
def test_the_reader_batches_small_parts_and_hands_large_ones_over_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part_bytes: int, requests: list[int]
) -> None:
    """Small parts share requests (their latency overlaps); a batch is handed over whole,
    so a part of more than ``BATCH_BYTES`` comes alone, to be unpickled while the next
    is read."""
    assert 5 << 20 > BATCH_BYTES > 16 * (64 << 10)
    seen: list[int] = []
    get_many = Store.get_many

    def counted(self: Store, keys: list[str]) -> Any:
        seen.append(len(keys))
        return get_many(self, keys)

    monkeypatch.setattr(Store, "get_many", counted)  # the job's store is another object
    with open_store(f"file://{tmp_path}") as store:
        parts.read_back(store, sum(requests) + 1, part_bytes, PARTS_REQUESTED, None)  # + dst
    assert seen == requests
