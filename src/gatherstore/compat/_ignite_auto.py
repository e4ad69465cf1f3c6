"""ignite's ``auto_*`` helpers: a data loader, model and optimizer fit for this rank."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.data.sampler import Sampler

from gatherstore.compat._ignite_model import (
    device,
    get_local_rank,
    get_nproc_per_node,
    get_rank,
    get_world_size,
    rank_zero_logger,
)

__all__ = ["DistributedProxySampler", "auto_dataloader", "auto_model", "auto_optim"]

_LOGGERS = "ignite.distributed.auto."


class DistributedProxySampler(DistributedSampler):  # type: ignore[type-arg]
    """Each rank's share of another sampler's indices (that sampler repeated to fill).

    Raises:
        TypeError: ``sampler`` is not a sized, non-distributed torch Sampler.
    """

    def __init__(
        self, sampler: Sampler[Any], num_replicas: int | None = None, rank: int | None = None
    ) -> None:
        if not isinstance(sampler, Sampler):
            raise TypeError(
                f"Argument sampler should be instance of torch Sampler, but given: {type(sampler)}"
            )
        if isinstance(sampler, DistributedSampler):
            raise TypeError("Argument sampler must not be a distributed sampler already")
        if not hasattr(sampler, "__len__"):
            raise TypeError("Argument sampler should have length")
        super().__init__(sampler, num_replicas=num_replicas, rank=rank, shuffle=False)  # type: ignore[arg-type]
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        torch.manual_seed(self.epoch)
        indices: list[Any] = []
        while len(indices) < self.total_size:
            indices += list(self.sampler)
        mine = indices[: self.total_size][self.rank : self.total_size : self.num_replicas]
        if len(mine) != self.num_samples:
            raise RuntimeError(f"{len(mine)} vs {self.num_samples}")
        return iter(mine)


def _distributed_sampler(dataset: Dataset[Any], kwargs: dict[str, Any]) -> None:
    """Put the sampler that splits ``dataset`` across ranks into ``kwargs`` (warn on a bad one)."""
    rank, world = get_rank(), get_world_size()
    sampler = kwargs.get("sampler")
    if isinstance(sampler, DistributedSampler):
        if sampler.rank != rank:
            warnings.warn(
                f"Found distributed sampler with rank={sampler.rank}, but process rank is {rank}",
                stacklevel=3,
            )
        if sampler.num_replicas != world:
            warnings.warn(
                f"Found distributed sampler with num_replicas={sampler.num_replicas}, "
                f"but world size is {world}",
                stacklevel=3,
            )
    elif sampler is None:
        shuffle = kwargs.pop("shuffle", True)
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle)
    else:
        sampler = DistributedProxySampler(sampler, num_replicas=world, rank=rank)
    kwargs["sampler"] = sampler


def auto_dataloader(dataset: Dataset[Any], **kwargs: Any) -> DataLoader[Any]:
    """A DataLoader for this rank: per-rank batch size and workers, a distributed sampler."""
    logger = rank_zero_logger(_LOGGERS + "auto_dataloader")
    world = get_world_size()
    if world > 1:
        if kwargs.get("batch_size", 0) >= world:
            kwargs["batch_size"] //= world
        nproc = get_nproc_per_node()
        if kwargs.get("num_workers", -1) >= nproc:
            kwargs["num_workers"] = (kwargs["num_workers"] + nproc - 1) // nproc
        if "batch_sampler" in kwargs:
            warnings.warn(
                "Found batch_sampler in provided kwargs. Please, make sure that it is compatible "
                "with distributed configuration",
                stacklevel=2,
            )
        elif isinstance(dataset, IterableDataset):
            logger.info(
                "Found iterable dataset, dataloader will be created without any distributed "
                "sampling. Please, make sure that the dataset itself produces different data on "
                "different ranks."
            )
        else:
            _distributed_sampler(dataset, kwargs)
    kwargs["pin_memory"] = kwargs.get("pin_memory", "cuda" in device().type)
    logger.info(f"Use data loader kwargs for dataset '{repr(dataset)[:20].strip()}': \n\t{kwargs}")
    return DataLoader(dataset, **kwargs)


def auto_model(model: nn.Module, sync_bn: bool = False, **kwargs: Any) -> nn.Module:
    """``model`` on this rank's device, in DistributedDataParallel when distributed.

    Raises:
        ValueError: ``device_ids`` in ``kwargs`` under CUDA (it is set here).
    """
    logger = rank_zero_logger(_LOGGERS + "auto_model")
    dev = device()
    if not all(p.device == dev for p in model.parameters()):
        model.to(dev)
    if get_world_size() > 1:
        if sync_bn:
            logger.info("Convert batch norm to sync batch norm")
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
        if torch.cuda.is_available():
            if "device_ids" in kwargs:
                raise ValueError(
                    f"Argument kwargs should not contain 'device_ids', but got {kwargs}"
                )
            logger.info(
                f"Apply torch DistributedDataParallel on model, device id: {get_local_rank()}"
            )
            kwargs["device_ids"] = [get_local_rank()]
        else:
            logger.info("Apply torch DistributedDataParallel on model")
        return nn.parallel.DistributedDataParallel(model, **kwargs)
    if torch.cuda.device_count() > 1 and "cuda" in dev.type:
        logger.info("Apply torch DataParallel on model")
        return nn.parallel.DataParallel(model, **kwargs)
    return model


def auto_optim(optimizer: Optimizer, **kwargs: Any) -> Optimizer:
    """``optimizer`` unchanged: torch.distributed needs no optimizer wrapper."""
    return optimizer
