"""gatherstore: gather large Python objects across PyTorch ranks through a pluggable store.

The public API lives here and only here; the implementation lives in private packages
by concept (``calls``, ``routes``, ``codec``, ``job``, ``results``, ...).  Names load on
first use, so that
``import gatherstore`` costs milliseconds and does not import torch until a
function needs it.  ``gatherstore.stores`` (the Store base class and registry),
``gatherstore.testing`` (the conformance suite and pytest plugin, with the
``testing`` extra) and ``gatherstore.compat`` (drop-in modules) are public
subpackages.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from gatherstore import _errors
from gatherstore._errors import (
    GatherError,
    GatherTimeout,
    InsufficientMemoryError,
    IntegrityError,
    MismatchError,
    ProcessGroupError,
    RemoteRankError,
    StoreNotSharedError,
    StoreUnavailableError,
)
from gatherstore.stores.base import Store

if _TYPE_CHECKING:
    from gatherstore.calls.dicts import all_reduce_dict, reduce_dict
    from gatherstore.calls.objects import (
        all_gather_object,
        broadcast_object,
        gather_iter,
        gather_object,
    )
    from gatherstore.calls.rank_filters import one_rank_only, rank_zero_only
    from gatherstore.calls.tensors import (
        all_gather_tensor,
        all_reduce,
        barrier,
        broadcast_tensor,
        shared_random_seed,
    )
    from gatherstore.job.launch import init_from_env, launch, shutdown
    from gatherstore.job.topology import (
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
        local_group,
    )
    from gatherstore.results.collect import collect_results
    from gatherstore.results.resultset import ResultSet
    from gatherstore.stores.registry import open_store, register_store, set_default_store

#: Written out for linters (which read no computed list); tests/test_public_api.py checks
#: that it names what the imports above name, and nothing else.
__all__ = [
    "GatherError",
    "GatherTimeout",
    "InsufficientMemoryError",
    "IntegrityError",
    "MismatchError",
    "ProcessGroupError",
    "RemoteRankError",
    "ResultSet",
    "Store",
    "StoreNotSharedError",
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
    "local_group",
    "one_rank_only",
    "open_store",
    "rank_zero_only",
    "reduce_dict",
    "register_store",
    "set_default_store",
    "shared_random_seed",
    "shutdown",
]

#: Where each lazily loaded name is defined (see ``_lazy``), read at the first lookup.
_LAZY: dict[str, str] | None = None

for _name in (*_errors.__all__, "Store"):  # shown as gatherstore.<name> in tracebacks
    globals()[_name].__module__ = __name__
del _name


def _lazy() -> dict[str, str]:
    """Where each lazily loaded name is defined, read from the imports under
    ``TYPE_CHECKING`` above: each public name is written there once (and in ``__all__``
    for linters, which tests/test_public_api.py checks against them)."""
    import ast

    with open(__file__, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    block = next(n for n in tree.body if isinstance(n, ast.If))
    return {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def __getattr__(name: str) -> _Any:
    global _LAZY
    if name == "__version__":  # pyproject.toml's, from the installed metadata
        from gatherstore._version import version

        globals()[name] = version()
        return globals()[name]
    if _LAZY is None:
        _LAZY = _lazy()
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gatherstore' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    value.__module__ = __name__  # help(), reprs and pickles name gatherstore, not its module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
