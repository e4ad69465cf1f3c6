"""ignite's process setup: ``spawn``, ``initialize``, ``finalize`` and ``Parallel``.

Processes start through ``gatherstore.launch``; input checks and log
lines are ignite's, with ignite's messages.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

import gatherstore as gs
from gatherstore._config import to_seconds
from gatherstore._errors import seconds as format_seconds
from gatherstore.compat._ignite_model import (
    available_backends,
    get_local_rank,
    get_world_size,
    rank_zero_logger,
)
from gatherstore.job import slurm

__all__ = ["Parallel", "finalize", "initialize", "spawn"]

_saved_env: list[dict[str, str] | None] = [None]
_TORCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
_ADDRESS_KEY = "gatherstore/ignite/master"


def _assert_backend(name: str) -> None:
    backends = available_backends()
    if name not in backends:
        raise ValueError(f"Backend should be one of '{backends}'")


def _refuse_tcp(init_method: str | None) -> None:
    if init_method is not None and init_method.startswith("tcp://"):
        raise ValueError(
            f"TCP initialization via init_method='{init_method}' will hang. "
            "To fix this, please configure MASTER_ADDR and MASTER_PORT in the environment and "
            "use 'env://' (or omit init_method)."
        )


def _spawned(fn: Callable[..., Any], args: tuple[Any, ...], kwargs_dict: Mapping[str, Any]) -> None:
    fn(gs.get_local_rank(), *args, **kwargs_dict)


def _address_through_file(
    init_method: str, nnodes: int, node_rank: int, timeout: Any
) -> tuple[str, int, Any]:
    """The job's master address, which node 0 writes into ``init_method``'s shared file.

    Node 0 publishes its hostname and a free port; the other nodes wait for
    them.  The store is returned to keep the file until the job ends (the last
    node to let go removes it).

    Raises:
        TimeoutError: node 0's address did not appear within the timeout.
    """
    path = init_method[len("file://") :]
    store = dist.FileStore(path, nnodes)  # type: ignore[attr-defined]
    seconds = to_seconds(timeout)
    store.set_timeout(_dt.timedelta(seconds=seconds))
    if node_rank == 0:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        store.set(_ADDRESS_KEY, f"{socket.gethostname()}:{port}")
    try:
        host, _, port_text = store.get(_ADDRESS_KEY).decode().rpartition(":")
    except RuntimeError as exc:  # torch's store timeout
        del store
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the file this node made, waiting in vain
        raise TimeoutError(
            f"node {node_rank}: node 0 wrote no address into {path} within "
            f"{format_seconds(seconds)} s; "
            "init_method='file://...' must name a file on a filesystem every node shares, "
            "and node 0 must run spawn() too"
        ) from exc
    return host, int(port_text), store


def spawn(
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs_dict: Mapping[str, Any] | None = None,
    nproc_per_node: int = 1,
    **kwargs: Any,
) -> None:
    """Run ``fn(local_rank, *args, **kwargs_dict)`` in ``nproc_per_node`` processes.

    Processes start through ``gatherstore.launch``; ``kwargs`` may hold
    nnodes, node_rank, master_addr, master_port (default: a free port on one
    node), init_method and timeout.  With ``init_method="file://<path>"`` on
    one node the file is not needed; across nodes node 0 publishes its address
    and a free port in it, and the nodes join there.

    Raises:
        ValueError: unknown backend, a tcp:// init_method, master_addr/master_port
            with a file:// init_method, or options gatherstore's launcher lacks.
        TimeoutError: across nodes, node 0's address never appeared in the file.
        gatherstore.RemoteRankError: a process raised; names its rank.
    """
    _assert_backend(backend)
    init_method = kwargs.pop("init_method", None)
    kwargs.pop("start_method", None)
    if not kwargs.pop("join", True) or kwargs.pop("daemon", False):
        raise ValueError("spawn() here supports join=True and daemon=False only")
    known = {"nnodes", "node_rank", "master_addr", "master_port", "timeout"}
    if set(kwargs) - known:
        raise ValueError(
            f"spawn() got unsupported options {sorted(set(kwargs) - known)}; use {sorted(known)}"
        )
    store = None
    if init_method not in (None, "env://"):
        for name in ("master_addr", "master_port"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"{name} should be None if init_method is provided other then 'env://'"
                )
        _refuse_tcp(init_method)
        if not init_method.startswith("file://"):
            raise ValueError(f"init_method={init_method!r}: use 'env://' or 'file://<shared path>'")
        if kwargs.get("nnodes", 1) > 1:
            host, port, store = _address_through_file(
                init_method, kwargs["nnodes"], kwargs.get("node_rank", 0), kwargs.get("timeout")
            )
            kwargs.update(master_addr=host, master_port=port)
    if kwargs.get("master_addr") is None:
        kwargs.pop("master_addr", None)
    try:
        gs.launch(
            _spawned,
            nproc_per_node=nproc_per_node,
            backend=backend,
            args=(fn, tuple(args), dict(kwargs_dict or {})),
            **kwargs,
        )
    finally:
        del store  # node 0's file lives until here


def _env_from_slurm(env: MutableMapping[str, str]) -> None:
    """RANK, LOCAL_RANK, WORLD_SIZE and the master from a SLURM task's variables.

    Kept as they are when a launcher inside the allocation set all of them.
    The master is the first node of the step; its port 15000 plus the job id's
    last four digits, the same on every task.
    """
    if all(name in env for name in (*_TORCH_VARS, "MASTER_ADDR", "MASTER_PORT")):
        return
    for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"):
        if name not in env:
            raise RuntimeError(
                f"SLURM distributed configuration is missing '{name}' in env variables"
            )
    env.update(
        RANK=env["SLURM_PROCID"],
        LOCAL_RANK=env["SLURM_LOCALID"],
        WORLD_SIZE=env["SLURM_NTASKS"],
        MASTER_ADDR=slurm.master_addr(env),
        MASTER_PORT=str(15000 + int(env["SLURM_JOB_ID"][-4:])),
    )


def _setup_env(rank: int | None, world_size: int | None) -> None:
    """The variables env:// needs, from SLURM or the launcher, else those of one process."""
    env = os.environ
    if "SLURM_JOB_ID" in env:
        if rank is not None or world_size is not None:
            raise ValueError("Arguments rank and world_size should not be specified with SLURM")
        _env_from_slurm(env)
        return
    present = [name in env for name in _TORCH_VARS]
    if any(present) and not all(present):
        raise RuntimeError(
            f"PyTorch distributed configuration should define env variables '{list(_TORCH_VARS)}'"
        )
    env.setdefault("RANK", str(0 if rank is None else rank))
    env.setdefault("WORLD_SIZE", str(1 if world_size is None else world_size))
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_PORT", "15000")
    env.setdefault("MASTER_ADDR", "127.0.0.1")


def initialize(backend: str, **kwargs: Any) -> None:
    """Create the process group from the environment (torchrun's or SLURM's, else one process).

    ``kwargs``: timeout, init_method (env:// or file://), world_size, rank.
    Nothing is created and the environment is left as it was when this raises.

    Raises:
        ValueError: unknown backend; a tcp:// init_method; rank/world_size under SLURM;
            a process group exists already.
        RuntimeError: NCCL without CUDA; RANK,
            LOCAL_RANK and WORLD_SIZE only partly set.
    """
    _assert_backend(backend)
    init_method = kwargs.pop("init_method", None) or "env://"
    _refuse_tcp(init_method)
    if gs.is_distributed():  # torch's words, which ignite's users see
        raise ValueError("trying to initialize the default process group twice!")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("Nccl backend is required but no cuda capable devices")
    rank, world = kwargs.pop("rank", None), kwargs.pop("world_size", None)
    saved = dict(os.environ)
    try:
        _setup_env(rank, world)
        options: dict[str, Any] = {k: v for k, v in kwargs.items() if v is not None}
        if "env" not in init_method:
            options.update(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(backend, init_method=init_method, **options)
    except BaseException:
        os.environ.clear()
        os.environ.update(saved)
        raise
    _saved_env[0] = saved
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    gs.barrier()


def finalize() -> None:
    """Destroy the process group and restore the environment that ``initialize`` changed."""
    gs.shutdown()
    saved = _saved_env[0]
    if saved is not None:
        os.environ.clear()
        os.environ.update(saved)
        _saved_env[0] = None


def _spawn_params(
    nproc_per_node: int,
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    init_method: str | None,
    **spawn_kwargs: Any,
) -> dict[str, Any]:
    """ignite's checks of the arguments that spawn processes; the set ones, for spawn()."""
    if nproc_per_node < 1:
        raise ValueError(f"Argument nproc_per_node should positive, but given {nproc_per_node}")
    nnodes = 1 if nnodes is None else nnodes
    if nnodes < 1:
        raise ValueError(f"Argument nnodes should positive, but given {nnodes}")
    if node_rank is None:
        if nnodes > 1:
            raise ValueError(
                "If number of nodes larger than one, arguments node_rank should be given"
            )
        node_rank = 0
    if not 0 <= node_rank < nnodes:
        raise ValueError(
            f"Argument node_rank should be between 0 and {nnodes - 1}, but given {node_rank}"
        )
    if nnodes > 1 and (master_addr is None or master_port is None) and init_method is None:
        raise ValueError(
            "If number of nodes larger than one, arguments master_addr and master_port or "
            f"init_method should be specified, but given master_addr={master_addr}, "
            f"master_port={master_port} and init_method={init_method}."
        )
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


class Parallel:
    """Run a function in a distributed configuration: spawned, or in the current process group.

    Raises:
        ValueError: unknown backend; launch arguments without a backend; a
            tcp:// init_method; bad counts (ignite's messages).
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
        if backend is not None and backend not in available_backends():
            raise ValueError(
                f"Unknown backend '{backend}'. Available backends: {available_backends()}"
            )
        if backend is None:
            for name, value in (
                ("nproc_per_node", nproc_per_node),
                ("nnodes", nnodes),
                ("node_rank", node_rank),
                ("master_addr", master_addr),
                ("master_port", master_port),
            ):
                if value is not None:
                    raise ValueError(
                        f"If backend is None, argument '{name}' should be also None, "
                        f"but given {value}"
                    )
        _refuse_tcp(init_method)
        self.backend = backend
        self.init_method = init_method
        self._spawn_params: dict[str, Any] | None = None
        if backend is not None and nproc_per_node is not None:
            self._spawn_params = _spawn_params(
                nproc_per_node,
                nnodes,
                node_rank,
                master_addr,
                master_port,
                init_method,
                **spawn_kwargs,
            )

    @property
    def _logger(self) -> logging.Logger:
        return rank_zero_logger("ignite.distributed.launcher.Parallel")

    def run(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Spawn ``func(local_rank, *args, **kwargs)`` in new processes, or call it here."""
        if self._spawn_params is not None and self.backend is not None:
            nproc = self._spawn_params["nproc_per_node"]
            self._logger.info(f"Spawn function '{func}' in {nproc} processes")
            spawn(self.backend, func, args=args, kwargs_dict=kwargs, **self._spawn_params)
        else:
            self._logger.info(f"- Run '{func}' in {get_world_size()} processes")
            func(get_local_rank(), *args, **kwargs)
        self._logger.info("End of run")

    def __enter__(self) -> Parallel:
        if self.backend is not None and self._spawn_params is None:
            initialize(self.backend, init_method=self.init_method)
        if self.backend is not None:
            if self._spawn_params is None:
                self._logger.info(f"Initialized processing group with backend: '{self.backend}'")
            else:
                self._logger.info(
                    f"Initialized distributed launcher with backend: '{self.backend}'"
                )
                lines = "\n\t".join(f"{k}: {v}" for k, v in self._spawn_params.items())
                self._logger.info(f"- Parameters to spawn processes: \n\t{lines}")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.backend is not None and self._spawn_params is None:
            self._logger.info(f"Finalized processing group with backend: '{self.backend}'")
            finalize()
