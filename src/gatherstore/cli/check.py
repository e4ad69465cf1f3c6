"""``gatherstore check``: whether a store works for the job, in one line.

Reachability, a put/get/delete round trip in a job area of its own (created with
its marker and removed, as a job does), permissions, and, with several ranks,
that every rank sees the store.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from gatherstore._config import ROUTES
from gatherstore._errors import (
    IntegrityError,
    StoreUnavailableError,
    counted,
    first_line,
)
from gatherstore.calls import objects
from gatherstore.cli import CommandFailed, demo
from gatherstore.cli.bench.measure import format_bytes
from gatherstore.job import topology
from gatherstore.job.launch import joined_from_env, launch
from gatherstore.job.session import create_area
from gatherstore.stores.base import hide_password
from gatherstore.stores.registry import open_store

__all__ = ["CheckFailed", "run"]

_PROBE_BYTES = 1 << 20


class CheckFailed(CommandFailed):
    """``gatherstore check`` found a problem; the message says which rank and what."""


def _roundtrip(spec: str) -> dict[str, Any]:
    """Create a job area, put/get/delete a probe in it, remove it; what was seen.

    Raises:
        StoreUnavailableError / IntegrityError: a step failed (the message says which).
    """
    with open_store(spec) as store:
        start = time.perf_counter()
        try:
            _, locator = create_area(store)
        except OSError as exc:  # the store's message says what to check
            raise StoreUnavailableError(
                f"store {store} cannot create a job area: {exc}", store=str(store)
            ) from exc
        facts: dict[str, Any] = {"store": demo.describe_store(spec)}
        try:
            job = store.join_job(locator)
            probe = os.urandom(_PROBE_BYTES)
            job.put("check/probe", probe)
            back = job.get("check/probe")
            if back is None or bytes(back) != probe:
                raise IntegrityError(
                    f"store {store}: the probe read back differs from the one written"
                )
            job.delete("check/probe")
            if job.exists("check/probe"):
                raise StoreUnavailableError(
                    f"store {store} did not delete the probe", store=str(store)
                )
            facts.update(store.area_facts(locator))
        finally:
            store.end_job(locator)
        if store.holds_area(locator):
            raise StoreUnavailableError(
                f"store {store}: could not remove the job area {locator!r}; check permissions",
                store=str(store),
            )
        facts["seconds"] = time.perf_counter() - start
    return facts


def _check_rank(spec: str, timeout: float) -> dict[str, Any]:
    """The check on one rank: its own round trip, then, with several ranks, the shared-ness."""
    world = topology.get_world_size()
    facts: dict[str, Any] = {"store": spec}
    error = None
    try:
        if spec not in ROUTES:
            facts = _roundtrip(spec)
    except Exception as exc:
        error = first_line(exc)
    if world == 1:
        if error:
            raise CheckFailed(error)
        return facts
    errors = objects.all_gather_object(error, store="collective", timeout=timeout)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        raise CheckFailed(f"rank {bad[0][0]}: {bad[0][1]}")
    hosts = objects.all_gather_object(socket.gethostname(), store=spec, timeout=timeout)
    facts.update(ranks=world, hosts=sorted(set(hosts)))
    return facts


def _check_report(facts: dict[str, Any]) -> str:
    spec = hide_password(facts["store"])
    lines = [f"route {spec}: the process group" if spec in ROUTES else f"store {spec}: reachable"]
    if "seconds" in facts:
        mode = f" (mode {facts['mode'][2:]})" if "mode" in facts else ""
        lines[0] += (
            f"; job area{mode} created, {format_bytes(_PROBE_BYTES)} put/get/delete, "
            f"removed in {facts['seconds'] * 1000:.1f} ms"
        )
    if "ranks" in facts:
        where = f"{counted(facts['ranks'], 'rank')} on {', '.join(facts['hosts'])}"
        lines.append(f"every rank sees the store: {where}")
    return "\n".join([*lines, "ok"])


def run(spec: str, nproc: int, timeout: float) -> int:
    """``gatherstore check``: on ``nproc`` new local ranks, or on this process's job (under
    torchrun: every rank); prints the report on rank 0.

    Raises:
        CheckFailed: a rank found a problem (named).
    """
    if nproc > 1:
        facts = launch(_check_rank, nproc_per_node=nproc, backend="gloo", args=(spec, timeout))[0]
    else:
        with joined_from_env(timeout):
            facts = _check_rank(spec, timeout)
            rank = topology.get_rank()
        if rank != 0:
            return 0
    print(_check_report(facts))
    return 0
