"""The bench's output: a terminal table, JSON lines, a PNG chart."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gatherstore.cli.bench.cases import BASELINE
from gatherstore.cli.bench.measure import format_bytes

__all__ = ["PLOT_HINT", "check_plot", "json_lines", "plot", "table"]

PLOT_HINT = "--plot needs matplotlib: pip install 'gatherstore[bench]'"

_COLUMNS = [
    ("case", "<"),
    ("payload", "<"),
    ("size", ">"),
    ("W", ">"),
    ("time s", ">"),
    ("GB/s", ">"),
    ("dst peak", ">"),
    ("other peak", ">"),
    ("time/ref", ">"),
    ("mem/ref", ">"),
    ("%memcpy", ">"),
    ("%pickle", ">"),
    ("%client", ">"),
    ("%fast", ">"),
]


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _row(r: dict[str, Any]) -> list[str]:
    head = [r["case"], r["payload"], r["size"], str(r["world"])]
    if r["error"] is not None:
        return [*head, f"failed: {r['error']}"]
    return [
        *head,
        f"{r['seconds']:.3f}",
        f"{r['gbps']:.3f}",
        format_bytes(r["dst_peak"]),
        format_bytes(r["other_peak"]) if r["world"] > 1 else "-",
        _num(r["time_ratio"], ".2f"),
        _num(r["mem_ratio"], ".2f"),
        _pct(r["of_memcpy"]),
        _pct(r["of_pickle_dumps"]),
        _pct(r.get("of_client")),
        _pct(r.get("of_fast")),
    ]


def _cell(text: str, align: str, width: int) -> str:
    return format(text, f"{align}{width}")


def _gbps(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} GB/s"


#: (key prefix in the ceilings, what it measured) of each client ceiling line.
_CLIENT_LINES = [
    ("redis_default", "redis-py defaults, one SET then one GET per 4 MiB value"),
    ("redis_default_hiredis", "the same with hiredis installed"),
    ("redis_pipelined", "redis-py pipelines of 4 values, its Python packer, 1 MiB reads"),
    ("redis_hiredis_packer", "the same with hiredis' command packer"),
    ("redis_fast", "gatherstore's wire: 4 in flight, values sent and received in place"),
    ("s3_default", "s3fs defaults, pipe_file then cat_file"),
    ("s3_fast", "s3fs as gatherstore sets it: 16 MiB objects, 4 in flight, unhashed"),
    ("s3_obstore", "obstore in the same shape, for comparison"),
]


def _client_lines(ceilings: dict[str, Any]) -> list[str]:
    """One line per measured client ceiling: write, read and write+read GB/s."""
    lines = []
    for prefix, what in _CLIENT_LINES:
        if f"{prefix}_gbps" in ceilings:
            lines.append(
                f"  {prefix}: write {_gbps(ceilings[f'{prefix}_write_gbps'])}, read "
                f"{_gbps(ceilings[f'{prefix}_read_gbps'])}, both "
                f"{_gbps(ceilings[f'{prefix}_gbps'])} ({what})"
            )
    return lines


def table(records: Sequence[dict[str, Any]], ceilings: dict[str, Any], notes: list[str]) -> str:
    """The results as an aligned text table with the ceilings above and notes below."""
    rows = [[name for name, _ in _COLUMNS]] + [_row(r) for r in records]
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(_COLUMNS))]
    lines = [
        f"ceilings: memcpy {_gbps(ceilings['memcpy_gbps'])}; /dev/shm write "
        f"{_gbps(ceilings['shm_write_gbps'])}, read {_gbps(ceilings['shm_read_gbps'])}; "
        f"pickle.dumps {_gbps(ceilings['pickle_dumps_gbps'])} "
        f"(loads {_gbps(ceilings['pickle_loads_gbps'])}) of detections",
        *_client_lines(ceilings),
        "",
    ]
    for row in rows:
        if len(row) < len(_COLUMNS):  # a failed case: the message fills the rest
            cells = [_cell(c, a, w) for c, (_, a), w in zip(row, _COLUMNS, widths, strict=False)]
            lines.append("  ".join([*cells[:-1], row[-1]]))
            continue
        cells = [_cell(c, a, w) for c, (_, a), w in zip(row, _COLUMNS, widths, strict=True)]
        lines.append("  ".join(cells))
    impls = sorted({f"{r['case']}: {r['impl']}" for r in records if r["case"].startswith("mm")})
    lines += _floor_lines(records)
    lines += [
        "",
        "time: median over repeats of the slowest rank; GB/s: payload bytes / time (1e9);",
        "peak: VmHWM growth over RSS before the call (dst = rank 0, other = worst other rank);",
        f"time/ref, mem/ref (worst rank): relative to ref = {BASELINE}, same payload/size/W;",
        "%memcpy / %pickle: GB/s as a fraction of the ceilings above (%pickle can pass 100%:",
        "ranks serialise in parallel, rank 0 never serialises its own part);",
        "%client / %fast: GB/s as a fraction of the store's service used by its client library",
        "alone, same bytes, write then read, median of as many passes as the cases' repeats,",
        "each client in a fresh process as each case is (defaults, the faster with or without",
        "hiredis / fast settings; /dev/shm for tmpdir).",
        *impls,
        *notes,
    ]
    return "\n".join(lines)


#: The cases the floors and the payload ratios are read against: ``tmpdir`` as gatherstore
#: picks it (parts handed over in RAM) and the same base named (parts as files there).
_FLOORED = ("gs.tmpdir", "gs.tmpdir-shm")


def _floor_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """Per floored case, payload, size and W: the floors beside its time; then the
    payloads' times against each other (records against the same bytes as one dict of
    tensors, CUDA records against the same records on the CPU)."""
    done = {
        (r["case"], r["payload"], r["size"], r["world"]): r
        for r in records
        if r["case"] in _FLOORED and r["error"] is None and "floors" in r
    }
    if not done:
        return []
    lines = [
        "",
        "floors (from memory in one process, medians; digest share: one part sealed + W-1 "
        "verified, of the gather's time):",
    ]
    for (case, payload, size, world), r in done.items():
        f = r["floors"]
        digest = world * f["part_bytes"] / (f["checksum_gbps"] * 1e9)
        line = (
            f"  {case} {payload} {size} W={world}: {r['seconds']:.3f} s = "
            f"{r['seconds'] / f['floor_s']:.2f}x max(encode one part {f['encode_s']:.3f} s, "
            f"decode the other parts {f['decode_s']:.3f} s); checksum "
            f"{f['checksum_gbps']:.1f} GB/s, digest share {100 * digest / r['seconds']:.1f}%"
        )
        if r.get("dst_phases"):
            spent = ", ".join(f"{k} {v:.3f} s" for k, v in r["dst_phases"].items())
            line += f"; rank 0's phases: {spent}"
        if "d2h_gbps" in f:
            line += (
                f"; device to host {f['d2h_gbps']:.1f} GB/s = "
                f"{100 * f['d2h_gbps'] / f['pinned_gbps']:.0f}% of a pinned copy_ "
                f"({f['pinned_gbps']:.1f} GB/s; .cpu() {f['cpu_gbps']:.1f} GB/s)"
            )
        if "gpu_held" in r:
            held = "/".join(format_bytes(b) for b in r["gpu_held"])
            grown = "/".join(format_bytes(b) for b in r["gpu_growth"])
            line += f"; GPU memory per rank: held {held}, peak beyond it {grown}"
        lines.append(line)
    for payload, ref in (("records", "tensors"), ("cuda-records", "records")):
        for (case, kind, size, world), r in done.items():
            other = done.get((case, ref, size, world))
            if kind == payload and other:
                lines.append(
                    f"  {case} {payload} / {ref}, {size} W={world}: "
                    f"{r['seconds'] / other['seconds']:.2f}x the time"
                )
    return lines


def json_lines(records: Sequence[dict[str, Any]], ceilings: dict[str, Any]) -> str:
    """One JSON object per line: the ceilings (``"kind": "ceilings"``), then each case."""
    out = [json.dumps({"kind": "ceilings", **ceilings})]
    out += [json.dumps(r) for r in records]
    return "\n".join(out) + "\n"


def check_plot() -> None:
    """Raise ImportError with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(PLOT_HINT) from exc


def plot(records: Sequence[dict[str, Any]], path: str) -> None:
    """Grouped bars of time and worst-rank peak memory per case, one row per payload."""
    check_plot()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if r["error"] is None]
    kinds = list(dict.fromkeys(r["payload"] for r in done)) or ["(no results)"]
    cases = list(dict.fromkeys(r["case"] for r in done))
    fig, axes = plt.subplots(len(kinds), 2, figsize=(14, 4.5 * len(kinds)), squeeze=False)
    width = 0.8 / max(len(cases), 1)
    for row, kind in enumerate(kinds):
        mine = [r for r in done if r["payload"] == kind]
        groups = list(dict.fromkeys((r["size"], r["world"]) for r in mine))
        for col, (metric, label) in enumerate([("seconds", "time (s)"), ("peak", "peak GiB")]):
            ax = axes[row][col]
            for i, case in enumerate(cases):
                by_group = {(r["size"], r["world"]): r for r in mine if r["case"] == case}
                values = [_metric(by_group.get(g), metric) for g in groups]
                xs = [g + i * width for g in range(len(groups))]
                ax.bar(xs, values, width, label=case)
            ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
            ax.set_xticklabels([f"{s} W={w}" for s, w in groups])
            ax.set_title(f"{kind}: {label}")
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _metric(record: dict[str, Any] | None, metric: str) -> float:
    if record is None:
        return 0.0
    if metric == "peak":
        return float(max(record["dst_peak"], record["other_peak"])) / 2**30
    return float(record[metric])
