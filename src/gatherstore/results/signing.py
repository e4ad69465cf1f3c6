"""The signing key of a result set: one that outlives the job, never stored anywhere.

A job's session key is random and lives as long as the job; a result set is
read by later jobs, so its key comes from the user: the ``key=`` argument,
else the file ``GATHERSTORE_RESULTS_KEY_FILE`` names, else the text of
``GATHERSTORE_RESULTS_KEY``.  With a key every chunk is signed (keyed BLAKE3
over the chunk and where it belongs); without one, chunks carry an XXH3-128 checksum,
which finds damage but not forgery.  The set records which of the two it is
in its signed (or checksummed) metadata, so a set written with one key and
opened with another, or with none, is refused before any chunk is read.
"""

from __future__ import annotations

from gatherstore import _config as config

__all__ = ["MIN_KEY", "resolve"]

#: Shortest key accepted, in bytes.
MIN_KEY = 16


def resolve(key: bytes | str | None) -> bytes | None:
    """The key in force: ``key`` (a str is UTF-8), else the settings, else None.

    Raises:
        ValueError: a key shorter than ``MIN_KEY`` bytes, a key of another type, or
            an unreadable key file; the message never shows the key.
    """
    if key is None:
        found = config.results_key()
        where = "GATHERSTORE_RESULTS_KEY(_FILE)"
    elif isinstance(key, (bytes, bytearray, memoryview)):
        found, where = bytes(key), "key="
    elif isinstance(key, str):
        found, where = key.encode(), "key="
    else:
        raise ValueError(f"key= takes bytes or a str, not {type(key).__name__}")
    if found is not None and len(found) < MIN_KEY:
        raise ValueError(
            f"the result set signing key from {where} has {len(found)} bytes, fewer than "
            f"{MIN_KEY}: use a long random one, e.g. the output of `openssl rand -hex 32`"
        )
    return found
