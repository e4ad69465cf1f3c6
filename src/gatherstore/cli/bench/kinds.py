"""The names of the bench's payload kinds, apart from ``payloads`` (which needs torch) so
that the command's parser names and checks them in milliseconds."""

from __future__ import annotations

__all__ = ["KINDS", "ON_REQUEST"]

KINDS = ("detections", "keyed", "tensors", "records", "logits", "cuda-records", "coco")
#: Kinds made only when asked for: millions of small dicts take a while to make and pickle.
ON_REQUEST = ("coco",)
