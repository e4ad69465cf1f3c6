"""``gatherstore check``: whether a store works for the job, in one line.

Reachability, a put/get/delete round trip in a job area of its own (created with
its marker and removed, as a job does), permissions, and, with several ranks,
that every rank sees the store.  It leaves nothing behind: a store's folder that
did not exist (a store creates it at its first use) is removed again, and named.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gatherstore._config import ROUTES
from gatherstore._errors import (
    GatherError,
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


def _missing_folders(spec: str) -> list[Path]:
    """The folders of the store ``spec`` names that do not exist yet, outermost first."""
    if spec in ROUTES:
        return []
    try:
        with open_store(spec) as store:
            folder = store.folder
    except (GatherError, ValueError, ImportError, TypeError):  # the round trip reports it
        return []
    if folder is None:
        return []
    return [p for p in (*reversed(Path(folder).parents), Path(folder)) if not p.exists()]


@contextlib.contextmanager
def _leaving_no_folder(spec: str) -> Iterator[list[str]]:
    """Remove, when the block ends, the folders of ``spec``'s store that did not exist
    when it began (the deepest first; only empty ones); yields the list of those removed.

    Looked at before the job is joined, so before any rank can create them.
    """
    missing = _missing_folders(spec)
    removed: list[str] = []
    try:
        yield removed
    finally:
        for folder in reversed(missing):
            try:
                folder.rmdir()
            except FileNotFoundError:  # another rank of this host was first
                continue
            except OSError:  # not empty: what it holds is not the check's
                break
            removed.insert(0, str(folder))


def _check_report(facts: dict[str, Any]) -> str:
    spec = hide_password(facts["store"])
    lines = [f"route {spec}: the process group" if spec in ROUTES else f"store {spec}: reachable"]
    if facts.get("created"):
        made = facts["created"]
        lines[0] += (
            f"; created the missing folder{'s' * (len(made) > 1)} {', '.join(made)} "
            "(removed after the check)"
        )
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
    with _leaving_no_folder(spec) as removed:
        if nproc > 1:
            args = (spec, timeout)
            facts = launch(_check_rank, nproc_per_node=nproc, backend="gloo", args=args)[0]
        else:
            with joined_from_env(timeout):
                facts = _check_rank(spec, timeout)
                rank = topology.get_rank()
            if rank != 0:
                return 0
    print(_check_report({**facts, "created": removed}))
    return 0
