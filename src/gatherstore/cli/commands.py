"""What each subcommand of ``gatherstore`` does, once its arguments are parsed.

Apart from the parser (``cli.main``), which imports this module only when a command
runs: ``gatherstore --help`` and a bad argument cost no import of torch, the bench or
the launcher.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from importlib import metadata

from gatherstore._config import ROUTES
from gatherstore.calls import objects
from gatherstore.cli import check, demo
from gatherstore.cli import results as results_cli
from gatherstore.job import topology
from gatherstore.job.cleanup import collect
from gatherstore.job.launch import joined_from_env
from gatherstore.results import admin as result_sets
from gatherstore.stores.base import hide_password
from gatherstore.stores.registry import default_store, open_store
from gatherstore.stores.tmpdir import default_tmpdir_base

__all__ = ["run"]

_VERSIONS = ("gatherstore", "torch", "numpy", "fsspec", "cloudpickle", "redis", "s3fs", "mmengine")


def run(args: argparse.Namespace) -> int:
    """Run the command ``args`` names; its exit status."""
    return int(_HANDLERS[args.command](args))


# --- demo ------------------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    cfg = demo.DemoConfig(args.nproc, args.size, args.store, args.stream, compare=args.compare)
    demo.run(cfg)
    return 0


# --- bench -----------------------------------------------------------------------------------
def _bench(args: argparse.Namespace) -> int:
    """The benchmark a mode option names, else the default run of every case."""
    if args.scale:
        from gatherstore.cli.bench import scale

        return scale.main(args.scale)
    if args.latency:
        from gatherstore.cli.bench import latency

        return latency.main(args.latency)
    if args.soak:
        from gatherstore.cli.bench import soak

        return soak.main(args.soak, redis=args.redis)
    if args.result_sets:
        from gatherstore.cli.bench import resultsets

        (_, add), (_, items) = (args.result_sets * 2)[:2]
        return resultsets.main(add, items, args.repeats)
    if args.export:
        from gatherstore.cli.bench import exports

        return exports.main(args.export, args.repeats)
    if args.share_local and not args.hosts:
        raise ValueError("--share-local goes with --hosts 2")
    if args.hosts:
        from gatherstore.cli.bench import hostbench

        return hostbench.main(share_local=args.share_local, repeats=args.repeats)
    if args.group_size:
        from gatherstore.cli.bench import groups

        kinds = args.payloads or ["detections"]
        return groups.main(
            args.world, args.group_size, args.sizes, kinds, args.repeats, args.timeout
        )
    if args.s3_latency and not args.parts:
        raise ValueError("--s3-latency goes with --parts W")
    if args.parts:
        from gatherstore.cli.bench import parts

        return parts.main(
            args.parts,
            args.part_size,
            args.repeats,
            redis=args.redis,
            s3=args.s3,
            s3_latency=args.s3_latency,
        )
    return _bench_cases(args)


def _bench_cases(args: argparse.Namespace) -> int:
    """The default bench: the stores against the usual tools."""
    from gatherstore.cli.bench import payloads, suite

    kinds = payloads.defaults() if args.payloads is None else args.payloads
    plan = suite.Plan(args.sizes, args.world, kinds, args.repeats, args.timeout, args.map_images)
    if args.quick:  # the preset's sizes; --cases still chooses
        plan, args.ceiling_size = suite.QUICK, suite.QUICK_CEILING
        args.cases = args.cases or suite.QUICK_CASES
    failed = suite.run(
        plan,
        patterns=args.cases,
        redis=args.redis,
        s3=args.s3,
        services=args.services,
        ceiling_bytes=args.ceiling_size,
        json_path=args.json,
        plot_path=args.plot,
        progress=sys.stderr.isatty(),
    )
    if args.quick:
        print(f"bench: {suite.FULL_RUN}", file=sys.stderr)
    return 1 if failed else 0


# --- gc ------------------------------------------------------------------------------------
def _gc(args: argparse.Namespace) -> int:
    if args.store in ROUTES:
        raise ValueError(f"gc needs a store URL, not the route {args.store!r}")
    with open_store(args.store) as store:
        removed, failed = collect(store, args.older_than, dry_run=args.dry_run)
        sets, sets_failed = (
            result_sets.collect(store, args.older_than, dry_run=args.dry_run)
            if args.result_sets
            else ([], [])
        )
    verb = "would remove" if args.dry_run else "removed"
    now = time.time()
    for item in removed:
        quiet = _age(now - item.seen)
        print(f"{verb} {item.where} (job {item.job}, last {item.source} {quiet} ago)")
    for found in sets:
        print(f"{verb} result set {found.name!r} (last run {_age(now - found.seen)} ago)")
    for where in [item.where for item in failed] + [f"result set {f.name!r}" for f in sets_failed]:
        print(f"could not remove {where}; check its permissions", file=sys.stderr)
    print(f"{verb} {len(removed)} job area(s) from {store}")
    if args.result_sets:
        print(f"{verb} {len(sets)} result set(s) from {store}")
    return 1 if failed or sets_failed else 0


def _age(seconds: float) -> str:
    """A duration for people: ``42 s``, ``12 min``, ``3.5 h``, ``2.0 d``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 172800 else f"{seconds / 86400:.1f} d"


# --- check and describe ----------------------------------------------------------------------
def _check(args: argparse.Namespace) -> int:
    return check.run(args.store, args.nproc, args.timeout)


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in _VERSIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _store_problem(spec: object) -> str | None:
    """Why the default store cannot be opened (its scheme, syntax, options or package), or
    None; nothing is connected to."""
    if not isinstance(spec, str) or spec in ROUTES:
        return None
    try:
        open_store(spec).close()
    except (ValueError, TypeError, ImportError) as exc:
        return f"the default store GATHERSTORE_STORE={hide_password(spec)} is unusable: {exc}"
    return None


def _describe(args: argparse.Namespace) -> int:
    with joined_from_env(None):
        info = topology.describe()
        ranks = objects.gather_object(topology.describe(), store="collective")
    if ranks is None:
        return 0
    spec = default_store()
    problem = _store_problem(spec)
    if problem:
        print(f"gatherstore describe: warning: {problem}", file=sys.stderr)
        info["warnings"] = [problem]
    info.update(
        default_store=hide_password(str(spec)),
        auto_threshold=objects.AUTO_THRESHOLD,
        tmpdir_base=default_tmpdir_base(),
        versions=_versions(),
    )
    if len(ranks) > 1:
        info["ranks"] = ranks
    print(json.dumps(info, indent=2, default=str))
    return 0


_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": _demo,
    "bench": _bench,
    "check": _check,
    "gc": _gc,
    "results": results_cli.run,
    "describe": _describe,
}
