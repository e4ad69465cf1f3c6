"""gatherstore: gather large Python objects across PyTorch ranks through a pluggable store."""

from .collectives import (
    all_gather_tensor,
    all_reduce,
    all_reduce_dict,
    barrier,
    broadcast_tensor,
    one_rank_only,
    rank_zero_only,
    reduce_dict,
    shared_random_seed,
)
from .errors import (
    GatherError,
    GatherTimeout,
    IntegrityError,
    MismatchError,
    RemoteRankError,
    StoreNotSharedError,
    StoreUnavailableError,
)
from .launch import init_from_env, launch, shutdown
from .topology import (
    backend,
    describe,
    device,
    get_local_rank,
    get_local_size,
    get_nnodes,
    get_node_rank,
    get_rank,
    get_world_size,
    gpu_mem_usage,
    is_distributed,
    is_main_process,
)

__version__ = "0.1.0"

__all__ = [
    "GatherError",
    "GatherTimeout",
    "IntegrityError",
    "MismatchError",
    "RemoteRankError",
    "StoreNotSharedError",
    "StoreUnavailableError",
    "__version__",
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_dict",
    "backend",
    "barrier",
    "broadcast_tensor",
    "describe",
    "device",
    "get_local_rank",
    "get_local_size",
    "get_nnodes",
    "get_node_rank",
    "get_rank",
    "get_world_size",
    "gpu_mem_usage",
    "init_from_env",
    "is_distributed",
    "is_main_process",
    "launch",
    "one_rank_only",
    "rank_zero_only",
    "reduce_dict",
    "shared_random_seed",
    "shutdown",
]
