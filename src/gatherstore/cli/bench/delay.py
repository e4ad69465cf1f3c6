"""A TCP proxy that holds every reply for a fixed time: a remote round trip for a local server.

A SeaweedFS on loopback answers in about a millisecond, so it hides what a real
region's round trip costs a reader that waits for each part in turn.
``gatherstore bench --parts W --s3-latency MS`` reads S3 through this proxy as
well: each chunk the server sends is forwarded ``MS`` after it arrived, in
order, so every request/reply exchange takes at least ``MS`` longer, as it does
across a network.  The proxy runs in a process of its own, so that its work does
not share the measured reader's interpreter.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from urllib.parse import urlsplit, urlunsplit

__all__ = ["DelayProxy"]

_CHUNK = 1 << 16


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it arrived."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        try:
            while data := await reader.read(_CHUNK):
                await queue.put((time.monotonic() + delay, data))
        finally:  # at the end, or a reset connection: send() stops too
            await queue.put((time.monotonic() + delay, b""))

    async def send() -> None:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if not data:
                return
            writer.write(data)
            await writer.drain()

    await asyncio.gather(receive(), send(), return_exceptions=True)
    writer.close()


async def _serve(host: str, port: int, delay: float) -> None:
    async def connect(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(host, port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pump(client_r, server_w, 0.0), _pump(server_r, client_w, delay))

    server = await asyncio.start_server(connect, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)  # the port, for DelayProxy
    async with server:
        await server.serve_forever()


class DelayProxy:
    """``with DelayProxy("http://127.0.0.1:8333", 0.02) as proxy:`` ``proxy.url`` is the same
    server, with every reply held 20 ms longer."""

    def __init__(self, upstream: str, delay: float) -> None:
        parts = urlsplit(upstream)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"DelayProxy needs a URL with a host and a port, not {upstream!r}")
        self._upstream, self._host, self._port = parts, parts.hostname, parts.port
        self.delay = delay
        self._process: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> DelayProxy:
        command = [sys.executable, "-m", __name__, self._host, str(self._port), repr(self.delay)]
        self._process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self._process.stdout is not None
        port = self._process.stdout.readline().strip()
        if not port.isdigit():
            why = self._stop().strip().splitlines() or [port or "it printed no port"]
            raise RuntimeError(f"the delay proxy did not start: {why[-1]}")
        self.url = urlunsplit(self._upstream._replace(netloc=f"127.0.0.1:{port}"))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop()

    def _stop(self) -> str:
        """End the proxy's process; what it wrote to stderr."""
        process, self._process = self._process, None
        if process is None:
            return ""
        process.terminate()
        return process.communicate(timeout=10)[1]


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
