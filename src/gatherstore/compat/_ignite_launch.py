"""ignite's process setup: ``spawn``, ``initialize``, ``finalize``, ``Parallel`` and ``auto_*``.

Re-exported by :mod:`gatherstore.compat.ignite`; the functions there are
reached through a late import because that module imports this one.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.data.sampler import Sampler

import gatherstore as gs

__all__ = [
    "DistributedProxySampler",
    "Parallel",
    "auto_dataloader",
    "auto_model",
    "auto_optim",
    "finalize",
    "initialize",
    "spawn",
]

_log = logging.getLogger(__name__)
_saved_env: list[dict[str, str] | None] = [None]


def _idist() -> Any:
    from . import ignite

    return ignite


# --- lifecycle ------------------------------------------------------------------------
def _assert_backend(name: str) -> None:
    backends = _idist().available_backends()
    if name not in backends:
        raise ValueError(f"Backend should be one of {backends}, not {name!r}")


def _spawned(fn: Callable[..., Any], args: tuple[Any, ...], kwargs_dict: Mapping[str, Any]) -> None:
    fn(gs.get_local_rank(), *args, **kwargs_dict)


def spawn(
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs_dict: Mapping[str, Any] | None = None,
    nproc_per_node: int = 1,
    **kwargs: Any,
) -> None:
    """Run ``fn(local_rank, *args, **kwargs_dict)`` in ``nproc_per_node`` processes.

    Processes start through :func:`gatherstore.launch`; ``kwargs`` may hold
    nnodes, node_rank, master_addr, master_port (default: a free port on one
    node) and timeout.

    Raises:
        ValueError: unknown backend, or options gatherstore's launcher lacks.
        gatherstore.RemoteRankError: a process raised; names its rank.
    """
    _assert_backend(backend)
    init_method = kwargs.pop("init_method", None)
    kwargs.pop("start_method", None)
    if (
        init_method not in (None, "env://")
        or not kwargs.pop("join", True)
        or kwargs.pop("daemon", False)
    ):
        raise ValueError(
            "spawn() here supports init_method='env://', join=True and daemon=False only"
        )
    known = {"nnodes", "node_rank", "master_addr", "master_port", "timeout"}
    if set(kwargs) - known:
        raise ValueError(
            f"spawn() got unsupported options {sorted(set(kwargs) - known)}; use {sorted(known)}"
        )
    if kwargs.get("master_addr") is None:
        kwargs.pop("master_addr", None)
    gs.launch(
        _spawned,
        nproc_per_node=nproc_per_node,
        backend=backend,
        args=(fn, tuple(args), dict(kwargs_dict or {})),
        **kwargs,
    )


def initialize(backend: str, **kwargs: Any) -> None:
    """Create the process group from the environment (RANK, WORLD_SIZE, ... default to one process).

    ``kwargs``: timeout, init_method, world_size, rank.

    Raises:
        ValueError: unknown backend, or rank/world_size without init_method.
        RuntimeError: a process group already exists.
    """
    _assert_backend(backend)
    if gs.is_distributed():
        raise RuntimeError("a default process group already exists: call finalize() first")
    init_method = kwargs.pop("init_method", None) or "env://"
    rank, world = kwargs.pop("rank", None), kwargs.pop("world_size", None)
    if init_method == "env://" and (rank is not None or world is not None):
        raise ValueError("rank and world_size need an init_method other than env://")
    _saved_env[0] = dict(os.environ)
    env = os.environ
    env.setdefault("RANK", str(rank or 0))
    env.setdefault("WORLD_SIZE", str(world or 1))
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_PORT", "15000")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    options: dict[str, Any] = {k: v for k, v in kwargs.items() if v is not None}
    if not init_method.startswith("env"):
        options.update(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))
    dist.init_process_group(backend, init_method=init_method, **options)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(env["LOCAL_RANK"]))
    gs.barrier()


def finalize() -> None:
    """Destroy the process group and restore the environment :func:`initialize` changed."""
    gs.shutdown()
    saved = _saved_env[0]
    if saved is not None:
        os.environ.clear()
        os.environ.update(saved)
        _saved_env[0] = None


class DistributedProxySampler(DistributedSampler):  # type: ignore[type-arg]
    """Each rank's share of another sampler's indices (that sampler repeated to fill).

    Raises:
        TypeError: ``sampler`` is not a sized, non-distributed torch Sampler.
    """

    def __init__(
        self, sampler: Sampler[Any], num_replicas: int | None = None, rank: int | None = None
    ) -> None:
        if not isinstance(sampler, Sampler):
            raise TypeError(f"sampler should be a torch Sampler, not {type(sampler)}")
        if isinstance(sampler, DistributedSampler):
            raise TypeError("sampler must not be a distributed sampler already")
        if not hasattr(sampler, "__len__"):
            raise TypeError("sampler should have a length")
        super().__init__(sampler, num_replicas=num_replicas, rank=rank, shuffle=False)  # type: ignore[arg-type]
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        torch.manual_seed(self.epoch)
        indices: list[Any] = []
        while len(indices) < self.total_size:
            indices += list(self.sampler)
        mine = indices[: self.total_size][self.rank : self.total_size : self.num_replicas]
        if len(mine) != self.num_samples:
            raise RuntimeError(f"{len(mine)} indices for this rank, expected {self.num_samples}")
        return iter(mine)


def auto_dataloader(dataset: Dataset[Any], **kwargs: Any) -> DataLoader[Any]:
    """A DataLoader for this rank: per-rank batch size and workers, a distributed sampler."""
    idist = _idist()
    rank, world = idist.get_rank(), idist.get_world_size()
    if world > 1:
        if kwargs.get("batch_size", 0) >= world:
            kwargs["batch_size"] //= world
        nproc = idist.get_nproc_per_node()
        if kwargs.get("num_workers", -1) >= nproc:
            kwargs["num_workers"] = (kwargs["num_workers"] + nproc - 1) // nproc
        if "batch_sampler" in kwargs:
            warnings.warn(
                "Found batch_sampler in provided kwargs; make sure it splits data across ranks",
                stacklevel=2,
            )
        elif isinstance(dataset, IterableDataset):
            _log.info("iterable dataset: no distributed sampler; each rank yields its own data")
        else:
            sampler = kwargs.get("sampler")
            if isinstance(sampler, DistributedSampler):
                if sampler.rank != rank or sampler.num_replicas != world:
                    warnings.warn(
                        f"distributed sampler for rank {sampler.rank} of {sampler.num_replicas}, "
                        f"but this is rank {rank} of {world}",
                        stacklevel=2,
                    )
            elif sampler is None:
                shuffle = kwargs.pop("shuffle", True)
                sampler = DistributedSampler(
                    dataset, num_replicas=world, rank=rank, shuffle=shuffle
                )
            else:
                sampler = DistributedProxySampler(sampler, num_replicas=world, rank=rank)
            kwargs["sampler"] = sampler
    kwargs["pin_memory"] = kwargs.get("pin_memory", "cuda" in idist.device().type)
    return DataLoader(dataset, **kwargs)


def auto_model(model: nn.Module, sync_bn: bool = False, **kwargs: Any) -> nn.Module:
    """``model`` on this rank's device, in DistributedDataParallel when distributed.

    Raises:
        ValueError: ``device_ids`` in ``kwargs`` under CUDA (it is set here).
    """
    idist = _idist()
    dev = idist.device()
    if not all(p.device == dev for p in model.parameters()):
        model.to(dev)
    if idist.get_world_size() > 1:
        if sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
        if torch.cuda.is_available():
            if "device_ids" in kwargs:
                raise ValueError(f"kwargs should not contain 'device_ids' (set here), got {kwargs}")
            kwargs["device_ids"] = [idist.get_local_rank()]
        return nn.parallel.DistributedDataParallel(model, **kwargs)
    if torch.cuda.device_count() > 1 and "cuda" in dev.type:
        return nn.parallel.DataParallel(model, **kwargs)
    return model


def auto_optim(optimizer: Optimizer, **kwargs: Any) -> Optimizer:
    """``optimizer`` unchanged: torch.distributed needs no optimizer wrapper."""
    return optimizer


class Parallel:
    """Run a function in a distributed configuration: spawned, or in the current process group.

    Raises:
        ValueError: unknown backend; launch arguments without a backend; bad counts.
    """

    def __init__(
        self,
        backend: str | None = None,
        nproc_per_node: int | None = None,
        nnodes: int | None = None,
        node_rank: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        init_method: str | None = None,
        **spawn_kwargs: Any,
    ) -> None:
        idist = _idist()
        launch = {
            "nproc_per_node": nproc_per_node,
            "nnodes": nnodes,
            "node_rank": node_rank,
            "master_addr": master_addr,
            "master_port": master_port,
        }
        if backend is not None and backend not in idist.available_backends():
            raise ValueError(
                f"Unknown backend {backend!r}; available: {idist.available_backends()}"
            )
        if backend is None:
            for name, value in launch.items():
                if value is not None:
                    raise ValueError(f"{name}={value!r} needs a backend; pass backend= too")
        if init_method is not None and init_method.startswith("tcp://"):
            raise ValueError(
                f"init_method={init_method!r} hangs: use 'env://' with MASTER_ADDR/PORT"
            )
        self.backend = backend
        self.init_method = init_method
        self._spawn_params: dict[str, Any] | None = None
        if backend is not None and nproc_per_node is not None:
            self._spawn_params = self._setup_spawn_params(
                nproc_per_node,
                nnodes,
                node_rank,
                master_addr,
                master_port,
                init_method,
                **spawn_kwargs,
            )

    @staticmethod
    def _setup_spawn_params(
        nproc_per_node: int,
        nnodes: int | None = None,
        node_rank: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        init_method: str | None = None,
        **spawn_kwargs: Any,
    ) -> dict[str, Any]:
        nnodes = 1 if nnodes is None else nnodes
        if nproc_per_node < 1 or nnodes < 1:
            raise ValueError(f"nproc_per_node={nproc_per_node}, nnodes={nnodes}: both must be >= 1")
        if node_rank is None:
            if nnodes > 1:
                raise ValueError("with more than one node, give node_rank")
            node_rank = 0
        if not 0 <= node_rank < nnodes:
            raise ValueError(
                f"node_rank should be between 0 and {nnodes - 1}, but given {node_rank}"
            )
        if nnodes > 1 and (master_addr is None or master_port is None) and init_method is None:
            raise ValueError("with more than one node, give master_addr and master_port")
        params = {
            "nproc_per_node": nproc_per_node,
            "nnodes": nnodes,
            "node_rank": node_rank,
            "master_addr": master_addr,
            "master_port": master_port,
            "init_method": init_method,
            **spawn_kwargs,
        }
        return {k: v for k, v in params.items() if v is not None}

    def run(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Spawn ``func(local_rank, *args, **kwargs)`` in new processes, or call it here."""
        idist = _idist()
        if self._spawn_params is not None and self.backend is not None:
            idist.spawn(self.backend, func, args=args, kwargs_dict=kwargs, **self._spawn_params)
        else:
            func(idist.get_local_rank(), *args, **kwargs)

    def __enter__(self) -> Parallel:
        if self.backend is not None and self._spawn_params is None:
            _idist().initialize(self.backend, init_method=self.init_method)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.backend is not None and self._spawn_params is None:
            _idist().finalize()
