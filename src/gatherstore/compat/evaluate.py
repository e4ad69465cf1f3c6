"""HuggingFace evaluate's distributed modules gather through gatherstore instead of lock files.

A module loaded with ``num_process=W, process_id=rank`` writes every process's
predictions and references to an Arrow file in ``cache_dir`` and meets the
others through lock files there, so ``cache_dir`` must be one folder every
process sees, and shared filesystems break the locks ("Couldn't acquire lock",
"Expected to find locked file").  Patched, inside a torch.distributed job whose
world size is ``num_process`` and rank ``process_id``, each process buffers its
rows in memory and ``compute()`` gathers them to process 0 through gatherstore:
no lock, no file, any ``cache_dir``.  A process whose ``compute()`` fails before
the gather (say, its inputs do not match) makes the others raise ``RemoteRankError``
naming it at once, instead of waiting ``timeout`` for it.  Every other module behaves
as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import gatherstore as gs
from gatherstore.compat._patching import Patch, _import, patch_methods
from gatherstore.compat._raising import Raising

__all__ = ["patch"]

#: evaluate's own ``_init_writer``, ``_finalize`` and ``compute``.
_ORIGINAL: dict[str, Callable[..., Any]] = {}
#: ids of the modules whose running ``compute()`` reached the gather.
_gathering: set[int] = set()


def _gathers(module: Any) -> bool:
    """Whether ``module`` is one process of this torch.distributed job, with nothing
    written to a cache file yet (a module that began writing before ``patch()``
    finishes the way it began)."""
    return (
        module.num_process > 1
        and gs.is_distributed()
        and (module.num_process, module.process_id) == (gs.get_world_size(), gs.get_rank())
        and module.cache_file_name is None
    )


def _buffer() -> Any:
    """An empty in-memory Arrow stream (pyarrow comes with evaluate's datasets)."""
    return _import("pyarrow", "evaluate").BufferOutputStream()


def _init_writer(self: Any, timeout: int = 1) -> None:
    """Start this process's writer: in memory and without a rendezvous when it gathers
    through gatherstore, else evaluate's own (a cache file and lock files)."""
    if not _gathers(self):
        _ORIGINAL["_init_writer"](self, timeout)
        return
    from datasets.arrow_writer import ArrowWriter

    self.buf_writer = _buffer()
    self.writer = ArrowWriter(
        features=self.selected_feature_format,
        stream=self.buf_writer,
        writer_batch_size=self.writer_batch_size,
    )


def _finalize(self: Any) -> None:
    """Close the writer and gather every process's rows, in process order, on process 0
    (within the module's ``timeout``); evaluate's own for the modules it keeps.

    Raises:
        ValueError: on process 0, when no process added anything.
        GatherError: gatherstore's errors, e.g. ``GatherTimeout`` naming a process
            that did not reach ``compute()`` within ``timeout``.
    """
    if not _gathers(self):
        _ORIGINAL["_finalize"](self)
        return
    from datasets import Dataset, concatenate_datasets

    part = None
    if self.writer is not None:
        self.writer.finalize()
        part = self.buf_writer.getvalue()
    self.writer = None
    _gathering.add(id(self))
    parts = gs.gather_object(part, 0, timeout=self.timeout)
    if parts is None:
        self.buf_writer = None
        return
    tables = [Dataset.from_buffer(p) for p in parts if p is not None]
    if not tables:
        raise ValueError(
            f"{self.name}: no process added predictions before compute(); "
            "call add() or add_batch() on at least one process first"
        )
    self.data = concatenate_datasets(tables)
    if self.buf_writer is None:  # compute() frees in-memory data only when this is set
        self.buf_writer = _buffer()


def _compute(self: Any, **kwargs: Any) -> Any:
    """evaluate's ``compute()``; when it fails on this process before the gather, the
    failure goes into the gather the others wait in: they raise ``RemoteRankError``
    naming this process, and this process raises its own error."""
    original = _ORIGINAL["compute"]
    if not _gathers(self):
        return original(self, **kwargs)
    _gathering.discard(id(self))
    try:
        return original(self, **kwargs)
    except Exception as exc:
        if id(self) not in _gathering:
            with contextlib.suppress(Exception):  # raises exc here: re-raised below
                gs.gather_object(Raising(exc), 0, timeout=self.timeout)
        raise
    finally:
        _gathering.discard(id(self))


def patch() -> Patch:
    """Make evaluate's distributed modules gather through gatherstore.

    Replaces ``EvaluationModule._init_writer``, ``_finalize`` and ``compute`` (class
    methods, so modules created before ``patch()`` change too, unless they already
    wrote to their cache file).  ``compute()`` returns the same dict on process
    0 and None on the others, as evaluate's own.

    Raises:
        ImportError: evaluate is not installed.
    """
    base = _import("evaluate.module", "evaluate").EvaluationModule
    replacements = {"_init_writer": _init_writer, "_finalize": _finalize, "compute": _compute}
    for name in replacements:
        _ORIGINAL.setdefault(name, vars(base)[name])
    return patch_methods("evaluate.module", "evaluate", "EvaluationModule", replacements)
