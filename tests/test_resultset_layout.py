"""A result set's pure pieces, each alone: key order, names, the flush policy, the merge
of its chunks in bounded memory, and the columns of an export.  The set itself, against
real stores, is test_resultset.py's."""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys
import uuid
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gatherstore as gs
from gatherstore.results import export, layout, merge, order
from gatherstore.results.read import SetReader
from gatherstore.results.writer import FlushEvery, flush_policy


def test_keys_are_ints_then_strs() -> None:
    assert order.check_key(np.int64(3)) == 3 and type(order.check_key(np.int64(3))) is int
    for bad in (True, 1.5, (1,), None, b"x"):
        with pytest.raises(TypeError, match="int or a str"):
            order.check_key(bad)
    assert order.unpack(order.sort_keys(["b", 3, "a", 1, 3])) == [1, 3, "a", "b"]
    assert isinstance(order.sort_keys(range(5, 0, -1)), np.ndarray)
    assert order.unpack(order.sort_keys(range(5, 0, -1))) == [1, 2, 3, 4, 5]
    mask = order.stored_mask(order.sort_keys(range(6)), [np.array([1, 4]), [5, "x"]])
    assert mask.tolist() == [False, True, False, False, True, True]
    assert order.stored_mask(["a", "b"], [np.array([1]), ["b"]]).tolist() == [False, True]


def test_flush_every_takes_values_bytes_and_seconds() -> None:
    default = flush_policy()
    assert flush_policy(10) == FlushEvery(10, default.nbytes, default.seconds)
    assert flush_policy("2MB").nbytes == 2 << 20
    assert flush_policy("1.5s").seconds == 1.5
    assert flush_policy(dt.timedelta(minutes=1)).seconds == 60
    assert flush_policy((7, "1KB", "2s")) == FlushEvery(7, 1024, 2.0)
    for bad in (0, -1, 1.5, "soon", True, "0s"):
        with pytest.raises(ValueError, match="flush_every"):
            flush_policy(bad)


def test_names_are_checked() -> None:
    assert layout.check_name("coco-val/ckpt-1200") == "coco-val/ckpt-1200"
    for bad in ("", "/a", "a//b", "../a", ".hidden", "a b", "x.chunks", 3):
        with pytest.raises(ValueError, match="result set name"):
            layout.check_name(bad)


@pytest.mark.parametrize(
    "values",
    [
        [np.arange(6, dtype=np.float32).reshape(3, 2), np.ones((1, 2), np.float32)],  # ragged rows
        [torch.arange(4).reshape(2, 2), torch.zeros((0, 2), dtype=torch.int64)],  # tensors
        [np.float64(1.5), np.array(2.5)],  # numpy scalars
        [np.array(3), np.array(4)],  # 0-d arrays
        [np.ones((2, 2)), np.ones((2, 3))],  # trailing shapes differ: one list per row
        [np.ones(2, np.int8), np.ones(2, np.int64)],  # dtypes differ
        [np.arange(3, dtype=">i4"), np.arange(2, dtype=">i4")],  # not this machine's order
        [np.array([True, False]), np.array([True])],  # bools: bits
        [1, None, 3],
        [True, False, True],
        [0.5, 1.5],
        ["a", "bé", ""],
        [b"a", b"", b"\xff"],
        [[1, 2], [3]],
    ],
    ids=lambda v: type(v[0]).__name__ + str(len(v)),
)
def test_an_exported_column_holds_each_value_as_a_list_would(values: list[Any]) -> None:
    """The columns built from the arrays' memory equal pyarrow's own conversion of the
    same values as Python lists."""
    import pyarrow as pa

    plain = [v.tolist() if hasattr(v, "tolist") else v for v in values]
    assert export._column(pa, values).to_pylist() == plain


# --- the merge ------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(
        st.lists(st.one_of(st.integers(-5, 40), st.sampled_from("abc")), min_size=1, max_size=12),
        min_size=1,
        max_size=8,
    ),
    budget=st.sampled_from([1, 300, 1 << 30]),
    parts=st.integers(1, 5),
)
def test_the_merge_keeps_key_order_and_the_first_chunks_value(
    chunks: list[list[Any]], budget: int, parts: int
) -> None:
    """Whole, or cut into ranges of keys merged one by one (an export to files)."""
    store = gs.open_store(f"memory://merge-{uuid.uuid4().hex}")
    indexes = []
    for seq, keys in enumerate(chunks):
        name = layout.chunk_name(1, seq % 3, seq)
        items = [(k, (seq, pos)) for pos, k in enumerate(keys)]
        data, index = layout.encode_chunk(items, name, None, "uid")
        store.put(f"chunks/{name}", data.segments)
        indexes.append(layout.decode_index(b"".join(index.segments), name, None, "uid", name))

    infos, reader = [info for info, _ in indexes], SetReader(store, None, "uid", "test")
    cuts = merge.split(indexes, parts)
    assert 1 <= len(cuts) <= parts
    ranges = [list(merge.merged(infos, reader, budget, a, b)) for a, b in cuts]
    assert all(ranges)  # none empty
    got = [item for found in ranges for item in found]
    first: dict[Any, Any] = {}
    by_name = sorted(range(len(chunks)), key=lambda s: layout.chunk_name(1, s % 3, s))
    for seq in by_name:
        for pos, k in enumerate(chunks[seq]):
            first.setdefault(k, (seq, pos))
    assert got == sorted(first.items(), key=lambda kv: order.order_key(kv[0]))


def _stored(chunks: list[list[tuple[Any, Any]]]) -> tuple[list[layout.ChunkInfo], SetReader]:
    """Chunks of ``(key, value)`` items in a store of their own, as a set's reader sees them."""
    store = gs.open_store(f"memory://merge-{uuid.uuid4().hex}")
    infos = []
    for seq, items in enumerate(chunks):
        name = layout.chunk_name(1, seq % 3, seq)
        data, index = layout.encode_chunk(items, name, None, "uid")
        store.put(f"chunks/{name}", data.segments)
        infos.append(layout.decode_index(b"".join(index.segments), name, None, "uid", name)[0])
    return infos, SetReader(store, None, "uid", "test")


#: How a chunk's records hold their arrays: one shape (numpy or torch), rows of lengths
#: that differ, or one shape with the fields in another order.
_ARRAYS = ["fixed", "tensor", "ragged", "reversed"]


def _record(key: Any, seq: int, pos: int, arrays: str) -> dict[str, Any]:
    rows = 1 + pos % 3 if arrays == "ragged" else 2
    boxes = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + seq * 100 + pos
    record = {"id": seq * 1000 + pos, "boxes": boxes, "label": np.int64(pos), "name": f"{key}"}
    if arrays == "tensor":
        record["boxes"] = torch.from_numpy(boxes)
    if arrays == "reversed":  # the same fields in another order
        record = dict(reversed(record.items()))
    return record


@settings(max_examples=30, deadline=None)
@given(
    chunks=st.lists(
        st.tuples(
            st.lists(st.integers(-5, 40), min_size=1, max_size=20),
            st.sampled_from(_ARRAYS),
        ),
        min_size=1,
        max_size=6,
    ),
    budget=st.sampled_from([1, 1 << 30]),
    named=st.booleans(),
)
def test_an_export_takes_the_columns_of_chunks_as_their_rows_would_give(
    chunks: list[tuple[list[int], str]], budget: int, named: bool
) -> None:
    """Chunks of records held as columns (``codec.load_columns``) give the tables that
    their records, rebuilt one by one, give: the same rows and one schema; whatever the
    mix of chunks that hold columns and chunks that do not (fewer records than a batch,
    other fields' order, spilled within a tiny budget), duplicate keys, int or str keys."""
    import pyarrow as pa

    def key(k: int) -> Any:
        return f"img-{k + 5:03d}" if named else k

    items = [
        [(key(k), _record(key(k), seq, pos, arrays)) for pos, k in enumerate(keys)]
        for seq, (keys, arrays) in enumerate(chunks)
    ]
    infos, reader = _stored(items)
    found = {}
    with pytest.MonkeyPatch.context() as patch:  # columns from the fourth row on
        patch.setattr(export, "FIRST_ROWS", 3)
        for columnar in (False, True):
            blocks = merge.blocks(infos, reader, budget, columnar=columnar)
            found[columnar] = list(export._Tables(pa, blocks))
    rows = {c: [r for table, _ in found[c] for r in table.to_pylist()] for c in found}
    assert rows[True] == rows[False]
    assert len({table.schema for c in found for table, _ in found[c]}) == 1
    firsts = {c: [(t.column("key")[0].as_py(), key) for t, key in found[c]] for c in found}
    assert all(column == key for c in firsts for column, key in firsts[c])


@dataclasses.dataclass
class Detection:
    boxes: np.ndarray
    label: int


@dataclasses.dataclass(slots=True)
class SlottedDetection:  # what ``Detection`` became after its set was stored
    boxes: np.ndarray
    label: int


def test_records_held_as_columns_that_cannot_be_rebuilt_fail_as_a_load_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pyarrow as pa

    infos, reader = _stored([[(k, Detection(np.ones(3) * k, k)) for k in range(20)]])
    monkeypatch.setattr(sys.modules[__name__], "Detection", SlottedDetection)
    tables = export._Tables(pa, merge.blocks(infos, reader, 1 << 30, columnar=True))
    with pytest.raises(gs.GatherError, match=r"chunk .* cannot be rebuilt here: AttributeError"):
        list(tables)


def test_an_export_holds_a_chunk_of_one_batch_as_its_columns() -> None:
    """A chunk of records with arrays is held as its columns, and its arrays are taken
    a column at a time (a field more in some chunks is left out, as from rows); a chunk
    too short for a batch is held as its records."""
    infos, reader = _stored(
        [
            [(k, _record(k, 0, k, "fixed")) for k in range(0, 40, 2)],
            [(k, {**_record(k, 1, k, "fixed"), "more": k}) for k in range(1, 40, 2)],
            [(k, _record(k, 2, k, "fixed")) for k in range(40, 43)],
        ]
    )
    blocks = merge.blocks(infos, reader, 1 << 30, 0, 40, columnar=True)
    keys, (labels,) = next(blocks).fields(["label"])  # key 0 alone: below the second
    assert keys.tolist() == [0] and labels == [0]  # chunk's first
    block = next(blocks)  # read before the merge goes on
    assert block.fields(["more"]) is None  # only one of its two chunks holds it
    keys, (boxes, names) = block.fields(["boxes", "name"])
    assert keys.tolist() == list(range(1, 40))
    assert boxes.shape == (39, 2, 4) and names == [str(k) for k in range(1, 40)]
    assert boxes[:, 0, 0].tolist() == [k % 2 * 100 + k for k in range(1, 40)]
    assert next(blocks, None) is None
    short = merge.blocks(infos, reader, 1 << 30, 40, None, columnar=True)
    assert [block.fields(["id"]) for block in short] == [None]
