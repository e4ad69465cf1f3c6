"""The ``gatherstore`` command: demo, bench, check, gc, describe, results.

Every failure ends in one line on stderr that names what to fix, and a
non-zero exit: 2 for bad arguments, 1 for a failed run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

from gatherstore._config import ROUTES
from gatherstore._errors import first_line
from gatherstore._version import version
from gatherstore.calls import objects
from gatherstore.cli import bench, check, demo
from gatherstore.cli import results as results_cli
from gatherstore.cli.bench.measure import parse_size
from gatherstore.cli.bench.payloads import KINDS, available, defaults
from gatherstore.job import topology
from gatherstore.job.cleanup import collect, parse_duration
from gatherstore.job.launch import joined_from_env
from gatherstore.results import admin as result_sets
from gatherstore.stores.base import hide_password
from gatherstore.stores.registry import check_scheme, default_store, open_store
from gatherstore.stores.tmpdir import default_tmpdir_base

__all__ = ["main"]

if TYPE_CHECKING:
    _Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

_PROBE_BYTES = 1 << 20
_VERSIONS = ("gatherstore", "torch", "numpy", "fsspec", "cloudpickle", "redis", "s3fs", "mmengine")


# --- argument types ------------------------------------------------------------------------
def _argtype(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` that turns ValueError into argparse's clean usage error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = parse.__name__
    return convert


def _store_spec(spec: str) -> str:
    """A spec whose scheme gatherstore knows; the registry's error names its stores and
    the closest scheme.  Nothing is opened."""
    if spec not in ROUTES:
        check_scheme(spec)
    return spec


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{text!r} is not a positive integer")
    return int(text)


def _milliseconds(text: str) -> float:
    """Milliseconds on the command line, seconds in the code."""
    try:
        return _seconds(text.removesuffix("ms")) / 1e3
    except ValueError:
        raise ValueError(f"{text!r} is not a positive number of milliseconds") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{text!r} is not a positive number of seconds")
    return value


def _sizes(text: str) -> list[tuple[str, int]]:
    return [(item.strip(), parse_size(item)) for item in text.split(",")]


def _ints(text: str) -> list[int]:
    return [_positive_int(item.strip()) for item in text.split(",")]


def _names(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _payloads(text: str) -> list[str]:
    kinds = _names(text)
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown payload {kind!r}; use {', '.join(KINDS)}")
        if kind not in available():
            raise ValueError(f"payload {kind!r} needs a CUDA device; this machine has none")
    return kinds


# --- demo ------------------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    cfg = demo.DemoConfig(args.nproc, args.size, args.store, args.stream, compare=args.compare)
    demo.run(cfg)
    return 0


# --- bench -----------------------------------------------------------------------------------
def _bench(args: argparse.Namespace) -> int:
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
    if args.share_local and not args.hosts:
        raise ValueError("--share-local goes with --hosts 2")
    if args.hosts:
        from gatherstore.cli.bench import hostbench

        return hostbench.main(share_local=args.share_local, repeats=args.repeats)
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
    plan = bench.Plan(
        args.sizes, args.world, args.payloads, args.repeats, args.timeout, args.map_images
    )
    if args.quick:  # the preset's sizes; --cases still chooses
        plan, args.ceiling_size = bench.QUICK, bench.QUICK_CEILING
        args.cases = args.cases or bench.QUICK_CASES
    failed = bench.run(
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
        print(f"bench: {bench.FULL_RUN}", file=sys.stderr)
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


# --- describe ------------------------------------------------------------------------------
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


def _check(args: argparse.Namespace) -> int:
    return check.run(args.store, args.nproc, args.timeout)


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


# --- the parser ----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    """The ``gatherstore`` command's parser, one subcommand at a time, in help order."""
    parser = argparse.ArgumentParser(
        prog="gatherstore", description="Gather large Python objects across PyTorch ranks."
    )
    parser.add_argument("--version", action="version", version=f"gatherstore {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    store = _argtype(_store_spec)
    _add_demo(sub, store)
    _add_bench(sub)
    _add_check(sub, store)
    _add_gc(sub, store)
    results_cli.add_parser(sub, store)
    _add_describe(sub)
    return parser


def _add_demo(sub: _Subparsers, store: Callable[[str], str]) -> None:
    """Add the ``demo`` command (``store`` checks a URL)."""
    p = sub.add_parser("demo", help="gather a sharded evaluation's predictions on rank 0")
    p.add_argument("--nproc", type=_argtype(_positive_int), default=4, help="processes (4)")
    p.add_argument("--size", type=_argtype(parse_size), default=64 << 20, help="total (64MB)")
    p.add_argument("--store", type=store, default="tmpdir", help="store URL (tmpdir)")
    p.add_argument("--stream", action="store_true", help="gather_iter, verified part by part")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run torch.distributed.all_gather_object on the same predictions",
    )
    p.set_defaults(handler=_demo)


def _add_bench(sub: _Subparsers) -> None:
    """Add the ``bench`` command: the measured runs' options, then the other modes'."""
    p = sub.add_parser("bench", help="gatherstore's stores against the usual tools")
    _add_bench_measure(p)
    _add_bench_modes(p)
    p.set_defaults(handler=_bench)


def _add_bench_measure(p: argparse.ArgumentParser) -> None:
    """The options of bench's default run: the stores against the usual tools."""
    p.add_argument(
        "--sizes", type=_argtype(_sizes), default=_sizes("256MB,1GB"), help="totals (256MB,1GB)"
    )
    p.add_argument("--world", type=_argtype(_ints), default=[2, 4], help="world sizes (2,4)")
    p.add_argument("--repeats", type=_argtype(_positive_int), default=3, help="median of (3)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a first look in under 30 s: 32MB, W=2, 4 cases, 1 repeat (sizes flags ignored)",
    )
    p.add_argument(
        "--cases",
        type=_names,
        help="glob patterns of case names, e.g. 'gs.*'; 'torchmetrics.*': MAP sync (opt-in)",
    )
    p.add_argument(
        "--map-images",
        type=_argtype(_positive_int),
        default=200,
        help="images per rank of the torchmetrics cases (200)",
    )
    p.add_argument(
        "--payloads",
        type=_argtype(_payloads),
        default=defaults(),
        help=f"payload kinds ({','.join(KINDS)}; cuda-records where CUDA is; coco on request)",
    )
    p.add_argument("--redis", help="redis:// URL ($GATHERSTORE_TEST_REDIS_URL)")
    p.add_argument("--s3", metavar="ENDPOINT", help="S3 endpoint ($GATHERSTORE_TEST_S3_ENDPOINT)")
    p.add_argument("--services", action="store_true", help="start redis and S3 locally")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="JSON lines (stdout)")
    p.add_argument("--plot", metavar="PATH", help="PNG chart (needs matplotlib)")
    p.add_argument(
        "--ceiling-size",
        type=_argtype(parse_size),
        default=1 << 30,
        help="bytes moved to measure memcpy, /dev/shm and the Redis/S3 clients alone (1GB)",
    )
    p.add_argument("--timeout", type=_argtype(_seconds), default=900.0, help="per collective")


def _add_bench_modes(p: argparse.ArgumentParser) -> None:
    """The options that run another benchmark instead, and the ones that go with them."""
    p.add_argument(
        "--scale",
        type=_argtype(_ints),
        nargs="?",
        const=[64, 256, 1024],
        metavar="WORLDS",
        help="instead: the control exchange with simulated ranks (64,256,1024)",
    )
    p.add_argument(
        "--latency",
        type=_argtype(_ints),
        nargs="?",
        const=[32],
        metavar="WORLDS",
        help="instead: median and p90 latency of 1 KiB and 1 MiB gathers, gatherstore's and "
        "torch's, in one job of W processes each (32)",
    )
    p.add_argument(
        "--soak",
        type=int,
        nargs="?",
        const=1000,
        metavar="CALLS",
        help="instead: CALLS random 1 KiB calls over a mix of stores in one job of 3 processes; "
        "each store's first and last 100 calls (1000)",
    )
    p.add_argument(
        "--result-sets",
        type=_argtype(_sizes),
        nargs="?",
        const=_sizes("1GB,4GB"),
        metavar="ADD,ITEMS",
        help="instead: gs.ResultSet's add, gather, items() and export figures (1GB,4GB)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        choices=[2],
        help="instead: 200 MiB per rank across 2 simulated hosts (root; sshfs, Redis, S3)",
    )
    p.add_argument(
        "--share-local",
        action="store_true",
        help="with --hosts: host 1 reads the share from local disk (only host 2 mounts it)",
    )
    p.add_argument(
        "--parts",
        type=_argtype(_positive_int),
        metavar="W",
        help="instead: the destination reading W parts through each store (e.g. 1000)",
    )
    p.add_argument(
        "--part-size", type=_argtype(parse_size), default=64 << 10, help="with --parts (64KB)"
    )
    p.add_argument(
        "--s3-latency",
        type=_argtype(_milliseconds),
        metavar="MS",
        help="with --parts: S3 once more through a proxy holding each reply MS (e.g. 20)",
    )


def _add_check(sub: _Subparsers, store: Callable[[str], str]) -> None:
    """Add the ``check`` command (``store`` checks a URL)."""
    p = sub.add_parser("check", help="check that a store works for every rank")
    p.add_argument("--store", type=store, required=True, help="store URL")
    p.add_argument("--nproc", type=_argtype(_positive_int), default=1, help="local processes")
    p.add_argument("--timeout", type=_argtype(_seconds), default=60.0, help="per step (60 s)")
    p.set_defaults(handler=_check)


def _add_gc(sub: _Subparsers, store: Callable[[str], str]) -> None:
    """Add the ``gc`` command (``store`` checks a URL)."""
    p = sub.add_parser(
        "gc", help="remove the job areas of jobs that are gone (no heartbeat, no live process)"
    )
    p.add_argument("--store", type=store, required=True, help="store URL")
    p.add_argument(
        "--older-than",
        type=_argtype(parse_duration),
        required=True,
        help="silent for at least this long (and 4 heartbeat intervals), e.g. 1h, 2d",
    )
    p.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    p.add_argument(
        "--result-sets",
        action="store_true",
        help="also remove result sets no job writes, silent for --older-than (never otherwise)",
    )
    p.set_defaults(handler=_gc)


def _add_describe(sub: _Subparsers) -> None:
    """Add the ``describe`` command."""
    p = sub.add_parser("describe", help="topology and configuration as JSON")
    p.set_defaults(handler=_describe)


def _one_line(exc: BaseException) -> str:
    """The first line of an error, as a failed check says it, else as first_line does."""
    if isinstance(exc, check.CheckFailed):
        return (str(exc).strip().splitlines() or ["the check failed"])[0]
    return first_line(exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gatherstore`` command; the exit status."""
    args = _parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the boundary: one line a user can act on
        print(f"gatherstore {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
