"""Errors whose hint fits the store: an unknown scheme, a missing GATHERSTORE_TMPDIR, a
Redis that needs a password, ``gatherstore check`` on a server, ``describe`` with an
unusable default store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import gatherstore as gs
from gatherstore.testing import services

PASSWORD = "hint-pw-7c1"
FORM = "redis://:PASSWORD@host:port/db (redis://USER:PASSWORD@host:port/db for an ACL user"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gatherstore", *args],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, **(env or {})},
    )


# --- an unknown scheme ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "closest"), [("reddis://h:6379/0", "redis"), ("tmpdri", "tmpdir"), ("zzz://x", None)]
)
def test_an_unknown_scheme_names_gatherstore_s_stores_and_the_closest(
    spec: str, closest: str | None
) -> None:
    for call in (gs.open_store, gs.set_default_store):
        with pytest.raises(ValueError) as caught:
            call(spec)
        message = str(caught.value)
        assert message.startswith(f"store {spec!r}: unknown store scheme {spec.split(':')[0]!r}")
        assert ("did you mean" in message) == (closest is not None)
        if closest:
            assert f"(did you mean {closest!r}?)" in message
        for store in ("tmpdir", "file:///", "redis://host:port/db", "s3://bucket/prefix"):
            assert store in message
        assert "dropbox" not in message and "webhdfs" not in message  # not fsspec's list
    result = run_cli("check", "--store", spec)
    assert result.returncode == 2
    assert "gatherstore's stores are tmpdir" in result.stderr


# --- GATHERSTORE_TMPDIR -------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_missing_gatherstore_tmpdir_says_create_it_or_unset_it(tmp_path: Path) -> None:
    base = tmp_path / "absent" / "gather"
    result = run_cli(
        "check", "--store", "tmpdir", "--nproc", "2", env={"GATHERSTORE_TMPDIR": str(base)}
    )
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert f"GATHERSTORE_TMPDIR={base} does not exist ({tmp_path / 'absent'} is missing)" in line
    assert "create it (`mkdir -m 700 -p" in line and "or unset the variable" in line
    assert "not private" not in line and "Another user" not in line
    assert not (tmp_path / "absent").exists()


def test_a_missing_tmpdir_base_in_the_url_says_create_it(tmp_path: Path) -> None:
    base = tmp_path / "absent" / "gather"
    result = run_cli("check", "--store", f"tmpdir://{base}")
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert f"the tmpdir base {base} does not exist" in line and "or name another base" in line
    assert not (tmp_path / "absent").exists()


def test_a_missing_last_folder_of_the_base_is_created_and_check_removes_it(
    tmp_path: Path,
) -> None:
    base = tmp_path / "gather"
    result = run_cli("check", "--store", f"tmpdir://{base}")
    assert result.returncode == 0, result.stderr
    assert f"created the missing folder {base} (removed after the check)" in result.stdout
    assert list(tmp_path.iterdir()) == []  # check leaves nothing it created


# --- Redis ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server that requires a password; its URL without one."""
    service = services.start_redis(workdir=str(tmp_path_factory.mktemp("redis")))
    with service:
        client = redis.Redis.from_url(service.url)
        client.config_set("requirepass", PASSWORD)
        client.close()
        yield service.url


def _put_error(url: str, **options: str) -> str:
    store = gs.open_store(url, socket_connect_timeout=5, **options)
    try:
        with pytest.raises(gs.StoreUnavailableError) as caught:
            store.put("k", b"v")
    finally:
        store.close()
    return str(caught.value)


def test_a_redis_that_needs_a_password_says_where_it_goes(locked_redis: str) -> None:
    message = _put_error(locked_redis)
    assert "the server requires a password and none was given; put it in the URL: " in message
    assert FORM in message
    assert "HELLO" not in message and "AUTH" not in message  # not Redis's own words


@pytest.mark.parametrize("user", ["", "someone"])
def test_a_refused_password_is_named_and_never_shown(locked_redis: str, user: str) -> None:
    url = locked_redis.replace("redis://", f"redis://{user}:wrong-{PASSWORD}@")
    message = _put_error(url)
    assert "the server refused the user name or password given; check them: " in message
    assert FORM in message
    assert f"wrong-{PASSWORD}" not in message
    message = _put_error(locked_redis, password=f"wrong-{PASSWORD}")  # as an option too
    assert "refused the user name or password" in message


@pytest.mark.timeout(120)
def test_check_on_a_redis_gives_redis_hints_not_a_folder_s(locked_redis: str) -> None:
    result = run_cli("check", "--store", locked_redis)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert "requires a password and none was given" in line and FORM in line
    assert "directory" not in line and "folder" not in line
    with_password = locked_redis.replace("redis://", f"redis://:{PASSWORD}@")
    result = run_cli("check", "--store", with_password)
    assert result.returncode == 0, result.stderr
    assert PASSWORD not in result.stdout + result.stderr


# --- describe --------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_describe_warns_of_an_unusable_default_store() -> None:
    result = run_cli("describe", env={"GATHERSTORE_STORE": "reddis://host:6379/0"})
    assert result.returncode == 0, result.stderr
    warning = "the default store GATHERSTORE_STORE=reddis://host:6379/0 is unusable: "
    assert f"gatherstore describe: warning: {warning}" in result.stderr
    assert "did you mean 'redis'" in result.stderr
    info = json.loads(result.stdout)
    assert info["default_store"] == "reddis://host:6379/0"
    assert info["warnings"][0].startswith(warning)
    result = run_cli("describe", env={"GATHERSTORE_STORE": f"redis://:{PASSWORD}@h:port/0"})
    assert "is unusable: the port 'port'" in result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    result = run_cli("describe", env={"GATHERSTORE_STORE": "redis://127.0.0.1:1/0"})
    assert result.stderr == "" and "warnings" not in json.loads(result.stdout)  # not connected
