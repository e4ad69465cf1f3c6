"""``torchvision.models`` names torchmetrics imports at load time; none of them works here."""

from __future__ import annotations

from typing import Any

__all__ = ["VGG16_Weights", "resnet50", "vgg16"]


def _missing(name: str) -> Any:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"torchvision.models.{name}: not in the tests' torchvision stand-in"
        )

    stand_in.__name__ = name
    return stand_in


resnet50 = _missing("resnet50")
vgg16 = _missing("vgg16")
VGG16_Weights = _missing("VGG16_Weights")
