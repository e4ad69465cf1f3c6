"""A long list encoded in chunks and rebuilt in order, in one process: what the chunks
rebuild, the identities they keep, and when a list is sent whole instead."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from gatherstore.codec import chunks
from gatherstore.codec import frames as serialize


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 1 MiB, and lists from 4 MiB: lists of a few MB span many chunks."""
    monkeypatch.setattr(chunks, "CHUNK", 1 << 20)
    monkeypatch.setattr(chunks, "MIN_PART", 4 << 20)


def _sealed(frame: serialize.Frame) -> bytearray:
    out = bytearray(frame.nbytes)
    frame.seal(None).copy_into(memoryview(out))
    return out


def _encoded(items: list[Any] | dict[Any, Any]) -> list[serialize.Frame]:
    run = chunks.Chunks.first(items)
    assert run is not None, "the list is not sent in chunks"
    return [run.head, *run.rest()]


def _rebuilt(frames: list[serialize.Frame]) -> Any:
    assembly = chunks.Assembly()
    for frame in frames:
        assembly.add(serialize.verify(_sealed(frame)))
    return assembly.value


def _detections(count: int) -> list[dict[str, Any]]:
    """Per-image records whose arrays are views of three batch arrays."""
    rng = np.random.default_rng(0)
    boxes = rng.random((count, 100, 4), dtype=np.float32)
    scores = rng.random((count, 100), dtype=np.float32)
    labels = rng.integers(0, 80, (count, 100))
    return [
        {"image_id": i, "boxes": boxes[i], "scores": scores[i], "labels": labels[i], "name": f"{i}"}
        for i in range(count)
    ]


def test_records_keyed_by_id_come_back_as_one_dict_in_order() -> None:
    meta = {"classes": ["cat", "dog"]}
    items = {f"img-{i}": dict(record, meta=meta) for i, record in enumerate(_detections(4000))}
    frames = _encoded(items)
    assert len(frames) > 8
    got = _rebuilt(frames)
    assert type(got) is dict and list(got) == list(items)
    for key, theirs in items.items():
        assert np.array_equal(got[key]["boxes"], theirs["boxes"]), key
    assert all(record["meta"] is got["img-0"]["meta"] for record in got.values())


@dataclass
class Box:
    label: int
    xyxy: torch.Tensor


def test_records_come_back_whole_and_in_order_from_many_chunks() -> None:
    items = _detections(4000)  # 11 MB
    frames = _encoded(items)
    assert len(frames) > 8
    got = _rebuilt(frames)
    assert len(got) == len(items)
    for mine, theirs in zip(got, items, strict=True):
        assert mine.keys() == theirs.keys()
        assert mine["image_id"] == theirs["image_id"] and mine["name"] == theirs["name"]
        for name in ("boxes", "scores", "labels"):
            assert np.array_equal(mine[name], theirs[name])
    got[5]["boxes"][0, 0] = -1.0  # writable, as a part's arrays
    assert got[5]["boxes"][0, 0] == -1.0


def test_objects_two_chunks_hold_stay_one_object() -> None:
    meta = {"classes": ["cat", "dog"]}
    items: list[Any] = [
        {"id": i, "scores": torch.full((40000,), float(i)), "meta": meta} for i in range(400)
    ]
    items[350] = dict(items[350], parent=items[20])  # a record of a later chunk holds an earlier
    got = _rebuilt(_encoded(items))
    assert all(item["meta"] is got[0]["meta"] for item in got)
    assert got[350]["parent"] is got[20]
    assert all(
        torch.equal(mine["scores"], theirs["scores"])
        for mine, theirs in zip(got, items, strict=True)
    )


def test_dataclass_records_in_chunks() -> None:
    items = [Box(i % 80, torch.arange(4000.0) + i) for i in range(4000)]
    got = _rebuilt(_encoded(items))
    assert [b.label for b in got] == [b.label for b in items]
    assert all(torch.equal(mine.xyxy, theirs.xyxy) for mine, theirs in zip(got, items, strict=True))


def test_a_record_packed_in_one_chunk_and_met_in_a_later_one_breaks_the_run() -> None:
    items: list[Any] = [{"id": i, "x": np.full(4000, i, np.float32)} for i in range(2000)]
    items[1500] = {"other": [items[1000]]}
    run = chunks.Chunks.first(items)
    assert run is not None
    with pytest.raises(chunks.Unchunkable):
        list(run.rest())
    got = serialize.decode(_sealed(serialize.encode(items)))  # what the sender sends instead
    assert got[1500]["other"][0] is got[1000]


@pytest.mark.parametrize(
    "items",
    [
        pytest.param([np.zeros(1 << 20)] * 3, id="too-few-items"),
        pytest.param([{"id": i} for i in range(5000)], id="too-few-bytes"),
        pytest.param(tuple(np.zeros(1 << 18) for _ in range(64)), id="not-a-list"),
    ],
)
def test_what_is_not_worth_chunks_goes_whole(items: Any) -> None:
    assert chunks.Chunks.first(items) is None


def test_records_that_share_an_array_go_whole() -> None:
    """Packing would rebuild the shared array once per chunk: the list goes whole."""
    shared = np.arange(4000.0)
    items = [{"id": i, "x": np.full(4000, i, np.float32), "w": shared} for i in range(2000)]
    assert chunks.Chunks.first(items) is None
    got = serialize.decode(_sealed(serialize.encode(items)))
    assert got[0]["w"] is got[-1]["w"]


def test_a_list_inside_its_own_item_breaks_the_run() -> None:
    items: list[Any] = [{"id": i, "x": np.full(4000, i, np.float32)} for i in range(2000)]
    items[1900] = {"up": items}
    run = chunks.Chunks.first(items)
    assert run is not None
    with pytest.raises(chunks.Unchunkable):
        list(run.rest())


def test_views_of_one_storage_in_two_chunks_break_the_run() -> None:
    """Sent in chunks, memory two chunks share would go once per chunk, and come back as
    two buffers: the list goes whole, and its views share one storage again."""
    big = torch.arange(1 << 18, dtype=torch.float32)
    items = [{"id": i, "w": big[:], "x": torch.full((4000,), float(i))} for i in range(2000)]
    run = chunks.Chunks.first(items)
    assert run is not None
    with pytest.raises(chunks.Unchunkable):
        list(run.rest())
    got = serialize.decode(_sealed(serialize.encode(items)))
    assert got[0]["w"].untyped_storage().data_ptr() == got[-1]["w"].untyped_storage().data_ptr()


def test_rows_of_one_batch_split_at_a_chunks_edge_stay_in_their_chunk() -> None:
    batch = torch.arange(2000 * 1024, dtype=torch.float32).view(2000, 1024)  # 8 MB
    items = [{"id": i, "row": batch[i]} for i in range(2000)]
    got = _rebuilt(_encoded(items))
    assert all(torch.equal(item["row"], batch[i]) for i, item in enumerate(got))


def test_numpy_rows_of_one_batch_go_in_chunks_each_row_once() -> None:
    """Rows of 4 KiB of one batch array travel as a cover of each chunk's rows (the cover
    is no other holder of a row): in chunks, and the batch's bytes once."""
    batch = np.random.default_rng(0).random((2000, 1024), dtype=np.float32)  # 8 MB
    items = [{"id": i, "row": batch[i]} for i in range(2000)]
    frames = _encoded(items)
    assert len(frames) > 4 and sum(f.nbytes for f in frames) < 1.01 * batch.nbytes
    got = _rebuilt(frames)
    assert all(np.array_equal(item["row"], batch[i]) for i, item in enumerate(got))


def test_a_record_held_elsewhere_in_a_later_chunk_breaks_the_run() -> None:
    items = [{"id": i, "x": np.full(400, i, np.float32)} for i in range(20000)]
    kept = items[15000]  # the caller still holds it: packing it would rebuild it twice
    run = chunks.Chunks.first(items)
    assert run is not None
    with pytest.raises(chunks.Unchunkable):
        list(run.rest())
    assert kept["id"] == 15000


class Slow:
    """An item that takes at least a millisecond to pickle (as thousands of plain records
    do together: a few bytes each, a few microseconds each)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        time.sleep(0.001)
        return (Slow, (self.index,))


def test_a_list_slow_to_encode_goes_in_chunks_of_little_time_however_few_its_bytes() -> None:
    items = [Slow(i) for i in range(400)]  # a few KB: whole by its bytes; 0.4 s to encode
    frames = _encoded(items)
    assembly, sizes = chunks.Assembly(), []
    for frame in frames:
        assembly.add(serialize.verify(_sealed(frame)))
        sizes.append(len(assembly.value) - sum(sizes))
    assert [item.index for item in assembly.value] == list(range(400))
    # after the first, no chunk holds more items than take CHUNK_SECONDS at 1 ms each
    assert max(sizes[1:]) <= round(chunks.CHUNK_SECONDS / 0.001) < len(items) // 8
