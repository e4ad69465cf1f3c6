"""What the bench compares: gatherstore over every reachable store, and the usual tools."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatherstore.cli.bench.baselines import mmengine_collect_results_cpu
from gatherstore.stores.registry import open_store

__all__ = ["BASELINE", "TORCHMETRICS", "Case", "reachable", "select"]

#: The case every other one is compared with (time and memory ratios).
BASELINE = "torch.all_gather_object"
#: How to give the bench a service it skipped.
_HOW = "--{}, its GATHERSTORE_TEST_* variable, or --services to start one here"
#: The op of the torchmetrics cases (see ``metrics``).
TORCHMETRICS = "torchmetrics"


@dataclass
class Case:
    """One way to gather: ``op`` names the call; gatherstore's calls go through ``store``."""

    name: str
    op: str  # gather_object | gather_iter | all_gather_object | torch_gather_object | mmengine
    store: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    impl: str = ""
    #: whose ceiling bounds it: "shm", "redis", "s3" (see ``clients``) or none
    service: str = ""
    #: runs only when a ``--cases`` pattern names it (not a gather of the payloads)
    opt_in: bool = False


def _disk_base() -> str:
    return "/var/tmp" if os.access("/var/tmp", os.W_OK) else tempfile.gettempdir()


def _baselines() -> list[Case]:
    impl = mmengine_collect_results_cpu()[1]
    return [
        Case(BASELINE, "all_gather_object", impl="torch.distributed (gloo)"),
        Case("torch.gather_object", "torch_gather_object", impl="torch.distributed (gloo)"),
        Case("mmengine.collect_results_cpu", "mmengine", impl=impl),
    ]


def _torchmetrics() -> list[Case]:
    """MeanAveragePrecision's sync and compute three ways (opt-in: ``--cases 'torchmetrics.*'``)."""
    ways: list[tuple[str, bool, int | None, str]] = [
        ("", False, None, "torchmetrics"),
        ("-gs", True, None, "patch()"),
        ("-gs-on0", True, 0, "patch(compute_on=0)"),
    ]
    return [
        Case(
            f"torchmetrics.map{suffix}",
            TORCHMETRICS,
            options={"patched": patched, "compute_on": on},
            impl=impl,
            opt_in=True,
        )
        for suffix, patched, on, impl in ways
    ]


def _local(workdir: Path) -> list[Case]:
    cases = [Case("gs.collective", "gather_object", "collective")]
    if os.access("/dev/shm", os.W_OK):
        shm = "tmpdir:///dev/shm"
        # `tmpdir` as gatherstore picks it: parts handed over in RAM on one machine
        cases.append(Case("gs.tmpdir", "gather_object", "tmpdir", service="shm"))
        cases.append(Case("gs.tmpdir-shm", "gather_object", shm, service="shm"))
        cases.append(Case("gs.iter-tmpdir-shm", "gather_iter", shm, service="shm"))
    cases.append(Case("gs.tmpdir-disk", "gather_object", f"tmpdir://{_disk_base()}"))
    file_dir = workdir / "file-store"
    file_dir.mkdir()
    cases.append(Case("gs.file", "gather_object", f"file://{file_dir}"))
    return cases


def _s3_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for ``endpoint``, credentials from ``GATHERSTORE_TEST_S3_KEY``/``_SECRET``.

    Raises:
        KeyError: the credentials are not set.
    """
    return {
        "key": os.environ["GATHERSTORE_TEST_S3_KEY"],
        "secret": os.environ["GATHERSTORE_TEST_S3_SECRET"],
        "client_kwargs": {"endpoint_url": endpoint},
    }


def _remote(
    stack: contextlib.ExitStack,
    redis: dict[str, str | None],
    s3: str | None,
    notes: list[str],
) -> list[Case]:
    """Redis (``redis``: case name to URL) and S3 cases; a store that cannot be opened
    becomes a note."""
    cases = []
    for name, url in redis.items():
        if not url:
            continue
        try:
            open_store(url).close()
            cases.append(Case(name, "gather_object", url, service="redis"))
        except Exception as exc:
            notes.append(f"{name} skipped: {type(exc).__name__}: {exc}")
    if s3:
        try:
            import fsspec

            options = _s3_options(s3)
            bucket = f"gatherstore-bench-{uuid.uuid4().hex[:12]}"
            fs = fsspec.filesystem("s3", **options)
            fs.mkdir(bucket)
            stack.callback(fs.rm, bucket, recursive=True)
            url = f"s3://{bucket}/parts"
            open_store(url, **options).close()
            cases.append(Case("gs.s3", "gather_object", url, options, service="s3"))
        except Exception as exc:
            notes.append(f"gs.s3 skipped: {type(exc).__name__}: {exc}")
    return cases


def _start_services(stack: contextlib.ExitStack, notes: list[str]) -> tuple[str | None, str | None]:
    """Start redis-server and SeaweedFS on loopback (stopped when ``stack`` closes)."""
    from gatherstore.testing.services import RedisService, S3Service, start_redis, start_s3

    urls: list[str | None] = []
    starts: list[tuple[str, Callable[[], RedisService | S3Service]]] = [
        ("redis", start_redis),
        ("s3", start_s3),
    ]
    for name, start in starts:
        try:
            service = start()
            stack.callback(service.stop)
            urls.append(service.url)
            for variable, value in service.environ.items():  # e.g. the S3 credentials
                stack.callback(os.environ.pop, variable, None)
                os.environ[variable] = value
        except (RuntimeError, OSError) as exc:
            notes.append(f"{name} service not started: {str(exc).splitlines()[0]}")
            urls.append(None)
    return urls[0], urls[1]


@contextlib.contextmanager
def reachable(
    redis: str | None = None, s3: str | None = None, services: bool = False
) -> Iterator[tuple[list[Case], list[str], Path]]:
    """Every case this machine can run, notes on those it cannot, and a scratch directory.

    Redis and S3 come from the arguments, else ``GATHERSTORE_TEST_REDIS_URL`` /
    ``GATHERSTORE_TEST_S3_ENDPOINT``, else (with ``services``) fresh local servers.
    ``gs.redis-unix`` runs over the same Redis's unix socket when it is known:
    ``GATHERSTORE_TEST_REDIS_UNIX_URL``, which a started server sets, unless ``redis``
    names another server.
    """
    named = redis is not None
    redis = redis or os.environ.get("GATHERSTORE_TEST_REDIS_URL")
    s3 = s3 or os.environ.get("GATHERSTORE_TEST_S3_ENDPOINT")
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=_disk_base())))
        if services and not (redis and s3):
            started = _start_services(stack, notes)
            redis, s3 = redis or started[0], s3 or started[1]
        unix = None if named else os.environ.get("GATHERSTORE_TEST_REDIS_UNIX_URL")
        if not redis and not services:
            notes.append(f"gs.redis skipped: no Redis given ({_HOW.format('redis URL')})")
        if not s3 and not services:
            notes.append(f"gs.s3 skipped: no S3 endpoint given ({_HOW.format('s3 ENDPOINT')})")
        remote = _remote(stack, {"gs.redis": redis, "gs.redis-unix": unix}, s3, notes)
        cases = _baselines() + _local(workdir) + remote + _torchmetrics()
        yield cases, notes, workdir


def select(cases: list[Case], patterns: list[str] | None) -> list[Case]:
    """The cases whose name matches one of the glob ``patterns`` (without patterns, all
    but the opt-in ones).

    Raises:
        ValueError: a pattern matches no case.
    """
    if not patterns:
        return [c for c in cases if not c.opt_in]
    names = [c.name for c in cases]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise ValueError(f"--cases {pattern!r} matches no case; cases: {', '.join(names)}")
    return [c for c in cases if any(fnmatch.fnmatch(c.name, p) for p in patterns)]
