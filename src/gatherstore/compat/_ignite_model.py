"""ignite's computation model and topology: which model runs, ranks, nodes, device, its log lines.

Every answer reads torch.distributed when asked, so there is no model state to
sync; only the native (torch.distributed) model exists here.  The other
``_ignite_*`` modules build on this one; ``gatherstore.compat.ignite``
re-exports them all.
"""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist

import gatherstore as gs

__all__ = [
    "available_backends",
    "backend",
    "device",
    "get_local_rank",
    "get_nnodes",
    "get_node_rank",
    "get_nproc_per_node",
    "get_rank",
    "get_world_size",
    "has_hvd_support",
    "has_native_dist_support",
    "has_xla_support",
    "hostname",
    "model_name",
    "rank_zero_logger",
    "registered_computation_models",
    "set_local_rank",
    "show_config",
    "sync",
]

has_native_dist_support = dist.is_available()
#: Only torch.distributed is driven here: no XLA, no Horovod.
has_xla_support = False
has_hvd_support = False


class _SerialModel:
    """No process group."""

    name = "serial"
    available_backends: tuple[str, ...] = ()


class _NativeDistModel:
    """A torch.distributed process group."""

    name = "native-dist"
    available_backends = tuple(
        b for b in ("nccl", "gloo", "mpi") if getattr(dist, f"is_{b}_available")()
    )


registered_computation_models = (_SerialModel, _NativeDistModel)
_state: dict[str, int | None] = {"local_rank": None}
_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


def sync(temporary: bool = False) -> None:
    """Nothing to do: every function here reads torch.distributed when called."""


def available_backends() -> tuple[str, ...]:
    """Backends ``initialize`` and ``spawn`` accept."""
    return tuple(b for m in registered_computation_models for b in m.available_backends)


def model_name() -> str:
    """ "native-dist" with a process group, "serial" without."""
    return (_NativeDistModel if gs.is_distributed() else _SerialModel).name


def backend() -> str | None:
    """The process group's backend, None without one."""
    return gs.backend()


def device() -> torch.device:
    """The current CUDA device (else cpu); serially cuda, mps or cpu, whichever exists."""
    if torch.cuda.is_available():
        if gs.is_distributed():
            return torch.device(f"cuda:{torch.cuda.current_device()}")
        return torch.device("cuda")
    if not gs.is_distributed() and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return gs.get_world_size()


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return gs.get_rank()


def get_local_rank() -> int:
    """Rank on this node: LOCAL_RANK, else the hint of ``set_local_rank``, else by hostname."""
    hint = _state["local_rank"]
    if gs.is_distributed() and "LOCAL_RANK" not in os.environ and hint is not None:
        return hint
    return gs.get_local_rank()


def get_nproc_per_node() -> int:
    """Processes on this node (1 without a process group)."""
    return gs.get_local_size()


def get_nnodes() -> int:
    """Number of nodes (1 without a process group)."""
    return gs.get_nnodes()


def get_node_rank() -> int:
    """This node's index (0 without a process group)."""
    return gs.get_node_rank()


def hostname() -> str:
    """This host's name."""
    return socket.gethostname()


def set_local_rank(index: int) -> None:
    """Hint the local rank of a process group created by hand (LOCAL_RANK wins)."""
    _state["local_rank"] = index


def rank_zero_logger(name: str) -> logging.Logger:
    """The logger ignite's ``setup_logger(name)`` gives: INFO lines on stderr from rank 0 only.

    ignite's own logger names are kept, so a user's ``setup_logger(name, level=...)``
    or logging configuration applies to these lines too.  A logger that exists
    already keeps its configuration; off rank 0 its handlers give way to a
    NullHandler.  Lines never propagate to the root logger.
    """
    existing = name in logging.root.manager.loggerDict
    logger = logging.getLogger(name)
    rank = get_rank()
    if rank > 0:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.addHandler(logging.NullHandler())
    if existing:
        return logger
    if rank == 0:
        logger.setLevel(logging.INFO)
        handler = logging.StreamHandler()  # the stderr of this moment, as ignite's
        handler.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(handler)
    logger.propagate = False
    return logger


def show_config() -> None:
    """Write the distributed configuration to stderr on rank 0, as ignite's lines."""
    logger = rank_zero_logger("ignite.distributed.utils")
    for label, value in (
        ("distributed configuration", model_name()),
        ("backend", backend()),
        ("device", device().type),
        ("hostname", hostname()),
        ("world size", get_world_size()),
        ("rank", get_rank()),
        ("local rank", get_local_rank()),
        ("num processes per_node", get_nproc_per_node()),
        ("num nodes", get_nnodes()),
        ("node rank", get_node_rank()),
    ):
        logger.info(f"{label}: {value}")
