"""The public surface is explicit: ``__all__`` is pinned here."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import gatherstore as gs

PUBLIC = {
    # topology
    "get_world_size",
    "get_rank",
    "get_local_rank",
    "get_local_size",
    "local_group",
    "get_node_rank",
    "get_nnodes",
    "is_main_process",
    "is_distributed",
    "backend",
    "device",
    "describe",
    "gpu_mem_usage",
    # lifecycle
    "launch",
    "init_from_env",
    "shutdown",
    # sync and rank filters
    "barrier",
    "rank_zero_only",
    "one_rank_only",
    "shared_random_seed",
    # tensors
    "all_reduce",
    "all_reduce_dict",
    "reduce_dict",
    "all_gather_tensor",
    "broadcast_tensor",
    # objects
    "all_gather_object",
    "gather_object",
    "gather_iter",
    "broadcast_object",
    "collect_results",
    # result sets
    "ResultSet",
    # stores
    "Store",
    "open_store",
    "set_default_store",
    "register_store",
    # errors
    "GatherError",
    "GatherTimeout",
    "RemoteRankError",
    "StoreNotSharedError",
    "IntegrityError",
    "StoreUnavailableError",
    "InsufficientMemoryError",
    "MismatchError",
    "ProcessGroupError",
    "__version__",
}


def test_all_is_pinned() -> None:
    assert set(gs.__all__) == PUBLIC
    assert len(gs.__all__) == len(set(gs.__all__))


def test_the_lists_agree() -> None:
    """``__all__`` is the errors, the Store, the version and the lazy names, and each lazy
    name is in its module's own ``__all__``."""
    import importlib

    from gatherstore import _errors

    lazy = gs._lazy()  # type: ignore[attr-defined]
    assert set(gs.__all__) == {*_errors.__all__, "Store", "__version__", *lazy}
    for name, module in lazy.items():
        assert name in importlib.import_module(module, "gatherstore").__all__, (name, module)


def test_the_version_is_pyproject_s() -> None:
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"$', pyproject, re.MULTILINE)
    assert declared is not None
    assert gs.__version__ == metadata.version("gatherstore") == declared.group(1)


def test_every_name_resolves() -> None:
    for name in gs.__all__:
        assert getattr(gs, name) is not None


#: Public subpackages, imported by path (``gatherstore.stores.file``, ...).
SUBPACKAGES = {"stores", "testing", "compat"}
#: The implementation's packages by concept (DESIGN.md's layers): attributes of the
#: package once imported, but no part of the API.
INTERNAL = {"calls", "cli", "codec", "host", "job", "results", "routes"}


def test_no_stray_public_name() -> None:
    for name in gs.__all__:
        getattr(gs, name)  # load every lazy name first
    public = {name for name in vars(gs) if not name.startswith("_")}
    assert public - SUBPACKAGES - INTERNAL == set(gs.__all__) - {"__version__"}
    assert set(dir(gs)) >= set(gs.__all__)


def test_exported_names_report_the_package() -> None:
    """Classes and functions say they are gatherstore's (``help()`` names no private
    module), and pickle by that name."""
    import pickle

    for name in gs.__all__:
        value = getattr(gs, name)
        if callable(value):
            assert value.__module__ == "gatherstore", name
            assert pickle.loads(pickle.dumps(value)) is value, name


def test_import_is_light() -> None:
    code = (
        "import sys, gatherstore; "
        "heavy = [m for m in ('torch', 'tqdm', 'matplotlib', 'gatherstore.cli.main', "
        "'gatherstore.cli.bench', 'gatherstore.testing', 'redis', 'fsspec') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        gs.no_such_thing  # noqa: B018


def test_errors_subclass_the_root_and_a_builtin() -> None:
    pairs = {
        gs.GatherTimeout: TimeoutError,
        gs.RemoteRankError: RuntimeError,
        gs.StoreNotSharedError: RuntimeError,
        gs.IntegrityError: ValueError,
        gs.StoreUnavailableError: ConnectionError,
        gs.InsufficientMemoryError: MemoryError,
        gs.MismatchError: ValueError,
        gs.ProcessGroupError: RuntimeError,
    }
    for error, builtin in pairs.items():
        assert issubclass(error, gs.GatherError)
        assert issubclass(error, builtin)
