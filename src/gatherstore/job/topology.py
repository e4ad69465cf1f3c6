"""Where this process sits in the job: ranks, nodes, backend and device.

Every function answers without an initialised process group, with the serial
answers (world size 1, rank 0, ...).  Local rank/size and node rank come from
the launcher's environment (torchrun, SLURM, Open MPI) when it agrees with the
process group, and otherwise from grouping ranks by the hostnames they publish
on the rendezvous store (no exchange: a getter called on one rank alone puts
no call out of step), computed once per group, at init under ``launch`` and
``init_from_env``.
"""

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gatherstore._config import default_timeout
from gatherstore.job import control, slurm
from gatherstore.job import state as job

__all__ = [
    "backend",
    "describe",
    "device",
    "get_local_rank",
    "get_local_size",
    "get_nnodes",
    "get_node_rank",
    "get_rank",
    "get_world_size",
    "group_nodes",
    "gpu_mem_usage",
    "is_distributed",
    "is_main_process",
    "launched_as",
    "local_group",
]


@dataclass(frozen=True)
class _Layout:
    local_rank: int
    local_size: int
    node_rank: int
    nnodes: int


# launcher -> (rank, world size, local rank, local size, node rank, nnodes) variables
_LAUNCHERS = {
    "torchrun": (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
    ),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", None, None, None, None),  # rest: _slurm.layout
    "openmpi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        None,
        None,
    ),
}


def is_distributed() -> bool:
    """Whether a torch.distributed process group is initialised.

    Returns:
        True in a job (``gs.launch``, ``init_from_env``, or the program's own
        ``torch.distributed.init_process_group``); False in a plain process.

    Examples:
        >>> if not gs.is_distributed():
        ...     gs.init_from_env()
    """
    return control.is_initialized()


def launched_as() -> tuple[int, str] | None:
    """How many processes a launcher started for this job, and the variable that says so,
    when it says more than one: torchrun's ``WORLD_SIZE``, SLURM's ``SLURM_NTASKS`` inside
    a job step (``srun``; a batch script runs once), Open MPI's ``OMPI_COMM_WORLD_SIZE``."""
    for name in _LAUNCHERS:
        world_var = _LAUNCHERS[name][1]
        assert world_var is not None
        value = os.environ.get(world_var, "")
        if name == "slurm" and "SLURM_STEP_ID" not in os.environ:
            continue
        if value.isdigit() and int(value) > 1:
            return int(value), world_var
    return None


def get_world_size(group: Any = None) -> int:
    """Number of processes in the job, or in ``group``.

    Args:
        group: a process group (None: the default group).

    Returns:
        The group's size; 1 without a process group.  As in torch, -1 on a rank outside
        ``group``.

    Examples:
        >>> shard = dataset[gs.get_rank() :: gs.get_world_size()]  # this rank's slice
    """
    if not is_distributed():
        return 1
    return dist.get_world_size() if group is None else dist.get_world_size(group)


def get_rank(group: Any = None) -> int:
    """This process's global rank, or its rank in ``group``.

    Args:
        group: a process group (None: the default group).

    Returns:
        From 0 to ``get_world_size(group) - 1``; 0 without a process group.  As in
        torch, -1 on a rank outside ``group``.

    Examples:
        >>> shard = dataset[gs.get_rank() :: gs.get_world_size()]  # this rank's slice
    """
    if not is_distributed():
        return 0
    return dist.get_rank() if group is None else dist.get_rank(group)


def is_main_process() -> bool:
    """Whether this is global rank 0 (always, without a process group).

    Returns:
        ``get_rank() == 0``.

    Examples:
        >>> if gs.is_main_process():
        ...     print(metrics)
    """
    return get_rank() == 0


def get_local_rank() -> int:
    """Rank of this process among those on its node.

    The launcher's variables say it (torchrun, SLURM, Open MPI); in a process group
    made without them (and without ``launch`` or ``init_from_env``, which compute it
    at once), the hostnames every rank publishes at its first use of gatherstore do.

    Returns:
        From 0 to ``get_local_size() - 1``; 0 without a process group.

    Raises:
        GatherTimeout: in that case, ranks that published no hostname within
            ``GATHERSTORE_TIMEOUT``, named.

    Examples:
        >>> torch.cuda.set_device(gs.get_local_rank())  # one GPU per process of a node
    """
    return _layout().local_rank


def get_local_size() -> int:
    """Number of processes of the job on this node, found as ``get_local_rank`` is.

    Returns:
        At least 1; 1 without a process group.

    Raises:
        GatherTimeout: as in ``get_local_rank``.

    Examples:
        >>> workers = os.cpu_count() // gs.get_local_size()  # DataLoader workers per rank
    """
    return _layout().local_size


def get_node_rank() -> int:
    """Index of this node in the job, found as ``get_local_rank`` is (without the
    launcher's word, nodes are numbered in the order of their lowest rank).

    Returns:
        From 0 to ``get_nnodes() - 1``; 0 without a process group.

    Raises:
        GatherTimeout: as in ``get_local_rank``.

    Examples:
        >>> if gs.get_local_rank() == 0:
        ...     print(f"node {gs.get_node_rank()} of {gs.get_nnodes()} is up")
    """
    return _layout().node_rank


def get_nnodes() -> int:
    """Number of nodes in the job, found as ``get_local_rank`` is.

    Returns:
        At least 1; 1 without a process group.

    Raises:
        GatherTimeout: as in ``get_local_rank``.

    Examples:
        >>> store = "tmpdir" if gs.get_nnodes() == 1 else "file:///nfs/scratch/gather"
    """
    return _layout().nnodes


def backend() -> str | None:
    """The process group's backend.

    Returns:
        ``"nccl"``, ``"gloo"``, ... (as ``torch.distributed.get_backend`` names it); None
        without a process group.

    Examples:
        >>> on_gpu = gs.backend() == "nccl"
    """
    return str(dist.get_backend()) if is_distributed() else None


def device() -> torch.device:
    """The device this rank computes on.

    Returns:
        ``cuda:<local rank>`` under NCCL (modulo the GPUs this process sees); ``cpu``
        under gloo; without a process group, the current CUDA device when CUDA is
        available, else ``cpu``.

    Raises:
        GatherTimeout: under NCCL, as in ``get_local_rank``.

    Examples:
        >>> model = model.to(gs.device())
    """
    name = backend()
    if name is not None and "nccl" in name:
        return torch.device("cuda", get_local_rank() % max(torch.cuda.device_count(), 1))
    if name is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gpu_mem_usage() -> int:
    """Peak GPU memory that torch allocated in this process on its device.

    Returns:
        MiB, as ``torch.cuda.max_memory_allocated`` counts them on ``device()`` (the
        current CUDA device under gloo); 0 without CUDA.

    Raises:
        GatherTimeout: under NCCL, as in ``get_local_rank``.

    Examples:
        >>> print(f"rank {gs.get_rank()}: peak {gs.gpu_mem_usage()} MiB")
    """
    if not torch.cuda.is_available():
        return 0
    dev = device()  # cpu under gloo even with CUDA: then the current CUDA device
    index = dev.index if dev.type == "cuda" else torch.cuda.current_device()
    return int(torch.cuda.max_memory_allocated(index) // (1024 * 1024))


def describe() -> dict[str, Any]:
    """The topology, as ``gatherstore describe`` prints it.

    Returns:
        A JSON-friendly dict: ``rank``, ``world_size``, ``local_rank``, ``local_size``,
        ``node_rank``, ``nnodes``, ``is_main_process``, ``is_distributed``, ``backend``
        and ``device`` (the answers of the functions of those names), ``hostname``,
        ``pid``, ``launcher`` (``"torchrun"``, ``"slurm"``, ``"openmpi"`` or None),
        ``torch`` (its version) and ``cuda_devices``.

    Raises:
        GatherTimeout: as in ``get_local_rank``.

    Examples:
        >>> print(json.dumps(gs.describe(), indent=2))
    """
    return {
        "rank": get_rank(),
        "world_size": get_world_size(),
        "local_rank": get_local_rank(),
        "local_size": get_local_size(),
        "node_rank": get_node_rank(),
        "nnodes": get_nnodes(),
        "is_main_process": is_main_process(),
        "is_distributed": is_distributed(),
        "backend": backend(),
        "device": str(device()),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "launcher": _launcher_name(),
        "torch": torch.__version__,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def _layout() -> _Layout:
    if not is_distributed():
        return _Layout(0, 1, 0, 1)
    state = job.group_state(dist.group.WORLD)
    if state.layout is None:
        state.layout = _from_env() or _from_hostnames()
    layout: _Layout = state.layout
    return layout


def _launcher_name() -> str | None:
    for name, names in _LAUNCHERS.items():
        if names[0] in os.environ:
            return name
    return None


def _from_env() -> _Layout | None:
    """The layout the launcher exported, if it is complete and matches the group."""
    name = _launcher_name()
    if name is None:
        return None
    rank_var, world_var, lrank_var, lsize_var, node_var, nnodes_var = _LAUNCHERS[name]
    env, rank, world = os.environ, dist.get_rank(), dist.get_world_size()
    try:
        if int(env[rank_var]) != rank or int(env[world_var]) != world:
            return None
        if name == "slurm":
            found = slurm.layout(env, rank, world)
            return None if found is None else _Layout(*found)
        names = (lrank_var, lsize_var, node_var, nnodes_var)
        values = [int(env[var]) for var in names if var is not None]
        return _Layout(*values) if len(values) == len(names) else None
    except (KeyError, ValueError):
        return None


def _from_hostnames() -> _Layout:
    """Group ranks by hostname: nodes numbered in order of their lowest rank."""
    hosts = control.hosts(default_timeout(), dist.group.WORLD)
    nodes = list(dict.fromkeys(hosts))
    rank = dist.get_rank()
    mine = hosts[rank]
    peers = [r for r, h in enumerate(hosts) if h == mine]
    return _Layout(peers.index(rank), len(peers), nodes.index(mine), len(nodes))


def local_group() -> Any:
    """The process group of the ranks on this machine.

    Made once, on first use, from the ranks' hostnames: that first call is a collective
    of the whole job (every rank makes its machine's group, as ``new_subgroups`` needs),
    later calls return it at once.  Pass it as ``group=`` to gather within each machine,
    as detectron2's ``create_local_process_group`` does.

    Returns:
        A ``torch.distributed`` process group; None without a process group.

    Raises:
        GatherTimeout: at the first call, ranks that published no hostname within
            ``GATHERSTORE_TIMEOUT``, named.

    Examples:
        >>> parts = gs.gather_object(preds, group=gs.local_group())
    """
    if not is_distributed():
        return None
    state = job.group_state(dist.group.WORLD)
    if state.local is None:
        hosts = control.hosts(default_timeout(), dist.group.WORLD)
        nodes = [[r for r, h in enumerate(hosts) if h == node] for node in dict.fromkeys(hosts)]
        state.local, _ = dist.new_subgroups_by_enumeration(nodes)  # type: ignore[no-untyped-call]
    return state.local


def group_nodes() -> int:
    """How many machines the current group (see ``gatherstore.job.state.using``) spans:
    the job's node count for the default group; for another, its members' hostnames
    counted once (they published them at their first use of the group)."""
    if not is_distributed():
        return 1
    state = job.group_state()
    if state.is_default:
        return get_nnodes()
    if not state.nodes:
        state.nodes = len(set(control.hosts(default_timeout())))
    return state.nodes


def settle() -> None:
    """Compute the layout now, on every rank at once (``launch`` and ``init_from_env``
    call it), so that no getter waits later."""
    _layout()
