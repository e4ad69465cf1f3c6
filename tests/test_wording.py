"""The words of gatherstore's messages and arguments, one pure function each: counts in
the singular, ranks named, seconds rounded, sizes and durations read and written."""

from __future__ import annotations

import pytest

from gatherstore._config import parse_duration
from gatherstore._errors import counted, ranks_named, seconds
from gatherstore.cli import demo
from gatherstore.cli.bench.measure import format_bytes, parse_size
from gatherstore.job.exchange import late_error


def test_sizes_and_durations() -> None:
    assert parse_size("4MB") == 4 << 20
    assert parse_size("1gb") == 1 << 30
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("512K") == 512 << 10
    assert parse_size("4096") == 4096
    for bad in ("banana", "", "0MB", "-1GB", "1XB"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
    assert [parse_duration(t) for t in ("30s", "15m", "1h", "2d", "1.5h")] == [
        30,
        900,
        3600,
        172800,
        5400,
    ]
    for bad in ("soon", "1", "h", "-1h"):
        with pytest.raises(ValueError, match="is not a duration"):
            parse_duration(bad)
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 << 29) == "1.5 GiB"


def test_messages_say_one_rank_in_the_singular() -> None:
    assert [counted(n, "rank") for n in (0, 1, 2)] == ["0 ranks", "1 rank", "2 ranks"]
    assert ranks_named([3]) == "rank 3" and ranks_named([1, 2]) == "ranks [1, 2]"
    assert "exchange: rank 1 did not arrive within 10 s" in str(late_error("exchange", [1], 10))
    ranks = [{"rank": 0, "seconds": 0.5, "peak": 1 << 20}]
    said = demo.summary(demo.DemoConfig(nproc=1), "tmpdir", 1000, ranks)
    assert said.startswith("gatherstore demo: 1 rank (gloo), store tmpdir\n")
    assert "(2.7 MiB of arrays, 1 part) on rank 0" in said


def test_seconds_are_written_rounded() -> None:
    assert [seconds(x) for x in (9.99904, 1800.0, 2.54, 0.25, 59.6)] == [
        "10",
        "1800",
        "2.5",
        "0.25",
        "60",
    ]
