"""gatherstore.compat.evaluate side by side with HuggingFace evaluate's own lock-file rendezvous:
modules with num_process=3 in 3 gloo ranks (equal, uneven, empty, strings, nested inputs),
node-local cache folders and a rank without data (where the original fails), and a rank that
fails before the gather."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compat_groups import torch_objects_refused
from compat_same import same

import gatherstore as gs
from gatherstore.compat import evaluate as compat

evaluate = pytest.importorskip("evaluate")
datasets = pytest.importorskip("datasets")

V = datasets.Value


def _info(features: dict[str, Any]) -> Any:
    return evaluate.MetricInfo(
        description="a test metric",
        citation="",
        inputs_description="predictions and references",
        features=datasets.Features(features),
    )


class Accuracy(evaluate.Metric):
    """Accuracy, with the predictions in the order the module received them."""

    def _info(self) -> Any:
        return _info({"predictions": V("int64"), "references": V("int64")})

    def _compute(self, predictions: list[int], references: list[int]) -> dict[str, Any]:
        hits = sum(p == r for p, r in zip(predictions, references, strict=True))
        return {"accuracy": hits / len(predictions), "order": list(predictions)}


class AnyMatch(evaluate.Metric):
    """Strings: a prediction counts when it equals any of its references."""

    def _info(self) -> Any:
        return _info({"predictions": V("string"), "references": datasets.Sequence(V("string"))})

    def _compute(self, predictions: list[str], references: list[list[str]]) -> dict[str, Any]:
        hits = [p in refs for p, refs in zip(predictions, references, strict=True)]
        return {"match": sum(hits) / len(hits), "predictions": predictions}


class Nested(evaluate.Metric):
    """Nested inputs: a label and its scores per prediction."""

    def _info(self) -> Any:
        scored = {"label": V("string"), "scores": datasets.Sequence(V("float64"))}
        return _info({"predictions": scored, "references": V("int64")})

    def _compute(self, predictions: list[Any], references: list[int]) -> dict[str, Any]:
        return {"predictions": predictions, "total": sum(sum(p["scores"]) for p in predictions)}


def feed(rank: int, case: str) -> tuple[type, list[tuple[str, dict[str, Any]]]]:
    """The metric and this rank's calls (``add``, ``add_batch`` or ``compute`` inputs)."""
    if case == "equal":
        return Accuracy, [("add_batch", {"predictions": [rank, 1], "references": [rank, 0]})]
    if case == "uneven":
        calls = [
            ("add", {"prediction": rank * 10 + i, "reference": rank * 10}) for i in range(rank)
        ]
        return Accuracy, [*calls, ("add_batch", {"predictions": [9], "references": [9]})]
    if case == "empty batch":
        rows = [] if rank == 1 else [rank]
        return Accuracy, [("add_batch", {"predictions": rows, "references": rows})]
    if case == "inputs at compute":
        return Accuracy, [("compute", {"predictions": [rank] * 2, "references": [0, rank]})]
    if case == "reused buffer":  # every batch is the same array, refilled
        buffer = np.zeros(2, dtype=np.int64)
        calls = []
        for step in range(3):
            calls.append(("refill", {"buffer": buffer, "value": rank + step}))
            batch = {"predictions": buffer, "references": np.array([rank + step, 0])}
            calls.append(("add_batch", batch))
        return Accuracy, calls
    if case == "strings":
        words = ["é" * rank, "plain", "ü€"]
        return AnyMatch, [
            ("add_batch", {"predictions": words, "references": [[w, "x"] for w in words]})
        ]
    label = {"label": "l" * rank, "scores": [0.5 * rank] * rank}
    return Nested, [("add_batch", {"predictions": [label, label], "references": [rank, 0]})]


CASES = [
    "equal",
    "uneven",
    "empty batch",
    "inputs at compute",
    "reused buffer",
    "strings",
    "nested",
]


def run(module: Any, calls: list[tuple[str, dict[str, Any]]]) -> Any:
    """Make the calls, then compute() (with the inputs of a "compute" call)."""
    inputs: dict[str, Any] = {}
    for name, kwargs in calls:
        if name == "refill":
            kwargs["buffer"][:] = kwargs["value"]
        elif name == "compute":
            inputs = kwargs
        else:
            getattr(module, name)(**kwargs)
    return module.compute(**inputs)


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def side_by_side(tmp: str) -> dict[str, Any]:
    """Every case unpatched, then patched (through a file:// store), each in its own cache_dir;
    a module created before patch() last."""
    rank, root = gs.get_rank(), Path(tmp)
    out: dict[str, Any] = {"left": {}}
    early = Accuracy(num_process=3, process_id=rank, cache_dir=str(root / "early"))
    for patched in (False, True):
        if patched:
            gs.set_default_store(f"file://{tmp}/store")
        patching = compat.patch() if patched else contextlib.nullcontext()
        with patching, torch_objects_refused() as out["torch objects", patched]:
            for case in CASES:
                metric, calls = feed(rank, case)
                cache = root / f"{case}-{patched}"
                module = metric(num_process=3, process_id=rank, cache_dir=str(cache), timeout=30)
                out[case, patched] = run(module, calls)
                gs.barrier()  # evaluate's own deletes the next round's files without it
                out[case, patched, "again"] = run(module, calls)  # a second round, same module
                gs.barrier()
                out["left"][case, patched] = files(cache)
            if patched:
                out["early"] = run(early, feed(rank, "equal")[1])
                gs.barrier()
                out["left"]["early"] = files(root / "early")
    gs.barrier()
    out["store"] = sorted({p.name.split("-")[0] for p in (root / "store").iterdir()})
    return out


def alone(case: str) -> Any:
    """The same case computed by one process fed every rank's calls in rank order."""
    metric, _ = feed(0, case)
    module = metric(keep_in_memory=True)
    for rank in range(3):
        for name, kwargs in feed(rank, case)[1]:
            if name == "refill":
                kwargs["buffer"][:] = kwargs["value"]
            else:
                getattr(module, "add_batch" if name == "compute" else name)(**kwargs)
    return module.compute()


@pytest.mark.timeout(240)
def test_patched_compute_equals_evaluate_in_three_ranks(tmp_path: Path) -> None:
    results = gs.launch(side_by_side, nproc_per_node=3, backend="gloo", args=(str(tmp_path),))
    for case in CASES:
        expected = alone(case)
        for again in ((), ("again",)):
            assert same(results[0][(case, False, *again)], results[0][(case, True, *again)]) == []
            assert same(expected, results[0][(case, True, *again)]) == [], case
            for out in results[1:]:
                assert out[(case, False, *again)] is None and out[(case, True, *again)] is None
    assert results[0]["early"] == alone("equal")
    for out in results:
        left = out["left"]
        assert all(left[case, False] for case in CASES)  # evaluate leaves its lock files
        assert not any(left[case, True] for case in CASES)
        assert left["early"] == []
        assert out["store"] == ["gatherstore"]  # the rows went through the file store
        # nor through torch's object collectives (evaluate's own does not use them either)
        assert out["torch objects", True] == out["torch objects", False] == []


def where_the_original_fails(tmp: str) -> dict[str, Any]:
    """Node-local cache folders, and a rank that adds nothing: evaluate, then patched."""
    rank, out = gs.get_rank(), {}
    for patched in (False, True):
        with compat.patch() if patched else contextlib.nullcontext():
            local = os.path.join(tmp, f"node{rank}-{patched}")
            module = Accuracy(num_process=3, process_id=rank, cache_dir=local, timeout=1)
            calls = [("add_batch", {"predictions": [rank, 1], "references": [rank, 0]})]
            out["node-local", patched] = _outcome(lambda m=module, c=calls: run(m, c))
            gs.barrier()
            shared = os.path.join(tmp, f"shared-{patched}")
            module = Accuracy(num_process=3, process_id=rank, cache_dir=shared, timeout=1)
            calls = [] if rank == 2 else [("add_batch", {"predictions": [rank], "references": [0]})]
            out["no data", patched] = _outcome(lambda m=module, c=calls: run(m, c))
            gs.barrier()
            out["left", patched] = files(Path(local)) + files(Path(shared))
    return out


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.timeout(240)
def test_node_local_cache_and_a_rank_without_data_work_patched(tmp_path: Path) -> None:
    args = (str(tmp_path),)
    results = gs.launch(where_the_original_fails, nproc_per_node=3, backend="gloo", args=args)
    assert "Expected to find locked file" in results[0]["node-local", False]
    assert "ValueError" in results[0]["no data", False]
    assert results[0]["node-local", True] == {"accuracy": 0.5, "order": [0, 1, 1, 1, 2, 1]}
    assert results[0]["no data", True] == {"accuracy": 0.5, "order": [0, 1]}
    for out in results:
        assert out["left", True] == []
    for out in results[1:]:
        assert out["node-local", True] is None and out["no data", True] is None


def one_rank_fails(tmp: str) -> dict[str, Any]:
    """Rank 1 passes mismatched inputs to compute() and raises before the gather:
    evaluate's own, then patched."""
    rank, out = gs.get_rank(), {}
    for patched in (False, True):
        with compat.patch() if patched else contextlib.nullcontext():
            cache = os.path.join(tmp, str(patched))
            timeout = 30 if patched else 3  # patched, ranks 0 and 2 must not wait for it
            module = Accuracy(num_process=3, process_id=rank, cache_dir=cache, timeout=timeout)
            references = [0] if rank == 1 else [0, 0]
            try:
                module.compute(predictions=[0, 1], references=references)
                out[patched] = None
            except Exception as exc:
                out[patched] = (type(exc).__name__, getattr(exc, "ranks", None))
            del module
            gs.barrier()
            out["left", patched] = files(Path(cache))
    return out


@pytest.mark.timeout(240)
def test_a_rank_that_fails_makes_every_rank_raise(tmp_path: Path) -> None:
    results = gs.launch(one_rank_fails, nproc_per_node=3, backend="gloo", args=(str(tmp_path),))
    # evaluate's own: rank 0 waits `timeout` for rank 1's file and raises (ValueError, or
    # pyarrow's ArrowInvalid when it finds a file half written), rank 2 returns None
    own = [r[False] for r in results]
    assert own[0] in (("ValueError", None), ("ArrowInvalid", None)), own
    assert own[1:] == [("ValueError", None), None]
    # patched: ranks 0 and 2 raise RemoteRankError naming rank 1 at once (it reported its
    # failure: a timeout would be GatherTimeout), and nothing is left behind
    remote = ("RemoteRankError", [1])
    assert [r[True] for r in results] == [remote, ("ValueError", None), remote]
    assert all(r["left", True] == [] for r in results)


def test_single_process_modules_are_left_to_evaluate(tmp_path: Path) -> None:
    with compat.patch():
        module = Accuracy(cache_dir=str(tmp_path))
        module.add_batch(predictions=[1, 2], references=[1, 0])
        assert module.compute() == {"accuracy": 0.5, "order": [1, 2]}
        with pytest.raises(ValueError, match="add"):  # evaluate's own message
            Accuracy(cache_dir=str(tmp_path)).compute()


def test_patch_swaps_the_writer_and_finalize_and_undoes() -> None:
    base = evaluate.EvaluationModule
    originals = (base._init_writer, base._finalize)
    with compat.patch() as handle:
        assert compat.patch() is handle  # twice is harmless
        assert base._init_writer is not originals[0] and base._finalize is not originals[1]
        assert Accuracy(keep_in_memory=True).compute.__doc__.endswith("and references")
    assert (base._init_writer, base._finalize) == originals
    assert "__init_subclass__" not in vars(base)
    handle.undo()  # again: nothing


def test_patch_without_evaluate_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "evaluate.module", None)
    with pytest.raises(ImportError, match="pip install evaluate"):
        compat.patch()
