"""Secrets kept out of what gatherstore shows and publishes, one pure function each: a
store URL shown (passwords and secret query parameters hidden), any text shown, and what
rank 0 publishes of a store on the launcher's rendezvous store (no credentials).  Where
URLs are shown, through the commands and the errors: test_secrets.py."""

from __future__ import annotations

import json

import gatherstore as gs
from gatherstore.job.published import public_spec
from gatherstore.stores.base import hide_password, hide_secrets

PW, QPW = "userinfo-pw-123", "query-pw-456"


def test_hide_password_covers_userinfo_query_and_fragment() -> None:
    cases = {
        f"redis://alice:{PW}@host:6379/0?password={QPW}&ttl=60": (
            "redis://alice:***@host:6379/0?password=***&ttl=60"
        ),
        f"rediss://:{PW}@host/0": "rediss://:***@host/0",
        f"unix:///run/redis.sock?db=1&password={QPW}": "unix:///run/redis.sock?db=1&password=***",
        f"s3://bucket/x?key=AKIA&secret={QPW}&session_token=t&region=eu": (
            "s3://bucket/x?key=***&secret=***&session_token=***&region=eu"
        ),
        f"az://c/p?sv=2020&sig={QPW}#access_token={PW}": "az://c/p?sv=2020&sig=***#access_token=***",
        f"redis://u:{PW}@[::1/0": "redis://u:***@[::1/0",  # malformed: still hidden
        "redis://user@host/0?key_prefix=jobs/": "redis://user@host/0?key_prefix=jobs/",
    }
    for url, shown in cases.items():
        assert hide_password(url) == shown
    text = f"Error connecting to redis://:{PW}@h:1/0 (see https://x/?token={QPW})"
    assert PW not in hide_secrets(text) and QPW not in hide_secrets(text)


def test_public_specs_carry_no_credentials() -> None:
    store = gs.open_store(
        "s3://bucket/prefix",
        key="AKIDEXAMPLE",
        secret="wJalrXUtnFEMI",
        token="session-token",
        client_kwargs={"endpoint_url": "http://127.0.0.1:8333", "aws_secret_access_key": "x"},
        config_kwargs={"retries": {"max_attempts": 2}},
    )
    spec = public_spec(store)
    assert spec == {
        "url": "s3://bucket/prefix",
        "options": {
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"},
            "config_kwargs": {"retries": {"max_attempts": 2}},
        },
    }
    redis_store = gs.open_store("redis://user:secret@host:6379/0?password=secret&db=0")
    text = json.dumps(public_spec(redis_store))
    assert "secret" not in text and "user@host:6379" in text
