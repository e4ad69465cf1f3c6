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
    InsufficientMemoryError,
    IntegrityError,
    MismatchError,
    RemoteRankError,
    StoreNotSharedError,
    StoreUnavailableError,
)
from .launch import init_from_env, launch, shutdown
from .objects import all_gather_object, broadcast_object, gather_iter, gather_object
from .results import collect_results
from .stores import Store, open_store, register_store, set_default_store
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
    "InsufficientMemoryError",
    "IntegrityError",
    "MismatchError",
    "RemoteRankError",
    "StoreNotSharedError",
    "Store",
    "StoreUnavailableError",
    "__version__",
    "all_gather_object",
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_dict",
    "backend",
    "barrier",
    "broadcast_object",
    "broadcast_tensor",
    "collect_results",
    "describe",
    "device",
    "gather_iter",
    "gather_object",
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
    "open_store",
    "rank_zero_only",
    "reduce_dict",
    "register_store",
    "set_default_store",
    "shared_random_seed",
    "shutdown",
]
