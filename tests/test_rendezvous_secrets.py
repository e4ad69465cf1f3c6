"""What rank 0 publishes on the launcher's rendezvous store holds no secret and no pickle,
and the launcher still sweeps a killed job's area with the credentials it holds itself."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

import gatherstore as gs
from gatherstore.testing.services import RedisService, start_redis

PASSWORD = "pw-never-published-7f3a"


@pytest.fixture
def redis_with_password() -> Iterator[RedisService]:
    """A redis-server of its own that requires ``PASSWORD``."""
    import redis

    try:
        service = start_redis()
    except RuntimeError as exc:
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            raise
        pytest.skip(str(exc))
    with service:
        with redis.Redis.from_url(service.url) as client:
            client.config_set("requirepass", PASSWORD)
        yield service


def _gather_then_die(out: str) -> None:
    """Gather through the default store, then die without cleaning up (rank 0 by SIGKILL,
    rank 1 by a SIGTERM handler of its own that exits at once): only the launcher sweeps."""
    rank = gs.get_rank()
    assert gs.all_gather_object(rank, timeout=30) == [0, 1]
    signal.signal(signal.SIGTERM, lambda *args: os._exit(9))
    if rank == 1:
        while True:
            time.sleep(1)
    # the launcher's store, as the launcher reads it (gs.launch's parent hosts it)
    launcher = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    count = int(launcher.add("gatherstore-areas", 0))
    raw = [launcher.get(f"gatherstore-areas/{n}") for n in range(1, count + 1)]
    Path(out, "published").write_bytes(b"\n".join(raw))
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_the_launcher_sweeps_a_killed_job_without_reading_secrets_from_the_store(
    redis_with_password: RedisService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    url = redis_with_password.url.replace("redis://", f"redis://:{PASSWORD}@")
    monkeypatch.setenv("GATHERSTORE_STORE", url + f"?password={PASSWORD}")
    monkeypatch.setenv("GATHERSTORE_AUTO_THRESHOLD", "0")
    with pytest.raises(gs.RemoteRankError, match="SIGKILL"):
        gs.launch(_gather_then_die, nproc_per_node=2, backend="gloo", args=(str(tmp_path),))
    published = (tmp_path / "published").read_bytes()
    assert published, "rank 0 published its area"
    assert PASSWORD.encode() not in published
    for line in published.splitlines():
        entry = json.loads(line)  # plain JSON, never a pickle
        assert entry["url"].startswith("redis://127.0.0.1:")
        assert entry["locator"].startswith("gatherstore/")
    with redis.Redis.from_url(url) as client:
        assert client.keys("*") == [], "the launcher swept the killed job's keys"
