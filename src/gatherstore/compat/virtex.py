"""``virtex.utils.distributed`` on gatherstore: launch without CUDA, averages on the fast path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import torch

import gatherstore as gs
from gatherstore.compat._patching import Patch, patch_module

__all__ = [
    "average_across_processes",
    "get_rank",
    "get_world_size",
    "gpu_mem_usage",
    "is_master_process",
    "launch",
    "patch",
    "synchronize",
]


def launch(
    job_fn: Callable[..., Any],
    num_machines: int = 1,
    num_gpus_per_machine: int = 1,
    machine_rank: int = 0,
    dist_url: str = "tcp://127.0.0.1:23456",
    args: tuple[Any, ...] = (),
) -> None:
    """Run ``job_fn(*args)`` in one process per GPU on each machine.

    Processes start through ``gatherstore.launch`` (NCCL with one GPU per
    process, else gloo), so this also runs on CPU-only machines, where virtex
    asserts CUDA.  One process in all runs ``job_fn`` right here, without a
    process group (every helper then gives the single-process answer).

    Raises:
        ValueError: ``dist_url`` is not ``tcp://host:port``.
        gatherstore.RemoteRankError: a process raised; names its rank.
    """
    if num_machines * num_gpus_per_machine == 1:
        job_fn(*args)
        return
    url = urlsplit(dist_url)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"dist_url={dist_url!r}: use tcp://<host of machine 0>:<free port>")
    gs.launch(
        job_fn,
        nproc_per_node=num_gpus_per_machine,
        nnodes=num_machines,
        node_rank=machine_rank,
        master_addr=url.hostname,
        master_port=url.port,
        args=args,
    )


def synchronize() -> None:
    """Barrier among all processes (nothing in a single process)."""
    gs.barrier()


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return gs.get_world_size()


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return gs.get_rank()


def is_master_process() -> bool:
    """Whether this is rank 0 (always True in a single process)."""
    return get_rank() == 0


def average_across_processes(t: torch.Tensor | dict[str, torch.Tensor]) -> None:
    """Average a tensor, or each tensor of a flat dict, across processes, in place.

    Raises:
        RuntimeError: an integer tensor (an average cannot be stored in it).
    """
    if not gs.is_distributed():
        return
    tensors = [t] if isinstance(t, torch.Tensor) else list(t.values())
    for tensor in tensors:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            raise RuntimeError(
                f"cannot average a {tensor.dtype} tensor in place; use a float tensor"
            )
    if isinstance(t, torch.Tensor):
        t.copy_(gs.all_reduce(t, "mean"))
    else:
        reduced = gs.all_reduce_dict(t, "mean")
        for key, value in t.items():
            value.copy_(reduced[key])


def gpu_mem_usage() -> int:
    """Peak GPU memory allocated, in MiB (0 without CUDA)."""
    return gs.gpu_mem_usage()


def patch() -> Patch:
    """Make the installed ``virtex.utils.distributed`` average through gatherstore.

    Raises:
        ImportError: virtex is not installed.
    """
    return patch_module(
        "virtex.utils.distributed",
        "git+https://github.com/kdexd/virtex",
        {"average_across_processes": average_across_processes},
    )
