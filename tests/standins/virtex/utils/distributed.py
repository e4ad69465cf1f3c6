"""Stand-in for ``virtex.utils.distributed``: helpers that fall back to single-process answers
without a process group, as virtex documents."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _job_worker(local_rank, job_fn, world, gpus, machine, url, args):
    rank = machine * gpus + local_rank
    dist.init_process_group("nccl", init_method=url, world_size=world, rank=rank)
    torch.cuda.set_device(local_rank)
    synchronize()
    job_fn(*args)


def launch(
    job_fn,
    num_machines=1,
    num_gpus_per_machine=1,
    machine_rank=0,
    dist_url="tcp://127.0.0.1:23456",
    args=(),
):
    """One process per GPU through torch.multiprocessing.spawn; needs CUDA."""
    assert torch.cuda.is_available(), "CUDA not available, Cannot launch distributed processes."
    world = num_machines * num_gpus_per_machine
    if world == 1:
        job_fn(*args)
        return
    worker_args = (job_fn, world, num_gpus_per_machine, machine_rank, dist_url, args)
    mp.spawn(_job_worker, nprocs=num_gpus_per_machine, args=worker_args)


def synchronize() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_master_process() -> bool:
    return get_rank() == 0


def average_across_processes(t: torch.Tensor | dict[str, torch.Tensor]) -> None:
    """In place: every process ends with the mean."""
    if not dist.is_initialized():
        return
    for tensor in [t] if isinstance(t, torch.Tensor) else t.values():
        dist.all_reduce(tensor)
        tensor /= get_world_size()


def gpu_mem_usage() -> int:
    return int(torch.cuda.max_memory_allocated() / 1024**2) if torch.cuda.is_available() else 0
