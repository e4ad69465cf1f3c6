"""Secrets never shown: every place a store URL appears hides passwords and secret
query parameters (``describe``, ``check``, ``gc``, errors, logs, ``str``/``repr``)."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import gatherstore as gs
from gatherstore.testing import services

SRC = str(Path(__file__).resolve().parents[1] / "src")
PW, QPW = "userinfo-pw-123", "query-pw-456"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of its own that needs a password; its URL carries it twice."""
    try:
        service = services.start_redis(workdir=str(tmp_path_factory.mktemp("redis")))
    except (RuntimeError, OSError) as exc:
        from gatherstore.testing.plugin import _unavailable

        _unavailable("redis-server", exc)
    with service:
        with redis.Redis.from_url(service.url) as client:
            client.config_set("requirepass", PW)
        parts = urllib.parse.urlsplit(service.url)
        yield urllib.parse.urlunsplit(
            parts._replace(netloc=f":{PW}@{parts.netloc}", query=f"password={PW}")
        )


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gatherstore.cli.main", *args],
        env={**os.environ, "PYTHONPATH": SRC, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _hidden(text: str) -> None:
    assert PW not in text and QPW not in text, text
    assert "***" in text, text


@pytest.mark.timeout(300)
def test_the_command_never_prints_a_secret(locked_redis: str) -> None:
    with_query = f"{locked_redis.split('?')[0]}?password={QPW}"
    described = _cli("describe", GATHERSTORE_STORE=with_query)
    assert described.returncode == 0, described.stderr
    _hidden(described.stdout)
    unreachable = f"redis://:{PW}@127.0.0.1:1/0?password={QPW}"
    check = _cli("check", "--store", unreachable, "--timeout", "10")
    assert check.returncode == 1
    _hidden(check.stderr)
    unknown = _cli("gc", "--store", f"nosuch://:{PW}@x/?token={QPW}", "--older-than", "1h")
    assert unknown.returncode == 2
    _hidden(unknown.stderr)
    store = gs.open_store(locked_redis)
    area = store.join_job(store.prepare_job("0123456789abcdef"))
    area.put("marker", b'{"job": "0123456789abcdef", "created": 0}')
    gc = _cli("gc", "--store", locked_redis, "--older-than", "1s")
    assert gc.returncode == 0, gc.stderr
    assert "removed 1 job area(s)" in gc.stdout
    _hidden(gc.stdout + gc.stderr)


def test_store_errors_str_and_repr_hide_secrets(locked_redis: str) -> None:
    store = gs.open_store(locked_redis, ttl=60)
    for text in (str(store), repr(store), str(store.scoped("a/b")), repr(store.scoped("a"))):
        _hidden(text)
    with pytest.raises(ValueError) as bad:
        gs.open_store(f"{locked_redis}&ttl=soon")
    assert PW not in str(bad.value)
    bad_urls = (f"file://x:{PW}@host/dir?token={QPW}", f"redis://u:{PW}@h:99999/0?password={QPW}")
    for url in bad_urls:
        with pytest.raises(ValueError) as info:
            gs.open_store(url)
        assert PW not in str(info.value) and QPW not in str(info.value)
    down = gs.open_store(f"redis://:{PW}@127.0.0.1:1/0?password={QPW}")
    with pytest.raises(gs.StoreUnavailableError) as unavailable:
        down.put("k", b"v")
    _hidden(str(unavailable.value) + unavailable.value.store)


def _logged_gather(url: str) -> str:
    """One rank: gather through ``url`` with the gatherstore logger at DEBUG; its log."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("gatherstore")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    assert gs.all_gather_object(gs.get_rank(), store=url, timeout=60) == [0, 1]
    try:
        down = f"redis://:{PW}@127.0.0.1:1/0?password={QPW}"
        gs.all_gather_object(gs.get_rank(), store=down, timeout=20)
    except gs.GatherError as exc:
        logger.exception("the gather failed: %s", exc)
    return out.getvalue()


@pytest.mark.timeout(180)
def test_logs_hide_secrets(locked_redis: str, gatherstore_run: Any) -> None:
    for log in gatherstore_run(_logged_gather, 2, locked_redis, timeout=120):
        _hidden(log)
