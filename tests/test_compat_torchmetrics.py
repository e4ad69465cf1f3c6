"""gatherstore.compat.torchmetrics side by side with torchmetrics' own sync in 3 gloo ranks:
synced states and compute() equal where torchmetrics works, a single-process metric's answer
where it hangs or crashes (uneven list states, a rank without data), one gather per sync,
compute_on=0, and a failing rank that makes every rank raise; in 4 ranks, metrics whose
process_group is another group sync through gatherstore.

torchmetrics is imported only inside the ranks, after ``tests/standins`` (a torchvision
stand-in, see its docstring) is put on sys.path, so that MeanAveragePrecision loads."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from compat_groups import TAIL, pair_of, subgroups, torch_objects_refused
from compat_same import Unsendable, outcome, reused_buffer, same
from compat_standins import ROOT

import gatherstore as gs
from gatherstore.cli.bench.metrics import counted
from gatherstore.compat import torchmetrics as compat

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchmetrics") is None, reason="needs torchmetrics"
)

W = 3
COUNTS = {"equal": [2, 2, 2], "uneven": [1, 3, 2], "empty": [2, 3, 0]}
# where torchmetrics itself works: fixed-size states, or list states of equal lengths
SIDE_BY_SIDE = {
    "mse": ["equal", "uneven", "empty"],
    "accuracy": ["equal", "uneven", "empty"],
    "cat": ["equal", "uneven", "empty"],
    "kinds": ["equal"],
    "map-bbox": ["equal"],
    "map-segm": ["equal"],
}


SIDE_BY_SIDE_CALLS = [f"{name}/{s}" for name, scenarios in SIDE_BY_SIDE.items() for s in scenarios]


def torchvision_standin() -> None:
    """In a rank, before torchmetrics loads: the tests' torchvision (MAP's box helpers)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


# --- metrics and their inputs ---------------------------------------------------------------
def kinds_class() -> type:
    """A metric with a state of every kind: tensors reduced by sum, mean, max, min, None and
    a function; lists reduced by cat (2-D), None (items of several lengths) and a function."""
    from torchmetrics import Metric

    class Kinds(Metric):
        full_state_update = False

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.add_state("total", torch.zeros(3), "sum")
            self.add_state("average", torch.zeros(3), "mean")
            self.add_state("high", torch.full((3,), -1e9), "max")
            self.add_state("low", torch.full((3,), 1e9), "min")
            self.add_state("each", torch.zeros(3), None)
            self.add_state("product", torch.ones(3), lambda x: x.prod(0))
            self.add_state("rows", [], "cat")
            self.add_state("items", [], None)
            self.add_state("norms", [], lambda items: torch.stack([i.norm() for i in items]))

        def update(self, x: torch.Tensor) -> None:
            self.total += x
            self.average += x / 2
            self.high = torch.max(self.high, x)
            self.low = torch.min(self.low, x)
            self.each += x
            self.product *= 1 + x.abs() / 10
            self.rows.append(x.reshape(1, 3).repeat(2, 1))
            self.items.append(x[: 1 + int(x.abs().sum() * 10) % 3])
            self.norms.append(x)

        def compute(self) -> Any:
            return {name: getattr(self, name) for name in self._defaults}

    return Kinds


def notes_class() -> type:
    """A metric whose list state holds strings and nested objects, not tensors."""
    from torchmetrics import Metric

    class Notes(Metric):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.add_state("notes", [], None)

        def update(self, items: list[Any]) -> None:
            self.notes.extend(items)

        def compute(self) -> Any:
            return list(self.notes)

    return Notes


def makers() -> dict[str, Callable[..., Any]]:
    torchvision_standin()
    from torchmetrics.aggregation import CatMetric
    from torchmetrics.classification import MulticlassAccuracy
    from torchmetrics.detection import MeanAveragePrecision
    from torchmetrics.regression import MeanSquaredError

    return {
        "mse": MeanSquaredError,
        "accuracy": lambda **kw: MulticlassAccuracy(num_classes=4, average="macro", **kw),
        "cat": CatMetric,
        "kinds": kinds_class(),
        "notes": notes_class(),
        "map-bbox": lambda **kw: MeanAveragePrecision(backend="pycocotools", **kw),
        "map-segm": lambda **kw: MeanAveragePrecision(iou_type="segm", backend="pycocotools", **kw),
    }


def image(g: torch.Generator, rank: int) -> tuple[Any, ...]:
    """One image for MAP: 3 detections, 2 ground truths, boxes and masks."""
    corner = torch.rand(3, 2, generator=g) * 20
    boxes = torch.cat([corner, corner + 4 + torch.rand(3, 2, generator=g) * 8], 1)
    masks = torch.zeros(3, 32, 32, dtype=torch.bool)
    for i, (x1, y1, x2, y2) in enumerate(boxes.int().tolist()):
        masks[i, y1:y2, x1:x2] = True
    labels = torch.randint(0, 2, (3,), generator=g)
    scores = torch.rand(3, generator=g)
    pred = {"boxes": boxes, "masks": masks, "scores": scores, "labels": labels}
    target = {"boxes": boxes[:2] + rank, "masks": masks[:2].roll(rank, 1), "labels": labels[:2]}
    return [pred], [target]


def inputs(name: str, rank: int, count: int) -> list[tuple[Any, ...]]:
    """``count`` updates' arguments for metric ``name``, the same for the same rank."""
    out: list[tuple[Any, ...]] = []
    for index in range(count):
        g = torch.Generator().manual_seed(1000 * rank + index)
        if name == "mse":
            out.append((torch.randn(4, generator=g), torch.randn(4, generator=g)))
        elif name == "accuracy":
            preds, target = torch.randint(0, 4, (2, 4), generator=g)
            out.append((preds, target))
        elif name == "cat":
            out.append((torch.randn(2 + index, generator=g),))
        elif name == "kinds":
            out.append((torch.randn(3, generator=g),))
        elif name == "notes":
            out.append(([f"r{rank}-{index}", ("nested", {"rank": rank, "b": b"\0" * index})],))
        else:
            out.append(image(g, rank))
    return out


def fed(make: Callable[..., Any], name: str, rank: int, count: int, **kw: Any) -> Any:
    metric = make(**kw)
    for args in inputs(name, rank, count):
        metric.update(*args)
    return metric


def snapshot(metric: Any) -> dict[str, Any]:
    return {
        k: v.clone() if isinstance(v, torch.Tensor) else list(v)
        for k, v in metric.metric_state.items()
    }


def interleave(lists: list[list[Any]]) -> list[Any]:
    longest = max(len(items) for items in lists)
    return [items[i] for i in range(longest) for items in lists if i < len(items)]


def expected_states(name: str, make: Callable[..., Any], counts: list[int]) -> dict[str, Any]:
    """Kinds' and Notes' synced states, from every rank's local states, by the rules
    torchmetrics documents (stack then reduce; lists: item i of every rank in turn)."""
    local = [snapshot(fed(make, name, r, counts[r])) for r in range(W)]
    if name == "notes":
        return {"notes": interleave([p["notes"] for p in local])}

    def stacked(k: str) -> torch.Tensor:
        return torch.stack([p[k] for p in local])

    return {
        "total": stacked("total").sum(0),
        "average": stacked("average").mean(0),
        "high": stacked("high").max(0).values,
        "low": stacked("low").min(0).values,
        "each": stacked("each"),
        "product": stacked("product").prod(0),
        "rows": torch.cat([row for p in local for row in p["rows"]]),
        "items": interleave([p["items"] for p in local]),
        "norms": torch.stack([i.norm() for i in interleave([p["norms"] for p in local])]),
    }


def single_process(name: str, make: Callable[..., Any], counts: list[int]) -> Any:
    """compute() of one metric fed every rank's inputs, in the order the sync keeps."""
    metric = make(sync_on_compute=False)
    per_rank = [inputs(name, r, counts[r]) for r in range(W)]
    ordered = (
        interleave(per_rank) if name.startswith("map") else [a for part in per_rank for a in part]
    )
    for args in ordered:
        metric.update(*args)
    return metric.compute()


def squeezed(value: Any) -> Any:
    from torchmetrics.utilities.data import _squeeze_if_scalar

    return _squeeze_if_scalar(value)


def close(a: Any, b: Any, where: str) -> list[str]:
    """As ``same``, with floating-point tensors compared to the last bits (sums in another
    order)."""
    if isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b):
        return [p for k in a for p in close(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point():
        ok = a.shape == b.shape and torch.allclose(a, b, atol=1e-6, equal_nan=True)
        return [] if ok else [f"{where}: {a} != {b}"]
    return same(a, b, where)


def run(make: Callable[..., Any], name: str, count: int) -> dict[str, Any]:
    """Update, then sync() (calls counted), unsync(), compute(); every stage's states."""
    metric = fed(make, name, gs.get_rank(), count)
    local = snapshot(metric)
    with counted() as calls:
        metric.sync(dist_sync_fn=metric.dist_sync_fn)
    synced = snapshot(metric)
    metric.unsync()
    return {
        "local": local,
        "synced": synced,
        "restored": snapshot(metric),
        "compute": metric.compute(),
        "calls": calls.counts,
    }


# --- in 3 ranks ------------------------------------------------------------------------------
def ranks_side_by_side() -> dict[str, Any]:
    """Unpatched and patched on the same inputs where torchmetrics works."""
    rank, make = gs.get_rank(), makers()
    problems: list[str] = []
    calls: dict[str, Any] = {}
    for name, scenarios in SIDE_BY_SIDE.items():
        for scenario in scenarios:
            where, count = f"{name}/{scenario}", COUNTS[scenario][rank]
            plain = run(make[name], name, count)
            with compat.patch():
                ours = run(make[name], name, count)
            for stage in ("synced", "restored", "compute"):
                problems += same(plain[stage], ours[stage], f"{where} {stage}")
            problems += same(ours["local"], ours["restored"], f"{where} unsync")
            calls[where] = (plain["calls"], ours["calls"])
    # strings and nested objects: torchmetrics leaves them unsynced, patched they are gathered
    plain = run(make["notes"], "notes", 2)
    with compat.patch():
        ours = run(make["notes"], "notes", 2)
    problems += same(plain["local"], plain["synced"], "notes: torchmetrics keeps them local")
    expected = expected_states("notes", make["notes"], COUNTS["equal"])
    problems += same(expected, ours["synced"], "notes patched")
    # dist_sync_fn: per tensor, without patch()
    own = torch.arange(rank + 1)
    parts = compat.dist_sync_fn(own)
    problems += same([torch.arange(r + 1) for r in range(W)], parts, "dist_sync_fn")
    problems += [] if parts[rank] is own else ["dist_sync_fn: own entry is not the input"]
    from torchmetrics.utilities.distributed import gather_all_tensors

    # torchmetrics keeps this rank's own tensor (not a copy): so does dist_sync_fn
    problems += same(
        reused_buffer(lambda o: gather_all_tensors(o["scores"]), rank),
        reused_buffer(lambda o: compat.dist_sync_fn(o["scores"]), rank),
        "dist_sync_fn reused buffer",
    )
    theirs = run(make["kinds"], "kinds", 2)
    kinds = make["kinds"]
    with_fn = run(lambda: kinds(dist_sync_fn=compat.dist_sync_fn), "kinds", 2)
    for stage in ("synced", "compute"):
        problems += same(theirs[stage], with_fn[stage], f"dist_sync_fn {stage}")
    calls["dist_sync_fn"] = with_fn["calls"]
    return {"problems": problems, "calls": calls}


def ranks_where_torchmetrics_fails() -> list[str]:
    """Patched, every scenario: a single-process metric's answer (lists: synced states)."""
    rank, make = gs.get_rank(), makers()
    problems: list[str] = []
    with compat.patch():
        for name in ("mse", "accuracy", "cat", "kinds", "notes", "map-bbox", "map-segm"):
            for scenario, counts in COUNTS.items():
                where = f"{name}/{scenario}"
                ours = run(make[name], name, counts[rank])
                if name in ("kinds", "notes"):
                    expected = expected_states(name, make[name], counts)
                    problems += same(expected, ours["synced"], f"{where} synced")
                    # compute() returns the states (squeezed as torchmetrics squeezes results)
                    value = expected["notes"] if name == "notes" else squeezed(expected)
                    problems += same(value, ours["compute"], f"{where} compute")
                else:
                    reference = single_process(name, make[name], counts)
                    problems += close(reference, ours["compute"], f"{where} compute")
                problems += [] if ours["calls"] == {"gs.all_gather_object": 1} else [where]
    return problems


def ranks_compute_on_0() -> dict[str, Any]:
    """patch(compute_on=0) next to unpatched: the same result on every rank, states
    gathered on rank 0 only, two gatherstore calls."""
    rank, make = gs.get_rank(), makers()
    problems: list[str] = []
    names = ("mse", "cat", "kinds", "map-bbox", "map-segm")
    expected = {name: fed(make[name], name, rank, 2).compute() for name in names}
    before = {name: fed(make[name], name, rank, 2) for name in names}  # made before patch()
    calls: dict[str, Any] = {}
    with compat.patch(compute_on=0):
        after = {name: fed(make[name], name, rank, 2) for name in names}
        for when, metrics in (("before", before), ("after", after)):
            for name, metric in metrics.items():
                local = snapshot(metric)
                with counted() as counts:
                    value = metric.compute()
                problems += same(expected[name], value, f"{name} made {when} patch")
                problems += same(local, snapshot(metric), f"{name} {when}: states stay local")
                calls[f"{name} {when}"] = counts.counts
                with counted() as again:
                    problems += [] if metric.compute() is value else [f"{name}: not cached"]
                calls[f"{name} {when} again"] = again.counts
        counts_ = COUNTS["uneven"]
        for name in ("map-bbox", "cat"):
            value = fed(make[name], name, rank, counts_[rank]).compute()
            reference = single_process(name, make[name], counts_)
            problems += close(reference, value, f"{name} uneven on rank 0")
        alone = fed(make["mse"], "mse", rank, 2, sync_on_compute=False)
        with counted() as counts:
            value = alone.compute()
        local = fed(make["mse"], "mse", rank, 2, sync_on_compute=False).compute()
        problems += same(local, value, "sync_on_compute=False")
        calls["sync_on_compute=False"] = counts.counts
        stepping = make["mse"](dist_sync_on_step=True)
        plain_step = make["mse"](dist_sync_on_step=True)
        args = inputs("mse", rank, 1)[0]
        with counted() as counts:
            step = stepping(*args)
        calls["dist_sync_on_step"] = counts.counts
    problems += same(plain_step(*args), step, "forward with dist_sync_on_step")
    problems += same(stepping.compute(), plain_step.compute(), "after forward")
    return {"problems": problems, "calls": calls}


def ranks_raising() -> dict[str, Any]:
    """A rank whose states cannot be sent or whose compute fails: every rank raises."""
    rank, make = gs.get_rank(), makers()
    seen: dict[str, Any] = {}

    def record(label: str, fn: Callable[[], Any]) -> None:
        result = outcome(fn)
        seen[label] = result[1].__name__ if isinstance(result, tuple) else result

    with compat.patch():
        notes = fed(make["notes"], "notes", rank, 1)
        if rank == 1:
            notes.notes.append(Unsendable())
        record("unpicklable item", notes.compute)
        kinds = fed(make["kinds"], "kinds", rank, 2)
        if rank == 1:
            kinds.rows.append(torch.ones(5))  # 1-D among 2-D rows: cat fails before sending
        record("cat fails", kinds.compute)
        record("in step", lambda: gs.all_gather_object(rank))

    class Failing(make["mse"]):  # type: ignore[misc]
        def compute(self) -> Any:
            raise ValueError("compute failed")

    with compat.patch(compute_on=0):
        record("rank 0's compute", fed(Failing, "mse", rank, 1).compute)
        notes = fed(make["notes"], "notes", rank, 1)
        if rank == 2:
            notes.notes.append(Unsendable())
        record("rank 2 cannot send", notes.compute)
        record("in step after", lambda: gs.all_gather_object(rank))
    return seen


@pytest.mark.timeout(300)
def test_three_ranks_match_torchmetrics_where_it_works() -> None:
    results = gs.launch(ranks_side_by_side, nproc_per_node=W, backend="gloo", timeout=120)
    for rank, result in enumerate(results):
        assert result["problems"] == [], rank
        for where in SIDE_BY_SIDE_CALLS:
            plain, ours = result["calls"][where]
            # one gather per sync, where torchmetrics runs several collectives per state
            assert ours == {"gs.all_gather_object": 1}, where
            assert sum(plain.values()) > 2 and not any(k.startswith("gs.") for k in plain), where
        # MAP: a barrier and gathers per image and state; masks by object
        assert result["calls"]["map-segm/equal"][0]["torch.all_gather_object"] == 2
        assert sum(result["calls"]["map-bbox/equal"][0].values()) > 30
        # dist_sync_fn: one gatherstore gather per tensor: 6 tensor states, the "cat" list
        # concatenated first, two lists of 2
        assert result["calls"]["dist_sync_fn"] == {"gs.all_gather_object": 6 + 1 + 2 * 2}


@pytest.mark.timeout(300)
def test_three_ranks_uneven_and_empty_equal_a_single_process() -> None:
    results = gs.launch(ranks_where_torchmetrics_fails, nproc_per_node=W, backend="gloo")
    assert results == [[], [], []]


@pytest.mark.timeout(300)
def test_compute_on_rank_0() -> None:
    results = gs.launch(ranks_compute_on_0, nproc_per_node=W, backend="gloo", timeout=120)
    for rank, result in enumerate(results):
        assert result["problems"] == [], rank
        calls = result["calls"]
        for name in ("mse", "cat", "kinds", "map-bbox", "map-segm"):
            for when in ("before", "after"):
                # one gather to rank 0, one broadcast of its result; no torch collective
                assert calls[f"{name} {when}"] == {"gs.gather_object": 1, "gs.broadcast_object": 1}
                assert calls[f"{name} {when} again"] == {}
        assert calls["sync_on_compute=False"] == {}
        assert calls["dist_sync_on_step"] == {"gs.all_gather_object": 1}


@pytest.mark.timeout(300)
def test_a_failing_rank_makes_every_rank_raise() -> None:
    results = gs.launch(ranks_raising, nproc_per_node=W, backend="gloo", timeout=120)
    remote = "RemoteRankError"
    assert [r["unpicklable item"] for r in results] == [remote, "TypeError", remote]
    assert [r["cat fails"] for r in results] == [remote, "RuntimeError", remote]
    assert [r["in step"] for r in results] == [[0, 1, 2]] * W
    assert [r["rank 0's compute"] for r in results] == ["ValueError", remote, remote]
    assert [r["rank 2 cannot send"] for r in results] == [remote, remote, "TypeError"]
    assert [r["in step after"] for r in results] == [[0, 1, 2]] * W


# --- one process -----------------------------------------------------------------------------
def test_serially_patched_equals_unpatched() -> None:
    from torchmetrics.regression import MeanSquaredError

    args = inputs("mse", 0, 1)[0]
    plain = MeanSquaredError()
    plain.update(*args)
    for compute_on in (None, 0):
        with compat.patch(compute_on=compute_on):
            ours = MeanSquaredError()
            ours.update(*args)
            assert same(plain.compute(), ours.compute()) == []
    tensor = torch.ones(2)
    assert compat.dist_sync_fn(tensor)[0] is tensor


def test_patch_swaps_methods_and_undoes() -> None:
    from torchmetrics import Metric
    from torchmetrics.detection.mean_ap import MeanAveragePrecision as MAP

    originals = {
        name: dict(vars(cls))[attr]
        for name, cls, attr in (
            ("sync", Metric, "_sync_dist"),
            ("wrap", Metric, "_wrap_compute"),
            ("map", MAP, "_sync_dist"),
            ("tuples", MAP, "_gather_tuple_list"),
        )
    }
    with compat.patch() as handle:
        assert compat.patch() is handle  # twice is harmless
        assert vars(Metric)["_sync_dist"] is not originals["sync"]
        assert vars(MAP)["_sync_dist"] is not originals["map"]
        assert isinstance(vars(MAP)["_gather_tuple_list"], staticmethod)
        assert vars(MAP)["_gather_tuple_list"] is not originals["tuples"]
        assert vars(Metric)["_wrap_compute"] is originals["wrap"]  # only compute_on needs it
        with pytest.raises(ValueError, match="already patched with compute_on=None"):
            compat.patch(compute_on=0)
    assert vars(Metric)["_sync_dist"] is originals["sync"]
    assert vars(MAP)["_gather_tuple_list"] is originals["tuples"]
    handle.undo()  # again: nothing
    with compat.patch(compute_on=1):
        assert vars(Metric)["_wrap_compute"] is not originals["wrap"]
    assert vars(Metric)["_wrap_compute"] is originals["wrap"]
    assert vars(MAP)["_sync_dist"] is originals["map"]


@pytest.mark.parametrize("bad", [-1, "0", True, 0.0])
def test_compute_on_must_be_a_rank(bad: Any) -> None:
    with pytest.raises(ValueError, match="compute_on"):
        compat.patch(compute_on=bad)


def test_patch_without_torchmetrics_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "torchmetrics" or m.startswith("torchmetrics.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "torchmetrics", None)
    with pytest.raises(ImportError, match="pip install torchmetrics"):
        compat.patch()


# --- any process group: through gatherstore, never torch's object collectives ------------


def ranks_on_subgroups() -> dict[str, Any]:
    """In 4 ranks, torch's object collectives refused: CatMetric and SumMetric whose
    process_group is a pair (ranks 0-1 or 2-3) or ranks 1-3, synced under patch() and
    patch(compute_on=1) (rank 1 of the group), and dist_sync_fn on a pair."""
    from torchmetrics.aggregation import CatMetric, SumMetric

    rank = gs.get_rank()
    groups = dict(zip(("pair", "tail"), subgroups(), strict=True))

    def synced(group: Any) -> Any:
        cat, total = CatMetric(process_group=group), SumMetric(process_group=group)
        cat.update(torch.arange(rank + 1.0))  # uneven: rank + 1 values
        total.update(torch.tensor(float(rank)))
        with counted() as calls:
            values = (cat.compute().tolist(), total.compute().item())
        return values, calls.counts

    out: dict[str, Any] = {}
    with torch_objects_refused() as called:
        parts = compat.dist_sync_fn(torch.arange(rank + 1), groups["pair"])
        out["dist_sync_fn"] = [t.tolist() for t in parts]
        for compute_on in (None, 1):
            with compat.patch(compute_on=compute_on):
                for name, group in groups.items():
                    if name == "pair" or rank in TAIL:
                        out[f"{name} {compute_on}"] = synced(group)
    return {**out, "called": called}


def cat_of(ranks: list[int]) -> list[float]:
    """CatMetric's value when ``ranks`` each added ``arange(rank + 1)``."""
    return [float(v) for r in ranks for v in range(r + 1)]


@pytest.mark.timeout(300)
def test_metrics_on_any_group_sync_through_gatherstore_in_four_ranks() -> None:
    results = gs.launch(ranks_on_subgroups, nproc_per_node=4, backend="gloo", timeout=120)
    # two metrics each: one gather on every rank, or one to rank 1 and one broadcast of
    # its result
    every_rank = {"gs.all_gather_object": 2}
    on_rank_1 = {"gs.gather_object": 2, "gs.broadcast_object": 2}
    for rank, out in enumerate(results):
        expected: dict[str, Any] = {"dist_sync_fn": [list(range(r + 1)) for r in pair_of(rank)]}
        for name, ranks in (("pair", pair_of(rank)), ("tail", TAIL)):
            if name == "pair" or rank in TAIL:
                value = (cat_of(ranks), float(sum(ranks)))
                expected[f"{name} None"] = (value, every_rank)
                expected[f"{name} 1"] = (value, on_rank_1)
        assert out == {**expected, "called": []}, rank
