"""The default ``gatherstore bench``: every case on the same payloads, the machine's
ceilings and the gathers' floors, and the report (see the package's docstring)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from gatherstore.cli.bench import cases, ceilings, clients, floors, metrics, report
from gatherstore.cli.bench.runner import Plan, run_cases

__all__ = ["FULL_RUN", "QUICK", "QUICK_CASES", "QUICK_CEILING", "Plan", "run"]

#: ``--quick``: a first look in under 30 s (one small size, two ranks, one repeat).
QUICK = Plan([("32MB", 32 << 20)], [2], ["detections"], 1, 300.0)
QUICK_CASES = ["torch.all_gather_object", "gs.collective", "gs.tmpdir", "gs.tmpdir-disk"]
QUICK_CEILING = 64 << 20
#: What ``--quick`` prints last.
FULL_RUN = (
    "a quick run (32MB, W=2, detections, 4 cases, 1 repeat); the full one compares every "
    "case at 256MB and 1GB, W=2 and 4, both payloads, 3 repeats (minutes): "
    "gatherstore bench --services --plot bench.png"
)


def run(
    plan: Plan,
    *,
    patterns: list[str] | None = None,
    redis: str | None = None,
    s3: str | None = None,
    services: bool = False,
    ceiling_bytes: int = 1 << 30,
    json_path: str | None = None,
    plot_path: str | None = None,
    out: TextIO = sys.stdout,
    progress: bool = False,
) -> int:
    """Run the bench and write its outputs; the number of failed cases.

    ``json_path`` ``"-"`` writes JSON lines to ``out`` instead of the table.

    Raises:
        ImportError: ``plot_path`` is given but matplotlib is missing.
        ValueError: a pattern matches no case.
    """
    if plot_path:
        report.check_plot()
    with cases.reachable(redis, s3, services) as (found, notes, workdir):
        chosen = cases.select(found, patterns)
        said = len(notes)  # said before any work: what will not run, and why
        for note in notes:
            print(f"bench: {note}", file=sys.stderr, flush=True)
        gathers = [c for c in chosen if c.op != cases.TORCHMETRICS]
        records: list[dict[str, Any]] = []
        limits: dict[str, Any] = {}
        if gathers:
            limits = ceilings.measure(ceiling_bytes)
            limits.update(clients.measure(gathers, ceiling_bytes, notes, plan.repeats))
            records = run_cases(plan, gathers, workdir, limits, progress)
            _add_floors(records, plan)
        scored = [c for c in chosen if c.op == cases.TORCHMETRICS]
        maps = metrics.run(scored, plan.worlds, plan.map_images, plan.repeats, plan.timeout)
    if json_path == "-":
        out.write(report.json_lines(records + maps, limits))
    else:
        tables = [report.table(records, limits, notes[said:])] if records else []
        out.write("\n\n".join(tables + ([metrics.table(maps)] if maps else [])) + "\n")
        if json_path:
            with open(json_path, "w") as f:
                f.write(report.json_lines(records + maps, limits))
    if plot_path:
        report.plot(records, plot_path)
    return sum(r["error"] is not None for r in records + maps)


def _add_floors(records: list[dict[str, Any]], plan: Plan) -> None:
    """The floors (see ``floors``) of each payload, size and world gatherstore gathered,
    measured once and added to each of its records."""
    found: dict[tuple[str, int, int], dict[str, Any]] = {}
    for record in records:
        if record["impl"] != "gatherstore":
            continue
        group = (record["payload"], record["bytes"], record["world"])
        if group not in found:
            found[group] = floors.measure(*group, plan.repeats)
        record["floors"] = found[group]
