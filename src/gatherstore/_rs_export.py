"""Writing a result set to a file: Parquet, Arrow IPC or JSON lines, streamed in batches.

Rows are (key, value) in key order.  A value that is a dict becomes one column
per field (the first row's fields, in its order); any other value one
``value`` column.  Arrays and tensors of one dtype become Arrow lists (nested
fixed-size lists for their trailing dimensions), built from their memory in
one go per batch; other values go through pyarrow's conversion of Python
objects.  The file is written beside ``path`` and renamed at the end, so a
reader never sees half of it and a failure leaves nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FORMATS", "check", "write"]

FORMATS = (".parquet", ".arrow", ".jsonl")
#: Rows per Arrow record batch (and Parquet row group).
ROWS = 4096
_PIP = "pip install 'gatherstore[arrow]' (pyarrow)"


def _format(path: str | os.PathLike[str]) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(
            f"export to {os.fspath(path)!r}: unknown format {suffix or '(no extension)'!r}; "
            f"name a {', '.join(FORMATS)} file"
        )
    return suffix


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as exc:
        raise ImportError(f"Parquet and Arrow export need pyarrow: {_PIP}", name=exc.name) from None
    return pyarrow


def check(path: str | os.PathLike[str]) -> None:
    """Fail before anything is read when ``path`` cannot be written as asked.

    Raises:
        ValueError: an unknown extension.
        ImportError: Parquet or Arrow without pyarrow (with the pip line).
    """
    if _format(path) != ".jsonl":
        _pyarrow()


def write(rows: Iterable[tuple[Any, Any]], path: str | os.PathLike[str]) -> int:
    """Write ``rows`` to ``path`` in the format its extension names; how many.

    Raises:
        ValueError: an unknown extension, or values the format cannot hold.
        ImportError: Parquet or Arrow without pyarrow.
        OSError: the file cannot be written.
    """
    suffix = _format(path)
    target = Path(path)
    handle, temp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    os.close(handle)
    try:
        count = _jsonl(rows, temp) if suffix == ".jsonl" else _arrow(rows, temp, suffix)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return count


# --- JSON lines --------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """A value JSON can write: arrays and tensors as lists, numpy scalars as numbers."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if type(value).__module__ == "torch" and hasattr(value, "tolist"):
        return value.detach().cpu().tolist()
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("latin-1")
    raise TypeError(f"a {type(value).__name__} cannot be written as JSON")


def _jsonl(rows: Iterable[tuple[Any, Any]], path: str) -> int:
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for key, value in rows:
            try:
                line = json.dumps({"key": key, "value": value}, default=_plain)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"export: the value of key {key!r}: {exc}") from None
            out.write(line + "\n")
            count += 1
    return count


# --- Arrow and Parquet -------------------------------------------------------------------------
def _batches(rows: Iterable[tuple[Any, Any]]) -> Iterator[list[tuple[Any, Any]]]:
    batch: list[tuple[Any, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == ROWS:
            yield batch
            batch = []
    if batch:
        yield batch


def _as_array(value: Any) -> Any:
    """A tensor as a numpy array (other values as they are)."""
    if type(value).__module__ == "torch" and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    return value


def _column(pa: Any, values: list[Any]) -> Any:
    """One Arrow column of ``values``: arrays of one dtype and trailing shape from their
    memory, anything else through pyarrow's conversion."""
    values = [_as_array(v) for v in values]
    first = values[0]
    if isinstance(first, np.ndarray) and all(
        isinstance(v, np.ndarray) and v.dtype == first.dtype and v.shape[1:] == first.shape[1:]
        for v in values
    ):
        if first.ndim == 0:
            return pa.array(np.stack(values))
        flat = np.concatenate([v.reshape(-1) for v in values])
        inner = pa.array(flat)
        for size in reversed(first.shape[1:]):
            inner = pa.FixedSizeListArray.from_arrays(inner, size)
        offsets = np.zeros(len(values) + 1, dtype=np.int32)
        np.cumsum([len(v) for v in values], out=offsets[1:])
        return pa.ListArray.from_arrays(pa.array(offsets), inner)
    return pa.array([v.tolist() if isinstance(v, np.ndarray | np.generic) else v for v in values])


def _table(pa: Any, batch: list[tuple[Any, Any]], fields: list[str] | None) -> Any:
    columns = {"key": pa.array([k for k, _ in batch])}
    values = [v for _, v in batch]
    if fields is None:
        columns["value"] = _column(pa, values)
    else:
        for name in fields:
            if not all(isinstance(v, dict) and name in v for v in values):
                key = next(k for k, v in batch if not (isinstance(v, dict) and name in v))
                raise ValueError(
                    f"export: the value of key {key!r} has no field {name!r}, which the first "
                    "value has: export values of one shape"
                )
            columns[name] = _column(pa, [v[name] for v in values])
    return pa.table(columns)


def _arrow(rows: Iterable[tuple[Any, Any]], path: str, suffix: str) -> int:
    pa = _pyarrow()
    count = 0
    sink: Any = None
    fields: list[str] | None = None
    try:
        for batch in _batches(rows):
            if sink is None:
                first = batch[0][1]
                fields = [str(f) for f in first] if isinstance(first, dict) else None
            try:
                table = _table(pa, batch, fields)
                if sink is None:
                    schema = table.schema
                    sink = (
                        pa.parquet.ParquetWriter(path, schema)
                        if suffix == ".parquet"
                        else pa.ipc.new_file(path, schema)
                    )
                sink.write_table(table.cast(schema))
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                raise ValueError(
                    f"export: values from key {batch[0][0]!r} on do not fit one table "
                    f"({exc}); export values of one shape, or to .jsonl"
                ) from None
            count += len(batch)
    finally:
        if sink is not None:
            sink.close()
    if sink is None:  # an empty set: an empty table with a key column
        table = pa.table({"key": pa.array([], pa.int64())})
        if suffix == ".parquet":
            pa.parquet.write_table(table, path)
        else:
            with pa.ipc.new_file(path, table.schema) as empty:
                empty.write_table(table)
    return count
