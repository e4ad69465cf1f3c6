"""gatherstore.compat.lm_eval side by side with lm-evaluation-harness's own gather: LM.gather_object
in 3 gloo ranks (equal, uneven, empty, strings, nested), simple_evaluate(log_samples=True) on a
local task with a dummy model, and a rank whose samples cannot be pickled."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from compat_groups import torch_objects_refused
from compat_same import failure, outcome, reused_buffer, same, same_outcome

import gatherstore as gs
from gatherstore.compat import lm_eval as compat

model = pytest.importorskip("lm_eval.api.model")

TASKS = ["gs_choice", "gs_generate"]


class Quiet(model.LM):
    """A deterministic model that reports torch.distributed's rank and world size and keeps
    LM.gather_object (lm_eval's answer: ``[obj]``)."""

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        return [(-float(sum(map(ord, r.args[1])) % 17), len(r.args[1]) % 2 == 0) for r in requests]

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        raise NotImplementedError

    def generate_until(self, requests: list[Any]) -> list[str]:
        return [r.args[0].split()[-1] for r in requests]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        slots = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(slots, tensor)
        return torch.stack(slots)

    def barrier(self) -> None:
        dist.barrier()


class Dummy(Quiet):
    """Gathers as lm_eval's HFLM does (torch.distributed.gather_object)."""

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size <= 1:
            return [obj]
        result = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, result, dst=dst)
        return result


class Unpicklable(str):
    """A generated string that refuses to be pickled."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("Unpicklable cannot be pickled")

    def __deepcopy__(self, memo: Any) -> Unpicklable:
        return self


class Poisoned(Dummy):
    """Rank 1 generates a string that cannot be pickled."""

    def generate_until(self, requests: list[Any]) -> list[str]:
        answers = super().generate_until(requests)
        return [Unpicklable(a) for a in answers] if self.rank == 1 else answers


@pytest.fixture
def task_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two local tasks with local JSON lines data: 7 multiple-choice documents (uneven over
    3 ranks) and 6 generation documents (even)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with (tmp_path / "choice.jsonl").open("w") as f:
        for i in range(7):
            doc = {"question": f"q{i} ü{'x' * i}", "choices": ["a", "bb" + "c" * (i % 3), "ddd"]}
            f.write(json.dumps({**doc, "answer": i % 3}) + "\n")
    with (tmp_path / "generate.jsonl").open("w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": f"say {i}", "target": str(i) if i % 2 else "no"}) + "\n")
    common = {
        "dataset_path": "json",
        "test_split": "test",
    }
    tasks = {
        "gs_choice": {
            "output_type": "multiple_choice",
            "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
        },
        "gs_generate": {
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{target}}",
            "generation_kwargs": {"until": ["\n"]},
            "metric_list": [{"metric": "exact_match"}],
        },
    }
    for (name, spec), data in zip(tasks.items(), ("choice", "generate"), strict=True):
        files = {"data_files": {"test": str(tmp_path / f"{data}.jsonl")}}
        kwargs = {**files, "cache_dir": str(tmp_path / "hf")}
        config = {"task": name, **common, "dataset_kwargs": kwargs, **spec}
        (tmp_path / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML
    return tmp_path


# --- LM.gather_object, object by object --------------------------------------------------


def cases(rank: int) -> dict[str, Any]:
    return {
        "equal": {"task": [rank, rank * 10]},
        "uneven": {"task": [{"doc_id": rank + 3 * i} for i in range(3 - rank)]},
        "empty rank": {"task": [] if rank == 1 else [rank]},
        "strings": ["é" * rank, "", "plain"],
        "nested": {"t": {("acc", "none"): [rank, None, (rank, "x" * rank)]}},
    }


def direct_gathers() -> dict[str, Any]:
    """lm.gather_object(obj, dst) for dst 0 and 2, unpatched then patched (torch's object
    collectives refused)."""
    rank = gs.get_rank()

    def script(lm: Any) -> list[tuple[str, Any]]:
        reused = [
            (
                f"reused buffer dst={dst}",
                outcome(lambda d=dst: reused_buffer(lambda o: lm.gather_object(o, d), rank)),
            )
            for dst in (0, 2)
        ]
        return [
            (f"{label} dst={dst}", outcome(lambda o=obj, d=dst: lm.gather_object(o, d)))
            for label, obj in cases(rank).items()
            for dst in (0, 2)
        ] + reused

    original = script(Dummy())
    inherited = Quiet().gather_object({"rank": rank})
    with compat.patch(), torch_objects_refused() as called:

        class Late(Dummy):  # defined while patched: its override is replaced too
            def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
                return super().gather_object(obj, dst)

        patched = script(Dummy())
        late = script(Late())
        inherited_patched = Quiet().gather_object({"rank": rank})
    problems = [
        p
        for ours in (patched, late)
        for (label, a), (_, b) in zip(original, ours, strict=True)
        for p in same_outcome(a, b, label)
    ]
    return {
        "problems": problems + [f"torch.distributed.{name} called" for name in called],
        "answers": dict(original),
        "inherited": (inherited, inherited_patched),
    }


@pytest.mark.timeout(180)
def test_gather_object_matches_lm_eval_in_three_ranks() -> None:
    results = gs.launch(direct_gathers, nproc_per_node=3, backend="gloo", timeout=60)
    for rank, out in enumerate(results):
        assert out["problems"] == []
        answers = out["answers"]
        if rank == 0:
            assert answers["empty rank dst=0"] == [{"task": [0]}, {"task": []}, {"task": [2]}]
        else:
            assert answers["empty rank dst=0"] is None
        assert (answers["strings dst=2"] is None) == (rank != 2)
        # a model without its own gather_object: lm_eval gives each rank only its own object,
        # patched gives dst every rank's (a deliberate difference)
        inherited, inherited_patched = out["inherited"]
        assert inherited == [{"rank": rank}]
        assert inherited_patched == ([{"rank": r} for r in range(3)] if rank == 0 else None)


# --- simple_evaluate end to end -----------------------------------------------------------


def evaluate_both(tmp: str) -> dict[str, Any]:
    """simple_evaluate with log_samples=True, unpatched then patched (through a file:// store)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out: dict[str, Any] = {}
    for patched in (False, True):
        if patched:
            gs.set_default_store(f"file://{tmp}/store")
        with compat.patch() if patched else contextlib.nullcontext():
            tasks = TaskManager(include_path=tmp, include_defaults=False)
            result = simple_evaluate(
                Dummy(), tasks=TASKS, task_manager=tasks, log_samples=True, bootstrap_iters=10
            )
        keys = ("results", "samples", "n-samples", "configs")
        out[patched] = None if result is None else {k: result[k] for k in keys}
    gs.barrier()
    out["store"] = sorted({p.name.split("-")[0] for p in Path(tmp, "store").iterdir()})
    return out


@pytest.mark.timeout(240)
def test_simple_evaluate_gives_rank0_the_same_results_and_samples(task_dir: Path) -> None:
    results = gs.launch(evaluate_both, nproc_per_node=3, backend="gloo", args=(str(task_dir),))
    plain, patched = results[0][False], results[0][True]
    assert same(plain, patched) == []
    # rank after rank, as lm_eval concatenates them: 7 documents split 3/2/2, 6 split 2/2/2
    assert [s["doc_id"] for s in patched["samples"]["gs_choice"]] == [0, 3, 6, 1, 4, 2, 5]
    assert [s["doc_id"] for s in patched["samples"]["gs_generate"]] == [0, 3, 1, 4, 2, 5]
    assert patched["results"]["gs_generate"]["exact_match,none"] == 0.5
    for out in results:
        assert out["store"] == ["gatherstore"]  # the samples went through the file store
    for out in results[1:]:
        assert out[False] is None and out[True] is None


def evaluate_poisoned(tmp: str) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with compat.patch():
        tasks = TaskManager(include_path=tmp, include_defaults=False)
        out = failure(
            lambda: simple_evaluate(Poisoned(), tasks=TASKS, task_manager=tasks, log_samples=True),
            "Unpicklable cannot be pickled",
        )
        out["after"] = Dummy().gather_object(gs.get_rank())  # the job goes on
    return out


@pytest.mark.timeout(240)
def test_a_rank_whose_samples_cannot_be_pickled_makes_every_rank_raise(
    task_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # unpatched, torch.distributed.gather_object raises on rank 1 and leaves the others
    # waiting for the process group's timeout (52 weeks in lm_eval's HFLM)
    monkeypatch.setenv("GATHERSTORE_TIMEOUT", "60")  # a hang would fail fast
    results = gs.launch(evaluate_poisoned, nproc_per_node=3, backend="gloo", args=(str(task_dir),))
    assert [r["raised"] for r in results] == ["RemoteRankError", "TypeError", "RemoteRankError"]
    assert [r["names"] for r in results] == [1, None, 1]
    assert all(r["says why"] for r in results)
    assert [r["after"] for r in results] == [[0, 1, 2], None, None]


# --- the patch itself ---------------------------------------------------------------------


def test_patch_replaces_every_override_and_undoes() -> None:
    base = model.LM
    originals = {cls: vars(cls)["gather_object"] for cls in (base, Dummy)}
    with compat.patch() as handle:
        assert compat.patch() is handle  # twice is harmless
        for cls in (base, Dummy):
            assert vars(cls)["gather_object"] is compat.gather_object
        assert "gather_object" not in vars(Quiet)  # inherits the replacement

        class Later(Dummy):
            def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
                raise AssertionError("replaced")

        class Plain(Dummy):
            pass

        assert vars(Later)["gather_object"] is compat.gather_object
        assert "gather_object" not in vars(Plain)
        assert Dummy.all_gather is Quiet.all_gather  # tensors stay the model's
    for cls, original in originals.items():
        assert vars(cls)["gather_object"] is original
    assert vars(Later)["gather_object"].__qualname__.endswith("Later.gather_object")
    assert "__init_subclass__" not in vars(base)
    handle.undo()  # again: nothing
    assert Dummy().gather_object("x") == ["x"]  # serially, as lm_eval answers


def test_patch_without_lm_eval_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)
    with pytest.raises(ImportError, match="pip install lm-eval"):
        compat.patch()
