"""Stand-in for ``vis4d.engine.callbacks.evaluator``, which binds the gather functions by name
(``from vis4d.common.distributed import all_gather_object_cpu``)."""

from __future__ import annotations

from typing import Any

from vis4d.common.distributed import all_gather_object_cpu, all_gather_object_gpu


class EvaluatorCallback:
    """Outputs per rank; at the end of the epoch the main process gets every rank's."""

    def __init__(self, collect: str = "cpu") -> None:
        self.collect = collect
        self.outputs: list[Any] = []

    def process(self, output: Any) -> None:
        self.outputs.append(output)

    def on_test_epoch_end(self) -> list[Any] | None:
        gather = all_gather_object_cpu if self.collect == "cpu" else all_gather_object_gpu
        parts = gather(self.outputs)
        return None if parts is None else [o for part in parts for o in part]
