"""How a result set ends, in one process: ``with`` closes it (the next job opens it at
once), an exception in the block keeps what was added and ends the run here; ``close``
writes what is buffered and ends this job's run; ``discard`` removes the set."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import gatherstore as gs


def _url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'sets'}"


@pytest.mark.timeout(60)
def test_with_closes_the_set_and_the_next_job_takes_it_over(tmp_path: Path) -> None:
    name = f"with-{uuid.uuid4().hex[:8]}"
    with gs.ResultSet(name, store=_url(tmp_path)) as rs:
        rs.add(0, "a")
        rs.add(1, "b")
    with pytest.raises(gs.GatherError, match="closed"):
        rs.add(2, "c")
    with gs.ResultSet(name, store=_url(tmp_path)) as again:  # the writer's lock is released
        assert again.pending(range(3)) == [2]
        assert again.gather(keys=True) == [(0, "a"), (1, "b")]


@pytest.mark.timeout(60)
def test_an_exception_in_the_block_keeps_what_was_added(tmp_path: Path) -> None:
    name = f"raise-{uuid.uuid4().hex[:8]}"
    with pytest.raises(KeyError), gs.ResultSet(name, store=_url(tmp_path)) as rs:
        rs.add(0, "kept")
        raise KeyError("the evaluation failed")
    with gs.ResultSet(name, store=_url(tmp_path)) as again:
        assert again.gather() == ["kept"]
        again.discard()
    assert not any((tmp_path / "sets").rglob("*meta*"))


@pytest.mark.timeout(60)
def test_close_and_discard_are_the_verbs_that_end(tmp_path: Path) -> None:
    name = f"verbs-{uuid.uuid4().hex[:8]}"
    rs = gs.ResultSet(name, store=_url(tmp_path))
    rs.add("x", 1)
    rs.flush()  # durable now; the set stays open
    rs.add("y", 2)
    rs.close()  # what is buffered is written, this job's run ends
    rs.close()  # once is enough: again is nothing
    reader = gs.ResultSet(name, store=_url(tmp_path))
    assert list(reader.items()) == [("x", 1), ("y", 2)]
    reader.discard()
    assert not hasattr(rs, "drain") and not hasattr(rs, "end")


_READER = """
import sys
import gatherstore as gs
rs = gs.ResultSet(sys.argv[1], store=sys.argv[2], mode="r")
print(list(rs.items()))
"""


@pytest.mark.timeout(60)
def test_a_reader_opens_a_set_a_job_writes_and_sees_what_was_flushed(tmp_path: Path) -> None:
    import subprocess
    import sys

    name = f"read-{uuid.uuid4().hex[:8]}"
    with gs.ResultSet(name, store=_url(tmp_path)) as rs:
        rs.add(1, "flushed")
        rs.flush()
        rs.add(2, "buffered")  # not flushed: a reader does not see it yet
        out = subprocess.run(
            [sys.executable, "-c", _READER, name, _url(tmp_path)],
            capture_output=True, text=True, timeout=50, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[(1, 'flushed')]"
        reader = gs.ResultSet(name, store=_url(tmp_path), mode="r")
        assert "open to read" in repr(reader)
        with pytest.raises(ValueError, match="open to read"):
            reader.add(3, "no")
        with pytest.raises(ValueError, match="open to read"):
            reader.pending(range(3))
        reader.close()  # nothing to end
    assert list(gs.ResultSet(name, store=_url(tmp_path), mode="r").items()) == [
        (1, "flushed"),
        (2, "buffered"),
    ]


def test_reading_a_set_that_does_not_exist_creates_nothing(tmp_path: Path) -> None:
    with gs.ResultSet("present", store=_url(tmp_path)) as rs:
        rs.add(0, 0)
    with pytest.raises(ValueError, match="'present'"):
        gs.ResultSet("absent", store=_url(tmp_path), mode="r")
    assert not any(p.name == "absent" for p in (tmp_path / "sets").rglob("*"))
    with pytest.raises(ValueError, match="mode='a'"):
        gs.ResultSet("present", store=_url(tmp_path), mode="a")
