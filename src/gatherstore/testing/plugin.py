"""gatherstore's pytest plugin: real Redis and S3 services, and a multi-process runner.

Opt-in (``pip install 'gatherstore[testing]'``): load it with
``-p gatherstore.testing.plugin`` or ``pytest_plugins = ["gatherstore.testing.plugin"]``
in a conftest.py.  It imports nothing heavy until a fixture runs.

Its fixtures:

- ``gatherstore_redis_url`` (session scope): the URL in ``GATHERSTORE_TEST_REDIS_URL``,
  else that of a throwaway ``redis-server`` under pytest-redis's executor
  (``gatherstore.testing.services``).
- ``gatherstore_s3`` (session scope): an ``S3Endpoint`` for
  ``GATHERSTORE_TEST_S3_ENDPOINT`` (with ``GATHERSTORE_TEST_S3_KEY`` and
  ``GATHERSTORE_TEST_S3_SECRET``), else for a throwaway SeaweedFS.
- ``gatherstore_run`` (test scope): ``run(fn, nproc=2, *args, timeout=60, **kwargs)``
  runs ``fn`` in ``nproc`` gloo processes with ``gs.launch``.

A service that cannot start skips the tests that need it, except when the environment
variable ``CI`` is set (and not "0"/"false"): then they fail.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest

from gatherstore.testing._endpoint import S3Endpoint

__all__ = ["S3Endpoint", "gatherstore_redis_url", "gatherstore_run", "gatherstore_s3"]


def _unavailable(service: str, exc: Exception) -> NoReturn:
    message = f"{service} could not start: {exc}"
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{message}\n(CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(f"{message}\n(run stores/install, or set the GATHERSTORE_TEST_* variables)")


@pytest.fixture(scope="session")
def gatherstore_redis_url() -> Iterator[str]:
    """A ``redis://`` URL of a real Redis for the whole session."""
    url = os.environ.get("GATHERSTORE_TEST_REDIS_URL")
    if url:
        yield url
        return
    from gatherstore.testing.services import start_redis

    try:
        service = start_redis()
    except (RuntimeError, OSError) as exc:
        _unavailable("redis-server", exc)
    with service:
        yield service.url


@pytest.fixture(scope="session")
def gatherstore_s3() -> Iterator[S3Endpoint]:
    """A real S3-compatible endpoint (SigV4 credentials included) for the whole session."""
    from gatherstore.testing.services import start_s3

    endpoint = os.environ.get("GATHERSTORE_TEST_S3_ENDPOINT")
    if endpoint:
        key, secret = (os.environ.get(f"GATHERSTORE_TEST_S3_{name}") for name in ("KEY", "SECRET"))
        if not key or not secret:
            pytest.fail(
                "GATHERSTORE_TEST_S3_ENDPOINT is set: also export GATHERSTORE_TEST_S3_KEY and "
                "GATHERSTORE_TEST_S3_SECRET (that endpoint's credentials)",
                pytrace=False,
            )
        yield S3Endpoint(endpoint, key, secret)
        return
    try:
        service = start_s3()
    except (RuntimeError, OSError) as exc:
        _unavailable("SeaweedFS (S3)", exc)
    with service:
        yield S3Endpoint(service.endpoint_url, service.key, service.secret)


@pytest.fixture
def gatherstore_run() -> Callable[..., list[Any]]:
    """``run(fn, nproc=2, *args, timeout=60, **kwargs)``: ``fn``'s results, in rank order."""

    def run(
        fn: Callable[..., Any], nproc: int = 2, *args: Any, timeout: float = 60, **kwargs: Any
    ) -> list[Any]:
        import gatherstore

        return gatherstore.launch(
            fn, nproc_per_node=nproc, backend="gloo", args=args, kwargs=kwargs, timeout=timeout
        )

    return run
