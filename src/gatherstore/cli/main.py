"""The ``gatherstore`` command's parser: demo, bench, check, gc, results, describe.

Every failure ends in one line on stderr that names what to fix, and a
non-zero exit: 2 for bad arguments, 1 for a failed run.  This module imports
no torch: the commands (``cli.commands``) are imported when one runs, so that
``--help`` and a usage error answer at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gatherstore._config import ROUTES, parse_duration, parse_size
from gatherstore._errors import first_line
from gatherstore._version import version
from gatherstore.cli import CommandFailed
from gatherstore.cli.bench.kinds import KINDS
from gatherstore.stores.registry import check_scheme

__all__ = ["main"]

if TYPE_CHECKING:
    _Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


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
    """Payload kinds this machine can make (``cuda-records``: where CUDA is, which only
    torch can tell, imported here: the bench imports it anyway)."""
    kinds = _names(text)
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown payload {kind!r}; use {', '.join(KINDS)}")
    from gatherstore.cli.bench.payloads import available

    for kind in kinds:
        if kind not in available():
            raise ValueError(f"payload {kind!r} needs a CUDA device; this machine has none")
    return kinds


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
    _add_results(sub, store)
    _add_describe(sub)
    return parser


def _add_demo(sub: _Subparsers, store: Callable[[str], str]) -> None:
    """Add the ``demo`` command (``store`` checks a URL)."""
    p = sub.add_parser(
        "demo",
        help="gather a sharded evaluation's predictions on rank 0",
        description="Start local processes that each hold a shard of an object detector's "
        "predictions, gather them all on rank 0 in dataset order, verify every one, and "
        "print the time and the peak memory of each rank.",
    )
    p.add_argument("--nproc", type=_argtype(_positive_int), default=4, help="processes (4)")
    p.add_argument("--size", type=_argtype(parse_size), default=64 << 20, help="total (64MB)")
    p.add_argument("--store", type=store, default="tmpdir", help="store URL (tmpdir)")
    p.add_argument("--stream", action="store_true", help="gather_iter, verified part by part")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run torch.distributed.all_gather_object on the same predictions",
    )


def _add_bench(sub: _Subparsers) -> None:
    """Add the ``bench`` command: the measured runs' options, then the other modes'."""
    p = sub.add_parser(
        "bench",
        help="gatherstore's stores against the usual tools",
        description="Gather the same payloads through each of gatherstore's stores and "
        "through torch.distributed and mmengine, in fresh local processes, and report time, "
        "throughput and peak memory against this machine's ceilings.  --quick gives a first "
        "look in under 30 s; --scale, --latency, --soak, --result-sets, --export, --hosts, "
        "--group-size and --parts run another benchmark instead.",
    )
    _add_bench_measure(p)
    _add_bench_modes(p)


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
        "--export",
        type=_argtype(parse_size),
        nargs="?",
        const=1 << 30,
        metavar="SIZE",
        help="instead: gs.ResultSet.export of SIZE of detections to Parquet, to 1, 2 and one "
        "file per core, against pyarrow's write_table and the disk (1GB)",
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
        "--group-size",
        type=_argtype(_positive_int),
        metavar="N",
        help="instead: gs.all_gather_object on the --world W ranks split into groups of N, "
        "against torch's on the same groups and gatherstore's on a default group of N "
        "(--sizes: a group's total; --repeats: rounds)",
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
    p = sub.add_parser(
        "check",
        help="check that a store works for every rank",
        description="Check that a store works for a job, and say so in a few lines: "
        "reachable, a job area created and removed, a 1 MiB put/get/delete, permissions, "
        "and with several ranks (--nproc, or under torchrun) that every rank sees it.",
    )
    p.add_argument("--store", type=store, required=True, help="store URL")
    p.add_argument("--nproc", type=_argtype(_positive_int), default=1, help="local processes")
    p.add_argument("--timeout", type=_argtype(_seconds), default=60.0, help="per step (60 s)")


def _add_gc(sub: _Subparsers, store: Callable[[str], str]) -> None:
    """Add the ``gc`` command (``store`` checks a URL)."""
    p = sub.add_parser(
        "gc",
        help="remove the job areas of jobs that are gone (no heartbeat, no live process)",
        description="Remove the job areas that jobs left in a store when they were killed: "
        "only those silent for --older-than whose process is gone.  With --result-sets, "
        "also result sets that no job writes.",
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


def _add_results(sub: _Subparsers, store: Callable[[str], str]) -> None:
    """Add the ``results`` command (``store`` checks a URL)."""
    p = sub.add_parser(
        "results",
        help="list, show, export or discard the result sets of a store",
        description="List the result sets a persistent store holds, show one (--name), "
        "write its values to a file (--export) or remove it (--discard).  A set that does "
        "not exist is never created: naming one fails, and says which sets the store holds.",
    )
    p.add_argument("--store", type=store, required=True, help="store URL")
    p.add_argument("--name", help="one set: show it, or export or discard it")
    p.add_argument(
        "--export", metavar="PATH", help="with --name: write it to PATH (.parquet, .arrow, .jsonl)"
    )
    p.add_argument(
        "--files",
        type=_argtype(_positive_int),
        default=1,
        metavar="N",
        help="with --export: N > 1 makes PATH a folder of N part files (.parquet, .arrow), "
        "written at once, one core each (1)",
    )
    p.add_argument("--discard", action="store_true", help="with --name: remove it from the store")


def _add_describe(sub: _Subparsers) -> None:
    """Add the ``describe`` command."""
    sub.add_parser(
        "describe",
        help="topology and configuration as JSON",
        description="Print as JSON where this process stands (rank, world size, node, "
        "backend, device, launcher), the default store and whether it can be opened, the "
        "temp directory base and the versions of the packages gatherstore uses; under "
        "torchrun, rank 0 prints every rank's place.",
    )


def _one_line(exc: BaseException) -> str:
    """The first line of an error: a command's own failure as it says it, else as
    first_line does (with the exception's name)."""
    if isinstance(exc, CommandFailed):
        return (str(exc).strip().splitlines() or ["the command failed"])[0]
    return first_line(exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gatherstore`` command; the exit status."""
    args = _parser().parse_args(argv)
    try:
        from gatherstore.cli import commands  # here: the parser imports no torch

        return commands.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the boundary: one line a user can act on
        print(f"gatherstore {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
