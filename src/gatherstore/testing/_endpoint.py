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

    def client(self, **options: Any) -> Any:
        """A botocore S3 client of the endpoint (``options``: more of
        ``create_client``'s, e.g. ``config``), to look at buckets as S3 itself shows them."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
            **options,
        )
