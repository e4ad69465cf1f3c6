"""Writing a result set to a file: Parquet, Arrow IPC or JSON lines, streamed in batches;
or to a folder of Parquet or Arrow part files, written at once.

Rows are (key, value) in key order.  A value that is a dict becomes one column
per field (the first row's fields, in its order); any other value one
``value`` column.  Arrays and tensors of one dtype become Arrow lists (nested
fixed-size lists for their trailing dimensions), built from their memory in
one go per batch; ints, floats, bools, strs and bytes from buffers made in one
pass (pyarrow's conversion of Python objects would first import pandas, a
quarter of a second); other values go through pyarrow's conversion.

For Parquet and Arrow the merge holds chunks of records as their columns
(``codec.load_columns``): a block of keys whose chunks all do is converted a field at
a time, straight from them (arrays of one shape gathered into one array, in key
order), with no record rebuilt per row; other blocks go row by row, into the same
columns.  The tables go in batches of about :data:`BATCH_BYTES` of Arrow data, each a
Parquet row group or Arrow record batch (rows: the first table of :data:`FIRST_ROWS`,
made from rows, whose types make the schema; the next sized by the bytes a row
took); the first table is written at once, so that the writer starts while the next
are read.  One thread merges and converts while another writes
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
from collections.abc import Generator, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

from gatherstore.results import merge

__all__ = ["FORMATS", "PART", "check", "columnar", "write"]

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


def columnar(path: str | os.PathLike[str]) -> bool:
    """Whether the format of ``path`` takes its values a field at a time (Parquet,
    Arrow): the merge then holds chunks of records as their columns."""
    return _format(path) != ".jsonl"


def write(
    ranges: Sequence[Iterable[merge.Block]],
    path: str | os.PathLike[str],
    compression: str | None = None,
    *,
    folder: bool = False,
) -> int:
    """Write the rows of ``ranges`` (ranges of keys, in key order, as a merge's blocks) to
    ``path`` in the format its extension names: one range to one file, or with
    ``folder`` each range to a part file of the folder ``path`` (``PART``), all at once;
    how many rows.  ``compression`` (Parquet and Arrow: e.g. ``"zstd"``, ``"lz4"``) is
    none by default.

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
            jobs = zip(ranges, outputs, strict=True)
            count = sum(_jsonl(merge.rows(iter(blocks)), out) for blocks, out in jobs)
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


def _jsonl(rows: Iterator[tuple[Any, Any]], path: str) -> int:
    count = 0
    with contextlib.closing(rows), open(path, "w", encoding="utf-8") as out:  # type: ignore[type-var]
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
                joined = np.concatenate(values)
                return _lists(pa, np.fromiter(map(len, values), np.int64, count), joined)
    return pa.array([v.tolist() if isinstance(v, np.ndarray | np.generic) else v for v in values])


def _stacked(pa: Any, rows: Any) -> Any:
    """One Arrow column of the array ``rows``, a row per value: the column ``_column``
    makes of its rows as arrays, from its memory at once."""
    if rows.dtype.kind not in "biufUS" or not rows.size:  # as ``_column`` takes them
        return _column(pa, list(rows))
    if rows.ndim == 1:
        return _numbers(pa, rows)
    lengths = np.full(len(rows), rows.shape[1], dtype=np.int64)
    return _lists(pa, lengths, rows.reshape(-1, *rows.shape[2:]))


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


def _lists(pa: Any, lengths: Any, joined: Any) -> Any:
    """Arrays of first dimensions ``lengths``, joined along it in ``joined``, as Arrow lists
    of their first dimension, nested fixed-size lists for the others."""
    column = _numbers(pa, joined.reshape(-1))
    for size in reversed(joined.shape[1:]):
        column = pa.FixedSizeListArray.from_arrays(column, size)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
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


def _columns_table(pa: Any, keys: Any, fields: list[str], values: list[Any]) -> Any:
    """The table of ``keys`` and the values of each of ``fields`` (``merge.Block.fields``:
    arrays of rows, or lists), the table ``_table`` makes of the same rows."""
    first = keys[0].item() if isinstance(keys, np.ndarray) else keys[0]
    try:
        key = _numbers(pa, keys) if isinstance(keys, np.ndarray) else _column(pa, keys)
        columns = [_stacked(pa, v) if isinstance(v, np.ndarray) else _column(pa, v) for v in values]
        return pa.Table.from_arrays([key, *columns], names=["key", *fields])
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise _mixed(first, exc) from None


def _mixed(key: Any, exc: Exception) -> ValueError:
    return ValueError(
        f"export: values from key {key!r} on do not fit one table ({exc}); export values "
        "of one shape, or to .jsonl"
    )


#: ``_Tables.fields`` before the first value is seen.
_UNKNOWN: Any = object()


class _Tables:
    """The tables of one range's blocks, with the first key of each: the first of
    :data:`FIRST_ROWS` rows (whose types make the file's schema, as many rows as
    before there were columns); then a block whose chunks hold columns
    (``merge.Block.fields``) as one table, taken from them, and the rows of the others
    in tables of about :data:`BATCH_BYTES`, sized by the bytes a row took.

    ``fields``: the fields of the values (None: they are not dicts), as the first value
    says; all ranges of an export take the first range's.
    """

    def __init__(self, pa: Any, blocks: Iterable[merge.Block]) -> None:
        self.pa, self.blocks = pa, iter(blocks)
        self.fields: list[str] | None = _UNKNOWN
        self.rows: list[tuple[Any, Any]] = []
        self.size = FIRST_ROWS
        self.found = self._tables()

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return self.found

    def _tables(self) -> Generator[tuple[Any, Any], None, None]:
        made = False  # the first table: from rows
        for block in self.blocks:
            fields = self.fields
            if made and isinstance(fields, list) and (found := block.fields(fields)):
                if self.rows:
                    yield self._batch()
                keys, values = found
                if len(keys):
                    first = keys[0].item() if isinstance(keys, np.ndarray) else keys[0]
                    yield _columns_table(self.pa, keys, fields, values), first
                continue
            rows = block.rows()
            while batch := list(itertools.islice(rows, self.size - len(self.rows))):
                self.rows += batch
                if len(self.rows) >= self.size:
                    made = True
                    yield self._batch()
        if self.rows:
            yield self._batch()

    def _batch(self) -> tuple[Any, Any]:
        """The table of the rows taken; the next ones sized by the bytes a row took."""
        batch, self.rows = self.rows, []
        if self.fields is _UNKNOWN:
            first = batch[0][1]
            self.fields = [str(f) for f in first] if isinstance(first, dict) else None
        table = _table(self.pa, batch, self.fields)
        per_row = table.nbytes / max(table.num_rows, 1)
        self.size = int(min(max(BATCH_BYTES // max(per_row, 1), 1), MAX_ROWS))
        return table, batch[0][0]

    def close(self) -> None:
        """Let go of the blocks not read (a merge's chunks and threads)."""
        self.found.close()
        close = getattr(self.blocks, "close", None)
        if close is not None:
            close()


@dataclasses.dataclass(frozen=True)
class _Files:
    """What the files of one export share: pyarrow, the format, the schema every file
    has, and the event that stops them all."""

    pa: Any
    suffix: str
    compression: str | None
    schema: Any
    stop: threading.Event


class _Sink:
    """Writes tables to one Parquet or Arrow file in a thread of its own (pyarrow encodes
    without the GIL), while the next ones are merged and converted: the tables put are
    gathered into batches of about :data:`BATCH_BYTES` (each a Parquet row group; the
    first queued at once), and at most two batches wait besides the one gathered.  The
    file is made at once: a range without rows is a file of the schema alone."""

    def __init__(self, files: _Files, path: str) -> None:
        self.files, self.path = files, path
        self.tables: queue.Queue[Any] = queue.Queue(maxsize=2)
        self.pending: list[Any] = []
        self.nbytes = 0
        self.started = False
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
        """Add ``table`` (cast to the schema) to the batch being gathered; queue the
        batch once it holds :data:`BATCH_BYTES` (a larger table: in slices of about as
        many).

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
        rows = max(int(table.num_rows * BATCH_BYTES / max(table.nbytes, 1)), 1)
        for start in range(0, table.num_rows, rows):
            piece = table.slice(start, rows)
            if self.nbytes + piece.nbytes > BATCH_BYTES:
                self._queue()
            self.pending.append(piece)
            self.nbytes += piece.nbytes
        if self.nbytes >= BATCH_BYTES or not self.started:  # the first at once: the
            self.started = True  # writer starts while the next ones are read
            self._queue()

    def _queue(self) -> None:
        """Queue the tables gathered as one batch (for Arrow IPC, one record batch: it
        writes each chunk of a table as one)."""
        if self.pending:
            pending, self.pending, self.nbytes = self.pending, [], 0
            batch = pending[0] if len(pending) == 1 else self.files.pa.concat_tables(pending)
            if self.files.suffix == ".arrow" and len(pending) > 1:
                batch = batch.combine_chunks()
            self.tables.put(batch)

    def close(self) -> None:
        """Write what is gathered and queued, and close the file.

        Raises:
            the error of a write that failed.
        """
        try:
            if self.error is None:
                self._queue()
        finally:
            self.tables.put(None)
            self.thread.join()
        if self.error is not None:
            raise self.error


def _first(ranges: list[_Tables]) -> tuple[int, Any, Any]:
    """The first table's range, the table and its first key; the fields of the values
    (those of the first value) given to every range.  An empty set's table holds an
    empty key column."""
    for i, tables in enumerate(ranges):
        for table, key in tables:
            for each in ranges:
                each.fields = tables.fields
            return i, table, key
    pa = ranges[0].pa
    for each in ranges:
        each.fields = None
    empty = pa.Table.from_arrays([_numbers(pa, np.empty(0, np.int64))], names=["key"])
    return 0, empty, None


def _part(files: _Files, tables: _Tables, path: str, head: Any = None, key: Any = None) -> int:
    """Write one range to ``path``: ``head`` (its first table, of first key ``key``), then
    its tables, converted here and written by a sink; the rows written."""
    count = 0
    try:
        sink = _Sink(files, path)
        try:
            if head is not None:
                sink.put(head, key)
                count, head = head.num_rows, None
            for table, first in tables:
                if files.stop.is_set():
                    break
                sink.put(table, first)
                count += table.num_rows
        finally:
            sink.close()
    finally:
        tables.close()
    return count


def _arrow(
    ranges: Sequence[Iterable[merge.Block]],
    paths: list[str],
    suffix: str,
    compression: str | None,
) -> int:
    """Write each range to its path, all at once (one range: from this thread); the rows.
    The first failure stops the others, and is raised."""
    pa = _pyarrow()
    tables = [_Tables(pa, blocks) for blocks in ranges]
    try:
        where, head, key = _first(tables)
    except BaseException:
        for each in tables:
            each.close()
        raise
    files = _Files(pa, suffix, compression, head.schema, threading.Event())
    heads = [(head, key) if i == where else (None, None) for i in range(len(ranges))]
    if len(ranges) == 1:
        return _part(files, tables[0], paths[0], *heads[0])
    with ThreadPoolExecutor(len(ranges), thread_name_prefix="gatherstore-export") as pool:
        jobs = zip(tables, paths, heads, strict=True)
        futures = [pool.submit(_part, files, each, path, *first) for each, path, first in jobs]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            files.stop.set()  # all done; or one failed, and the others end too
    for future in futures:
        if (error := future.exception()) is not None:
            raise error
    return sum(future.result() for future in futures)
