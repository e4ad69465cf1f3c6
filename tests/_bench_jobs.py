"""What test_bench.py runs in a fresh process (this module imports no client library)."""

from __future__ import annotations


def hiredis_in_use() -> bool:
    """In a fresh process: hide hiredis as the bench's ``redis_default`` ceiling does,
    then say whether redis-py still found it."""
    from gatherstore.cli.bench import clients

    clients._hide_hiredis()
    import redis.utils

    return bool(redis.utils.HIREDIS_AVAILABLE)
