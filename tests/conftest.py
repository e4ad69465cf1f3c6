"""The project's own tests load gatherstore's opt-in pytest plugin (real Redis and S3)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

# the conformance suite's asserts explain their failures, as a test module's do
pytest.register_assert_rewrite("gatherstore.testing")

pytest_plugins = ["gatherstore.testing.plugin"]

OTHER_USER = "gatherstore-other"


@dataclass(frozen=True)
class OtherUser:
    """A second local user, for tests of what another user on the machine can do."""

    name: str
    uid: int
    gid: int

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as this user (a real process with its uid, gid and no other groups)."""
        return subprocess.run(
            list(argv),
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )


def _forbidden(why: str) -> pytest.skip.Exception:
    """Skip where the machine forbids a second user; fail under CI (which runs as root)."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{why} (CI is set, so this fails instead of skipping)", pytrace=False)
    return pytest.skip.Exception(why)


@pytest.fixture(scope="session")
def other_user() -> OtherUser:
    """Another local user (created with useradd when missing; needs root)."""
    try:
        entry = pwd.getpwnam(OTHER_USER)
    except KeyError:
        if os.geteuid() != 0 or shutil.which("useradd") is None:
            raise _forbidden("another user is needed: run as root (with useradd)") from None
        subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(OTHER_USER)
    if os.geteuid() != 0:
        raise _forbidden("acting as another user needs root")
    return OtherUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


def empty_redis_db(server_url: str, db: int) -> Iterator[str]:
    """The URL of database ``db`` of the Redis at ``server_url``, emptied before and after
    the test (a fixture's body: ``yield from empty_redis_db(url, 9)``)."""
    import redis

    url = urllib.parse.urlunsplit(urllib.parse.urlsplit(server_url)._replace(path=f"/{db}"))
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    yield url
    with redis.Redis.from_url(url) as client:
        client.flushdb()
