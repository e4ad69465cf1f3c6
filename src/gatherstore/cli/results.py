"""``gatherstore results``: the result sets of a store, one in detail, its export, its removal.

A signed set is read with its key from ``GATHERSTORE_RESULTS_KEY_FILE`` or
``GATHERSTORE_RESULTS_KEY`` (never from the command line, which other users of
the machine can see).  Exporting or discarding a set opens it as a writer, as a
job does: refused while a job writes it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from gatherstore._config import ROUTES
from gatherstore.results import admin, signing
from gatherstore.stores.registry import open_store

__all__ = ["add_parser"]


def add_parser(sub: Any, store: Callable[[str], str]) -> None:
    """Add the ``results`` command to the subparsers ``sub`` (``store`` checks a URL)."""
    p = sub.add_parser("results", help="list, show, export or discard the result sets of a store")
    p.add_argument("--store", type=store, required=True, help="store URL")
    p.add_argument("--name", help="one set: show it, or export or discard it")
    p.add_argument(
        "--export", metavar="PATH", help="with --name: write it to PATH (.parquet, .arrow, .jsonl)"
    )
    p.add_argument("--discard", action="store_true", help="with --name: remove it from the store")
    p.set_defaults(handler=_results)


def _results(args: argparse.Namespace) -> int:
    if args.store in ROUTES or args.store.startswith("tmpdir"):
        raise ValueError(f"results needs the URL of a persistent store, not {args.store!r}")
    if (args.export or args.discard) and not args.name:
        raise ValueError("--export and --discard go with --name NAME")
    if args.export and args.discard:
        raise ValueError("give --export or --discard, not both")
    if args.export or args.discard:
        import gatherstore as gs

        rs = gs.ResultSet(args.name, store=args.store)
        if args.discard:
            rs.discard()
            print(f"discarded result set {args.name!r} from {args.store}")
            return 0
        count = rs.export(args.export)
        rs.close()
        print(f"wrote {count} values of result set {args.name!r} to {args.export}")
        return 0
    with open_store(args.store) as opened:
        if args.name:
            print(json.dumps(admin.describe(opened, args.name, signing.resolve(None)), indent=2))
            return 0
        found = [admin.summary(opened, name) for name in admin.names(opened)]
    for item in found:
        print(f"{item.name}: {item.chunks} chunks, {item.runs} runs, {item.state()}")
    print(f"{len(found)} result set(s) in {opened}")
    return 0
