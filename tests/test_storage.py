"""Storage spans and record rebuilding: shared memory travels once and comes back shared;
records are rebuilt the way their class says; CUDA tensors leave through pinned memory."""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serialize import assert_same, round_trip

import gatherstore as gs
from gatherstore import _config as config
from gatherstore.codec import frames as serialize
from gatherstore.codec import records, staging

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine (checked on the GPU one)"
)


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _size(obj: Any) -> int:
    return serialize.encode(obj).nbytes


def _scored(count: int, floats: int, device: str = "cpu") -> list[dict[str, Any]]:
    """Records as detectors return them: ``boxes`` is a view of ``scores``' storage."""
    out = []
    for i in range(count):
        scores = torch.arange(floats, dtype=torch.float32, device=device) + i
        out.append({"id": i, "scores": scores, "boxes": scores.view(-1, 4)[:, 1:3]})
    return out


def test_views_of_one_storage_travel_once_and_arrive_as_views() -> None:
    recs = _scored(16, 1 << 16)  # 256 KiB each
    unique = 16 * (1 << 18)
    assert _size(recs) < 1.02 * unique, "boxes shares scores' storage: its bytes travel once"
    out = round_trip(recs)
    assert_same(out, recs)
    for rec in out:
        scores, boxes = rec["scores"], rec["boxes"]
        assert boxes.untyped_storage().data_ptr() == scores.untyped_storage().data_ptr()
        assert boxes.stride() == (4, 1)
        scores[1] = -7.0
        assert boxes[0, 0] == -7.0, "boxes is a view of scores, as it was on the sender"


def test_slices_of_one_batch_tensor_travel_as_one_span() -> None:
    batch = torch.rand(64, 4096)
    recs = [{"i": i, "row": batch[i], "pair": batch[i : i + 2]} for i in range(63)]
    assert _size(recs) < 1.02 * batch.nbytes
    out = round_trip(recs)
    assert_same(out, recs)
    ptrs = {rec["row"].untyped_storage().data_ptr() for rec in out}
    assert len(ptrs) == 1, "every row is a view of one buffer"
    assert out[5]["pair"][1].data_ptr() == out[6]["row"].data_ptr()


def test_rows_of_batch_tensors_travel_once_each_batch_and_arrive_as_its_views() -> None:
    batches = [torch.rand(100, 1024, requires_grad=True) for _ in range(3)]
    rows = [row for batch in batches for row in batch]  # 4 KiB views: no column copy
    assert _size(rows) < 1.02 * 3 * batches[0].nbytes
    out = round_trip(rows)
    assert_same(out, rows)
    for first in (0, 100, 200):
        storages = {r.untyped_storage().data_ptr() for r in out[first : first + 100]}
        assert len(storages) == 1, "the rows of one batch are views of one buffer"
        assert out[first + 1].data_ptr() - out[first].data_ptr() == 4096
    out[1][0] = -1.0  # writable, the neighbours untouched
    assert out[0][0] != -1.0 and out[2][0] != -1.0


def test_rows_shared_with_their_batch_or_strided_stay_its_views() -> None:
    batch = torch.rand(1024, 1024)
    sent = {
        "batch": batch,
        "rows": list(batch),
        "some": [batch[i] for i in range(0, 64, 8)],  # 8 views, covering part of it
        "columns": list(batch[:, :16].T),  # strided views
        "records": [{"id": i, "emb": batch[i]} for i in range(32)],
    }
    assert _size(sent) < 1.02 * batch.nbytes, "every view's bytes travel with the batch's"
    out = round_trip(sent)
    assert_same(out, sent)
    ptr = out["batch"].untyped_storage().data_ptr()
    for name in ("rows", "some", "columns"):
        assert {v.untyped_storage().data_ptr() for v in out[name]} == {ptr}, name
    assert {r["emb"].untyped_storage().data_ptr() for r in out["records"]} == {ptr}
    assert out["columns"][3].stride() == (1024,)
    out["batch"][8, 3] = -5.0
    assert out["rows"][8][3] == out["some"][1][3] == out["columns"][3][8] == -5.0


def test_numpy_rows_of_batches_travel_once_each_batch_and_arrive_as_its_views() -> None:
    batches = [np.random.default_rng(i).random((100, 1024)).astype(">f4") for i in range(3)]
    rows = [row for batch in batches for row in batch]  # 4 KiB views: no column copy
    tall = np.arange(1024 * 64, dtype=">f4").reshape(1024, 64)
    sent = {"rows": rows, "batch": batches[1], "columns": list(tall[:, :16].T), "tall": tall}
    assert _size(sent) < 1.02 * (3 * batches[0].nbytes + tall.nbytes), "each batch once"
    out = round_trip(sent)
    assert_same(out, sent)
    for first in (0, 100, 200):
        bases = {id(r.base) for r in out["rows"][first : first + 100]}
        assert len(bases) == 1, "the rows of one batch are views of one buffer"
        assert _address(out["rows"][first + 1]) - _address(out["rows"][first]) == 4096
    assert out["columns"][3].strides == (256,) and out["rows"][0].dtype.str == ">f4"
    assert all(np.shares_memory(c, out["tall"]) for c in out["columns"])
    out["batch"][8, 3] = -5.0  # the rows of batch 1 are views of the batch beside them
    assert out["rows"][108][3] == -5.0
    out["rows"][1][0] = -1.0  # writable, the neighbours untouched
    assert out["rows"][0][0] != -1.0 and out["rows"][2][0] != -1.0


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_rows_in_any_order_come_back_as_views_in_that_order(kind: str) -> None:
    """Runs of evenly spaced rows are rebuilt a run at a time, the rest one by one."""
    batches = [torch.rand(40, 1024) for _ in range(2)]
    if kind == "numpy":
        batches = [b.numpy() for b in batches]  # type: ignore[misc]
    order = np.random.default_rng(0).permutation(80).tolist()
    shuffled = [batches[i % 2][i // 2] for i in order]  # batches alternate, rows in no order
    runs = [batches[0][i] for i in (0, 2, 4, 6, 7, 8, 9, 30, 20, 10)]
    runs += [batches[1][i] for i in range(39, -1, -3)]  # descending: one by one
    sent = {"shuffled": shuffled, "runs": runs, "batches": batches}
    out = round_trip(sent)
    assert_same(out, sent)
    for name in ("shuffled", "runs"):
        for got, want in zip(out[name], sent[name], strict=True):
            owner = next(i for i, b in enumerate(sent["batches"]) if _shares(want, b))
            assert _shares(got, out["batches"][owner]), "a view of its batch, as sent"


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_rows_taken_sparsely_from_a_big_batch_send_only_themselves(kind: str) -> None:
    batch = torch.rand(8000, 1024)
    source = batch if kind == "torch" else batch.numpy()
    rows = [source[i * 1000] for i in range(8)]  # 32 KiB of a 32 MiB batch
    assert _size(rows) < 64 << 10
    assert_same(round_trip(rows), rows)


def test_numpy_rows_of_structured_or_unaligned_views_come_back_equal() -> None:
    records = np.zeros((8, 10), [("a", "<f4"), ("b", "<i8")])
    records["a"] = np.arange(80).reshape(8, 10)
    raw = np.arange(4096 * 9 + 8, dtype=np.uint8)
    shifts = [2 * (i == 7) for i in range(8)]  # the last row 2 bytes off: not whole items
    odd = [raw[4096 * i + d : 4096 * (i + 1) + d].view("<f4") for i, d in enumerate(shifts)]
    sent = {"records": list(records), "odd": odd}
    out = round_trip(sent)
    assert_same(out, sent)
    assert out["records"][1]["a"][3] == 13.0


def test_rows_of_two_torch_storages_over_one_buffer_come_back_equal() -> None:
    data = np.random.default_rng(0).random((16, 1024)).astype("f4")
    small, big = torch.from_numpy(data[:2]), torch.from_numpy(data)  # one address, 8 vs 64 KiB
    rows = [small[0], small[1]] + [big[i] for i in range(2, 16)]
    assert_same(round_trip(rows), rows)


def _shares(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    return bool(np.shares_memory(a, b))


def test_a_part_of_a_batch_sends_only_the_rows_it_holds() -> None:
    batch = torch.rand(1000, 1024)
    rows = list(batch[100:120])
    assert _size(rows) < 1.1 * 20 * 4096
    assert_same(round_trip(rows), rows)


@pytest.mark.parametrize("kb", [1, 1024], ids=["small", "large"])
def test_an_array_many_records_hold_travels_once_and_stays_one_object(kb: int) -> None:
    shared = np.arange(kb * 256, dtype=np.float32)
    recs = [{"id": i, "meta": shared, "own": np.full(4, i, np.int64)} for i in range(200)]
    assert _size(recs) < shared.nbytes + 200 * 32 + (16 << 10)
    out = round_trip(recs)
    assert_same(out, recs)
    assert all(rec["meta"] is out[0]["meta"] for rec in out)


def test_a_tensor_not_aligned_to_its_dtype_comes_back_equal_and_aligned() -> None:
    raw = np.arange(10_000, dtype=np.uint16).view(np.uint8)
    odd = torch.from_numpy(raw[1 : 1 + 8192].view(np.float32))  # one byte past alignment
    assert odd.data_ptr() % 4
    sent = {"head": torch.from_numpy(raw[:4096]), "odd": odd}  # one span: they touch
    out = round_trip(sent)
    assert_same(out, sent)
    assert out["odd"].data_ptr() % 4 == 0


def test_numpy_views_keep_strides_byte_order_and_shared_memory() -> None:
    base = np.arange(1 << 16, dtype=">f8").reshape(256, 256)
    tensor = torch.arange(1 << 14, dtype=torch.float32)
    obj = {
        "base": base,
        "reversed": base[::-1, ::-2],
        "fortran": np.asfortranarray(base[:64]),
        "transposed": base.T,
        "tensor": tensor,
        "its array": tensor.numpy()[100:],
    }
    assert _size(obj) < base.nbytes * 1.3 + tensor.nbytes + (64 << 10)
    out = round_trip(obj)
    assert_same(out, obj)
    assert out["reversed"].strides == obj["reversed"].strides
    assert np.shares_memory(out["reversed"], out["base"])
    assert out["fortran"].flags.f_contiguous


def test_a_broadcast_array_comes_back_as_the_same_read_only_view() -> None:
    """``np.broadcast_to``'s arrays travel as the row they repeat and stay read-only (a
    write would change every row); other arrays, read-only or not, come back writable,
    as pickle gives them."""
    row = np.arange(1024, dtype=np.float64)
    obj = {"broadcast": np.broadcast_to(row, (100, 1024)), "frozen": row[::-1].copy()}
    obj["frozen"].flags.writeable = False
    out = round_trip(obj)
    assert_same(out, obj)
    assert out["broadcast"].strides == (0, 8) and not out["broadcast"].flags.writeable
    assert _size(obj) < 3 * row.nbytes + (64 << 10)
    out["frozen"][0] = -1.0


@dataclasses.dataclass
class Plain:
    x: Any
    y: int


@dataclasses.dataclass
class Reduced:
    x: Any
    y: int
    calls = 0

    def __reduce__(self) -> Any:
        return (_reduced, (self.x, self.y))


def _reduced(x: Any, y: int) -> Reduced:
    Reduced.calls += 1
    return Reduced(x, y)


@dataclasses.dataclass
class Stateful:
    x: Any
    y: int
    restored: bool = False

    def __getstate__(self) -> Any:
        return {"x": self.x, "y": self.y}

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state, restored=True)


@dataclasses.dataclass
class Extra:
    x: Any
    y: int

    def __post_init__(self) -> None:
        self.cache = self.y * 2  # an attribute that is no field


@dataclasses.dataclass
class Registered:
    x: Any
    y: int


def _registered(x: Any, y: int) -> Registered:
    return Registered(x, -y)  # a reducer of its own: the sign shows it ran


copyreg.pickle(Registered, lambda r: (_registered, (r.x, r.y)))


def test_dataclasses_with_a_pickling_protocol_are_rebuilt_by_it() -> None:
    arr = np.ones(3)
    assert records.structure(Plain(arr, 1)) == (Plain, ("x", "y"))
    for cls in (Reduced, Stateful, Extra, Registered):
        assert records.structure(cls(arr, 1)) is None, cls
    Reduced.calls = 0
    out = round_trip([Reduced(np.full(3, i), i) for i in range(20)])
    assert Reduced.calls == 20 and [r.y for r in out] == list(range(20))
    out = round_trip([Stateful(np.full(3, i), i) for i in range(20)])
    assert all(r.restored for r in out)
    out = round_trip([Extra(np.full(3, i), i) for i in range(20)])
    assert [r.cache for r in out] == [2 * i for i in range(20)]
    out = round_trip([Registered(np.full(3, i), i) for i in range(20)])
    assert [r.y for r in out] == [-i for i in range(20)]


CLASSES = st.sampled_from([Plain, Reduced, Stateful, Extra, Registered])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(CLASSES, st.integers(0, 3)), min_size=0, max_size=40), st.data())
def test_random_runs_of_records_come_back_as_pickle_rebuilds_them(
    kinds: list[tuple[type, int]], data: st.DataObject
) -> None:
    """Whatever mix of plain and protocol dataclasses, records shared between places,
    the result equals plain pickle's, identity included."""
    shared = [np.arange(n + 1) for n in range(4)]
    items: list[Any] = [cls(shared[n], n) for cls, n in kinds]
    if items:  # a record held twice, and one record's field held by others
        items += [items[data.draw(st.integers(0, len(items) - 1))] for _ in range(3)]
    expected = pickle.loads(pickle.dumps(items, protocol=5))
    out = round_trip(items)
    assert [type(r) for r in out] == [type(r) for r in expected]
    assert [r.__dict__.keys() for r in out] == [r.__dict__.keys() for r in expected]
    for got, want in zip(out, expected, strict=True):
        assert got.y == want.y and np.array_equal(got.x, want.x)
    same = [[a is b for b in items] for a in items]
    assert [[a is b for b in out] for a in out] == same
    fields = [[a.x is b.x for b in items] for a in items]
    assert [[a.x is b.x for b in out] for a in out] == fields


def test_a_record_held_twice_stays_one_object() -> None:
    one = {"x": np.arange(3), "y": 1}
    items = [one] * 10 + [{"x": np.arange(3), "y": i} for i in range(10)]
    out = round_trip(items)
    assert all(r is out[0] for r in out[:10])
    out[0]["y"] = 5
    assert out[9]["y"] == 5 and out[10]["y"] == 0


# --- CUDA: through the pinned buffer -----------------------------------------------------------
@CUDA
def test_cuda_records_go_through_a_small_pinned_buffer_in_many_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks go round the ring's slots (here 16 KiB each), across tensors and storages;
    every byte arrives, views of one storage arrive as views of one buffer."""
    staging.release()
    monkeypatch.setattr(config, "PINNED", 128 << 10)
    try:
        recs = _scored(24, 100_000, "cuda")  # 390 KiB each: several chunks per storage
        out = round_trip(recs)
        assert_same(out, [{k: v.cpu() if k != "id" else v for k, v in r.items()} for r in recs])
        assert staging._pinned[0].numel() == 128 << 10
        for rec in out:
            storages = (rec["boxes"].untyped_storage(), rec["scores"].untyped_storage())
            assert storages[0].data_ptr() == storages[1].data_ptr()
    finally:
        staging.release()


class _DoneEvent:
    """A CUDA event whose work is done (copies between CPU tensors complete at once)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _HostStream:
    def record_event(self) -> _DoneEvent:
        return _DoneEvent()

    def wait_event(self, event: _DoneEvent) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize(
    "pinned,slots,piece",
    [(8, 8, 1), (7, 3, 3), (1 << 15, 8, 100), (1 << 16, 2, 4096), (1000, 1, 7)],
)
def test_the_pinned_ring_moves_every_byte_whatever_the_sizes(
    monkeypatch: pytest.MonkeyPatch, pinned: int, slots: int, piece: int
) -> None:
    """The ring's bookkeeping on any machine (its CUDA copies are checked on a GPU one):
    sources larger and smaller than a slot, empty ones, more sources than slots, a ring
    of fewer bytes than slots; CPU tensors stand in for device memory."""
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _HostStream())
    monkeypatch.setattr(staging, "_stream", lambda device: _HostStream())
    monkeypatch.setattr(staging, "_streams", {})
    monkeypatch.setattr(staging, "_pinned", [torch.empty(pinned, dtype=torch.uint8)])
    monkeypatch.setattr(staging, "SLOTS", slots)
    monkeypatch.setattr(staging, "PIECE", piece)
    gen = torch.Generator().manual_seed(pinned)
    sizes = [0, 1, 5, 999, 5000, 3, 0, 20_000]
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    hosts = [np.zeros(n, np.uint8) for n in sizes]
    staging.to_host(list(zip(sources, hosts, strict=True)))
    for source, host in zip(sources, hosts, strict=True):
        assert np.array_equal(source.numpy(), host)


@CUDA
def test_two_cuda_storages_at_one_address_arrive_whole() -> None:
    """DLPack views of a tensor and of its first elements are two storages at one address,
    the first one shorter: the longer one is staged, and both arrive whole."""
    x = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    head, whole = torch.from_dlpack(x[:16]), torch.from_dlpack(x)
    if head.untyped_storage().nbytes() == whole.untyped_storage().nbytes():
        pytest.skip("this torch gives DLPack views the tensor's own storage")
    out = round_trip([head, whole])
    assert torch.equal(out[0], x[:16].cpu()) and torch.equal(out[1], x.cpu())


@CUDA
def test_a_cuda_tensor_a_kernel_still_writes_is_copied_after_that_kernel() -> None:
    """The copy runs on a side stream that waits for the caller's current stream."""
    x = torch.zeros(1 << 22, device="cuda")  # 16 MiB
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keep the current stream busy (~0.1 s)...
    x.fill_(3.0)  # ...then write x on it
    out = serialize.decode(_sealed({"x": x}))
    assert torch.equal(out["x"], torch.full((1 << 22,), 3.0))


def _sealed(obj: Any) -> bytearray:
    frame = serialize.encode(obj).seal(None)
    buf = bytearray(frame.nbytes)
    frame.copy_into(memoryview(buf))
    return buf


@CUDA
def test_pinned_memory_is_allocated_once_and_released_at_shutdown() -> None:
    staging.release()
    x = torch.ones(1 << 20, device="cuda")
    serialize.encode([x])
    first = staging._pinned[0].data_ptr()
    serialize.encode([x * 2])
    assert staging._pinned[0].data_ptr() == first, "one buffer per process, reused"
    gs.shutdown()  # no process group: only releases what the process holds
    assert not staging._pinned
