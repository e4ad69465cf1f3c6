"""Where the tests find an S3-compatible endpoint: its URL and credentials."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["S3Endpoint"]


@dataclass(frozen=True)
class S3Endpoint:
    """An S3-compatible endpoint and its credentials."""

    endpoint_url: str
    key: str
    secret: str

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` (fsspec storage options)."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url},
        }
