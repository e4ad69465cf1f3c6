"""gs.ResultSet in one process, against real stores (file://, Redis, S3 on SeaweedFS,
memory://): keys, order and duplicates, flushes, signing keys, damage, one writer job at
a time, export, and the merge in bounded memory (its pure pieces: test_resultset_layout.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _rs_jobs import NAME, redis_database, same, value

import gatherstore as gs
from gatherstore.cli import main as _cli

SRC = str(Path(gs.__file__).resolve().parents[1])
KEY = b"k" * 32


# --- the stores -----------------------------------------------------------------------------------
@pytest.fixture
def redis_url(gatherstore_redis_url: str) -> Iterator[str]:
    with redis_database(gatherstore_redis_url, 8) as url:
        yield url


@pytest.fixture(scope="module")
def s3_bucket(gatherstore_s3: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    from gatherstore.cli.bench.clients import fresh_bucket

    options = gatherstore_s3.storage_options
    with fresh_bucket(options, "results") as bucket:
        yield f"s3://{bucket}", options


@pytest.fixture(params=["file", "redis", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[gs.Store]:
    """A fresh place in each real store."""
    if request.param == "file":
        yield gs.open_store(f"file://{tmp_path}/store")
    elif request.param == "redis":
        yield gs.open_store(request.getfixturevalue("redis_url"))
    else:
        url, options = request.getfixturevalue("s3_bucket")
        opened = gs.open_store(f"{url}/{uuid.uuid4().hex[:8]}", **options)
        yield opened
        opened.delete("")


def stored_keys(rs: gs.ResultSet, n: int) -> set[int]:
    return set(range(n)) - set(rs.pending(range(n)))


# --- the contract, on every real store ------------------------------------------------------------
@pytest.mark.timeout(120)
def test_add_pending_gather_items_in_key_order_each_key_once(store: gs.Store) -> None:
    rs = gs.ResultSet(NAME, store=store, key=KEY, flush_every=4)
    assert rs.pending(range(20)) == list(range(20))
    for i in [5, 3, 9, 0]:
        rs.add(i, value(i))
    rs.add(3, "second")  # a key added twice: the first value counts
    rs.add("b", "B")
    rs.add("a", "A")
    assert rs.pending([9, "a", 7, 7, "z", 1]) == [1, 7, "z"]
    got = rs.gather()
    assert got is not None and [v if isinstance(v, str) else v["id"] for v in got] == [
        0,
        3,
        5,
        9,
        "A",
        "B",
    ]
    assert all(same(v, value(v["id"])) for v in got if isinstance(v, dict))
    assert [k for k, _ in rs.items()] == [0, 3, 5, 9, "a", "b"]
    rs.close()
    # a second run: its value of key 5 loses to the first run's, new keys join in order
    again = gs.ResultSet(NAME, store=store, key=KEY)
    again.add(5, "later")
    again.add(7, value(7))
    assert [k for k, _ in again.items()] == [0, 3, 5, 7, 9, "a", "b"]
    assert same(dict(again.items())[5], value(5))
    again.discard()
    # (SeaweedFS's listing may show the emptied folder itself: no key under it is left)
    assert [k for k in store.list("gatherstore-results/") if "/" in k] == []


@pytest.mark.timeout(120)
def test_a_set_written_with_one_key_is_refused_with_another(store: gs.Store) -> None:
    rs = gs.ResultSet(NAME, store=store, key=KEY)
    rs.add(1, "one")
    rs.close()
    for key, why in [
        (b"o" * 32, "written with another signing key"),
        (None, "it is signed: open it with its key"),
    ]:
        with pytest.raises(gs.IntegrityError, match=why):
            gs.ResultSet(NAME, store=store, key=key)
    plain = gs.ResultSet("plain", store=store)
    plain.close()
    with pytest.raises(gs.IntegrityError, match="written without a signing key"):
        gs.ResultSet("plain", store=store, key=KEY)
    assert [list(gs.ResultSet(NAME, store=store, key=KEY).items())] == [[(1, "one")]]


def test_the_key_comes_from_the_settings_and_is_never_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "correct horse battery staple 42"
    (tmp_path / "key").write_text(secret + "\n")
    monkeypatch.setenv("GATHERSTORE_RESULTS_KEY_FILE", str(tmp_path / "key"))
    url = f"file://{tmp_path}/store"
    rs = gs.ResultSet(NAME, store=url, flush_every=1)
    rs.add(1, "x")
    rs.flush()
    assert secret not in repr(rs)
    rs.close()
    monkeypatch.delenv("GATHERSTORE_RESULTS_KEY_FILE")
    with pytest.raises(gs.IntegrityError, match="another signing key"):
        gs.ResultSet(NAME, store=url, key=b"y" * 16)
    with pytest.raises(gs.IntegrityError, match="it is signed"):
        gs.ResultSet(NAME, store=url)
    for path in (tmp_path / "store").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    monkeypatch.setenv("GATHERSTORE_RESULTS_KEY", "short")
    with pytest.raises(ValueError, match="fewer than 16"):
        gs.ResultSet(NAME, store=url)


@pytest.mark.timeout(60)
def test_only_stores_that_outlive_the_job(tmp_path: Path) -> None:
    for spec in ("tmpdir", f"tmpdir://{tmp_path}", "auto", "collective", "stream"):
        with pytest.raises(ValueError, match=r"file:///<shared dir>, redis://.*s3://"):
            gs.ResultSet(NAME, store=spec)
    rs = gs.ResultSet(NAME, store="memory://results-test")  # one process: allowed
    rs.add(1, 2)
    assert rs.gather() == [2]
    rs.discard()


@pytest.mark.timeout(60)
def test_a_set_in_memory_with_no_root(capsys: pytest.CaptureFixture[str]) -> None:
    """``memory://`` alone is fsspec's whole in-process filesystem: a set lives there as
    under ``memory://bucket``, its keys listed as the store wrote them."""
    name = f"bare/{uuid.uuid4().hex[:8]}"
    with gs.ResultSet(name, store="memory://") as rs:
        rs.add(2, "b")
        rs.add(1, "a")
        assert rs.pending([1, 2, 3]) == [3]
        assert rs.gather(keys=True) == [(1, "a"), (2, "b")]
        assert list(rs.items()) == [(1, "a"), (2, "b")]
    assert _cli.main(["results", "--store", "memory://"]) == 0
    assert f"{name}:" in capsys.readouterr().out
    gs.ResultSet(name, store="memory://").discard()
    assert _cli.main(["results", "--store", "memory://"]) == 0
    assert f"{name}:" not in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_a_damaged_chunk_is_named(tmp_path: Path) -> None:
    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}", flush_every=3)
    for i in range(6):
        rs.add(i, value(i))
    rs.flush()
    chunks = sorted((tmp_path / "gatherstore-results" / NAME / "chunks").iterdir())
    data = bytearray(chunks[1].read_bytes())
    data[-5] ^= 0xFF
    chunks[1].write_bytes(bytes(data))
    with pytest.raises(gs.IntegrityError, match=f"chunk '{chunks[1].name}'"):
        rs.gather()
    chunks[1].unlink()  # a chunk whose index remains: gone, named
    with pytest.raises(gs.GatherError, match=f"chunk '{chunks[1].name}'.*is gone"):
        list(rs.items())


@pytest.mark.timeout(60)
def test_a_chunk_without_its_index_is_not_part_of_the_set(tmp_path: Path) -> None:
    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}", flush_every=2)
    for i in range(4):
        rs.add(i, i)
    rs.flush()
    index = sorted((tmp_path / "gatherstore-results" / NAME / "index").iterdir())
    index[0].unlink()  # as if the rank died between the chunk and its index
    assert rs.gather() == [2, 3]
    assert rs.pending(range(4)) == [0, 1]


@pytest.mark.timeout(60)
def test_a_failed_write_is_raised_once_and_retried_by_flush(tmp_path: Path) -> None:
    base = tmp_path / "store"
    rs = gs.ResultSet(NAME, store=f"file://{base}", flush_every=(2, "600s"))
    chunks = base / "gatherstore-results" / NAME / "chunks"
    rs.add(0, 0)
    rs.add(1, 1)
    rs.flush()
    os.rename(chunks, tmp_path / "aside")
    chunks.write_text("a file where the folder was")  # every write there fails
    rs.add(2, 2)
    rs.add(3, 3)
    deadline = time.monotonic() + 30
    with pytest.raises(gs.StoreUnavailableError):
        while time.monotonic() < deadline:
            rs.add(4, 4)  # raises once the write in the background failed
            time.sleep(0.05)
    chunks.unlink()
    os.rename(tmp_path / "aside", chunks)
    rs.flush()  # the values that failed are written now
    assert [k for k, _ in rs.items()] == [0, 1, 2, 3, 4]


@pytest.mark.timeout(60)
def test_a_value_that_cannot_be_pickled_fails_at_add_and_the_set_goes_on(tmp_path: Path) -> None:
    import threading

    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}", flush_every=2)
    rs.add(1, "fine")
    with pytest.raises(TypeError) as caught:
        rs.add(2, {"score": 0.5, "extra": [1, {"mask": threading.Lock()}]})
    assert str(caught.value) == (
        f"result set {NAME!r}: the value of key 2 cannot be pickled, so it was not added "
        "(TypeError: cannot pickle '_thread.lock' object — at value['extra'][1]['mask']: a "
        "<class '_thread.lock'>, which neither pickle nor cloudpickle can serialise; put "
        "something picklable in its place (convert it, or leave it out))"
    )
    with pytest.raises(TypeError, match="key 'gen' cannot be pickled"):
        rs.add("gen", (i for i in range(3)))
    rs.add(3, lambda: "kept")  # cloudpickle can: kept, as by the collectives
    rs.add(4, "fine too")
    rs.flush()  # nothing of the refused values is left to fail
    assert rs.pending([1, 2, 3, 4, "gen"]) == [2, "gen"]
    rs.add(2, "added again")
    got = rs.gather(keys=True)
    assert got is not None and [k for k, _ in got] == [1, 2, 3, 4]
    assert got[1][1] == "added again" and got[2][1]() == "kept"


@pytest.mark.timeout(60)
def test_values_changed_after_add_are_named_at_flush_and_the_others_kept(tmp_path: Path) -> None:
    """What add saw picklable and then was changed (the set keeps a reference until it
    writes): the writer drops it from its chunk and the next flush names it."""
    import threading

    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}", flush_every=10)
    changed: dict[str, Any] = {"score": 1}
    rs.add(1, "fine")
    rs.add(2, changed)
    rs.add(3, "fine too")
    changed["mask"] = threading.Lock()
    with pytest.raises(TypeError, match="keys 2 cannot be pickled"):
        rs.flush()
    assert rs.gather() == ["fine", "fine too"]


@pytest.mark.timeout(60)
def test_a_closed_set_refuses_adds(tmp_path: Path) -> None:
    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}")
    rs.close()
    with pytest.raises(gs.GatherError, match="closed"):
        rs.add(1, 1)


# --- one writer job at a time ---------------------------------------------------------------------
def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def _fake_run(store: gs.Store, run: int, host: str, age: float, name: str = NAME) -> None:
    """Runs as another job left them: its claim and last beat ``age`` seconds ago."""
    beat = {"job": "f" * 16, "host": host, "pid": _dead_pid(), "at": time.time() - age}
    beat["every"] = 30.0
    area = store.scoped(f"gatherstore-results/{name}/runs/{run:06d}")
    area.put("claim", json.dumps(beat).encode())
    area.replace("heartbeat", json.dumps(beat).encode())


@pytest.mark.timeout(60)
def test_a_live_writer_is_refused_a_stale_one_taken_over(tmp_path: Path) -> None:
    store = gs.open_store(f"file://{tmp_path}")
    first = gs.ResultSet(NAME, store=store)
    again = gs.ResultSet(NAME, store=store)  # the job that writes it may open it again
    assert again._run == first._run + 1
    again.close()
    first.close()
    gs.ResultSet(NAME, store=store).close()  # run 3; an ended run: taken over at once
    _fake_run(store, 4, "another-host", age=5)  # another host, beat 5 s ago: alive
    with pytest.raises(gs.GatherError, match="job ffffffffffffffff on another-host"):
        gs.ResultSet(NAME, store=store)
    _fake_run(store, 5, "another-host", age=4 * 30 + 5)  # silent for 4 intervals: stale
    taken = gs.ResultSet(NAME, store=store)
    assert taken._run == 6
    taken.close()
    _fake_run(store, 7, socket.gethostname(), age=1)  # this host, its process gone
    taken = gs.ResultSet(NAME, store=store)
    assert taken._run == 8
    taken.close()


HOLD = """
import sys, time, gatherstore as gs
rs = gs.ResultSet(sys.argv[2], store=sys.argv[1])
rs.add(1, "held")
rs.flush()
print(rs._held.job, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_second_live_job_is_refused_and_a_killed_one_taken_over(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    env = {**os.environ, "PYTHONPATH": SRC}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, url, NAME], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        job = holder.stdout.readline().strip()
        with pytest.raises(gs.GatherError, match=f"job {job} .*pid {holder.pid}"):
            gs.ResultSet(NAME, store=url)
    finally:
        holder.kill()
        holder.wait()
    rs = gs.ResultSet(NAME, store=url)  # its process is gone: taken over
    assert rs.gather() == ["held"]


# --- export ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_export_parquet_arrow_jsonl(tmp_path: Path) -> None:
    import pyarrow.ipc
    import pyarrow.parquet

    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}/store", flush_every=3)
    for i in reversed(range(10)):
        rs.add(i, value(i))
    for name in ("out.parquet", "out.arrow", "out.jsonl"):
        assert rs.export(tmp_path / name) == 10
    table = pyarrow.parquet.read_table(tmp_path / "out.parquet")
    assert table.column_names == ["key", "id", "boxes", "score", "name"]
    assert table.column("key").to_pylist() == list(range(10))
    assert table.slice(3, 1).to_pylist()[0]["boxes"] == value(3)["boxes"].tolist()
    with pyarrow.ipc.open_file(tmp_path / "out.arrow") as arrow:
        assert arrow.read_all().equals(table)
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert json.loads(lines[2]) == {
        "key": 2,
        "value": {**value(2), "boxes": value(2)["boxes"].tolist()},
    }
    with pytest.raises(ValueError, match=r"unknown format '.csv'"):
        rs.export(tmp_path / "out.csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "out.arrow",
        "out.jsonl",
        "out.parquet",
        "store",
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_export_to_files_writes_the_same_rows_in_parts(tmp_path: Path, suffix: str) -> None:
    """files=N writes a folder of N part files, each a range of keys: read as one
    dataset, they hold the rows of files=1, in the same order; fewer parts for fewer keys."""
    import pyarrow.dataset as ds

    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}/store", flush_every=7)
    for i in np.random.default_rng(0).permutation(52).tolist():  # chunks overlap in keys
        rs.add(i, value(i))
    kind = suffix.removeprefix(".").replace("arrow", "ipc")
    assert rs.export(tmp_path / f"one{suffix}") == 52
    one = ds.dataset(tmp_path / f"one{suffix}", format=kind).to_table()
    assert rs.export(tmp_path / f"three{suffix}", files=3) == 52
    parts = sorted(p.name for p in (tmp_path / f"three{suffix}").iterdir())
    assert parts == [f"part-0000{i}{suffix}" for i in range(3)]
    three = ds.dataset(tmp_path / f"three{suffix}", format=kind).to_table()
    assert three.equals(one)
    each = [ds.dataset(tmp_path / f"three{suffix}" / p, format=kind).to_table() for p in parts]
    assert [t.num_rows for t in each] == [17, 17, 18]  # about as many keys each
    named = gs.ResultSet("eval/named", store=f"file://{tmp_path}/store", flush_every=4)
    for i in reversed(range(10)):  # str keys
        named.add(f"img-{i}", value(i))
    assert named.export(tmp_path / f"named{suffix}", files=2) == 10
    both = ds.dataset(tmp_path / f"named{suffix}", format=kind).to_table()
    assert both.column("key").to_pylist() == [f"img-{i}" for i in range(10)]
    few = gs.ResultSet("eval/few", store=f"file://{tmp_path}/store")
    few.add(1, value(1))
    few.add(2, value(2))
    assert few.export(tmp_path / f"few{suffix}", files=4) == 2
    assert len(list((tmp_path / f"few{suffix}").iterdir())) == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_an_export_takes_its_schema_from_its_first_rows(tmp_path: Path) -> None:
    """Ranks' chunks that interleave in keys, whose first value lacks a label: the
    schema comes from the first rows together (an int column), whatever the merge's
    first block holds; arrays with an empty dimension, and an Arrow file in few record
    batches."""
    import pyarrow.ipc
    import pyarrow.parquet

    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}/store", flush_every=1000)
    for k in [*range(0, 3000, 2), *range(1, 3000, 2)]:  # two chunks that interleave
        label = None if k == 0 else k
        rs.add(k, {"boxes": np.full((2, 4), k, np.float32), "label": label, "e": np.zeros((3, 0))})
    assert rs.export(tmp_path / "out.parquet") == 3000
    table = pyarrow.parquet.read_table(tmp_path / "out.parquet")
    assert str(table.schema.field("label").type) == "int64"
    assert table.column("label").to_pylist() == [None, *range(1, 3000)]
    assert table.column("boxes").to_pylist()[2999] == [[2999.0] * 4] * 2
    assert table.column("e").to_pylist()[5] == [[], [], []]
    assert rs.export(tmp_path / "out.arrow") == 3000
    with pyarrow.ipc.open_file(tmp_path / "out.arrow") as arrow:
        assert arrow.num_record_batches <= 3  # the first rows, then batches of 8 MiB
        assert arrow.read_all().equals(table)


@pytest.mark.parametrize("files", [0, -2, 1.5, True, "2", None])
def test_export_refuses_a_files_that_is_no_positive_int(tmp_path: Path, files: Any) -> None:
    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}/store")
    rs.add(1, value(1))
    with pytest.raises(ValueError, match=r"is not a positive int: pass files=1 for one file"):
        rs.export(tmp_path / "out.parquet", files=files)
    with pytest.raises(ValueError, match=r"JSON lines go to one file: pass files=1"):
        rs.export(tmp_path / "out.jsonl", files=2)
    (tmp_path / "full.parquet").mkdir()
    (tmp_path / "full.parquet" / "mine.txt").write_text("kept")
    with pytest.raises(ValueError, match=r"full.parquet' is a folder that holds files: remove"):
        rs.export(tmp_path / "full.parquet", files=2)
    with pytest.raises(ValueError, match=r"full.parquet' is a folder: remove it"):
        rs.export(tmp_path / "full.parquet")
    assert (tmp_path / "full.parquet" / "mine.txt").read_text() == "kept"
    (tmp_path / "empty.parquet").mkdir()  # an empty folder is taken
    assert rs.export(tmp_path / "empty.parquet", files=2) == 1
    assert [p.name for p in (tmp_path / "empty.parquet").iterdir()] == ["part-00000.parquet"]


def test_a_failed_export_to_files_leaves_nothing(tmp_path: Path) -> None:
    """A value that does not fit, in the last part, fails the export: the parts written
    meanwhile are removed, and the error names the value."""
    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}/store", flush_every=5)
    for i in range(40):
        rs.add(i, {"a": i, "b": i} if i != 37 else {"a": i})
    with pytest.raises(ValueError, match=r"the value of key 37 has no field 'b'"):
        rs.export(tmp_path / "out.parquet", files=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_an_export_names_the_first_value_without_a_field(tmp_path: Path) -> None:
    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}/store")
    for i in range(5):
        rs.add(i, {"a": i, "b": i} if i != 3 else {"a": i})
    with pytest.raises(ValueError, match=r"the value of key 3 has no field 'b'"):
        rs.export(tmp_path / "out.parquet")
    rs.add(9, [1])  # not a dict: it has no field at all
    with pytest.raises(ValueError, match=r"the value of key 9 has no field 'a'"):
        rs.export(tmp_path / "out.arrow")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_arrow_export_without_pyarrow_names_the_pip_line(tmp_path: Path) -> None:
    code = f"""
import sys
sys.modules["pyarrow"] = None
import gatherstore as gs
rs = gs.ResultSet("x", store="file://{tmp_path}")
rs.add(1, 1)
try:
    rs.export("{tmp_path}/x.parquet")
except ImportError as exc:
    print(exc)
rs.export("{tmp_path}/x.jsonl")
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "pip install 'gatherstore[arrow]'" in done.stdout
    assert (tmp_path / "x.jsonl").read_text() == '{"key": 1, "value": 1}\n'


@pytest.mark.timeout(120)
def test_items_spills_to_stay_within_its_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rs = gs.ResultSet(NAME, store=f"file://{tmp_path}", flush_every=50)
    rng = np.random.default_rng(0)
    keys = rng.permutation(2000)  # every chunk spans the whole key range
    for k in keys.tolist():
        rs.add(k, np.full(256, k, np.int64))
    rs.flush()
    assert _cli.main(["results", "--store", f"file://{tmp_path}"]) == 0
    assert f"{NAME}: 40 chunks" in capsys.readouterr().out
    budget = 2 * 2 * 50 * 256 * 8  # two chunks of the forty, stored and rebuilt
    out = list(rs.items(read_ahead=budget))
    assert [k for k, _ in out] == list(range(2000))
    assert all(int(v[0]) == k for k, v in out)


# --- the command ----------------------------------------------------------------------------------
def test_gc_removes_result_sets_only_when_asked_and_results_shows_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path}"
    for name in ("eval/a", "eval/b", "eval/live"):
        rs = gs.ResultSet(name, store=url)
        rs.add(1, {"x": 1})
        rs.close()  # its run ended: gc may remove it, if asked
    _fake_run(gs.open_store(url), 2, "another-host", age=1, name="eval/live")  # written now
    assert _cli.main(["gc", "--store", url, "--older-than", "0s"]) == 0
    assert sorted(p.name for p in (tmp_path / "gatherstore-results" / "eval").iterdir()) == [
        "a",
        "b",
        "live",
    ]
    assert _cli.main(["results", "--store", url]) == 0
    listing = capsys.readouterr().out
    assert "eval/a: 1 chunks, 1 runs, ended" in listing
    assert "eval/live: 1 chunks, 2 runs, written by job ffffffffffffffff on another-host" in listing
    assert _cli.main(["results", "--store", url, "--name", "eval/a"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == 1
    assert (
        _cli.main(
            ["results", "--store", url, "--name", "eval/a", "--export", f"{tmp_path}/a.jsonl"]
        )
        == 0
    )
    assert (tmp_path / "a.jsonl").read_text() == '{"key": 1, "value": {"x": 1}}\n'
    assert _cli.main(["results", "--store", url, "--name", "eval/live", "--discard"]) == 1
    assert "is being written by another job" in capsys.readouterr().err
    assert _cli.main(["gc", "--store", url, "--older-than", "0s", "--result-sets"]) == 0
    assert "removed 2 result set(s)" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "gatherstore-results" / "eval").iterdir()] == ["live"]


def test_results_exports_to_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow.dataset as ds

    from gatherstore.cli import main as _cli

    url = f"file://{tmp_path}/store"
    with gs.ResultSet(NAME, store=url, flush_every=4) as rs:
        for i in range(10):
            rs.add(i, value(i))
    out = tmp_path / "preds.parquet"
    argv = ["results", "--store", url, "--name", NAME, "--export", str(out), "--files", "2"]
    assert _cli.main(argv) == 0
    said = capsys.readouterr().out
    assert said == f"wrote 10 values of result set {NAME!r} to 2 part files in the folder {out}\n"
    assert ds.dataset(out).to_table().column("key").to_pylist() == list(range(10))
    assert _cli.main(["results", "--store", url, "--name", NAME, "--files", "2"]) == 1
    assert "--files goes with --export PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the parser refuses it
        _cli.main([*argv[:-1], "0"])
    assert "argument --files: '0' is not a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("holds", [[], ["eval/a", "eval/b"]])
def test_a_set_that_does_not_exist_is_never_created_by_reading_or_removing_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], holds: list[str]
) -> None:
    """Showing, exporting or discarding a set the store does not hold fails alike, in one
    line that names the sets it holds, and leaves the store as it was."""
    url = f"file://{tmp_path}/store"
    for name in holds:
        with gs.ResultSet(name, store=url) as rs:
            rs.add(1, name)
    store = gs.open_store(url)
    before = store.list()
    held = ", ".join(repr(name) for name in holds) or "none"
    export = tmp_path / "nope.jsonl"
    for how in ([], ["--export", str(export)], ["--discard"]):
        assert _cli.main(["results", "--store", url, "--name", "nope", *how]) == 1
        said = capsys.readouterr()
        assert said.out == ""
        assert said.err == (
            f"gatherstore results: ValueError: store {store} holds no result set 'nope' "
            f"(it holds {held}): check the set's name and the store\n"
        )
        assert store.list() == before
    assert not export.exists()
    assert (tmp_path / "store").exists() == bool(holds)  # not even the store's folder
