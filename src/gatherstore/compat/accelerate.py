"""HuggingFace accelerate's ``gather_object`` with objects gathered through gatherstore.

``accelerate.utils.gather_object`` is ``torch.distributed.all_gather_object``
through the current device: every rank's object is pickled into a tensor that
every rank receives (on the GPU under NCCL).
``gather_object`` keeps its answers and moves the objects through gatherstore's routes
and stores; ``patch`` puts it wherever accelerate calls the original, so
``Accelerator.gather_for_metrics`` (and with it transformers'
``eval_use_gather_object``) gathers through the store too, and accelerate's
barrier (``wait_for_everyone``) meets on gatherstore's control plane, so that
ranks that made a different number of gathers (``even_batches=False`` with a
gather every step) all raise ``MismatchError`` where they meet, naming who called
what, instead of timing out in gloo.
"""

from __future__ import annotations

from typing import Any

import torch

import gatherstore as gs
from gatherstore._config import default_timeout
from gatherstore.compat._common import own_copies
from gatherstore.compat._patching import Patch, _import, patch_module

__all__ = ["gather_object", "patch"]

_PIP = "accelerate"
#: Libraries whose modules import ``gather_object`` from accelerate by name.
_USERS = ("trl", "transformers")


def gather_object(object: Any) -> Any:
    """Every process's items, rank after rank, on every process; ``object`` itself serially.

    As accelerate's: each process passes a list (any iterable) of picklable
    items and gets one flat list of all of them, this process's own items as
    copies (as accelerate's pickle round trip makes them); when accelerate's state
    is not distributed the object comes back unchanged.  Tensors from other ranks
    arrive on the CPU, and so do this rank's own CUDA tensors, never on another
    rank's GPU.

    Raises:
        ImportError: accelerate is not installed.
        NotImplementedError: accelerate runs on XLA (TPU), which it does not support either.
        TypeError: a process's object is not iterable (raised on every rank).
        GatherError: gatherstore's errors, e.g. ``RemoteRankError`` on every rank
            when one rank's object cannot be pickled.
    """
    state_module = _import("accelerate.state", _PIP)
    constants = _import("accelerate.utils.constants", _PIP)
    state = state_module.PartialState()
    if state.distributed_type == state_module.DistributedType.XLA:
        raise NotImplementedError("gather objects in TPU is not supported")
    if state.distributed_type not in constants.TORCH_DISTRIBUTED_OPERATION_TYPES:
        return object
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        object = _import("accelerate.utils", _PIP).send_to_device(object, "cpu")
    with own_copies():  # accelerate's pickle round trip copies this rank's items too
        parts = gs.all_gather_object(object)
    if state.device.type == "neuron":  # accelerate's Neuron path keeps non-list objects whole
        parts = [part if isinstance(part, list) else [part] for part in parts]
    return [item for part in parts for item in part]


def _wait_for_everyone(self: Any) -> None:
    """``PartialState.wait_for_everyone``: a barrier on gatherstore's control plane (within
    ``GATHERSTORE_TIMEOUT``) in a torch.distributed job, accelerate's own elsewhere.

    Raises:
        MismatchError: the other ranks are in a gather (this rank made fewer); names them.
        GatherTimeout: ranks that did not arrive in time (named).
    """
    constants = _import("accelerate.utils.constants", _PIP)
    if self.distributed_type in constants.TORCH_DISTRIBUTED_OPERATION_TYPES and gs.is_distributed():
        gs.barrier(timeout=default_timeout())
    else:
        _ORIGINAL_WAIT[0](self)


_ORIGINAL_WAIT: list[Any] = []


def patch() -> Patch:
    """Make the installed accelerate gather objects through gatherstore.

    Replaces ``gather_object`` in ``accelerate.utils.operations`` and wherever
    accelerate imported it by name (``accelerate.utils``,
    ``accelerate.accelerator``, so ``Accelerator.gather_for_metrics``), and in
    the already imported modules of TRL and transformers that imported it by
    name (TRL's trainers do); tensor gathers stay accelerate's.  Also replaces
    ``PartialState.wait_for_everyone`` (see ``_wait_for_everyone``).

    Raises:
        ImportError: accelerate is not installed.
    """
    _import("accelerate.accelerator", _PIP)  # load every site that binds the original
    replacements = {"gather_object": gather_object}
    handle = patch_module("accelerate.utils.operations", _PIP, replacements, also=_USERS)
    state = _import("accelerate.state", _PIP).PartialState
    if vars(state)["wait_for_everyone"] is not _wait_for_everyone:
        _ORIGINAL_WAIT[:] = [vars(state)["wait_for_everyone"]]
        handle.swap(state, "wait_for_everyone", _wait_for_everyone)
    return handle
