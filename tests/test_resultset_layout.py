"""A result set's pure pieces, each alone: key order, names, the flush policy, the merge
of its chunks in bounded memory, and the columns of an export.  The set itself, against
real stores, is test_resultset.py's."""

from __future__ import annotations

import datetime as dt
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
