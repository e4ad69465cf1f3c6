"""Writing a result set to a file: Parquet, Arrow IPC or JSON lines, streamed in batches;
or to a folder of Parquet or Arrow part files, written at once.

Rows are (key, value) in key order.  A value that is a dict becomes one column
per field (the first row's fields, in its order); any other value one
``value`` column.  Arrays and tensors of one dtype become Arrow lists (nested
fixed-size lists for their trailing dimensions), built from their memory in
one go per batch; ints, floats, bools, strs and bytes from buffers made in one
pass (pyarrow's conversion of Python objects would first import pandas, a
quarter of a second); other values go through pyarrow's conversion.

The rows go in batches of about :data:`BATCH_BYTES` of Arrow data, each a Parquet
row group: the first of :data:`FIRST_ROWS` rows, the next sized by the bytes a row
took.  One thread merges and converts a batch while another writes the one before
(pyarrow encodes without the GIL, on one thread per file).  With a folder, each
range of keys (``ResultSet.export(files=N)``) is merged, converted and written to a
part file of its own by threads of its own, all at once: N files use N cores.  The
file (or folder) is written beside ``path`` and renamed at the end, so a reader
never sees half of it and a failure leaves nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import operator
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FORMATS", "PART", "check", "write"]

FORMATS = (".parquet", ".arrow", ".jsonl")
#: The name of part ``i`` of a folder (``.format(i, suffix)``).
PART = "part-{:05d}{}"
#: Rows of a range's first batch, before the bytes of a row are known.
FIRST_ROWS = 1024
#: Arrow bytes a batch (a Parquet row group) aims at, and its most rows: big enough that
#: a row group's overhead is small, small enough that the batch written after the last
#: one is converted (the pipeline's tail) is a small part of an export.
BATCH_BYTES = 8 << 20
MAX_ROWS = 1 << 20
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


def check(path: str | os.PathLike[str], compression: str | None = None, files: int = 1) -> None:
    """Fail before anything is read when ``path`` cannot be written as asked: ``files``
    > 1 writes a folder of that many part files.

    Raises:
        ValueError: an unknown extension, a compression for JSON lines, a ``files`` that
            is not a positive int, or more than one file of JSON lines; a ``path`` that
            is a folder (with ``files`` > 1: a folder that holds something).
        ImportError: Parquet or Arrow without pyarrow (with the pip line).
    """
    if type(files) is not int or files < 1:
        raise ValueError(
            f"export: files={files!r} is not a positive int: pass files=1 for one file, or "
            "files=N (N > 1) for a folder of N part files written at once"
        )
    suffix = _format(path)
    if suffix != ".jsonl":
        _pyarrow()
    elif compression is not None:
        raise ValueError("export: JSON lines take no compression= (compress the file after)")
    elif files > 1:
        raise ValueError(
            f"export: files={files} writes Parquet or Arrow part files; JSON lines go to one "
            "file: pass files=1, or name a .parquet or .arrow path"
        )
    target = Path(path)
    if target.is_dir() and (files == 1 or any(target.iterdir())):
        raise ValueError(
            f"export: {os.fspath(path)!r} is a folder"
            + (" that holds files" if files > 1 else "")
            + ": remove it, or name another path"
        )


def write(
    ranges: Sequence[Iterable[tuple[Any, Any]]],
    path: str | os.PathLike[str],
    compression: str | None = None,
    *,
    folder: bool = False,
) -> int:
    """Write the rows of ``ranges`` (ranges of keys, in key order) to ``path`` in the format
    its extension names: one range to one file, or with ``folder`` each range to a part
    file of the folder ``path`` (``PART``), all at once; how many rows.  ``compression``
    (Parquet and Arrow: e.g. ``"zstd"``, ``"lz4"``) is none by default.

    Raises:
        ValueError: an unknown extension, or values the format cannot hold.
        ImportError: Parquet or Arrow without pyarrow.
        OSError: the file cannot be written.
    """
    suffix = _format(path)
    target = Path(path)
    if folder:
        temp = tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent or ".")
        outputs = [os.path.join(temp, PART.format(i, suffix)) for i in range(len(ranges))]
    else:
        handle, temp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
        os.close(handle)
        outputs = [temp]
    try:
        if suffix == ".jsonl":
            count = sum(_jsonl(rows, out) for rows, out in zip(ranges, outputs, strict=True))
        else:
            count = _arrow(ranges, outputs, suffix, compression)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            if folder:
                shutil.rmtree(temp)
            else:
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
def _as_array(value: Any) -> Any:
    """A tensor as a numpy array (other values as they are)."""
    if type(value).__module__ == "torch" and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    return value


#: Types whose values pyarrow converts as they are.
_PLAIN = {int, float, str, bool, bytes, type(None)}
#: Python scalars of one type, made a numpy array first: the dtype pyarrow would choose.
_SCALARS = {int: np.int64, float: np.float64, bool: np.bool_}
_dtype, _ndim = operator.attrgetter("dtype"), operator.attrgetter("ndim")


def _column(pa: Any, values: list[Any]) -> Any:
    """One Arrow column of ``values``: arrays of one dtype and trailing shape from their
    memory, scalars of one type from a numpy array or a buffer, anything else through
    pyarrow's conversion.  Every look at the values is a pass in C (``map``), not a
    Python loop: a batch holds thousands of rows."""
    kinds = set(map(type, values))
    if any(kind.__module__ == "torch" for kind in kinds):
        values = list(map(_as_array, values))
        kinds = set(map(type, values))
    if len(kinds) == 1 and (kind := next(iter(kinds))) in _SCALARS:
        with contextlib.suppress(OverflowError):  # an int beyond int64: pyarrow's choice
            return _numbers(pa, np.array(values, dtype=_SCALARS[kind]))
    if kinds == {str} or kinds == {bytes}:
        return _strings(pa, values)
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
                return _numbers(pa, np.stack(values))
            with contextlib.suppress(ValueError):  # trailing shapes differ: lists
                return _lists(pa, values, np.concatenate(values))
    return pa.array([v.tolist() if isinstance(v, np.ndarray | np.generic) else v for v in values])


def _numbers(pa: Any, array: Any) -> Any:
    """A 1-d numpy array as an Arrow array: numbers and bools from their memory (what
    ``pa.array`` would make, without the import of pandas it starts with), others
    through ``pa.array``."""
    if array.dtype.kind not in "biuf":
        return pa.array(array)
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
    data = np.packbits(array, bitorder="little") if array.dtype.kind == "b" else array
    kind = pa.from_numpy_dtype(array.dtype)
    return pa.Array.from_buffers(kind, len(array), [None, pa.py_buffer(data)])


def _strings(pa: Any, values: list[Any]) -> Any:
    """Strs (or bytes) as one Arrow string (binary) array, from their bytes joined."""
    text = type(values[0]) is str
    encoded = list(map(str.encode, values)) if text else values
    data = b"".join(encoded)
    if len(data) >= 1 << 31:  # beyond 32-bit offsets: pyarrow's conversion
        return pa.array(values)
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, encoded), np.int32, len(values)), out=offsets[1:])
    kind = pa.string() if text else pa.binary()
    return pa.Array.from_buffers(
        kind, len(values), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def _lists(pa: Any, values: list[Any], joined: Any) -> Any:
    """The arrays ``values`` (joined: ``joined``) as Arrow lists of their first dimension,
    nested fixed-size lists for the others."""
    column = _numbers(pa, joined.reshape(-1))
    for size in reversed(joined.shape[1:]):
        column = pa.FixedSizeListArray.from_arrays(column, size)
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, values), np.int64, len(values)), out=offsets[1:])
    return pa.LargeListArray.from_arrays(_numbers(pa, offsets), column)


def _table(pa: Any, batch: list[tuple[Any, Any]], fields: list[str] | None) -> Any:
    """The rows ``batch`` as an Arrow table: a key column, and a column per field of
    ``fields`` (values that are dicts) or a ``value`` column.

    Raises:
        ValueError: a value without one of ``fields`` (its key named), or values that do
            not fit one column (the batch's first key named).
    """
    keys = list(map(operator.itemgetter(0), batch))
    values = list(map(operator.itemgetter(1), batch))
    names, columns = ["key"], [keys]
    if fields is None:
        names.append("value")
        columns.append(values)
    else:
        dicts = set(map(type, values)) == {dict}
        for name in fields:
            try:
                if not dicts:
                    raise KeyError(name)
                columns.append(list(map(operator.itemgetter(name), values)))
            except KeyError:
                key = next(k for k, v in batch if not (isinstance(v, dict) and name in v))
                raise ValueError(
                    f"export: the value of key {key!r} has no field {name!r}, which the first "
                    "value has: export values of one shape"
                ) from None
            names.append(name)
    try:
        return pa.Table.from_arrays([_column(pa, c) for c in columns], names=names)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise _mixed(keys[0], exc) from None


def _mixed(key: Any, exc: Exception) -> ValueError:
    return ValueError(
        f"export: values from key {key!r} on do not fit one table ({exc}); export values "
        "of one shape, or to .jsonl"
    )


class _Batches:
    """The rows of one range in batches of about :data:`BATCH_BYTES` of Arrow data: the
    first of :data:`FIRST_ROWS` rows, each next one sized by the bytes a row took."""

    def __init__(self, rows: Iterable[tuple[Any, Any]]) -> None:
        self.rows: Iterator[tuple[Any, Any]] = iter(rows)
        self.size = FIRST_ROWS

    def take(self) -> list[tuple[Any, Any]]:
        """The next batch (empty: the range is over)."""
        return list(itertools.islice(self.rows, self.size))

    def sized(self, table: Any) -> None:
        """Size the next batches by the bytes a row of ``table`` took."""
        per_row = table.nbytes / max(table.num_rows, 1)
        self.size = int(min(max(BATCH_BYTES // max(per_row, 1), 1), MAX_ROWS))

    def close(self) -> None:
        """Let go of the rows not read (a merge's chunks and threads)."""
        close = getattr(self.rows, "close", None)
        if close is not None:
            close()


@dataclasses.dataclass(frozen=True)
class _Files:
    """What the files of one export share: pyarrow, the format, the schema every file
    has, the fields of the values (None: not dicts), and the event that stops them all."""

    pa: Any
    suffix: str
    compression: str | None
    schema: Any
    fields: list[str] | None
    stop: threading.Event


class _Sink:
    """Writes tables to one Parquet or Arrow file in a thread of its own (pyarrow encodes
    without the GIL), while the next batch is merged and converted: at most two tables
    wait.  The file is made at once: a range without rows is a file of the schema alone."""

    def __init__(self, files: _Files, path: str) -> None:
        self.files, self.path = files, path
        self.tables: queue.Queue[Any] = queue.Queue(maxsize=2)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="gatherstore-export", daemon=True)
        self.thread.start()

    def _open(self) -> Any:
        pa, schema, compression = self.files.pa, self.files.schema, self.files.compression
        if self.files.suffix == ".parquet":
            return pa.parquet.ParquetWriter(
                self.path, schema, compression=compression or "none", use_dictionary=False
            )
        return pa.ipc.new_file(
            self.path, schema, options=pa.ipc.IpcWriteOptions(compression=compression)
        )

    def _run(self) -> None:
        writer: Any = None
        try:
            writer = self._open()
            rows = {"row_group_size": MAX_ROWS} if self.files.suffix == ".parquet" else {}
            while (table := self.tables.get()) is not None:
                writer.write_table(table, **rows)  # a Parquet row group per table
        except BaseException as exc:
            self.error = exc
            while self.tables.get() is not None:  # let the producer finish
                continue
        finally:
            if writer is not None:
                writer.close()

    def put(self, table: Any, first_key: Any) -> None:
        """Queue ``table`` (cast to the schema).

        Raises:
            ValueError: it cannot be cast (``first_key``, its first key, named).
            the error of a write that failed.
        """
        if self.error is not None:
            raise self.error
        pa = self.files.pa
        if table.schema != self.files.schema:
            try:
                table = table.cast(self.files.schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                raise _mixed(first_key, exc) from None
        self.tables.put(table)

    def close(self) -> None:
        """Write what is queued and close the file.

        Raises:
            the error of a write that failed.
        """
        self.tables.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def _first(pa: Any, ranges: list[_Batches]) -> tuple[int, Any, Any, list[str] | None]:
    """The first rows' range, table, first key and fields (those of the first value; None:
    it is not a dict).  An empty set's table holds an empty key column."""
    for i, batches in enumerate(ranges):
        batch = batches.take()
        if batch:
            first = batch[0][1]
            fields = [str(f) for f in first] if isinstance(first, dict) else None
            table = _table(pa, batch, fields)
            batches.sized(table)
            return i, table, batch[0][0], fields
    empty = pa.Table.from_arrays([_numbers(pa, np.empty(0, np.int64))], names=["key"])
    return 0, empty, None, None


def _part(files: _Files, batches: _Batches, path: str, head: Any = None, key: Any = None) -> int:
    """Write one range to ``path``: ``head`` (its first table, of first key ``key``), then
    its batches, converted here and written by a sink; the rows written."""
    count = 0
    try:
        sink = _Sink(files, path)
        try:
            if head is not None:
                sink.put(head, key)
                count, head = head.num_rows, None
            while not files.stop.is_set() and (batch := batches.take()):
                table = _table(files.pa, batch, files.fields)
                batches.sized(table)
                sink.put(table, batch[0][0])
                count += len(batch)
        finally:
            sink.close()
    finally:
        batches.close()
    return count


def _arrow(
    ranges: Sequence[Iterable[tuple[Any, Any]]],
    paths: list[str],
    suffix: str,
    compression: str | None,
) -> int:
    """Write each range to its path, all at once (one range: from this thread); the rows.
    The first failure stops the others, and is raised."""
    pa = _pyarrow()
    batches = [_Batches(rows) for rows in ranges]
    try:
        where, head, key, fields = _first(pa, batches)
    except BaseException:
        for each in batches:
            each.close()
        raise
    files = _Files(pa, suffix, compression, head.schema, fields, threading.Event())
    heads = [(head, key) if i == where else (None, None) for i in range(len(ranges))]
    if len(ranges) == 1:
        return _part(files, batches[0], paths[0], *heads[0])
    with ThreadPoolExecutor(len(ranges), thread_name_prefix="gatherstore-export") as pool:
        jobs = zip(batches, paths, heads, strict=True)
        futures = [pool.submit(_part, files, rows, path, *first) for rows, path, first in jobs]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            files.stop.set()  # all done; or one failed, and the others end too
    for future in futures:
        if (error := future.exception()) is not None:
            raise error
    return sum(future.result() for future in futures)
