"""Synthetic payloads, deterministic per (seed, rank): detector predictions and tensors.

``detections`` mimics an object detector's evaluation output after a
DistributedSampler split: rank r holds images r, r+W, r+2W, ... of a dataset
padded to a multiple of W (the padding repeats the first images), one dict per
image with 100 boxes; ``keyed`` holds the same dicts in one dict keyed by image
id, as evaluators that index their results by image keep them.  ``tensors`` is
a dict of four large float32 tensors.
``records`` is a list of tensor-heavy records, ``{"id", "scores": <4 MiB
tensor>, "boxes": scores.view(-1, 4)[:, 1:3]}`` (``boxes`` a view of
``scores``' storage), and ``cuda-records`` the same records on the GPU (on
``cuda:<rank % GPUs>``).  ``logits`` is a list of one float32 tensor of 1000
class scores per sample, as a classifier's evaluation loop collects them.
``coco`` is COCO's result format, one plain dict per detected box
(``{"image_id", "category_id", "bbox": [x, y, w, h], "score"}``), as detectron2's
COCOEvaluator gathers them: made only when asked for (millions of small dicts).
All are sized so that all ranks together hold about the requested bytes
(counting each storage once; ``coco``: the bytes pickle writes).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

from gatherstore.cli.bench.kinds import KINDS, ON_REQUEST

__all__ = [
    "BOXES",
    "IMAGE_BYTES",
    "KINDS",
    "detections",
    "digest",
    "available",
    "coco",
    "cuda_device",
    "defaults",
    "image_count",
    "keyed",
    "logits",
    "make",
    "records",
    "shard",
    "tensors",
]

BOXES = 100
#: Array bytes of one image: boxes float32 (100, 4), scores float32 (100,), labels int64 (100,).
IMAGE_BYTES = BOXES * 4 * 4 + BOXES * 4 + BOXES * 8
_TENSORS = 4
#: Bytes of one record's ``scores`` in ``records``.
RECORD_BYTES = 4 << 20
#: Classes of one sample's scores in ``logits``.
CLASSES = 1000
#: Bytes pickle writes for one box of ``coco``.
COCO_BYTES = 66


def image_count(nbytes: int) -> int:
    """How many images make about ``nbytes`` of predictions (at least one)."""
    return max(1, nbytes // IMAGE_BYTES)


def shard(n_images: int, rank: int, world: int) -> range:
    """The padded dataset positions DistributedSampler gives ``rank`` (image = position % n)."""
    padded = -(-n_images // world) * world
    return range(rank, padded, world)


def detections(n_images: int, rank: int, world: int, seed: int = 0) -> list[dict[str, Any]]:
    """This rank's predictions: ``image_id``, ``boxes``, ``scores``, ``labels``, ``file_name``."""
    positions = shard(n_images, rank, world)
    count = len(positions)
    rng = np.random.default_rng([seed, rank])
    corner = rng.random((count, BOXES, 2), dtype=np.float32) * 640
    extent = rng.random((count, BOXES, 2), dtype=np.float32) * 128 + 1
    boxes = np.concatenate([corner, corner + extent], axis=2)
    scores = -np.sort(-rng.random((count, BOXES), dtype=np.float32), axis=1)
    labels = rng.integers(0, 80, (count, BOXES), dtype=np.int64)
    out = []
    for k, position in enumerate(positions):
        image_id = position % n_images
        out.append(
            {
                "image_id": image_id,
                "boxes": boxes[k],
                "scores": scores[k],
                "labels": labels[k],
                "file_name": f"val/{image_id:012d}.jpg",
            }
        )
    return out


def keyed(n_images: int, rank: int, world: int, seed: int = 0) -> dict[int, dict[str, Any]]:
    """This rank's :func:`detections`, keyed by image id (a rank never holds one twice)."""
    return {image["image_id"]: image for image in detections(n_images, rank, world, seed)}


def digest(image: dict[str, Any]) -> int:
    """CRC-32 of one prediction: its image id, arrays and file name."""
    crc = zlib.crc32(str(image["image_id"]).encode())
    for name in ("boxes", "scores", "labels"):
        crc = zlib.crc32(np.ascontiguousarray(image[name]).data, crc)
    return zlib.crc32(image["file_name"].encode(), crc)


def tensors(nbytes: int, rank: int, world: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Four float32 tensors of (256,)-wide rows; all ranks together hold about ``nbytes``."""
    rows = max(1, nbytes // world // _TENSORS // (256 * 4))
    gen = torch.Generator().manual_seed(seed * 100_003 + rank)
    return {f"tensor{i}": torch.rand(rows, 256, generator=gen) for i in range(_TENSORS)}


def records(
    nbytes: int, rank: int, world: int, seed: int = 0, device: str = "cpu"
) -> list[dict[str, Any]]:
    """Records of a 4 MiB float32 ``scores`` and ``boxes``, a strided view of it; all ranks
    together hold about ``nbytes`` (at least one record each)."""
    count = max(1, nbytes // world // RECORD_BYTES)
    gen = torch.Generator().manual_seed(seed * 100_003 + rank)
    out = []
    for i in range(count):
        scores = torch.rand(RECORD_BYTES // 4, generator=gen).to(device)
        out.append({"id": rank * count + i, "scores": scores, "boxes": scores.view(-1, 4)[:, 1:3]})
    return out


def logits(nbytes: int, rank: int, world: int, seed: int = 0) -> list[torch.Tensor]:
    """One float32 tensor of :data:`CLASSES` scores per sample, each its own storage; all
    ranks together hold about ``nbytes`` (at least one sample each)."""
    count = max(1, nbytes // world // (CLASSES * 4))
    gen = torch.Generator().manual_seed(seed * 100_003 + rank)
    return [torch.randn(CLASSES, generator=gen) for _ in range(count)]


def coco(nbytes: int, rank: int, world: int, seed: int = 0) -> list[dict[str, Any]]:
    """COCO results, one plain dict per box, :data:`BOXES` boxes an image (``image_id``
    as in :func:`shard`); all ranks together about ``nbytes`` pickled (at least one box)."""
    count = max(1, nbytes // world // COCO_BYTES)
    rng = np.random.default_rng([seed, rank])
    boxes = (rng.random((count, 4)) * 640).tolist()
    categories = rng.integers(1, 91, count).tolist()
    scores = rng.random(count).tolist()
    return [
        {"image_id": rank + world * (i // BOXES), "category_id": c, "bbox": b, "score": s}
        for i, (c, b, s) in enumerate(zip(categories, boxes, scores, strict=True))
    ]


def cuda_device(rank: int) -> str:
    """The GPU that ``rank`` holds its ``cuda-records`` on (ranks share GPUs round robin)."""
    return f"cuda:{rank % torch.cuda.device_count()}"


def available() -> list[str]:
    """The payload kinds this machine can make (``cuda-records`` needs a CUDA device)."""
    return [k for k in KINDS if k != "cuda-records" or torch.cuda.is_available()]


def defaults() -> list[str]:
    """The payload kinds the bench makes unless told which: those available, but for
    :data:`ON_REQUEST`."""
    return [k for k in available() if k not in ON_REQUEST]


def make(kind: str, nbytes: int, rank: int, world: int, seed: int = 0) -> Any:
    """The payload ``kind`` (one of :data:`KINDS`) of this rank.

    Raises:
        ValueError: unknown ``kind``, or ``cuda-records`` without a CUDA device.
    """
    if kind == "detections":
        return detections(image_count(nbytes), rank, world, seed)
    if kind == "keyed":
        return keyed(image_count(nbytes), rank, world, seed)
    if kind == "tensors":
        return tensors(nbytes, rank, world, seed)
    if kind == "records":
        return records(nbytes, rank, world, seed)
    if kind == "logits":
        return logits(nbytes, rank, world, seed)
    if kind == "coco":
        return coco(nbytes, rank, world, seed)
    if kind == "cuda-records":
        if not torch.cuda.is_available():
            raise ValueError("payload 'cuda-records' needs a CUDA device; this machine has none")
        return records(nbytes, rank, world, seed, cuda_device(rank))
    raise ValueError(f"unknown payload {kind!r}; use one of {', '.join(KINDS)}")
