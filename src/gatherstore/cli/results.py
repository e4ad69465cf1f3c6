"""``gatherstore results``: the result sets of a store, one in detail, its export, its removal.

A signed set is read with its key from ``GATHERSTORE_RESULTS_KEY_FILE`` or
``GATHERSTORE_RESULTS_KEY`` (never from the command line, which other users of
the machine can see).  Exporting a set opens it to read (``mode="r"``): it runs
while a job writes the set, and exports what was flushed.  Discarding opens it as a
writer, as a job does: refused while a job writes it.  A set that does not exist is never
created: showing, exporting or discarding one fails alike, naming the sets the
store holds.
"""

from __future__ import annotations

import argparse
import json
import os

from gatherstore._config import ROUTES
from gatherstore.results import admin, signing
from gatherstore.stores.base import Store
from gatherstore.stores.registry import open_store

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """List the sets of ``args.store``, or show, export or discard the set ``args.name``; 0.

    Raises:
        ValueError: a store that does not outlive a job, options that do not go
            together, or a set the store does not hold (named with those it holds).
    """
    if args.store in ROUTES or args.store.startswith("tmpdir"):
        raise ValueError(f"results needs the URL of a persistent store, not {args.store!r}")
    if (args.export or args.discard) and not args.name:
        raise ValueError("--export and --discard go with --name NAME")
    if args.export and args.discard:
        raise ValueError("give --export or --discard, not both")
    if args.files != 1 and not args.export:
        raise ValueError("--files goes with --export PATH")
    with open_store(args.store) as opened:
        if not args.name:
            return _list(opened)
        admin.require(opened, args.name)  # opening it as a writer below would create it
        if not (args.export or args.discard):
            print(json.dumps(admin.describe(opened, args.name, signing.resolve(None)), indent=2))
            return 0
    return _export_or_discard(args)


def _list(store: Store) -> int:
    found = [admin.summary(store, name) for name in admin.names(store)]
    for item in found:
        print(f"{item.name}: {item.chunks} chunks, {item.runs} runs, {item.state()}")
    print(f"{len(found)} result set(s) in {store}")
    return 0


def _export_or_discard(args: argparse.Namespace) -> int:
    """Export the set ``args.name`` (opened to read), or discard it (opened as a job does:
    refused while one writes it)."""
    import gatherstore as gs

    if args.discard:
        with gs.ResultSet(args.name, store=args.store) as rs:
            rs.discard()
        print(f"discarded result set {args.name!r} from {args.store}")
        return 0
    rs = gs.ResultSet(args.name, store=args.store, mode="r")
    count = rs.export(args.export, files=args.files)
    where = args.export
    if args.files > 1:
        where = f"{len(os.listdir(args.export))} part files in the folder {args.export}"
    print(f"wrote {count} values of result set {args.name!r} to {where}")
    return 0
