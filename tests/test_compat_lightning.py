"""gatherstore.compat.lightning.GatherPredictions in real DDP ``trainer.predict`` runs on CPU:
3 gloo ranks started by gs.launch (Lightning runs in them with its own environment, whose
teardown deletes WORLD_SIZE after every predict), and 3 processes Lightning launches itself.
On rank 0 the predictions equal the same split of a single-device ``Trainer.predict``."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from compat_same import Unsendable, outcome, same
from torch.utils.data import DistributedSampler

import gatherstore as gs
from gatherstore.compat import lightning as compat

pl = pytest.importorskip("pytorch_lightning")

W = 3
QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
}
# name -> (output kind, dataset size, batch size, the ranks' own DistributedSampler): Lightning's
# sampler for predict gives ranks uneven shares (10 samples: 4, 3, 3) without repeats; a
# DistributedSampler of one's own repeats samples to even them out (10: 4 each, samples 0
# and 1 twice; 2 samples: rank 2 has none of its own and gets sample 0 again); no data at all
SCENARIOS = {
    "equal": ("tensor", 12, 2, False),
    "uneven dict": ("dict", 10, 3, False),
    "strings": ("list", 7, 4, False),
    "repeats": ("dict", 10, 3, True),
    "rank 2 without data": ("dict", 2, 4, True),
    "no data": ("tensor", 0, 2, False),
}


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample i is [i, i / 2]: exact in float32, so every batching gives the same numbers."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i / 2])


class Model(pl.LightningModule):  # type: ignore[misc]
    """Integer weights: predictions are exact whatever the batch.  ``kind`` picks the output."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layer = torch.nn.Linear(2, 3)
        with torch.no_grad():
            self.layer.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
            self.layer.bias.fill_(1.0)

    def predict_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> Any:
        y = self.layer(batch)
        ids = batch[:, 0].long()
        if self.kind == "tensor":
            return y
        if self.kind == "list":
            return [f"sample-{i}" for i in ids.tolist()]
        if self.kind == "unsendable" and self.global_rank == 1:
            return [Unsendable() for _ in ids]
        if self.kind == "tuple" and self.global_rank == 2:
            return (y, ids)
        names = [f"name-{i}" for i in ids.tolist()]
        return {
            "y": y,
            "names": names,
            "meta": {"ids": ids, "tags": [("t", i) for i in ids.tolist()]},
        }


def predict(
    kind: str, loaders: Any, own_sampler: bool = False, dst: int = 0, **options: Any
) -> Any:
    """``trainer.predict`` on 3 CPU ranks with a GatherPredictions; its predictions."""
    writer = compat.GatherPredictions(dst=dst)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=W,
        strategy="ddp",
        callbacks=[writer],
        use_distributed_sampler=not own_sampler,
        **QUIET,
        **options,
    )
    trainer.predict(Model(kind), dataloaders=loaders, return_predictions=False)
    return writer.predictions


def loader(size: int, batch: int, **kwargs: Any) -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(Rows(size), batch_size=batch, **kwargs)


def ranks_predict() -> dict[str, Any]:
    """Every scenario in the same 3 processes, then failing ranks, then one more run."""
    rank = gs.get_rank()
    out: dict[str, Any] = {}
    for name, (kind, size, batch, own) in SCENARIOS.items():
        sampler = DistributedSampler(Rows(size), shuffle=False) if own else None
        out[name] = predict(kind, loader(size, batch, sampler=sampler), own)
    out["world size after predict"] = os.environ.get("WORLD_SIZE")
    out["two loaders"] = predict("dict", [loader(5, 2), loader(4, 3)])
    # the ranks' own shards of 5, 2 and 1 samples (Lightning refuses an empty one)
    shards = [list(range(5)), [5, 6], [7]]
    out["own shards, dst=1"] = predict("tensor", loader(8, 2, sampler=shards[rank]), True, 1)
    for kind in ("unsendable", "tuple"):
        result = outcome(lambda kind=kind: predict(kind, loader(9, 3)))
        out[kind] = result[1].__name__ if isinstance(result, tuple) else result
    limited = outcome(lambda: predict("list", loader(9, 1), limit_predict_batches=2))
    out["limited"] = limited[1].__name__ if isinstance(limited, tuple) else limited
    out["in step"] = predict("list", loader(4, 1))
    return out


def single_device(kind: str, loaders: Any) -> list[Any]:
    """``Trainer(devices=1).predict`` split into samples (per dataloader when several)."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, **QUIET)
    outputs = trainer.predict(Model(kind), dataloaders=loaders) or []  # None without data
    if isinstance(loaders, list):
        return [[s for o in outs for s in compat.split_output(o)] for outs in outputs]
    return [s for o in outputs for s in compat.split_output(o)]


@pytest.mark.timeout(300)
def test_ddp_predict_in_three_ranks_equals_single_device() -> None:
    results = gs.launch(ranks_predict, nproc_per_node=W, backend="gloo", timeout=120)
    first, *others = results
    for name, (kind, size, batch, _) in SCENARIOS.items():
        expected = single_device(kind, loader(size, batch))
        assert len(first[name]) == size
        assert same(expected, first[name], name) == []
        assert [r[name] for r in others] == [None, None]
    assert [r["world size after predict"] for r in results] == [None] * W  # Lightning's teardown
    expected = single_device("dict", [loader(5, 2), loader(4, 3)])
    assert same(expected, first["two loaders"], "two loaders") == []
    expected = single_device("tensor", loader(8, 2))
    assert [r["own shards, dst=1"] is None for r in results] == [True, False, True]
    assert same(expected, results[1]["own shards, dst=1"], "own shards") == []
    assert [r["unsendable"] for r in results] == ["RemoteRankError", "TypeError", "RemoteRankError"]
    assert [r["tuple"] for r in results] == ["RemoteRankError", "RemoteRankError", "TypeError"]
    # limit_predict_batches leaves samples out: dst names them, the others are done
    assert [r["limited"] for r in results] == ["ValueError", None, None]
    assert first["in step"] == [f"sample-{i}" for i in range(4)]


SCRIPT = """
import pickle, sys
sys.path.insert(0, {tests!r})
import pytorch_lightning as pl
from test_compat_lightning import QUIET, Model, loader
from gatherstore.compat.lightning import GatherPredictions

writer = GatherPredictions()
trainer = pl.Trainer(accelerator="cpu", devices=3, strategy="ddp", callbacks=[writer], **QUIET)
trainer.predict(Model("dict"), dataloaders=loader(10, 3), return_predictions=False)
with open(f"{{sys.argv[1]}}/rank{{trainer.global_rank}}.pkl", "wb") as f:
    pickle.dump(writer.predictions, f)
"""


@pytest.mark.timeout(300)
def test_ddp_predict_launched_by_lightning(tmp_path: Path) -> None:
    script = tmp_path / "predict.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    files = [tmp_path / f"rank{r}.pkl" for r in range(W)]
    deadline = time.monotonic() + 60  # Lightning's child processes write theirs on their own
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.2)
    results = [pickle.loads(f.read_bytes()) for f in files]
    assert same(single_device("dict", loader(10, 3)), results[0], "rank 0") == []
    assert results[1:] == [None, None]


def test_split_output() -> None:
    batch = {"y": torch.ones(2, 3), "names": ["a", "b"], "meta": {"ids": torch.tensor([4, 5])}}
    items = compat.split_output(batch)
    assert (
        same(items[1], {"y": torch.ones(3), "names": "b", "meta": {"ids": torch.tensor(5)}}) == []
    )
    with pytest.raises(TypeError, match="tuple"):
        compat.split_output((torch.ones(2), torch.ones(2)))
    with pytest.raises(ValueError, match="differ in length"):
        compat.split_output({"a": [1, 2], "b": [1]})
    with pytest.raises(ValueError, match="0-d"):
        compat.split_output(torch.tensor(1.0))


def test_writer_is_lightnings_and_needs_a_rank() -> None:
    writer = compat.GatherPredictions()
    assert isinstance(writer, pl.callbacks.BasePredictionWriter)
    assert writer.interval.on_epoch and not writer.interval.on_batch
    assert pickle.loads(pickle.dumps(writer)).dst == 0
    with pytest.raises(ValueError, match="dst"):
        compat.GatherPredictions(dst=-1)


def test_module_imports_without_lightning() -> None:
    code = (
        "import sys; sys.modules['pytorch_lightning'] = None\n"
        "from gatherstore.compat import lightning\n"
        "try:\n    lightning.GatherPredictions\nexcept ImportError as e:\n    print(e)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install pytorch-lightning" in run.stdout


class Seen(Model):
    """Records the samples it predicted."""

    def __init__(self) -> None:
        super().__init__("dict")
        self.seen: list[int] = []

    def predict_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self.seen += batch[:, 0].long().tolist()
        return super().predict_step(batch, batch_idx, dataloader_idx)


def resumed_predict(url: str) -> dict[str, Any]:
    """A predict stopped after one batch per rank, then one that predicts what is left."""

    def run(**options: Any) -> tuple[Any, list[int]]:
        writer = compat.GatherPredictions(resume="predict/ckpt-1", store=url)
        trainer = pl.Trainer(
            accelerator="cpu", devices=W, strategy="ddp", callbacks=[writer], **QUIET, **options
        )
        model, data = Seen(), Rows(10)
        sampler = writer.remaining(data) if not options else None
        batches = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
        trainer.predict(model, dataloaders=batches, return_predictions=False)
        return writer.predictions, model.seen

    first = outcome(lambda: run(limit_predict_batches=1))
    predictions, seen = run()
    return {"first": first[1].__name__, "seen": seen, "predictions": predictions}


@pytest.mark.timeout(300)
def test_a_predict_with_resume_continues_where_the_last_stopped(tmp_path: Path) -> None:
    results = gs.launch(
        resumed_predict, nproc_per_node=W, backend="gloo", args=(f"file://{tmp_path}",)
    )
    # the first run predicted one batch of 2 per rank: its teardown names what is missing
    assert [r["first"] for r in results] == ["ValueError"] * W
    # the second predicted only the 4 samples left, and rank 0 has all 10
    assert sorted(s for r in results for s in r["seen"]) == [6, 7, 8, 9]
    assert same(single_device("dict", loader(10, 2)), results[0]["predictions"], "resumed") == []
    assert [r["predictions"] for r in results[1:]] == [None, None]
