"""A PyTorch Lightning prediction writer that gathers ``trainer.predict``'s outputs on one rank.

Under DDP, ``trainer.predict`` returns only each rank's share, and the
DistributedSampler repeats samples so that every rank gets as many.
``GatherPredictions`` splits every batch's output into per-sample items,
pairs them with the dataset indices Lightning recorded for the batch, and
gathers them through gatherstore (``gs.collect_results`` with those indices) on
``dst``: one item per dataset sample, in dataset order, the repeats dropped.

With ``resume`` (a ``gs.ResultSet`` name, in a ``store`` that
outlives the job), every batch's samples are added to that set as the batch
ends, and ``dst`` gets every dataset index from this run or earlier ones: a
preempted ``trainer.predict`` continues on any number of ranks, and
``GatherPredictions.remaining`` is a sampler of the indices still to predict.

The class derives from ``pytorch_lightning``'s ``BasePredictionWriter``, so it is
defined on first use: importing this module does not import Lightning.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor

import gatherstore as gs
from gatherstore.compat._patching import _import
from gatherstore.compat._raising import Raising

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


def _per_loader(merged: list[Any] | None, sizes: list[int]) -> Any:
    """The predictions of all dataloaders as one list per dataloader (when several)."""
    if merged is None or len(sizes) < 2:
        return merged
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [merged[a:b] for a, b in itertools.pairwise(bounds)]


class _Remaining:
    """A sampler of the dataset indices the writer's set lacks (known once predict starts)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def _todo(self) -> list[int]:
        todo: list[int] | None = self.writer._todo
        if todo is None:
            raise RuntimeError(
                "GatherPredictions.remaining(): the result set opens when trainer.predict "
                "starts: give this sampler to the predict dataloader and the writer to the "
                "trainer's callbacks"
            )
        return todo

    def __iter__(self) -> Iterator[int]:
        return iter(self._todo())

    def __len__(self) -> int:
        return len(self._todo())


class _Gathering:
    """``GatherPredictions``' hooks that need no Lightning class: kept at module level so that
    ``_define`` only has to combine them with ``BasePredictionWriter`` on first use."""

    dst: int
    store: Any
    resume: str | None
    predictions: list[Any] | None
    _mine: Any
    _set: Any
    _size: int | None  # remaining(): the dataset's size
    _todo: list[int] | None

    def remaining(self, dataset: Any) -> _Remaining:
        """With ``resume``: a sampler of ``dataset``'s indices that no run stored yet, for
        the (one) predict dataloader, so that a requeued job predicts only those.

        Raises:
            ValueError: the writer has no ``resume``.
            TypeError: ``dataset`` has no length.
        """
        if self.resume is None:
            raise ValueError("remaining() needs GatherPredictions(resume=..., store=...)")
        self._size = len(dataset)
        return _Remaining(self)

    def write_on_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """With ``resume``: add the batch's samples to the set (raised at teardown)."""
        if isinstance(self._mine, Raising):
            return
        try:
            offset = sum(_dataset_sizes(trainer)[:dataloader_idx])
            items = split_output(prediction)
            if batch_indices is None or len(items) != len(batch_indices):
                raise ValueError(
                    "Lightning recorded no dataset indices for this batch, or not one per "
                    "sample: GatherPredictions needs a torch DataLoader over a sized dataset"
                )
            for item, index in zip(items, batch_indices, strict=True):
                self._set.add(offset + int(index), item)
        except Exception as exc:
            self._mine = Raising(exc)

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
        if self.resume is not None:
            self._settle(trainer)
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
        self.predictions = _per_loader(merged, sizes)

    def _settle(self, trainer: Any) -> None:
        """With ``resume``: every dataset index's prediction, from any run, on ``dst``."""
        from gatherstore.results.collect_into import settle

        rs, self._set, self._todo = self._set, None, None
        failed = self._mine.error if isinstance(self._mine, Raising) else None
        self._mine = None
        sizes = _dataset_sizes(trainer)
        merged = settle(rs, sum(sizes), self.dst, None, failed=failed, report=True)
        self.predictions = _per_loader(merged, sizes)


def _define() -> type:
    """``GatherPredictions``: ``_Gathering``'s hooks on Lightning's ``BasePredictionWriter``,
    which is imported now, on first use, rather than with this module."""
    writer: Any = _import("pytorch_lightning.callbacks", "pytorch-lightning").BasePredictionWriter

    class GatherPredictions(_Gathering, writer):  # type: ignore[misc]
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

        def __init__(self, dst: int = 0, store: Any = None, resume: str | None = None) -> None:
            super().__init__("epoch" if resume is None else "batch")
            if type(dst) is not int or dst < 0:
                raise ValueError(f"dst={dst!r}: use a rank number")
            self.dst = dst
            self.store = store
            self.resume = resume
            self.predictions = None
            self._mine = None
            self._set = None
            self._size = None
            self._todo = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            super().setup(trainer, pl_module, stage)
            if stage == "predict":
                self.predictions, self._mine = None, None
                if self.resume is not None:  # every rank, the process group up: a collective
                    self._set = gs.ResultSet(self.resume, store=self.store)
                    if self._size is not None:
                        self._todo = self._set.pending(range(self._size))

    GatherPredictions.__module__ = __name__
    GatherPredictions.__qualname__ = "GatherPredictions"
    return GatherPredictions


def __getattr__(name: str) -> Any:
    if name != "GatherPredictions":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = globals()[name] = _define()
    return cls
