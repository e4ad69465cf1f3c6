"""SLURM's environment: node lists, tasks per node, the master host and this task's place.

Inside a job step (``srun``) the ``SLURM_STEP_*`` variables describe the step,
which may run on a subset of the job's nodes with a different number of tasks
per node; they win over the job-wide ``SLURM_JOB_NODELIST``/``SLURM_NODELIST``
and ``SLURM_TASKS_PER_NODE``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["expand_nodelist", "layout", "master_addr", "tasks_per_node"]

# where each fact lives, most specific first
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_TASKS_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_NNODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES")


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((env[name] for name in names if env.get(name)), None)


def master_addr(env: Mapping[str, str]) -> str:
    """The first host of the step's node list (else the job's): where rank 0 runs.

    Raises:
        ValueError: no node list is set, or it is malformed.
    """
    nodelist = _first(env, _NODELIST_VARS)
    if nodelist is None:
        raise ValueError(
            "SLURM task without SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or MASTER_ADDR: "
            "start it with srun, or export MASTER_ADDR=<first node's hostname>"
        )
    return expand_nodelist(nodelist)[0]


def tasks_per_node(spec: str) -> list[int]:
    """Task counts of a ``SLURM_TASKS_PER_NODE`` value, e.g. ``"2(x3),1"`` -> [2, 2, 2, 1].

    Raises:
        ValueError: the value is malformed.
    """
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", item.strip())
        if match is None:
            raise ValueError(
                f"cannot parse SLURM tasks per node {spec!r} at {item!r}: expected "
                "counts such as '2(x3),1'"
            )
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def layout(env: Mapping[str, str], rank: int, world: int) -> tuple[int, int, int, int] | None:
    """``(local_rank, local_size, node_rank, nnodes)`` of task ``rank`` of ``world``.

    The node rank is ``SLURM_NODEID``, else the position of ``SLURMD_NODENAME`` in
    the node list, else (block distribution, srun's default) the node whose tasks
    include ``rank``.  None when the variables are missing, malformed or do not
    add up to ``world`` tasks (the caller then groups ranks by hostname).
    """
    spec, nodelist = _first(env, _TASKS_VARS), _first(env, _NODELIST_VARS)
    try:
        counts = tasks_per_node(spec) if spec else []
        nodes = expand_nodelist(nodelist) if nodelist else None
    except ValueError:
        return None
    nnodes = _first(env, _NNODES_VARS)
    if sum(counts) != world or (nnodes is not None and nnodes != str(len(counts))):
        return None
    starts = [sum(counts[:node]) for node in range(len(counts))]
    block_node = max(node for node, start in enumerate(starts) if start <= rank)
    if env.get("SLURM_NODEID", "").isdecimal():
        node_rank = int(env["SLURM_NODEID"])
    elif nodes is not None and env.get("SLURMD_NODENAME") in nodes:
        node_rank = nodes.index(env["SLURMD_NODENAME"])
    elif env.get("SLURM_DISTRIBUTION", "block").startswith("block"):
        node_rank = block_node
    else:
        return None
    if not node_rank < len(counts):
        return None
    local_id = env.get("SLURM_LOCALID", "")
    local_rank = int(local_id) if local_id.isdecimal() else rank - starts[node_rank]
    if not 0 <= local_rank < counts[node_rank]:
        return None
    return local_rank, counts[node_rank], node_rank, len(counts)


def expand_nodelist(nodelist: str) -> list[str]:
    """Hostnames of a SLURM node list, e.g. ``"gpu[01-03,07],cpu1"`` or ``"r[1-2]-n[1-4]"``.

    Ranges keep the zero padding of their first number; several bracket groups
    in one name expand to every combination, in order.

    Raises:
        ValueError: the list is malformed (unbalanced or nested brackets, empty
            names or ranges, non-numeric or decreasing ranges).
    """
    hosts: list[str] = []
    for name in _split_top_level(nodelist):
        hosts += _expand_name(name, nodelist)
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """The comma-separated names of a node list (commas inside brackets kept)."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"SLURM node list {nodelist!r}: unbalanced or nested brackets")
        if char == "," and depth == 0:
            names.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"SLURM node list {nodelist!r}: unbalanced brackets")
    names.append(nodelist[start:])
    for name in names:
        if not name or any(c.isspace() for c in name):
            raise ValueError(
                f"SLURM node list {nodelist!r} has an empty or blank host name; expected "
                "names such as 'node[01-04,07],gpu1'"
            )
    return names


def _expand_name(name: str, nodelist: str) -> list[str]:
    """Every host of one name with bracket groups, e.g. ``"n[1-2]-ib"``."""
    pieces = re.split(r"\[([^\]]*)\]", name)  # literal, ranges, literal, ..., literal
    expanded = [pieces[0]]
    for ranges, literal in zip(pieces[1::2], pieces[2::2], strict=True):
        numbers: list[str] = []
        for part in ranges.split(","):
            first, dash, last = part.partition("-")
            last = last if dash else first
            digits = re.fullmatch(r"[0-9]+", first) and re.fullmatch(r"[0-9]+", last)
            if not digits or int(first) > int(last):
                raise ValueError(
                    f"cannot parse SLURM node list {nodelist!r} at {part!r}: expected "
                    "ranges such as [01-04,07]"
                )
            numbers += [f"{n:0{len(first)}d}" for n in range(int(first), int(last) + 1)]
        expanded = [f"{head}{n}{literal}" for head in expanded for n in numbers]
    return expanded
