"""Start, join and end a process group: ``launch``, ``init_from_env``, ``shutdown``."""

import contextlib
import datetime as _dt
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from gatherstore import codec
from gatherstore._config import Timeout, check_environment, to_seconds
from gatherstore._errors import GatherError, GatherTimeout, RemoteRankError
from gatherstore.host import mappings
from gatherstore.job import control, gloo, hooks, session, shipping, signals, slurm, specs, topology
from gatherstore.job import published as publication
from gatherstore.job import state as job
from gatherstore.stores.base import Store
from gatherstore.stores.registry import default_store

__all__ = ["STOP_GRACE", "init_from_env", "launch", "shutdown"]

#: Seconds the ranks ``launch`` stops have, together, to end on their own (a rank that
#: failed) or on SIGTERM (the others, which remove their job areas) before SIGKILL.
STOP_GRACE = 5.0
#: What the ranks' C++ logs show, unless the environment says: errors only, not the
#: warnings of c10d's waits that gatherstore gives up on as it names the late ranks.
_CPP_LOG_LEVEL = "ERROR"
_log = logging.getLogger("gatherstore")


def _pick_backend(requested: str, nproc_per_node: int) -> str:
    if requested != "auto":
        return requested
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dist.is_nccl_available() and gpus >= nproc_per_node:
        return "nccl"
    return "gloo"


def _join(backend: str, rank: int, world_size: int, local_rank: int, timeout: Timeout) -> None:
    """Initialise the default group (env:// rendezvous) and the control group."""
    check_environment()
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=_dt.timedelta(seconds=to_seconds(timeout)),
    )
    if world_size > 1:
        gloo.group()
        topology.settle()
        # a stopped job removes its areas; installed now, not inside the first gather, so
        # that the program sees the same handlers from the start (see _signals)
        signals.install(session.abandon)
        _prepare_default_store(to_seconds(timeout))


def _prepare_default_store(timeout: float) -> None:
    """Set up the job's area in the default store now, if one is configured
    (``GATHERSTORE_STORE`` or ``set_default_store``), so that the first call does
    not.  A store that cannot be set up now is tried again, and reported, there."""
    try:
        store = specs.resolve(default_store())
        if isinstance(store, Store):  # not a route ("auto", "collective", "stream")
            session.session_for(store, timeout)
    except (GatherError, ValueError, ImportError) as exc:  # every rank alike
        _log.info("gatherstore: the default store is set up at its first call instead: %s", exc)


def launch(
    fn: Callable[..., Any],
    *,
    nproc_per_node: int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    backend: str = "auto",
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: Timeout = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``nproc_per_node`` new processes of one job.

    Each child gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, ...), joins
    the process group, runs ``fn`` and leaves the group; its C++ logs show errors only
    (``TORCH_CPP_LOG_LEVEL=ERROR``, unless set).  The children import the main script:
    call ``launch`` under ``if __name__ == "__main__":``.  When a child fails or dies, or
    this process is interrupted (Ctrl-C), the others get SIGTERM (they remove their job
    areas) and, ``STOP_GRACE`` (5) s later, SIGKILL, as torchrun does.  A collective that
    a rank never reaches raises ``GatherTimeout`` on the others ``timeout`` s after they
    called it: ``launch`` returns at most ``timeout`` + 5 s (``gloo.GRACE``, after a
    transfer) + ``STOP_GRACE`` after that call.

    Args:
        fn: what every rank runs: any callable cloudpickle can ship, lambdas and
            closures included.  One the ranks can import (a function of the main
            script or of a module) goes by reference, so that tracebacks name its
            file and line.
        nproc_per_node: the processes started here, one per GPU under NCCL.
        nnodes: the machines of the job, each running ``launch`` with the same
            arguments but its own ``node_rank``.
        node_rank: this machine's index, from 0 to ``nnodes - 1``.
        master_addr: the address of node 0, where the rendezvous store listens.
        master_port: that store's port, the same on every node; None (one node only):
            a free port, picked here.
        backend: ``"nccl"``, ``"gloo"``, or ``"auto"``: NCCL when every local rank
            has a GPU of its own (each then on ``cuda:LOCAL_RANK``), else gloo.
        args: the positional arguments of ``fn``.
        kwargs: the keyword arguments of ``fn``.
        timeout: the process group's timeout and the ranks' default one: seconds or a
            ``timedelta``; None: ``GATHERSTORE_TIMEOUT``.

    Returns:
        The local ranks' return values, in rank order.

    Raises:
        GatherTimeout: ranks did not arrive at a collective in time; names them
            (``ranks``) and the ``timeout``, as the ranks that waited saw it.
        RemoteRankError: a child raised or died; names the rank the failure started
            on (not one that only relays it), with its traceback text.
        ValueError: bad arguments (e.g. no ``master_port`` for several nodes) or settings.
        RuntimeError: a rank importing the main script ran it (no ``__main__`` guard).

    Examples:
        >>> def evaluate(dataset):
        ...     return len(dataset[gs.get_rank() :: gs.get_world_size()])
        >>> if __name__ == "__main__":
        ...     print(gs.launch(evaluate, nproc_per_node=4, args=(range(1000),)))
        [250, 250, 250, 250]
    """
    _check_call(nproc_per_node, nnodes, node_rank, master_port)
    check_environment()
    seconds = to_seconds(timeout)
    chosen = _pick_backend(backend, nproc_per_node)
    payload = (*shipping.ship_function(fn), cloudpickle.dumps((tuple(args), dict(kwargs or {}))))
    server = None
    if master_port is None:
        server = _host_rendezvous(master_addr, nproc_per_node * nnodes, seconds)
        master_port = server.port
    hosted = server is not None
    env = _environment(master_addr, master_port, nproc_per_node, nnodes, node_rank, hosted)
    env["GATHERSTORE_TIMEOUT"] = repr(seconds)  # the ranks' calls wait as long as their group
    try:
        return _run_ranks(payload, env, chosen, timeout, node_rank * nproc_per_node)
    finally:
        if server is not None:  # what a stopped job left behind, rank 0 published here
            publication.sweep(server)
        del server  # stops the store's server, if this process hosted one


def _run_ranks(
    payload: tuple[bytes | None, bytes | None, bytes],
    env: dict[str, str],
    backend: str,
    timeout: Timeout,
    first_rank: int,
) -> list[Any]:
    """Start this node's ranks (``env``: torchrun's variables but ``RANK`` and
    ``LOCAL_RANK``), return their results, and stop whichever still runs."""
    procs: list[Any] = []
    conns: list[Connection] = []
    failed: set[int] = set()  # the local ranks that reported a failure
    try:
        for local_rank in range(int(env["LOCAL_WORLD_SIZE"])):
            rank = first_rank + local_rank
            child_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
            proc, conn = _start_child(payload, child_env, backend, timeout)
            procs.append(proc)
            conns.append(conn)
        return _collect(procs, conns, first_rank, failed)
    finally:
        _stop(procs, failed)
        for conn in conns:
            conn.close()


def _check_call(nproc_per_node: int, nnodes: int, node_rank: int, master_port: int | None) -> None:
    """Refuse, before anything starts, a ``launch`` that a spawning rank runs again while it
    imports the main script, and arguments that describe no job."""
    if getattr(mp.current_process(), "_inheriting", False):  # set while spawn imports __main__
        raise RuntimeError(
            "gatherstore.launch() ran again while a launched rank was importing the main "
            'script: call launch() under `if __name__ == "__main__":` in that script'
        )
    if nproc_per_node < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(
            f"nproc_per_node={nproc_per_node}, nnodes={nnodes}, node_rank={node_rank}: "
            "need nproc_per_node >= 1, nnodes >= 1 and 0 <= node_rank < nnodes"
        )
    if master_port is None and nnodes > 1:
        raise ValueError(
            "master_port=None only works on one node: pass the same master_port "
            "(a free port on master_addr) to launch() on every node"
        )


def _environment(
    master_addr: str,
    master_port: int,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    agent_store: bool,
) -> dict[str, str]:
    """torchrun's variables for every local rank (RANK and LOCAL_RANK aside);
    ``agent_store``: this process hosts the rendezvous store."""
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(nproc_per_node * nnodes),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes),
        # env:// rendezvous: every rank is a client of the parent's store, or rank 0 hosts it
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
    }


def _host_rendezvous(master_addr: str, world_size: int, seconds: float) -> Any:
    """Host the rendezvous store in this process, on a port the OS picks while binding (as
    torchrun's agent does): no window in which another process can take a "free" port, and
    the store outlives any child that dies."""
    return dist.TCPStore(  # type: ignore[attr-defined]
        master_addr,
        0,
        world_size,
        is_master=True,
        timeout=_dt.timedelta(seconds=seconds),
        wait_for_workers=False,
    )


def _start_child(
    payload: tuple[bytes | None, bytes | None, bytes],
    env: dict[str, str],
    backend: str,
    timeout: Timeout,
) -> tuple[Any, Connection]:
    """Spawn the rank ``env`` names, running ``_child``; the process and the end of the pipe
    its result comes back on."""
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_child,
        args=(payload, env, backend, timeout, child_end),
        name=f"gatherstore-rank{env['RANK']}",
    )
    with _inherited("TORCH_CPP_LOG_LEVEL", _CPP_LOG_LEVEL):
        proc.start()
    child_end.close()
    return proc, parent_end


@contextlib.contextmanager
def _inherited(name: str, value: str) -> Iterator[None]:
    """Set ``name`` for the processes started meanwhile, unless it is set: read as a
    spawned rank imports torch, before ``_child`` applies the rank's own variables."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _collect(
    procs: list[Any], conns: list[Connection], first_rank: int, failed: set[int]
) -> list[Any]:
    """Wait for every child's result; on the first failure raise it (``_error``), naming
    the rank it started on: a child that relays another local rank's failure waits (a
    grace period) for that rank's own report.  ``failed`` gets the local ranks that
    reported a failure (they end on their own)."""
    results: list[Any] = [None] * len(procs)
    pending = dict(enumerate(conns))
    relayed: GatherError | None = None
    deadline = float("inf")
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sentinels = [procs[i].sentinel for i in pending]
        ready = wait(list(pending.values()) + sentinels, None if relayed is None else left)
        for i, conn in list(pending.items()):
            rank = first_rank + i
            if conn in ready or conn.poll():
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "died", None
                del pending[i]
                if status == "ok":
                    results[i] = cloudpickle.loads(value)
                    continue
                if status == "died":
                    procs[i].join(timeout=STOP_GRACE)  # its pipe closed as it ended
                    raise RemoteRankError(rank, _died(procs[i].exitcode), context="launch")
                failed.add(i)
                failure: shipping.Failure = value
                error = _error(failure)
                if failure.origin == rank or failure.origin - first_rank not in pending:
                    raise error
                if relayed is None:  # the failing rank's own report follows: wait for it
                    relayed, deadline = error, time.monotonic() + STOP_GRACE
            elif procs[i].sentinel in ready:
                procs[i].join()
                del pending[i]
                raise RemoteRankError(rank, _died(procs[i].exitcode), context="launch")
    if relayed is not None:
        raise relayed
    return results


def _error(failure: shipping.Failure) -> GatherError:
    """What ``launch`` raises for a rank's failure: a ``GatherTimeout`` that names the
    ranks that did not arrive, as that rank raised it; else a ``RemoteRankError``."""
    if failure.late:
        return GatherTimeout(
            f"{failure.message}; launch stopped the job (rank {failure.origin} waited)",
            ranks=failure.late,
            timeout=failure.timeout,
        )
    return RemoteRankError(
        failure.origin, failure.message, remote_traceback=failure.traceback, context="launch"
    )


def _stop(procs: list[Any], failed: set[int]) -> None:
    """Stop children as torchrun does: SIGTERM to those still running (they clean up) but
    the ``failed`` ones (which end on their own), then, ``STOP_GRACE`` s later for all of
    them together, SIGKILL."""
    for i, proc in enumerate(procs):
        if i not in failed and proc.is_alive():
            proc.terminate()
    ends = time.monotonic() + STOP_GRACE
    for proc in procs:
        proc.join(timeout=max(ends - time.monotonic(), 0.0))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _died(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} before returning"
    return f"exited with code {exitcode} before returning (its stderr says why)"


def _child(
    payload: tuple[bytes | None, bytes | None, bytes],
    env: dict[str, str],
    backend: str,
    timeout: Timeout,
    conn: Connection,
) -> None:
    os.environ.update(env)
    try:
        reference, value, arguments = payload
        fn = shipping.load_function(reference, value)
        args, kwargs = cloudpickle.loads(arguments)
        _join(backend, int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), timeout)
        result = fn(*args, **kwargs)
        shutdown()
        message: tuple[str, Any] = ("ok", cloudpickle.dumps(result))
    except BaseException as exc:  # report everything, SystemExit included
        # report first: the parent stops the other ranks, so shutdown cannot hang
        conn.send(("error", shipping.failure_of(exc, int(env["RANK"]))))
        conn.close()
        shutdown(wait=False)
        return
    conn.send(message)
    conn.close()


def init_from_env(backend: str = "auto", timeout: Timeout = None) -> bool:
    """Join the process group the environment describes: torchrun's, SLURM's, or none.

    Reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ``LOCAL_RANK``), or SLURM's (``SLURM_PROCID``, ``SLURM_NTASKS``,
    ``SLURM_LOCALID``, and ``MASTER_ADDR`` taken from the first host of the step's
    ``SLURM_STEP_NODELIST``, else of the job's ``SLURM_JOB_NODELIST``; ``MASTER_PORT``
    defaults to 29500).  Leave the group with ``shutdown``.

    Args:
        backend: ``"nccl"``, ``"gloo"``, or ``"auto"``: NCCL when every local rank
            has a GPU of its own (each then on ``cuda:LOCAL_RANK``), else gloo.
        timeout: the process group's timeout: seconds or a ``timedelta``; None:
            ``GATHERSTORE_TIMEOUT``.

    Returns:
        True when a group was joined (or already existed), False in a plain
        single process with none of those variables (the serial answers apply).

    Raises:
        ValueError: the variables are incomplete, a SLURM node list is malformed, or a
            setting is (e.g. ``GATHERSTORE_PROGRESS``).

    Examples:
        >>> if __name__ == "__main__":  # run by torchrun, srun, or plain python
        ...     gs.init_from_env()
        ...     evaluate(dataset)
        ...     gs.shutdown()
    """
    if topology.is_distributed():
        return True
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", "0"))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local_rank = int(env.get("SLURM_LOCALID", "0"))
        if "MASTER_ADDR" not in env:
            env["MASTER_ADDR"] = slurm.master_addr(env)
        env.setdefault("MASTER_PORT", "29500")
    else:
        return False
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise ValueError(
            "RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not: "
            "export both (torchrun does this for you)"
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_size = int(env.get("LOCAL_WORLD_SIZE", str(max(gpus, 1))))
    _join(_pick_backend(backend, local_size), rank, world, local_rank, timeout)
    return True


@contextlib.contextmanager
def joined_from_env(timeout: Timeout) -> Iterator[bool]:
    """Join the job the environment describes, if any (torchrun, SLURM, or the caller's
    own process group); leave it afterwards if this joined it.  Yields whether a job
    was joined."""
    owned = not topology.is_distributed()
    joined = init_from_env(timeout=timeout)
    try:
        yield joined
    finally:
        if joined and owned:
            shutdown()


def shutdown(*, wait: bool = True, timeout: Timeout = None) -> None:
    """Leave and destroy the process group (no-op without one), leaving nothing behind.

    Open result sets first write what they buffered and end their runs (see
    ``gs.ResultSet``).  Rank 0 then removes the job areas gatherstore created in its
    stores; if rank 0 is gone (its rendezvous store with it), this rank removes them
    itself, and a rank 0 that is only late removes them when it gets here.  The pinned
    memory that CUDA tensors were gathered through is released, and the memory of the
    parts the program no longer holds is returned to the system.

    Args:
        wait: every rank meets first, so that no rank is still reading what rank 0
            removes.  False: leave at once (after a failure, say).
        timeout: how long that meeting waits for ranks that are gone: seconds or a
            ``timedelta``; None: the timeout of the job's last call that used a store.

    Raises:
        ValueError: ``timeout`` is not a positive number of seconds.

    Examples:
        >>> gs.init_from_env()
        >>> try:
        ...     evaluate(dataset)
        ... finally:
        ...     gs.shutdown()
    """
    seconds = to_seconds(timeout) if timeout is not None else session.last_timeout()
    hooks.run(before_group_ends=True)  # result sets write what they buffered first
    if topology.is_distributed():
        if wait and session.has_sessions():
            try:
                control.serialized(control.exchange)(
                    b"", timeout=seconds or to_seconds(None), what="shutdown"
                )
            except GatherError as exc:
                # a rank 0 that is only late (say, still reading a gather_iter) removes its
                # areas itself; one whose rendezvous store is gone does not
                session.after_failure(exc, late_counts=False)
        session.end_sessions()
        signals.uninstall()
        control.outlive_readers()
        dist.destroy_process_group()
    specs.close_opened()
    codec.release_pinned()
    hooks.run(before_group_ends=False)  # the handover's listener is closed
    mappings.drained()
    job.forget_groups()
