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
import itertools
import json
import operator
import os
import queue
import tempfile
import threading
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


def check(path: str | os.PathLike[str], compression: str | None = None) -> None:
    """Fail before anything is read when ``path`` cannot be written as asked.

    Raises:
        ValueError: an unknown extension, or a compression for JSON lines.
        ImportError: Parquet or Arrow without pyarrow (with the pip line).
    """
    if _format(path) != ".jsonl":
        _pyarrow()
    elif compression is not None:
        raise ValueError("export: JSON lines take no compression= (compress the file after)")


def write(
    rows: Iterable[tuple[Any, Any]], path: str | os.PathLike[str], compression: str | None = None
) -> int:
    """Write ``rows`` to ``path`` in the format its extension names; how many.
    ``compression`` (Parquet and Arrow: e.g. ``"zstd"``, ``"lz4"``) is none by default.

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
        if suffix == ".jsonl":
            count = _jsonl(rows, temp)
        else:
            count = _arrow(rows, temp, suffix, compression)
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
    it = iter(rows)
    while batch := list(itertools.islice(it, ROWS)):
        yield batch


def _as_array(value: Any) -> Any:
    """A tensor as a numpy array (other values as they are)."""
    if type(value).__module__ == "torch" and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    return value


#: Types whose values pyarrow converts as they are.
_PLAIN = {int, float, str, bool, bytes, type(None)}
_dtype, _ndim = operator.attrgetter("dtype"), operator.attrgetter("ndim")


def _column(pa: Any, values: list[Any]) -> Any:
    """One Arrow column of ``values``: arrays of one dtype and trailing shape from their
    memory, anything else through pyarrow's conversion.  Every look at the values is a
    pass in C (``map``), not a Python loop: a batch holds thousands of rows."""
    kinds = set(map(type, values))
    if any(kind.__module__ == "torch" for kind in kinds):
        values = list(map(_as_array, values))
        kinds = set(map(type, values))
    if kinds <= _PLAIN:
        return pa.array(values)
    if kinds == {np.ndarray}:  # no object made per value: the collector stays idle
        first, count = values[0], len(values)
        if (
            first.dtype.kind in "biufUS"
            and list(map(_dtype, values)).count(first.dtype) == count
            and list(map(_ndim, values)).count(first.ndim) == count
        ):
            if first.ndim == 0:
                return pa.array(np.stack(values))
            with contextlib.suppress(ValueError):  # trailing shapes differ: lists
                return _lists(pa, values, np.concatenate(values))
    return pa.array([v.tolist() if isinstance(v, np.ndarray | np.generic) else v for v in values])


def _lists(pa: Any, values: list[Any], joined: Any) -> Any:
    """The arrays ``values`` (joined: ``joined``) as Arrow lists of their first dimension,
    nested fixed-size lists for the others."""
    column = pa.array(joined.reshape(-1))
    for size in reversed(joined.shape[1:]):
        column = pa.FixedSizeListArray.from_arrays(column, size)
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, values), np.int64, len(values)), out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), column)


def _table(pa: Any, batch: list[tuple[Any, Any]], fields: list[str] | None) -> Any:
    keys, values = zip(*batch, strict=True)
    names, columns = ["key"], [pa.array(keys)]
    if fields is None:
        names.append("value")
        columns.append(_column(pa, list(values)))
    else:
        for name in fields:
            try:
                if set(map(type, values)) != {dict}:
                    raise KeyError(name)
                field = list(map(operator.itemgetter(name), values))
            except KeyError:
                key = next(k for k, v in batch if not (isinstance(v, dict) and name in v))
                raise ValueError(
                    f"export: the value of key {key!r} has no field {name!r}, which the first "
                    "value has: export values of one shape"
                ) from None
            names.append(name)
            columns.append(_column(pa, field))
    return pa.Table.from_arrays(columns, names=names)


class _Sink:
    """Writes tables to a Parquet or Arrow file in a thread of its own (pyarrow encodes
    without the GIL), while the next batch is merged and converted: at most two tables
    wait."""

    def __init__(self, pa: Any, path: str, suffix: str, compression: str | None) -> None:
        self.pa, self.path, self.suffix, self.compression = pa, path, suffix, compression
        self.tables: queue.Queue[Any] = queue.Queue(maxsize=2)
        self.error: BaseException | None = None
        self.schema: Any = None
        self.thread = threading.Thread(target=self._run, name="gatherstore-export", daemon=True)
        self.thread.start()

    def _open(self, schema: Any) -> Any:
        pa = self.pa
        if self.suffix == ".parquet":
            return pa.parquet.ParquetWriter(
                self.path, schema, compression=self.compression or "none", use_dictionary=False
            )
        options = pa.ipc.IpcWriteOptions(compression=self.compression)
        return pa.ipc.new_file(self.path, schema, options=options)

    def _run(self) -> None:
        writer: Any = None
        try:
            while (table := self.tables.get()) is not None:
                if writer is None:
                    writer = self._open(table.schema)
                writer.write_table(table)
        except BaseException as exc:
            self.error = exc
            while self.tables.get() is not None:  # let the producer finish
                continue
        finally:
            if writer is not None:
                writer.close()

    def put(self, table: Any) -> None:
        """Queue ``table`` (cast to the first table's schema).

        Raises:
            the error of a write that failed.
        """
        if self.error is not None:
            raise self.error
        if self.schema is None:
            self.schema = table.schema
        self.tables.put(table.cast(self.schema))

    def close(self) -> None:
        """Write what is queued and close the file.

        Raises:
            the error of a write that failed.
        """
        self.tables.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def _arrow(rows: Iterable[tuple[Any, Any]], path: str, suffix: str, compression: str | None) -> int:
    pa = _pyarrow()
    count = 0
    fields: list[str] | None = None
    sink = _Sink(pa, path, suffix, compression)
    try:
        for batch in _batches(rows):
            if not count:
                first = batch[0][1]
                fields = [str(f) for f in first] if isinstance(first, dict) else None
            try:
                sink.put(_table(pa, batch, fields))
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                raise ValueError(
                    f"export: values from key {batch[0][0]!r} on do not fit one table "
                    f"({exc}); export values of one shape, or to .jsonl"
                ) from None
            count += len(batch)
        if not count:  # an empty set: an empty table with a key column
            sink.put(pa.table({"key": pa.array([], pa.int64())}))
    finally:
        sink.close()
    return count
