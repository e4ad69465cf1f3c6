"""Stand-in for ``detectron2.evaluation.coco_evaluation``, which calls through the module
(``import detectron2.utils.comm as comm``; ``comm.gather(...)``)."""

from __future__ import annotations

import itertools
from typing import Any

import detectron2.utils.comm as comm


class COCOEvaluator:
    """Predictions per rank; ``evaluate`` gathers them on the main process."""

    def __init__(self) -> None:
        self._predictions: list[dict[str, Any]] = []

    def process(self, image_ids: list[int], scores: list[float]) -> None:
        for image_id, score in zip(image_ids, scores, strict=True):
            self._predictions.append({"image_id": image_id, "score": score})

    def evaluate(self) -> dict[str, Any]:
        comm.synchronize()
        parts = comm.gather(self._predictions, dst=0)
        if not comm.is_main_process():
            return {}
        predictions = list(itertools.chain(*parts))
        return {"image_ids": sorted(p["image_id"] for p in predictions)}
