"""``ignite.distributed`` with objects and strings gathered through gatherstore.

Same names, signatures, return values, messages, log lines and serial answers
as ``ignite.distributed.utils`` (plus ``auto_*`` and ``Parallel``).  Every
answer reads torch.distributed live, so there is no computation-model state to
sync; only the native (torch.distributed) model exists here.  The functions
live in ``_ignite_model`` (topology), ``_ignite_comm`` (collectives),
``_ignite_launch`` (processes) and ``_ignite_auto``; this module gathers them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gatherstore.compat._ignite_auto import (
    DistributedProxySampler,
    auto_dataloader,
    auto_model,
    auto_optim,
)
from gatherstore.compat._ignite_comm import (
    all_gather,
    all_gather_tensors_with_shapes,
    all_reduce,
    barrier,
    broadcast,
    new_group,
    one_rank_first,
    one_rank_only,
)
from gatherstore.compat._ignite_launch import Parallel, finalize, initialize, spawn
from gatherstore.compat._ignite_model import (
    available_backends,
    backend,
    device,
    get_local_rank,
    get_nnodes,
    get_node_rank,
    get_nproc_per_node,
    get_rank,
    get_world_size,
    has_hvd_support,
    has_native_dist_support,
    has_xla_support,
    hostname,
    model_name,
    registered_computation_models,
    set_local_rank,
    show_config,
    sync,
)
from gatherstore.compat._patching import Patch, patch_module

__all__ = [
    "backend",
    "broadcast",
    "device",
    "available_backends",
    "model_name",
    "get_world_size",
    "get_rank",
    "get_local_rank",
    "get_nproc_per_node",
    "get_node_rank",
    "get_nnodes",
    "spawn",
    "initialize",
    "finalize",
    "show_config",
    "set_local_rank",
    "all_reduce",
    "all_gather",
    "barrier",
    "hostname",
    "has_xla_support",
    "has_native_dist_support",
    "has_hvd_support",
    "sync",
    "registered_computation_models",
    "one_rank_only",
    "new_group",
    "one_rank_first",
    "all_gather_tensors_with_shapes",
    "DistributedProxySampler",
    "Parallel",
    "auto_dataloader",
    "auto_model",
    "auto_optim",
    "patch",
]


def patch() -> Patch:
    """Make the installed ``ignite.distributed`` gather objects and strings through gatherstore.

    Replaces ``all_gather`` and ``broadcast`` wherever ignite bound them;
    the rest of ignite is untouched.

    Raises:
        ImportError: pytorch-ignite is not installed.
    """
    replacements: dict[str, Callable[..., Any]] = {"all_gather": all_gather, "broadcast": broadcast}
    return patch_module("ignite.distributed.utils", "pytorch-ignite", replacements)
