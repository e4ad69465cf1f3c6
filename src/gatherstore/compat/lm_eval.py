"""lm-evaluation-harness's end-of-evaluation gathers through gatherstore.

``lm_eval.evaluator.evaluate`` ends with ``lm.gather_object(...)`` of every
rank's logged samples and per-sample metrics to rank 0.  Its models implement
that with ``torch.distributed.gather_object`` (``HFLM``, ``NeMoLM``) or
``all_gather_object`` (``MegatronLMEval``): pickled through dst's GPU under
NCCL, with the process group's timeout.  ``patch`` replaces ``LM.gather_object`` and
every subclass's override with ``gather_object``.
"""

from __future__ import annotations

from typing import Any

import gatherstore as gs
from gatherstore.compat._common import own_copies
from gatherstore.compat._patching import Patch, patch_methods

__all__ = ["gather_object", "patch"]


def gather_object(self: Any, obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank ``dst``, None on the others.

    ``[obj]`` when the model runs alone (``self.world_size <= 1``) or without a
    process group, as ``LM.gather_object`` answers.

    Raises:
        ValueError: ``dst`` is not a rank of the job.
        GatherError: gatherstore's errors, e.g. ``RemoteRankError`` on every rank
            when one rank's object cannot be pickled.
    """
    if self.world_size <= 1 or not gs.is_distributed():
        return [obj]
    with own_copies():  # as torch.distributed.gather_object's: dst's entry is a copy
        return gs.gather_object(obj, dst)


def patch() -> Patch:
    """Make lm-evaluation-harness models gather objects through gatherstore.

    Replaces ``lm_eval.api.model.LM.gather_object`` and the override of every
    subclass that defines its own, those loaded later included (``HFLM`` loads
    when ``simple_evaluate(model="hf")`` asks for it).  ``all_gather`` of
    tensors and ``barrier`` stay the model's.

    Raises:
        ImportError: lm-evaluation-harness is not installed.
    """
    return patch_methods("lm_eval.api.model", "lm-eval", "LM", {"gather_object": gather_object})
