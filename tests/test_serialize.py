"""Framing and record batches: exact round trips, zero-copy views, damaged parts."""

from __future__ import annotations

import copyreg
import dataclasses
import gc
import itertools
import os
import pickle
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_signed_parts import Sentinel, _unpickled

import gatherstore as gs
from gatherstore import codec as gs_codec
from gatherstore.codec import digest as _digest
from gatherstore.codec import frames as serialize
from gatherstore.codec import records as _records
from gatherstore.codec import sizing as _sizing
from gatherstore.codec.records import MIN_RUN


def round_trip(obj: Any, key: bytes | None = None) -> Any:
    frame = serialize.encode(obj).seal(key)
    buf = bytearray(frame.nbytes)
    frame.copy_into(memoryview(buf))
    return serialize.decode(buf, key=key, rank=0)


def assert_same(a: Any, b: Any) -> None:
    """Equal values, the same types, dtypes, shapes and key order."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.dtype.str == b.dtype.str and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and not a.requires_grad
        assert torch.equal(a, b.detach())
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif dataclasses.is_dataclass(a):
        assert_same(dataclasses.asdict(a), dataclasses.asdict(b))
    else:
        assert a == b or (a != a and b != b)


@dataclasses.dataclass
class Detection:
    boxes: Any
    score: float
    name: str | None


DTYPES = st.sampled_from(["<f4", ">f4", "<i8", ">i2", "|u1", "|b1", "<f8", ">c16"])


@st.composite
def arrays(draw: Any) -> np.ndarray:
    arr = draw(
        hnp.arrays(
            dtype=draw(DTYPES),
            shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
        )
    )
    if arr.ndim >= 2 and draw(st.booleans()):
        arr = arr[:, ::-1]  # not contiguous
    return arr


@st.composite
def tensors(draw: Any) -> torch.Tensor:
    dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.bool]))
    shape = draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))
    tensor = torch.zeros(shape, dtype=torch.float64).uniform_(-5, 5).to(dtype)
    if dtype.is_floating_point and draw(st.booleans()):
        tensor.requires_grad_(True)
    return tensor


SCALARS = st.one_of(
    st.none(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5), st.booleans()
)
FIELDS = st.one_of(SCALARS, arrays(), tensors())


@st.composite
def record_lists(draw: Any) -> list[Any]:
    """Runs of same-shaped records, dicts or tuples (ragged first dims), some nested in
    another record's field, mixed with odd items."""
    out: list[Any] = []
    for _ in range(draw(st.integers(0, 3))):
        names = draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=4, unique=True))
        trailing = draw(st.lists(st.integers(0, 3), max_size=2))
        dtype = draw(DTYPES)
        as_tensor, as_tuple, nested = (draw(st.booleans()) for _ in range(3))
        count = draw(st.integers(0, 2 * MIN_RUN))
        for _ in range(count):
            record: dict[str, Any] = {}
            for i, name in enumerate(names):
                if i == 0:
                    shape = (draw(st.integers(0, 3)), *trailing)
                    arr = np.ones(shape, dtype=dtype)
                    record[name] = torch.from_numpy(arr.real.astype("<f4")) if as_tensor else arr
                else:
                    record[name] = draw(FIELDS)
            if nested:  # a record whose field is the record: {"n", "inner": {...}}
                record = {"n": len(out), "inner": record}
            out.append(tuple(record.values()) if as_tuple else record)
        out += draw(st.lists(FIELDS, max_size=2))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record_lists())
def test_round_trip_of_random_record_lists(items: list[Any]) -> None:
    assert_same(round_trip(items), items)
    assert_same(round_trip({"nested": (items, [items])}), {"nested": (items, [items])})


def _columns_of(obj: Any) -> Any:
    """``obj`` through a frame, loaded with ``load_columns``."""
    frame = serialize.encode(obj).seal(None)
    buf = bytearray(frame.nbytes)
    frame.copy_into(memoryview(buf))
    return gs_codec.load_columns(serialize.verify(buf))


def _as_rows(obj: Any) -> Any:
    """What ``load_columns`` gave, its columns rebuilt as records."""
    if type(obj) is tuple:
        return tuple(map(_records.listed, obj))
    return _records.listed(obj)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record_lists())
def test_loaded_as_columns_a_list_rebuilds_the_records_a_load_gives(items: list[Any]) -> None:
    """A top-level list of records, alone or in a tuple, loads as its columns (or as
    it is, when it is no batch); rebuilt, they are what a load gives, and so is any
    other object: a batch nested below is loaded as records."""
    for obj in (items, (np.arange(3), items), {"nested": [items]}, [{"a": items}] * 3):
        assert_same(_as_rows(_columns_of(obj)), obj)


def test_runs_of_records_load_once_as_their_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """A list of runs of two shapes rebuilds its batches' records as it loads: nothing is
    left as columns, and the part is not loaded again; a batch in a value of a short list
    is, plainly."""
    runs = [{"a": np.ones(2) * i} for i in range(MIN_RUN)] + [
        {"b": np.ones(3) * i, "c": i} for i in range(MIN_RUN)
    ]
    loads: list[int] = []
    plain = serialize.load
    monkeypatch.setattr(serialize, "load", lambda verified: loads.append(1) or plain(verified))
    assert_same(_columns_of(runs), runs)
    assert loads == []
    short = [{"records": runs[:MIN_RUN]}] * 2
    assert_same(_columns_of(short), short)
    assert loads == [1]


def test_a_batch_of_records_loads_as_columns_that_stack() -> None:
    boxes = np.arange(MIN_RUN * 8, dtype=">f4").reshape(MIN_RUN, 2, 4)
    records = [
        {
            "id": i,
            "boxes": boxes[i].copy(),
            "t": torch.tensor(float(i)),
            "hits": [{"x": np.ones(1)}] * 0,
        }
        for i in range(MIN_RUN)
    ]
    _, columns = _columns_of((np.arange(MIN_RUN), records))
    assert type(columns) is _records.Columns and columns.cls is dict
    assert columns.names == ("id", "boxes", "t", "hits") and len(columns) == MIN_RUN
    np.testing.assert_array_equal(columns.stacked("boxes"), boxes)  # its dtype kept
    assert columns.stacked("boxes").dtype.str == ">f4"
    assert columns.stacked("t").tolist() == list(range(MIN_RUN))  # 0-d tensors: one row each
    assert columns.stacked("id") is None and columns.field("id") == list(range(MIN_RUN))
    assert_same(columns.rows(), records)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(FIELDS, max_size=6))
def test_round_trip_of_random_fields(values: list[Any]) -> None:
    assert_same(round_trip(values), values)


def test_dataclass_records_and_none_fields() -> None:
    dets = [
        Detection(
            np.arange(i % 3 * 4, dtype=np.float32).reshape(-1, 4)
            if i % 5
            else np.zeros((0, 4), np.float32),
            i / 7,
            None if i % 2 else f"d{i}",
        )
        for i in range(40)
    ]
    assert_same(round_trip(dets), dets)


def test_rebuilt_records_are_each_an_object_of_their_own() -> None:
    """A batch rebuilds its records a field at a time: each is a dict (or instance) of its
    own, with its fields in their order, and a change to one touches no other."""
    dicts = [{"id": i, "x": np.arange(3) + i, "name": f"r{i}"} for i in range(20)]
    dets = [Detection(np.full((2, 4), i, np.float32), i / 7, f"d{i}") for i in range(20)]
    out_dicts, out_dets = round_trip([dicts, dets])
    assert len({id(r) for r in out_dicts}) == len({id(vars(d)) for d in out_dets}) == 20
    assert [list(r) for r in out_dicts] == [["id", "x", "name"]] * 20
    assert [list(vars(d)) for d in out_dets] == [["boxes", "score", "name"]] * 20
    out_dicts[0]["id"] = out_dets[0].score = -1
    assert [r["id"] for r in out_dicts[1:]] == list(range(1, 20))
    assert [d.score for d in out_dets[1:]] == [i / 7 for i in range(1, 20)]


def test_a_batch_whose_fields_differ_in_length_is_not_rebuilt() -> None:
    with pytest.raises(ValueError, match="a batch of 2 records has a field of another length"):
        _records._unbatch(dict, ("a", "b"), [("py",), ("py",)], 2, [[1, 2], [3]])


def test_numpy_and_torch_interleaved() -> None:
    items = [
        {"a": np.arange(3), "b": torch.arange(3)}
        if i % 2
        else {"a": torch.arange(3), "b": np.arange(3)}
        for i in range(30)
    ]
    assert_same(round_trip(items), items)


def test_tensor_that_requires_grad_is_detached() -> None:
    items = [{"x": torch.ones(2, requires_grad=True)} for _ in range(MIN_RUN)]
    out = round_trip(items)
    assert not out[0]["x"].requires_grad and torch.equal(out[0]["x"], torch.ones(2))


def test_records_are_views_into_the_part(tmp_path: Path) -> None:
    records = [
        {"boxes": np.full((i % 4 + 1, 4), i, np.float32), "t": torch.full((3,), float(i)), "id": i}
        for i in range(100)
    ]
    store = gs.open_store(f"file://{tmp_path}")
    frame = serialize.encode(records).seal(None)
    store.put("part", frame.segments)
    raw = store.get("part")
    out = serialize.decode(raw)
    store.delete("part")  # the mapping outlives the file
    assert_same(out, records)
    bases = {id(_root(r["boxes"])) for r in out}
    assert len(bases) == 1, "every record's array is a view of one column"
    ptrs = [r["t"].data_ptr() for r in out]
    assert ptrs == [ptrs[0] + 12 * i for i in range(100)], "tensors are views of one column"
    out[3]["boxes"][0, 0] = -1  # writable (copy-on-write), the others untouched
    assert out[4]["boxes"][0, 0] == 4


def test_a_list_of_small_arrays_is_one_column() -> None:
    shared = np.arange(8, dtype=">f4").reshape(2, 4)
    arrays = [np.full((i % 3, 4), i, ">f4") for i in range(60)] + [shared] * 3
    out = round_trip(arrays)
    assert_same(out, arrays)
    assert len({id(_root(a)) for a in out}) == 1, "every array is a view of one column"
    assert out[-1] is out[-2] is out[-3], "an array the list holds three times stays one"
    out[4][0, 0] = -1  # writable, the others untouched
    assert out[5][0, 0] == 5 and out[1][0, 0] == 1


def test_a_list_of_small_tensors_is_one_column() -> None:
    tensors = [torch.full((3,), float(i), requires_grad=True) for i in range(50)]
    out = round_trip(tensors)
    assert_same(out, tensors)
    ptrs = [t.data_ptr() for t in out]
    assert ptrs == [ptrs[0] + 12 * i for i in range(50)], "tensors are views of one column"


def test_lists_of_arrays_that_do_not_join_stay_as_they_are() -> None:
    mixed_dtypes = [np.ones(3, np.float32) if i % 2 else np.ones(3, np.int64) for i in range(20)]
    mixed_shapes = [np.ones((2, 1 + i % 2)) for i in range(20)]
    views = list(np.ones((20, 2048), np.float32))  # 8 KiB views of one batch: one span
    mixed_kinds = [np.ones(2)] * 10 + [torch.ones(2)] * 10
    for items in (mixed_dtypes, mixed_shapes, views, mixed_kinds):
        assert_same(round_trip(items), items)
    out = round_trip(views)
    assert len({id(_root(a)) for a in out}) == 1  # still views of one buffer


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    DTYPES.flatmap(
        lambda dtype: st.lists(
            hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=2, max_side=3)),
            min_size=MIN_RUN,
            max_size=3 * MIN_RUN,
        )
    )
)
def test_round_trip_of_random_lists_of_arrays(items: list[np.ndarray]) -> None:
    assert_same(round_trip(items), items)
    with np.errstate(over="ignore", invalid="ignore"):  # e.g. >f8 or complex to <f4
        torn = [torch.from_numpy(np.asarray(np.nan_to_num(a.real.astype("<f4")))) for a in items]
    assert_same(round_trip(torn), torn)


def test_a_long_dict_of_records_or_tensors_is_packed_as_a_list_of_them() -> None:
    keyed = {f"img{i}": {"boxes": np.full((4, 4), i, ">f4"), "id": i} for i in range(300)}
    tensors = {i: torch.full((1024,), float(i)) for i in range(100)}  # 4 KiB each
    out = round_trip({"keyed": keyed, "tensors": tensors})
    assert_same(out, {"keyed": keyed, "tensors": tensors})
    roots = {id(_root(r["boxes"])) for r in out["keyed"].values()}
    assert len(roots) == 1, "the records' arrays are views of one column"
    ptrs = [t.data_ptr() for t in out["tensors"].values()]
    assert ptrs == [ptrs[0] + 4096 * i for i in range(100)], "tensors are views of one column"


def test_a_list_of_tuples_holding_arrays_is_packed_and_one_of_atoms_is_not() -> None:
    batch = np.arange(40 * 12, dtype=">f4").reshape(40, 3, 4)
    pairs = [(i, batch[i], torch.full((2,), float(i))) for i in range(40)]
    out = round_trip(pairs)
    assert_same(out, pairs)
    assert len({id(_root(p[1])) for p in out}) == 1, "the arrays are views of one column"
    atoms = [(i, f"q{i}", i / 2) for i in range(40)]
    assert _records.pack(atoms).value is atoms, "pickle writes these as fast as columns"
    assert_same(round_trip(atoms), atoms)
    ragged = [(i, batch[i]) if i % 2 else (i, batch[i], "odd") for i in range(40)]
    assert_same(round_trip(ragged), ragged)


def test_records_nested_in_a_field_are_packed_as_a_list_of_them() -> None:
    batch = torch.arange(50 * 8, dtype=torch.float32).reshape(50, 2, 4)
    recs = [{"id": i, "pred": {"boxes": batch[i], "score": i / 2}} for i in range(50)]
    out = round_trip(recs)
    assert_same(out, recs)
    ptrs = [r["pred"]["boxes"].data_ptr() for r in out]
    assert ptrs == [ptrs[0] + 32 * i for i in range(50)], "views of one column"


def test_lists_of_records_in_a_field_are_packed_as_one_list_of_them() -> None:
    images = [
        {
            "image_id": i,
            "instances": [{"bbox": np.full(4, k, np.float32), "score": k} for k in range(i % 4)],
        }
        for i in range(30)
    ]
    out = round_trip(images)
    assert_same(out, images)
    boxes = [inst["bbox"] for image in out for inst in image["instances"]]
    assert len({id(_root(b)) for b in boxes}) == 1, "every box is a view of one column"
    out[5]["instances"].append("mine")  # lists of their own
    assert_same(out[6]["instances"], images[6]["instances"])


def test_records_of_plain_values_are_pickled_as_they_are() -> None:
    """Pickle reads and writes them faster than their columns."""
    plain = [{"image_id": i, "bbox": [1.0, 2.0, 3.0, 4.0], "score": i / 2} for i in range(50)]
    nested = [{"id": i, "dets": [{"score": 0.5}] * 2} for i in range(50)]
    tuples = [(i, f"q{i}") for i in range(50)]
    for items in (plain, nested, tuples):
        assert _records.pack(items).value is items


def test_a_list_of_records_held_twice_or_in_a_cycle_stays_one_object() -> None:
    recs = [{"id": i, "x": np.arange(3) + i} for i in range(20)]
    keyed = {i: {"id": i} for i in range(100)}
    out = round_trip({"a": recs, "b": recs, "c": [keyed, keyed]})
    assert_same(out["a"], recs)
    assert out["a"] is out["b"] and out["c"][0] is out["c"][1]
    cycle: list[Any] = [recs]
    cycle.append(cycle)
    back = round_trip(cycle)
    assert back[1] is back
    assert_same(back[0], recs)


@dataclasses.dataclass
class Point:
    x: Any
    y: int


def _held_elsewhere() -> dict[str, Callable[[], Any]]:
    """Objects that packing replaces, each also held by another place of the object."""
    recs = [{"id": i, "x": np.arange(3) + i} for i in range(20)]
    points = [Point(np.arange(2) + i, i) for i in range(20)]
    arrays = [np.arange(4) + i for i in range(20)]
    rows = list(torch.rand(20, 1024))
    keyed = {i: {"id": i} for i in range(100)}
    pairs = [(i, np.arange(3) + i) for i in range(20)]
    nested = [{"id": i, "pred": {"x": np.arange(3) + i}} for i in range(20)]
    inner = [{"id": i} for i in range(10)]
    found = [[{"box": np.arange(4.0) + i}] for i in range(10)]
    preds = [{"boxes": np.arange(4.0) + i} for i in range(10)]
    twice = [{"id": i, "pred": p, "best": p} for i, p in enumerate(preds)]
    tensors = [torch.arange(4.0) + i for i in range(10)]
    dets = [{"box": np.arange(4.0) + i, "score": i} for i in range(10)]
    return {
        "two fields": lambda: (twice, lambda o: o[3]["pred"] is o[3]["best"]),
        "tuple twice": lambda: (
            [(i, t, t) for i, t in enumerate(tensors)],
            lambda o: o[2][1] is o[2][2],
        ),
        "two batches": lambda: (
            {"dets": dets, "images": [{"id": i, "det": d} for i, d in enumerate(dets)]},
            lambda o: o["images"][3]["det"] is o["dets"][3],
        ),
        "record": lambda: ({"all": recs, "best": recs[3]}, lambda o: o["best"] is o["all"][3]),
        "field": lambda: ({"all": recs, "x": recs[3]["x"]}, lambda o: o["x"] is o["all"][3]["x"]),
        "dataclass": lambda: ({"all": points, "p": points[2]}, lambda o: o["p"] is o["all"][2]),
        "array": lambda: ([arrays, arrays[5]], lambda o: o[1] is o[0][5]),
        "row": lambda: ([rows, rows[5]], lambda o: o[1] is o[0][5]),
        "keyed value": lambda: ([keyed, keyed[7]], lambda o: o[1] is o[0][7]),
        "tuple": lambda: ([pairs, pairs[6]], lambda o: o[1] is o[0][6]),
        "nested": lambda: ([nested, nested[2]["pred"]], lambda o: o[1] is o[0][2]["pred"]),
        "records' list in a field": lambda: (
            {"images": [{"id": i, "found": f} for i, f in enumerate(found)], "third": found[3]},
            lambda o: o["third"] is o["images"][3]["found"],
        ),
        "list in a field": lambda: (
            [inner, [{"id": i, "rest": inner} for i in range(10)]],
            lambda o: o[1][4]["rest"] is o[0],
        ),
    }


@pytest.mark.parametrize("case", sorted(_held_elsewhere()))
def test_a_packed_object_held_elsewhere_in_the_object_stays_one_object(case: str) -> None:
    obj, same = _held_elsewhere()[case]()
    assert same(pickle.loads(pickle.dumps(obj, protocol=5)))
    out = round_trip(obj)
    assert_same(out, obj)
    assert same(out), "as pickle rebuilds it: one object in both places"


def _back_references() -> dict[str, tuple[Any, Callable[[Any], bool]]]:
    """Records that lead back to the list or dict they are in, or to each other."""
    parents = [{"id": i, "x": np.arange(2) + i} for i in range(10)]
    for parent in parents:
        parent["child"] = {"parent": parent, "score": 1}
    ring = [{"id": i, "x": np.arange(2) + i} for i in range(10)]
    for i, record in enumerate(ring):
        record["next"], record["me"] = ring[(i + 1) % 10], record
    held = [{"id": i, "x": np.arange(3) + i} for i in range(10)]
    for record in held:
        record["all"] = held
    keyed = {i: {"id": i, "x": np.arange(3) + i} for i in range(70)}
    for value in keyed.values():
        value["d"] = keyed
    root: dict[str, Any] = {"meta": "m", "recs": [{"id": i} for i in range(10)]}
    for record in root["recs"]:
        record["root"] = root
    del parent, record, value  # only the objects hold them now
    return {
        "child to parent": (parents, lambda o: o[4]["child"]["parent"] is o[4]),
        "ring": (ring, lambda o: o[2]["next"] is o[3] and o[5]["me"] is o[5]),
        "list": (held, lambda o: o[0]["all"] is o),
        "long dict": (keyed, lambda o: o[3]["d"] is o),
        "small dict": (root, lambda o: o["recs"][2]["root"] is o),
    }


@pytest.mark.parametrize("case", sorted(_back_references()))
def test_records_that_lead_back_keep_pickles_identities(case: str) -> None:
    obj, same = _back_references()[case]
    assert same(pickle.loads(pickle.dumps(obj, protocol=5)))
    assert same(round_trip(obj))


@dataclasses.dataclass
class Empty:
    """A dataclass without fields."""


def test_records_without_fields_or_keyed_oddly_come_back_as_they_were() -> None:
    obj = {
        "empty": [{} for _ in range(10)],
        "fields": [{"id": i, "x": np.arange(2) + i, "meta": {}} for i in range(10)],
        "keyed": {i: {} for i in range(70)},
        "tuples": [(i, np.arange(2) + i, {}) for i in range(10)],
        "dataclasses": [Empty() for _ in range(10)],
        "key types": [{np.int64(0) if i % 2 else 0: np.arange(3) + i} for i in range(10)],
    }
    out = round_trip(obj)
    assert [len(v) for v in out.values()] == [len(v) for v in obj.values()]
    assert_same(out["fields"], obj["fields"])
    assert out["keyed"] == obj["keyed"]
    assert [type(next(iter(r))) for r in out["key types"]][:2] == [int, np.int64]


_made: dict[str, Any] = {}


@dataclasses.dataclass
class Interned:
    """A dataclass whose ``__new__`` pickle calls (through ``__getnewargs__``)."""

    name: str

    def __new__(cls, name: str = "") -> Interned:
        if name not in _made:
            _made[name] = super().__new__(cls)
        return _made[name]  # type: ignore[no-any-return]

    def __getnewargs__(self) -> tuple[str]:
        return (self.name,)


def test_a_dataclass_with_its_own_new_is_rebuilt_through_it() -> None:
    labels = [Interned(f"c{i}") for i in range(10)]
    assert round_trip(labels)[3] is _made["c3"]


def _pool(obj: dict[str, Any]) -> list[Any]:
    """The records, arrays and tensors of ``obj``'s packed containers, in order."""
    keyed = list(obj["keyed"].values())
    return obj["recs"] + [r["x"] for r in obj["recs"]] + keyed + [v["t"] for v in keyed]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 2 * 12 + 2 * 70 - 1), max_size=4))
def test_random_references_into_packed_objects_keep_their_identity(picks: list[int]) -> None:
    obj: dict[str, Any] = {
        "recs": [{"id": i, "x": np.arange(3) + i} for i in range(12)],
        "keyed": {i: {"id": i, "t": torch.full((2,), float(i))} for i in range(70)},
    }
    obj["extra"] = [_pool(obj)[i] for i in picks]
    out = round_trip(obj)
    assert_same(out, obj)
    pool = _pool(out)
    assert [extra is pool[i] for extra, i in zip(out["extra"], picks, strict=True)] == [True] * len(
        picks
    )


@dataclasses.dataclass
class Hooked:
    """A plain dataclass that gains a ``copyreg`` reducer after its first encode."""

    a: Any
    b: Any


def test_a_pickling_hook_added_after_an_encode_is_used_by_the_next() -> None:
    records = [Hooked(i, np.arange(2) + i) for i in range(10)]
    assert round_trip(records)[0].a == 0
    copyreg.pickle(Hooked, lambda h: (Hooked, ("reduced", h.b)))
    try:
        assert round_trip(records)[0].a == "reduced"
    finally:
        del copyreg.dispatch_table[Hooked]


def test_pack_reports_only_what_something_else_holds() -> None:
    obj = {
        "recs": [{"id": i, "x": np.arange(3) + i} for i in range(20)],
        "keyed": {i: torch.full((4,), float(i)) for i in range(100)},
    }
    packed = _records.pack(obj)
    assert packed.shared == [obj] and not packed.twice, "only their containers hold them"
    del packed  # its columns hold the arrays until they are written
    held = obj["recs"][4]["x"], obj["keyed"][9], obj["recs"]
    shared = _records.pack(obj).shared
    assert {id(o) for o in shared} == {id(o) for o in (obj, *held)}
    obj["again"] = obj["recs"][:10]  # ten records now in two batches
    assert _records.pack(obj).twice


def _root(arr: np.ndarray) -> Any:
    while isinstance(arr.base, np.ndarray):
        arr = arr.base
    return arr.base


def test_a_decoded_part_is_freed_once_nothing_holds_it() -> None:
    """No reference cycle keeps a part alive until the next garbage collection."""
    sent = {"span": np.ones(1 << 16), "records": [{"a": np.ones(3)} for _ in range(MIN_RUN)]}
    frame = serialize.encode(sent).seal(None)
    raw = np.empty(frame.nbytes, np.uint8)
    frame.copy_into(memoryview(raw))
    gone = weakref.ref(raw)
    gc.disable()
    try:
        out = serialize.decode(raw)
        assert_same(out, sent)
        del out, raw
        assert gone() is None, "the part outlives what was decoded from it"
    finally:
        gc.enable()


def test_big_part_from_a_file_is_memory_mapped(tmp_path: Path) -> None:
    store = gs.open_store(f"file://{tmp_path}")
    data = {"x": np.arange(1 << 20, dtype=np.float64)}
    store.put("part", serialize.encode(data).seal(None).segments)
    out = serialize.decode(store.get("part"))
    assert isinstance(_root(out["x"]), memoryview)
    assert_same(out, data)


class CollectorProbe:
    """Notes, as it is unpickled, whether Python's cycle collection is on; fails to
    unpickle when its state says so."""

    seen: ClassVar[list[bool]] = []

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def __setstate__(self, state: dict[str, Any]) -> None:
        CollectorProbe.seen.append(gc.isenabled())
        if state["fail"]:
            raise RuntimeError("this probe does not unpickle")
        self.__dict__.update(state)


@pytest.mark.parametrize("collecting", [True, False])
def test_cycle_collection_is_paused_while_a_part_is_rebuilt(collecting: bool) -> None:
    """Unpickling makes many containers that stay alive: the collection would walk them
    again and again (see ``gatherstore.codec.frames._collection_paused``).  It is back as
    the caller had it afterwards, also when the rebuild fails."""
    CollectorProbe.seen.clear()
    was = gc.isenabled()
    try:
        gc.enable() if collecting else gc.disable()
        assert len(round_trip([CollectorProbe() for _ in range(3)])) == 3
        assert gc.isenabled() is collecting
        with pytest.raises(gs.GatherError, match="cannot be rebuilt here") as caught:
            round_trip([CollectorProbe(), CollectorProbe(fail=True)])
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert gc.isenabled() is collecting
    finally:
        gc.enable() if was else gc.disable()
    assert CollectorProbe.seen == [False] * 5


def test_cloudpickle_only_when_pickle_fails() -> None:
    fn = round_trip(lambda x: x + 1)
    assert fn(1) == 2
    assert round_trip([1, "x"]) == [1, "x"]


def _evaluation_object(device: str, strided: bool) -> dict[str, Any]:
    """Tensors as evaluation loops hold them: whole, sliced, in records, needing grad."""
    base = torch.arange(1 << 20, dtype=torch.float32, device=device)  # 4 MiB
    obj = {
        "whole": base,
        "slice": base[4096 : 3 * 4096],
        "records": [{"score": base[i], "box": base[4 * i : 4 * i + 4]} for i in range(MIN_RUN)],
        "leaf": torch.ones(1000, device=device, requires_grad=device != "cpu"),
    }
    if strided:  # a column of a batch: non-contiguous
        obj["column"] = base.view(-1, 4)[:, 1]
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj
    return [t for value in values for t in _tensors(value)]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_cuda_tensors_never_grow_gpu_memory(strided: bool) -> None:
    """Encoding and decoding an object holding CUDA tensors allocates no GPU memory at all
    (each tensor is copied straight to CPU memory), and everything decoded is on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine (checked on the GPU machine)")
    obj = _evaluation_object("cuda", strided)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()  # the peak starts at what the caller holds
    out = round_trip(obj)
    torch.cuda.synchronize()
    peak, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    assert peak == held, f"encode/decode allocated {peak - held} bytes of GPU memory"
    assert after == held
    decoded = _tensors(out)
    assert len(decoded) == len(_tensors(obj))
    assert all(t.device.type == "cpu" and not t.requires_grad for t in decoded)
    assert_same(_evaluation_object("cpu", strided), out)


VIEWS = [
    lambda t: t.transpose(1, 3),
    lambda t: t[:, ::2, 1:, ::3],
    lambda t: t[1, 2],
    lambda t: t[0:1].expand(4, 3, 4, 5),
    lambda t: t.permute(3, 0, 2, 1)[1:],
    lambda t: t[:0, 1],
    lambda t: torch.view_as_complex(t[..., 1:3].contiguous()).conj()[:, ::2],
    lambda t: t._neg_view()[1, 2:],
]
VIEW_IDS = ["transposed", "stepped", "offset", "expanded", "permuted", "empty", "conj", "neg"]


@pytest.mark.parametrize("view", VIEWS, ids=VIEW_IDS)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_strided_view_travels_as_the_span_it_covers(
    view: Callable[[torch.Tensor], torch.Tensor], device: str
) -> None:
    """A view of a large storage (CPU, or CUDA through the pinned buffer) arrives equal,
    with its shape, and the part carries the span the view covers, not the storage."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine (checked on the GPU machine)")
    big = torch.zeros(1 << 20, dtype=torch.float64, device=device)  # 8 MiB
    base = big[4096 : 4096 + 2 * 3 * 4 * 5 * 64]
    base.copy_(torch.arange(base.numel(), dtype=torch.float64, device=device))
    v = view(base.view(2 * 4, 3 * 4, 4 * 2, 5 * 2)[::4, ::4, ::2, ::2])
    frame = serialize.encode({"v": v})
    assert frame.nbytes < 1 << 20, "the span the view covers travels, not its 8 MiB storage"
    out = round_trip({"v": v})["v"]
    expected = v.cpu().resolve_conj().resolve_neg()
    assert out.device.type == "cpu" and out.shape == v.shape and out.dtype == v.dtype
    assert torch.equal(out.resolve_conj().resolve_neg(), expected)


class Canary:
    unpickled = 0

    def __reduce__(self) -> Any:
        return (_canary, ())


def _canary() -> Canary:
    Canary.unpickled += 1
    return Canary()


@pytest.mark.parametrize("where", [100, -1, 40])
def test_damaged_part_raises_integrity_error_and_unpickles_nothing(where: int) -> None:
    frame = serialize.encode([Canary(), np.arange(10_000)]).seal(None)
    buf = bytearray(frame.nbytes)
    frame.copy_into(memoryview(buf))
    buf[where] ^= 0xFF
    Canary.unpickled = 0
    with pytest.raises(gs.IntegrityError) as info:
        serialize.decode(buf, rank=3, where="call-1/3")
    assert info.value.rank == 3 and info.value.key == "call-1/3"
    assert Canary.unpickled == 0


def _format_3_object() -> dict[str, Any]:
    base = torch.arange(2048, dtype=torch.float32)
    records = [
        {"id": i, "boxes": np.full((2, 4), i, np.float32), "name": f"r{i}"} for i in range(10)
    ]
    big = np.arange(1024, dtype=">f8")
    return {"records": records, "big": big, "scores": base, "boxes": base.view(-1, 4)[:, 1:3]}


def test_a_part_of_format_3_is_still_read() -> None:
    """Written by gatherstore with format 3 (columns and spans by persistent ids), say a
    result set's chunk from before an upgrade."""
    raw = (Path(__file__).parent / "data" / "part-format-3.bin").read_bytes()
    out = serialize.decode(bytearray(raw), bind=b"format-3")
    assert_same(out, _format_3_object())
    assert out["boxes"].untyped_storage().data_ptr() == out["scores"].untyped_storage().data_ptr()


def _format_4_object() -> dict[str, Any]:
    batch = torch.arange(8 * 1024, dtype=torch.float32).reshape(8, 1024)
    records = [
        {"id": i, "boxes": np.full((2, 4), i, np.float32), "name": f"r{i}"} for i in range(10)
    ]
    return {
        "records": records,
        "arrays": [np.full(3, i, ">i4") for i in range(10)],
        "tensors": [torch.full((2,), float(i)) for i in range(10)],
        "rows": list(batch),
        "batch": batch,
    }


def test_a_part_of_format_4_is_still_read() -> None:
    """Written by gatherstore with format 4 (lists of arrays and columns of torch views
    named where that version kept them)."""
    raw = (Path(__file__).parent / "data" / "part-format-4.bin").read_bytes()
    out = serialize.decode(bytearray(raw), bind=b"format-4")
    assert_same(out, _format_4_object())
    ptr = out["batch"].untyped_storage().data_ptr()
    assert {r.untyped_storage().data_ptr() for r in out["rows"]} == {ptr}


def _format_5_object() -> dict[str, Any]:
    batch = np.arange(8 * 1024, dtype=np.float32).reshape(8, 1024)
    return {
        "rows": list(batch),
        "keyed": {i: {"id": i, "score": np.full(3, i, np.float32)} for i in range(70)},
        "tuples": [(i, np.full(2, i, np.int64)) for i in range(10)],
        "nested": [{"id": i, "pred": {"boxes": np.full(4, i, np.float32)}} for i in range(10)],
        "broadcast": np.broadcast_to(np.arange(1024.0), (8, 1024)),
    }


def test_a_part_of_format_5_is_still_read() -> None:
    """Written by gatherstore with format 5 (columns of numpy views, packed dicts, tuple
    and nested batches); its broadcast array came back writable then."""
    raw = (Path(__file__).parent / "data" / "part-format-5.bin").read_bytes()
    out = serialize.decode(bytearray(raw), bind=b"format-5")
    assert_same(out, _format_5_object())
    assert len({id(row.base) for row in out["rows"]}) == 1  # views of one batch


def test_truncated_foreign_and_other_version_parts() -> None:
    frame = serialize.encode({"a": 1}).seal(None)
    buf = bytearray(frame.nbytes)
    frame.copy_into(memoryview(buf))
    with pytest.raises(gs.IntegrityError, match="truncated"):
        serialize.decode(buf[:-5], rank=1)
    with pytest.raises(gs.IntegrityError, match="not a gatherstore part"):
        serialize.decode(pickle.dumps({"a": 1}) * 10, rank=1)
    other = bytearray(buf)
    other[8] = serialize.FORMAT_VERSION + 1
    with pytest.raises(gs.IntegrityError, match="format version"):
        serialize.decode(other, rank=1)


@pytest.mark.parametrize("key", [None, b"k" * 32], ids=["checksum", "signature"])
def test_the_digest_is_of_the_bytes_not_of_their_segments(key: bytes | None) -> None:
    """Blocks are cut over the frame (sealed in segments, verified in one piece); a byte
    changed in any block, or bytes moved between blocks, change the digest."""
    data = np.random.default_rng(0).integers(0, 256, 3 * _digest.BLOCK + 12345, np.uint8)
    whole = _digest.digest([memoryview(data)], key, b"bind")
    cuts = [0, 5, _digest.BLOCK - 1, _digest.BLOCK + 7, 2 * _digest.BLOCK, len(data)]
    pieces = [memoryview(data[a:b]) for a, b in itertools.pairwise(cuts)]
    assert _digest.digest(pieces, key, b"bind") == whole
    assert _digest.digest([memoryview(data)], key, b"other") != whole
    for where in (3, _digest.BLOCK + 1, len(data) - 1):
        data[where] ^= 1
        assert _digest.digest([memoryview(data)], key, b"bind") != whole
        data[where] ^= 1
    swapped = np.concatenate(
        [data[_digest.BLOCK : 2 * _digest.BLOCK], data[: _digest.BLOCK], data[2 * _digest.BLOCK :]]
    )
    assert _digest.digest([memoryview(swapped)], key, b"bind") != whole


# --- signed parts: a part altered, or written without the job's key, is refused unread --------
KEY = os.urandom(32)
SIGNED = {"sentinel": Sentinel(), "array": np.arange(10_000, dtype=np.float64)}


@pytest.fixture
def unpickled() -> list[str]:
    """The Sentinels unpickled in this process during the test."""
    _unpickled.clear()
    return _unpickled


def _signed(obj: Any, key: bytes | None) -> bytearray:
    frame = serialize.encode(obj).seal(key)
    out = bytearray(frame.nbytes)
    frame.copy_into(memoryview(out))
    return out


def test_signed_part_round_trips(unpickled: list[str]) -> None:
    out = serialize.decode(_signed(SIGNED, KEY), key=KEY)
    assert out["sentinel"] == "unpickled" and unpickled == [""]
    assert np.array_equal(out["array"], np.arange(10_000, dtype=np.float64))


@pytest.mark.parametrize("where", ["header", "digest", "pickle", "buffer", "last byte"])
def test_tampered_part_is_refused_before_unpickling(where: str, unpickled: list[str]) -> None:
    data = _signed(SIGNED, KEY)
    offsets = {
        "header": 24,  # inside the pickle length field
        "digest": 70,
        "pickle": data.find(b"_record"),
        "buffer": len(data) - 8 * 5000,
        "last byte": len(data) - 1,
    }
    data[offsets[where]] ^= 0x01
    with pytest.raises(gs.IntegrityError) as info:
        serialize.decode(data, key=KEY, rank=3, where="store-x call-1/3")
    assert info.value.rank == 3 and info.value.key == "store-x call-1/3"
    assert "rank 3" in str(info.value)
    assert unpickled == []


def test_part_without_the_key_is_refused(unpickled: list[str]) -> None:
    unsigned = _signed(SIGNED, None)  # a valid checksummed frame, as anyone could write
    with pytest.raises(gs.IntegrityError, match="unsigned but a signature is required"):
        serialize.decode(unsigned, key=KEY, rank=1, where="k")
    forged = _signed(SIGNED, os.urandom(32))  # signed, with someone else's key
    with pytest.raises(gs.IntegrityError, match="signature check"):
        serialize.decode(forged, key=KEY, rank=1, where="k")
    with pytest.raises(gs.IntegrityError, match="signed but no key"):
        serialize.decode(_signed(SIGNED, KEY), key=None)
    truncated = _signed(SIGNED, KEY)[:-1]
    with pytest.raises(gs.IntegrityError, match="truncated"):
        serialize.decode(truncated, key=KEY)
    assert unpickled == []


def _sealed_in_memory(frame: serialize.Frame, key: bytes | None) -> bytes:
    buf = bytearray(frame.nbytes)
    frame.seal(key, b"bind").copy_into(memoryview(buf))
    return bytes(buf)


def _sealed_into_memfd(frame: serialize.Frame, key: bytes | None) -> bytes:
    fd = os.memfd_create("part")
    try:
        frame.seal_into(fd, key, b"bind")
        return os.pread(fd, frame.nbytes + 1, 0)
    finally:
        os.close(fd)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record_lists(), st.sampled_from([None, b"k" * 32]))
def test_a_part_sealed_into_a_file_is_the_part_sealed_in_memory(
    items: list[Any], key: bytes | None
) -> None:
    """Written straight from its arrays (columns unjoined), then digested where it lies,
    a part is byte for byte what sealing it in memory makes."""
    written = _sealed_into_memfd(serialize.encode(items), key)
    assert written == _sealed_in_memory(serialize.encode(items), key)
    assert_same(serialize.decode(bytearray(written), key=key, bind=b"bind", rank=0), items)


def test_strided_swapped_ragged_and_0d_arrays_of_a_column_are_written_as_their_values() -> None:
    """A column's arrays that have no bytes to write as they are (strided) are copied as
    they are written; byte order, ragged lengths and 0-d arrays come back as they were."""
    base = np.arange(64 * 6 * 4, dtype=">f4").reshape(64, 6, 4)
    items = [
        {
            "boxes": base[i, ::2],  # not contiguous
            "transposed": base[i].T,  # Fortran order
            "swapped": base[i, 0],
            "ragged": np.full((i % 3, 2), i, "<i2"),
            "score": np.array(i / 2, ">f8"),  # 0-d
        }
        for i in range(64)
    ]
    written = _sealed_into_memfd(serialize.encode(items), None)
    assert written == _sealed_in_memory(serialize.encode(items), None)
    assert_same(serialize.decode(bytearray(written), bind=b"bind", rank=0), items)


def test_no_thread_keeps_a_view_of_what_was_digested() -> None:
    """The checksum hashes blocks on the pool's threads; once it returns, nothing views
    the memory it read: a part sealed into a memfd unmaps its view before the seal."""
    data = bytearray(3 * _digest.BLOCK)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns all the time: any window shows
    try:
        for _ in range(500):
            _digest.digest([memoryview(data)], None, b"")
            data.append(0)  # a bytearray with views exported cannot be resized
            del data[-1]
    finally:
        sys.setswitchinterval(interval)


# --- what a part costs rebuilt ----------------------------------------------------------------
def test_the_estimate_counts_objects_not_pickled_bytes() -> None:
    records = [{"id": i, "score": i * 0.5, "label": f"r0-{i}"} for i in range(400_000)]
    frame = serialize.encode(records)
    assert frame.rebuilt > 5 * frame.nbytes, (frame.rebuilt, frame.nbytes)
    tensors = {"x": torch.ones(1 << 20)}
    assert _sizing.rebuilt_size(tensors) < 4096  # out of band: a view of the part
    arrays = [np.ones(256) for _ in range(1000)]  # one column: views
    assert _sizing.rebuilt_size(arrays) < 200 * len(arrays)
    keyed = dict(enumerate(arrays))  # a long dict's values are packed as that list is
    assert _sizing.rebuilt_size(keyed) < 400 * len(arrays)  # not 2 KiB an array


# --- a part of more than 4 GiB ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_single_part_over_4_gib(tmp_path: Path) -> None:
    n = (4 << 30) // 8 + 1024
    big = np.arange(n, dtype=np.int64)
    frame = serialize.encode({"big": big, "tail": "end"}).seal(None)
    assert frame.nbytes > 4 << 30
    store = gs.open_store(f"file://{tmp_path}")
    store.put("part", frame.segments)
    del frame
    raw = store.get("part")
    out = serialize.decode(raw, rank=0, where="part")
    del raw
    store.delete("part")
    assert out["tail"] == "end"
    assert out["big"].shape == (n,)
    assert out["big"][0] == 0 and out["big"][-1] == n - 1 and out["big"][n // 2] == n // 2
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


# --- what is verified is what is unpickled, whatever happens to the file after ------------------
_AFTER_READ = """
import os, sys
import numpy as np
import gatherstore as gs
from gatherstore.codec import frames as serialize

kind, base = sys.argv[1], sys.argv[2]
if kind == "file":
    store = gs.open_store(f"file://{base}")
else:  # a private job folder: its parts were mapped, not copied, before
    area = gs.open_store(f"tmpdir://{base}")
    store = area.join_job(area.prepare_job("job"))
key = os.urandom(32) if kind == "file" else None
value = {"a": np.arange(1 << 21, dtype=np.int64)}  # 16 MiB
for name in ("flipped", "truncated"):
    store.put(name, serialize.encode(value).seal(key, b"bind").segments)
    verified = serialize.verify(store.get(name), key=key, bind=b"bind")
    path = os.path.join(store.folder, name)
    if name == "flipped":  # another process rewrites the file after it was verified
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            f.write(b"\\xff" * (1 << 20))
    else:  # ... or truncates it (a memory map would die of SIGBUS here)
        os.truncate(path, 4096)
    out = serialize.load(verified)["a"]
    assert np.array_equal(out, value["a"]), name
print("ok")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["file", "tmpdir"])
def test_what_is_verified_is_what_is_unpickled(tmp_path: Path, kind: str) -> None:
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    done = subprocess.run(
        [sys.executable, "-c", _AFTER_READ, kind, str(base)],
        env={**os.environ, "PYTHONPATH": str(Path(gs.__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "ok"
