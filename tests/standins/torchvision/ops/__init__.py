"""``torchvision.ops`` box helpers, as torchvision documents them (boxes are (N, 4) tensors)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["box_area", "box_convert", "box_iou"]

_FORMATS = ("xyxy", "xywh", "cxcywh")


def _to_xyxy(boxes: Tensor, fmt: str) -> Tensor:
    a, b, c, d = boxes.unbind(-1)
    if fmt == "xywh":  # corner, width, height
        return torch.stack((a, b, a + c, b + d), dim=-1)
    if fmt == "cxcywh":  # centre, width, height
        return torch.stack((a - c / 2, b - d / 2, a + c / 2, b + d / 2), dim=-1)
    return boxes


def _from_xyxy(boxes: Tensor, fmt: str) -> Tensor:
    x1, y1, x2, y2 = boxes.unbind(-1)
    if fmt == "xywh":
        return torch.stack((x1, y1, x2 - x1, y2 - y1), dim=-1)
    if fmt == "cxcywh":
        return torch.stack(((x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1), dim=-1)
    return boxes


def box_convert(boxes: Tensor, in_fmt: str, out_fmt: str) -> Tensor:
    """``boxes`` from ``in_fmt`` to ``out_fmt``: "xyxy", "xywh" or "cxcywh".

    Raises:
        ValueError: a format is not one of the three.
    """
    if in_fmt not in _FORMATS or out_fmt not in _FORMATS:
        raise ValueError(f"unsupported box formats {in_fmt!r} -> {out_fmt!r}; use {_FORMATS}")
    if in_fmt == out_fmt:
        return boxes.clone()
    return _from_xyxy(_to_xyxy(boxes, in_fmt), out_fmt)


def box_area(boxes: Tensor) -> Tensor:
    """Area of each "xyxy" box: (x2 - x1) * (y2 - y1)."""
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """Intersection over union of every pair of "xyxy" boxes: an (N, M) tensor."""
    top_left = torch.max(boxes1[:, None, :2], boxes2[None, :, :2])
    bottom_right = torch.min(boxes1[:, None, 2:], boxes2[None, :, 2:])
    overlap = (bottom_right - top_left).clamp(min=0).prod(dim=-1)
    union = box_area(boxes1)[:, None] + box_area(boxes2)[None, :] - overlap
    return overlap / union
