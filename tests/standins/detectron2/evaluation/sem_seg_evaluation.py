"""Stand-in for ``detectron2.evaluation.sem_seg_evaluation``, which binds comm's functions by
name (``from detectron2.utils.comm import all_gather, ...``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from detectron2.utils.comm import all_gather, is_main_process, synchronize


class SemSegEvaluator:
    """A confusion matrix per rank; ``evaluate`` sums every rank's on the main process."""

    def __init__(self, num_classes: int) -> None:
        self._conf = np.zeros((num_classes, num_classes), dtype=np.int64)

    def process(self, labels: list[int], predictions: list[int]) -> None:
        for label, predicted in zip(labels, predictions, strict=True):
            self._conf[label, predicted] += 1

    def evaluate(self) -> dict[str, Any] | None:
        synchronize()
        conf = sum(all_gather(self._conf))
        if not is_main_process():
            return None
        return {"pixels": int(conf.sum()), "acc": float(np.trace(conf) / conf.sum())}
