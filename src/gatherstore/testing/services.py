"""Real Redis and S3 (SeaweedFS) servers on free loopback ports, for tests, CI and the bench.

Redis runs under pytest-redis's executor (readiness, teardown:
``_redis_server``); SeaweedFS, which no fixture library starts, under
gatherstore's own supervisor (``_seaweedfs``, ``_process``).  Each S3 server
gets fresh random credentials.  ``python -m gatherstore.testing.services redis|s3 [--host ADDR]``
starts one, prints its variables as ``export`` lines on stderr, then its URL on one
line on stdout, and runs until SIGTERM or SIGINT.

Needs the ``testing`` extra: ``pip install 'gatherstore[testing]'``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from gatherstore.testing._process import HOST, STARTUP_TIMEOUT, free_ports
from gatherstore.testing._seaweedfs import S3Service, start_s3

try:  # redis-py, pytest-redis and mirakuru
    from gatherstore.testing._redis_server import RedisService, start_redis
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        f"gatherstore.testing.services needs {exc.name}: pip install 'gatherstore[testing]'"
    ) from exc

__all__ = [
    "HOST",
    "STARTUP_TIMEOUT",
    "RedisService",
    "S3Service",
    "free_ports",
    "main",
    "start_redis",
    "start_s3",
]


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
