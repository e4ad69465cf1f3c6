"""A PyTorch Lightning prediction writer that gathers ``trainer.predict``'s outputs on one rank.

Under DDP, ``trainer.predict`` returns only each rank's share, and the
DistributedSampler repeats samples so that every rank gets as many.
``GatherPredictions`` splits every batch's output into per-sample items,
pairs them with the dataset indices Lightning recorded for the batch, and
gathers them through gatherstore (``gs.collect_results`` with those indices) on
``dst``: one item per dataset sample, in dataset order, the repeats dropped.

The class derives from ``pytorch_lightning``'s ``BasePredictionWriter``, so it is
defined on first use: importing this module does not import Lightning.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor

import gatherstore as gs

from ._patching import _import
from ._raising import Raising

__all__ = ["GatherPredictions", "split_output"]

if TYPE_CHECKING:  # defined by _define() on first use
    GatherPredictions: Any


def split_output(output: Any) -> list[Any]:
    """One batch's output as per-sample items: a tensor or array along its first dimension,
    a list item by item, a dict field by field (its values split the same way).

    Raises:
        TypeError: another type (a tuple, a number, None); ValueError: a 0-d tensor, or dict
            values of different lengths.
    """
    if isinstance(output, (Tensor, np.ndarray)):
        if output.ndim == 0:
            raise ValueError("predict_step returned a 0-d tensor: give it a batch dimension")
        return list(output)
    if isinstance(output, list):
        return list(output)
    if isinstance(output, Mapping):
        fields = {key: split_output(value) for key, value in output.items()}
        lengths = {key: len(items) for key, items in fields.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"predict_step returned a dict whose values differ in length: {lengths}"
            )
        count = next(iter(lengths.values()), 0)
        return [{key: items[i] for key, items in fields.items()} for i in range(count)]
    raise TypeError(
        f"predict_step returned a {type(output).__name__}; GatherPredictions splits a tensor, "
        "a list, or a dict of them into samples"
    )


def _dataset_sizes(trainer: Any) -> list[int]:
    """Samples in each predict dataloader's dataset, in dataloader order."""
    loaders = trainer.predict_dataloaders
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    elif not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    return [len(loader.dataset) for loader in loaders]


def _samples(
    predictions: Sequence[Any], batch_indices: Sequence[Any], sizes: list[int]
) -> tuple[list[Any], list[int]]:
    """This rank's per-sample predictions and their indices (dataloader d's offset by the
    sizes of the ones before it)."""
    per_loader = [predictions] if len(batch_indices) == 1 else list(predictions)
    samples: list[Any] = []
    indices: list[int] = []
    offsets = list(itertools.accumulate(sizes, initial=0))[: len(batch_indices)]
    for loader, (outputs, seen, offset) in enumerate(
        zip(per_loader, batch_indices, offsets, strict=True)
    ):
        if len(seen) != len(outputs):
            raise ValueError(
                f"Lightning recorded no dataset indices for predict dataloader {loader}; "
                "GatherPredictions needs a torch DataLoader over a sized dataset"
            )
        for output, batch in zip(outputs, seen, strict=True):
            items = split_output(output)
            if len(items) != len(batch):
                raise ValueError(
                    f"predict_step returned {len(items)} items for a batch of {len(batch)} samples"
                )
            samples += items
            indices += [offset + int(i) for i in batch]
    return samples, indices


def _define() -> type:
    writer: Any = _import("pytorch_lightning.callbacks", "pytorch-lightning").BasePredictionWriter

    class GatherPredictions(writer):  # type: ignore[misc]
        """Every rank's ``trainer.predict`` outputs on ``dst``, one item per dataset sample.

        After ``trainer.predict(model, dataloaders=..., return_predictions=False)``,
        ``predictions`` on ``dst`` is the list of per-sample predictions in dataset
        order (a list per dataloader when there are several); None on the other ranks.
        A batch output is split into samples by ``split_output``.  The gather runs
        when the predict run ends on every rank (its ``teardown``), so a rank whose
        dataloader is empty takes part too; ``store`` is the gatherstore store
        (None: the default).

        Raises (from ``trainer.predict``, on every rank):
            RemoteRankError: another rank's predictions could not be split or sent.
            ValueError / TypeError: this rank's could not (see ``split_output``).
        """

        def __init__(self, dst: int = 0, store: Any = None) -> None:
            super().__init__("epoch")
            if type(dst) is not int or dst < 0:
                raise ValueError(f"dst={dst!r}: use a rank number")
            self.dst = dst
            self.store = store
            self.predictions: list[Any] | None = None
            self._mine: Any = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            super().setup(trainer, pl_module, stage)
            if stage == "predict":
                self.predictions, self._mine = None, None

        def write_on_epoch_end(
            self,
            trainer: Any,
            pl_module: Any,
            predictions: Sequence[Any],
            batch_indices: Sequence[Any],
        ) -> None:
            """Split and keep this rank's predictions until the run's teardown."""
            try:
                self._mine = _samples(predictions, batch_indices, _dataset_sizes(trainer))
            except Exception as exc:
                self._mine = Raising(exc)

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            """Gather every rank's samples on ``dst`` in dataset order."""
            if stage != "predict":
                return
            mine: Any = self._mine or ([], [])
            self._mine = None
            try:
                sizes = _dataset_sizes(trainer)
                if isinstance(mine, Raising):
                    raise mine.error
                samples, indices = mine
            except Exception as exc:  # every rank raises it, from collect_results' arguments
                samples, indices, sizes = [None], [Raising(exc)], [0]
            merged = gs.collect_results(
                samples, sum(sizes), indices=indices, dst=self.dst, store=self.store
            )
            if merged is not None and len(sizes) > 1:
                bounds = list(itertools.accumulate(sizes, initial=0))
                merged = [merged[a:b] for a, b in itertools.pairwise(bounds)]
            self.predictions = merged

    GatherPredictions.__module__ = __name__
    GatherPredictions.__qualname__ = "GatherPredictions"
    return GatherPredictions


def __getattr__(name: str) -> Any:
    if name != "GatherPredictions":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = globals()[name] = _define()
    return cls
