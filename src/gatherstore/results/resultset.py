"""``gs.ResultSet``: results keyed by sample, kept in a store as they come, continued by
a job of any world size after a preemption, read back in key order in bounded memory.

Its neighbours in ``gatherstore.results`` hold the rest: the set's layout in a store
(``layout``), its writer lock (``lock``), the buffer that flushes in the background
(``writer``), the merge in key order (``merge``), and what it uses of the core
(``job``); its collectives go through the one entry (``gatherstore.calls.entry``).
"""

import itertools
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from gatherstore import _config as config
from gatherstore._config import Timeout, to_seconds
from gatherstore._errors import (
    InsufficientMemoryError,
    IntegrityError,
    MismatchError,
    StoreNotSharedError,
)
from gatherstore._time import deadline
from gatherstore.calls.entry import check, collective, group_rank, outside
from gatherstore.results import admin, job, layout, lifetime, lock, merge, order, signing, writer
from gatherstore.results.read import SetReader
from gatherstore.routes.context import Context
from gatherstore.stores.base import Store

__all__ = ["ResultSet"]

_LIST_ENTRY = 8  # bytes a list holds per value it returns


class ResultSet:
    """Results keyed by sample, kept in a persistent store as they are added, so that an
    evaluation stopped at any point (preempted, requeued, killed) is continued by a job of
    any world size, and read back in key order in bounded memory whatever its size.

    Opening a set is a collective: every rank of the job calls ``ResultSet`` with the
    same arguments.  The job becomes the set's writer: a second job that opens it while
    this one lives is refused (see ``Raises``).  Keys are ints or strs (a sample's index
    or id): ints first, in numeric order, then strs.

    Values are buffered by ``add`` (one that cannot be pickled raises ``TypeError``
    there, naming where in it the culprit is) and written in the background as
    create-only chunks, each sealed with ``key`` (a signature) or, without a key, an
    XXH3-128 checksum: every ``flush_every``; by ``flush``; at exit; and on SIGTERM/SIGINT
    before the program's handler or the default action ends the process. A rank killed
    with SIGKILL loses what it added since its last flush.

    A set ends with ``close`` (a collective: this job's run ends, another job may open it
    at once) or ``discard`` (removes it); ``with gs.ResultSet(...) as rs:`` closes it when
    the block ends, and when the block raises, each rank writes what it added and ends its
    run without a collective.  ``flush`` makes what was added durable and keeps the set
    open.

    Args:
        name: the set's name: ``/``-separated parts of letters, digits and
            ``. _ = + -`` (e.g. ``"coco-val/ckpt-1200"``); the set lives under
            ``gatherstore-results/<name>/`` in ``store``.
        store: a store that outlives the job (``file:///shared/dir``, ``redis://``,
            ``s3://``, ``gs://``, ``az://``; ``memory://`` in one process); None: the
            default store (``set_default_store``, else ``GATHERSTORE_STORE``), which
            must outlive the job too.
        key: the signing key, bytes or str, at least 16 bytes (default:
            ``GATHERSTORE_RESULTS_KEY_FILE``, else ``GATHERSTORE_RESULTS_KEY``); it must
            be the same for every job that opens the set.
        flush_every: when a rank writes what it buffered: after so many values (an
            int), bytes (``"8MB"``) or seconds (``"30s"``, a ``timedelta``), or a tuple
            of them (default: the ``GATHERSTORE_FLUSH_*`` settings).
        timeout: bounds each collective: seconds or a ``timedelta`` (default:
            ``GATHERSTORE_TIMEOUT``).
        mode: ``"w"``: every rank of the job (or of ``group``) opens the set to write.
            ``"r"``: open it to read on this process alone, without a collective and
            while a job writes it: ``items`` and ``export`` read what its writers
            flushed; a set that does not exist is not created (``ValueError`` naming the
            sets the store holds).
        group: a set belongs to one process group (None: the default group), whose
            members open it, add to it and gather it together; ranks are the group's
            ranks.  A rank outside the group cannot open it to write (``ValueError``).

    Raises:
        ValueError: a bad name, key, ``flush_every`` or ``mode``; a store that does not
            outlive the job (``tmpdir``, a route, ``memory://`` across processes).
        IntegrityError: the set was written with another signing key, or without one
            where one is given (or the other way round).
        GatherError: another job that is alive writes the set (named); a stale writer's
            set is taken over.
        StoreNotSharedError: a rank cannot see the set rank 0 opened.
        StoreUnavailableError: the store cannot be reached.
        RemoteRankError / GatherTimeout: another rank failed, or did not come in time.

    Examples:
        >>> rs = gs.ResultSet("coco-val/ckpt-1200", store="file:///shared/results")
        >>> for i in rs.pending(range(len(dataset)))[gs.get_rank() :: gs.get_world_size()]:
        ...     rs.add(i, predict(dataset[i]))
        >>> merged = rs.gather(dst=0)  # every stored value in key order; None elsewhere
        >>> rs.close()
    """

    def __init__(
        self,
        name: str,
        *,
        store: str | Store | None = None,
        key: bytes | str | None = None,
        flush_every: Any = None,
        timeout: Timeout = None,
        mode: str = "w",
        group: Any = None,
    ) -> None:
        if mode not in ("w", "r"):
            raise ValueError(f"mode={mode!r}: give 'w' (every rank writes) or 'r' (read here)")
        self._timeout = to_seconds(timeout)
        self._what = f"result set {name!r}"
        check(self._what, group=group)
        if outside(self._what, group):
            raise ValueError(
                f"{self._what}: this rank (global rank {job.rank()}) is not in the group the "
                "set is opened on: open it on the group's members only (or pass mode='r' to "
                "read it)"
            )
        self._group = group if mode == "w" else None
        self._rank = job.rank(self._group)
        self._held: lock.Held | None = None
        self._closed = False
        self._writer: writer.Writer | None = None
        if mode == "r":
            self._open_to_read(name, store, key)
            return
        with collective(f"ResultSet({name!r})", timeout=self._timeout, group=group) as call:
            # what each rank reads of its arguments and settings, checked on every rank at once
            policy = call.agree(lambda: self._arguments(name, store, key, flush_every))
            assert policy is not None
            try:
                opened = json.loads(call.from_root(self._open_on_root))
                self._uid, self._run = str(opened["uid"]), int(opened["run"])
                call.agree(self._check_meta)
            except BaseException:
                if self._held is not None:
                    lock.release(self._held)
                raise
        self._seq = itertools.count()
        self._writer = writer.Writer(self._write_chunk, policy, self._what)
        lifetime.opened(self, drain=self._drain, end=self._end)

    def __enter__(self) -> "ResultSet":
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """Close the set (a collective); on an exception, write what this rank added and
        end its run here, without a collective (the other ranks may not come)."""
        if kind is None:
            self.close()
        elif not self._closed:
            self._end()

    @property
    def group(self) -> Any:
        """The process group the set is open on (None: the default group)."""
        return self._group

    def __repr__(self) -> str:
        state = f"run {self._run}" if self._writer is not None else "open to read"
        return f"<ResultSet {self.name!r} in {self._base}, {state}>"

    # --- opening ----------------------------------------------------------------------------
    def _arguments(self, name: str, store: Any, key: Any, flush_every: Any) -> writer.FlushEvery:
        self.name = layout.check_name(name)
        self._key = signing.resolve(key)
        self._base = job.open_persistent(store)
        self._store = self._base.scoped(layout.prefix(self.name))
        return writer.flush_policy(flush_every)

    def _open_to_read(self, name: str, store: Any, key: Any) -> None:
        """``mode="r"``: this process alone, no collective, no writer's lock; what the
        writers flushed is what it reads, while they go on."""
        self.name = layout.check_name(name)
        self._key = signing.resolve(key)
        self._base = job.open_persistent(store)
        admin.require(self._base, self.name)  # reading never creates
        self._store = self._base.scoped(layout.prefix(self.name))
        meta = layout.open_meta(self._store, self._key, create=False)
        assert meta is not None
        self._uid, self._run = meta.uid, 0

    def _writing(self, verb: str) -> writer.Writer:
        """The set's writer, for ``verb``.

        Raises:
            ValueError: the set is open to read (``mode="r"``).
        """
        if self._writer is None:
            raise ValueError(
                f"{self._what} is open to read (mode='r'): {verb} needs it open to write, "
                "on every rank of the job (mode='w', the default)"
            )
        return self._writer

    def _open_on_root(self) -> bytes:
        meta = layout.open_meta(self._store, self._key, create=True)
        assert meta is not None
        self._held = lock.acquire(
            self._store, f"{self._what} in {self._base}", job.world_size(self._group)
        )
        return json.dumps({"uid": meta.uid, "run": self._held.run}).encode()

    def _check_meta(self) -> None:
        if self._rank == 0:
            return
        meta = layout.open_meta(self._store, self._key, create=False)
        if meta is None:
            raise StoreNotSharedError(
                f"{self._what}: rank {self._rank} cannot see the set rank 0 opened in "
                f"{self._base}; use a store every rank shares (file:///<shared dir>, "
                "redis://, s3://)",
                ranks=[self._rank],
                store=str(self._base),
            )
        if meta.uid != self._uid:
            raise IntegrityError(f"{self._what}: rank {self._rank} sees another set's metadata")

    # --- writing ----------------------------------------------------------------------------
    def add(self, key: Any, value: Any) -> None:
        """Add ``value`` under ``key`` (an int or a str); it is written in the background.

        The set keeps a reference to ``value`` until it is written: do not change it
        after adding it.  Of a key added twice, in one run or across runs, the first
        stored value counts.  A ``value`` that neither pickle nor cloudpickle can pickle
        fails here, in this rank, and is neither buffered nor written; the set goes on.
        The other ranks are not told: a rank that this error ends is stopped with the
        job by its launcher (``gs.launch`` raises ``RemoteRankError`` naming it), else
        their next collective of the set raises a ``GatherError`` naming it within its
        timeout.

        Args:
            key: the sample's key: an int or a str.
            value: its result: anything pickle can encode.

        Raises:
            TypeError: ``key`` is not an int or a str, or ``value`` cannot be pickled
                (the message names the key and where in the value the culprit is, e.g.
                ``value['extra']['mask']``).
            GatherError: the set is closed, or a write in the background failed (e.g.
                StoreUnavailableError; raised once, the values stay buffered and a
                later flush writes them) or dropped values that could no longer be
                pickled (changed after ``add``).
        """
        self._writing("add").add(key, value)

    def flush(self, *, timeout: Timeout = None) -> None:
        """Return once every value this rank added is durable in the store.

        Args:
            timeout: how long the writes may take: seconds or a ``timedelta``; None:
                the set's ``timeout``.

        Raises:
            GatherError: a write failed (e.g. StoreUnavailableError), or the set is closed.
            GatherTimeout: the values were not written within ``timeout``.
        """
        self._writing("flush").flush(self._seconds(timeout))

    def _write_chunk(self, items: list[tuple[order.Key, Any]]) -> int:
        """Write one chunk and its index (in the writer's thread); its bytes."""
        name = layout.chunk_name(self._run, self._rank, next(self._seq))
        try:
            data, index = layout.encode_chunk(items, name, self._key, self._uid)
        except Exception:  # write those that pickle, name the others
            good, error = writer.picklable(items, self._what)
            raise writer.Unstorable(error, self._write_chunk(good) if good else 0) from None
        with deadline(self._timeout):
            self._store.put(f"{layout.CHUNKS}{name}", data.segments)
            self._store.put(f"{layout.INDEX}{name}", index.segments)
        return data.nbytes

    # --- collectives ----------------------------------------------------------------------
    def pending(self, keys: Iterable[Any], *, timeout: Timeout = None) -> list[Any]:
        """The keys of ``keys`` that no run has stored, distinct and in key order, the same
        on every rank (a collective: every rank passes the same ``keys``).

        Every rank's buffered values are written first, so a key added before counts.

        Args:
            keys: the keys to look for (e.g. ``range(len(dataset))``).
            timeout: how long the call may take: seconds or a ``timedelta``; None: the
                set's ``timeout``.

        Returns:
            The keys of ``keys`` not stored yet, distinct, in key order.

        Raises:
            TypeError: a key is not an int or a str (on every rank).
            MismatchError: ranks passed different keys.
            GatherError / GatherTimeout: a write failed, or did not end in time (see
                ``flush``).
            RemoteRankError: another rank failed (named), or did not come in time.
        """
        self._writing("pending")
        with collective(f"{self._what}.pending", **self._call(timeout)) as call:
            wanted = call.agree(lambda: self._flushed(order.sort_keys(keys), call))
            assert wanted is not None
            digests = call.send(order.digest(wanted).encode())
            if len(set(digests)) > 1:
                details = {r: d.decode()[:12] for r, d in enumerate(digests)}
                raise MismatchError(
                    f"{self._what}.pending: ranks passed different keys (digests {details}); "
                    "every rank must pass the same keys",
                    details=details,
                )
            mask = call.from_root(lambda: self._stored_mask(wanted))
        done = np.unpackbits(np.frombuffer(mask, np.uint8), count=len(wanted)).astype(bool)
        if isinstance(wanted, np.ndarray):
            return list(order.unpack(wanted[~done]))
        return [k for k, stored in zip(wanted, done.tolist(), strict=True) if not stored]

    def _flushed(self, out: Any, call: Context) -> Any:
        self._writing("pending").flush(call.deadline.left())
        return out

    def _stored_mask(self, wanted: order.Keys) -> bytes:
        reader = self._reader()
        names, _ = reader.names()
        stored = (keys for _, keys in reader.indexes(names))
        return np.packbits(order.stored_mask(wanted, stored)).tobytes()

    def gather(
        self,
        dst: int | None = None,
        *,
        group_dst: int | None = None,
        timeout: Timeout = None,
        keys: bool = False,
    ) -> list[Any] | None:
        """Every stored value, each key once, in key order, on ``dst``; None elsewhere
        (a collective).  Every rank's buffered values are written first.  With ``keys``,
        (key, value) pairs.

        Args:
            dst: the global rank that gets the values.
            group_dst: the rank within the set's group that gets the values (give
                ``dst`` or ``group_dst``; neither: the group's first rank).
            timeout: how long the call may take: seconds or a ``timedelta``; None: the
                set's ``timeout``.
            keys: (key, value) pairs instead of values.

        Returns:
            On ``dst``, every stored value (or pair), each key once, in key order; None
            on the other ranks.

        Raises:
            ValueError: ``dst`` is not a rank of the set's group.
            InsufficientMemoryError: the values would not fit in ``dst``'s memory (raised on
                every rank before any is read; use ``items`` or ``export``).
            IntegrityError: a chunk is damaged or sealed with another key (on ``dst``).
            GatherError / GatherTimeout: a write failed, or did not end in time (see
                ``flush``).
            RemoteRankError: another rank failed (named), or did not come in time.
        """
        what = f"{self._what}.gather"
        check(what, timeout=timeout)
        root = group_rank(what, self._group, ("dst", dst), ("group_dst", group_dst))
        written = self._writing("gather")
        with collective(what, **self._call(timeout)) as call:
            call.agree(lambda: written.flush(call.deadline.left()))
            planned: dict[str, Any] = {}
            plan = json.loads(call.from_root(lambda: self._plan(planned), root=root))
            if plan["short"]:
                raise InsufficientMemoryError(plan["short"])
            if "infos" not in planned:
                return None
            with deadline(call.deadline.left()):
                found = merge.merged(planned["infos"], self._reader(), 1 << 62)
                return list(found) if keys else [v for _, v in found]

    def _plan(self, planned: dict[str, Any]) -> bytes:
        """On the destination: the chunks, and whether their values fit in memory."""
        reader = self._reader()
        infos = reader.infos(reader.names()[0])
        need = sum(i.nbytes + i.rebuilt + _LIST_ENTRY * i.count for i in infos)
        room = job.headroom()
        planned["infos"] = infos
        short = ""
        if need > room:
            short = (
                f"{self._what}.gather of {need / 2**30:.2f} GiB (its chunks and what unpickling "
                f"them allocates) would not fit on rank {job.rank()}, which has "
                f"{room / 2**30:.2f} GiB free (capped by the memory cgroup): read it with "
                "items() or export() (bounded memory), or raise the job's memory limit"
            )
        return json.dumps({"short": short}).encode()

    def discard(self, *, timeout: Timeout = None) -> None:
        """Remove the set from its store, values buffered included (a collective).

        Args:
            timeout: how long the call may take: seconds or a ``timedelta``; None: the
                set's ``timeout``.

        Raises:
            StoreUnavailableError: the store failed (on every rank).
            RemoteRankError / GatherTimeout: another rank failed, or did not come in time.
        """
        self._writing("discard")
        with collective(f"{self._what}.discard", **self._call(timeout)) as call:
            self._stop(drop=True)
            call.agree(lambda: None)
            call.agree(self._remove, root=0)

    def _remove(self) -> None:
        if self._held is not None:
            lock.stop_beating(self._held)
            self._held = None
        self._base.delete(layout.prefix(self.name))

    def close(self, *, timeout: Timeout = None) -> None:
        """Write what is buffered and end this job's run (a collective): another job may
        then open the set at once.

        Args:
            timeout: how long the call may take: seconds or a ``timedelta``; None: the
                set's ``timeout``.

        Raises:
            GatherError / GatherTimeout: a write failed, or did not end in time (see
                ``flush``).
            RemoteRankError: another rank failed (named), or did not come in time.
        """
        if self._closed or self._writer is None:  # a reader has nothing to end
            self._closed = True
            return
        written = self._writer
        with collective(f"{self._what}.close", **self._call(timeout)) as call:
            call.agree(lambda: written.flush(call.deadline.left()))
            self._stop()
            call.agree(self._release, root=0)

    def _release(self) -> None:
        if self._held is not None:
            lock.release(self._held)
            self._held = None

    def _stop(self, *, drop: bool = False) -> None:
        self._closed = True
        if self._writer is not None:
            self._writer.close(drop=drop)
        lifetime.closed(self)

    # --- reading on one rank ----------------------------------------------------------------
    def items(self, *, read_ahead: int | None = None) -> Iterator[tuple[Any, Any]]:
        """Every stored value with its key, each key once, in key order, streamed on this
        rank alone.  This rank's buffered values are written first (not other ranks').

        Memory: the chunks held open and read ahead stay within ``read_ahead`` bytes plus
        one chunk; chunks that do not fit wait in a temporary file.

        Args:
            read_ahead: the bytes of chunks held open and read ahead (default: what the
                chunks that overlap in key order need, at least
                ``GATHERSTORE_READ_AHEAD``, at most a quarter of the free memory).

        Returns:
            An iterator over the (key, value) pairs.

        Raises:
            IntegrityError: a chunk is damaged or sealed with another key (names it).
            GatherError: a chunk is gone (deleted, or expired), or a value cannot be
                rebuilt here; and the errors of ``flush``.
            ValueError: a negative ``read_ahead``.
        """
        return merge.rows(self._ranges(1, read_ahead)[0])

    def export(
        self,
        path: str | os.PathLike[str],
        *,
        compression: str | None = None,
        read_ahead: int | None = None,
        files: int = 1,
    ) -> int:
        """Write every stored value with its key, in key order, to ``path``: Parquet
        (``.parquet``), Arrow IPC (``.arrow``; both need the ``arrow`` extra) or JSON
        lines (``.jsonl``); streamed, in the memory of ``items``.  A value that is a dict
        is a column per field, another value one ``value`` column; arrays are lists.  The
        file appears whole (written beside it, then renamed).

        Args:
            path: the file to write; its extension says the format.
            compression: Parquet's and Arrow's codec (``"zstd"``, ``"lz4"``, ...); None:
                uncompressed.
            read_ahead: as in ``items``; shared by the readers of ``files`` > 1.
            files: how many files to write at once, one core each.  With N > 1 (Parquet
                or Arrow) ``path`` becomes a folder of N part files, ``part-00000.parquet``,
                ... (``.arrow`` for Arrow; fewer when the set holds fewer than N values),
                each a range of keys, in key order across the parts (``pyarrow.dataset``
                reads the folder as one table).  The folder appears whole too.

        Returns:
            The number of values written.

        Raises:
            ValueError: an unknown extension, values that do not fit the format, a
                ``files`` that is not a positive int, ``files`` > 1 for JSON lines, or
                a ``path`` that is a folder (with ``files`` > 1: one that holds files).
            ImportError: Parquet or Arrow without pyarrow (with the pip line).
            GatherError: the errors of ``items``.
        """
        from gatherstore.results import export

        export.check(path, compression, files)
        ranges = self._ranges(files, read_ahead, columnar=export.columnar(path))
        return export.write(ranges, path, compression, folder=files > 1)

    # --- helpers ---------------------------------------------------------------------------
    def _reader(self) -> SetReader:
        return SetReader(self._store, self._key, self._uid, self._what)

    def _call(self, timeout: Timeout) -> dict[str, Any]:
        """The arguments of one of the set's collectives: its timeout, the set's group."""
        return {"timeout": self._seconds(timeout), "group": self._group}

    def _ranges(
        self, parts: int, read_ahead: int | None, columnar: bool = False
    ) -> list[Iterator[merge.Block]]:
        """The stored values in at most ``parts`` ranges of keys, each merged on its own
        within a share of the read-ahead budget (this rank's buffered values written
        first), in blocks (``columnar``: see ``merge.blocks``); none is read before it
        is iterated.

        Raises:
            ValueError: a negative ``read_ahead``.
        """
        config.read_ahead(read_ahead, 0)  # a bad value fails here
        if self._writer is not None:
            self._writer.flush(self._timeout)
        reader = self._reader()
        names = reader.names()[0]
        if parts == 1:  # the keys are not needed: what the indexes say is
            infos, cuts = reader.infos(names), merge.split([], 1)
        else:
            indexes = list(reader.indexes(names))
            infos, cuts = [info for info, _ in indexes], merge.split(indexes, parts)
        budget = merge.budget(read_ahead, infos, len(cuts))
        return [
            merge.blocks(infos, reader, budget, start, stop, columnar=columnar)
            for start, stop in cuts
        ]

    def _seconds(self, timeout: Timeout) -> float:
        return self._timeout if timeout is None else to_seconds(timeout)

    def _drain(self) -> None:
        """Write what is buffered, errors logged: for a process that stops."""
        if self._writer is not None:
            self._writer.drain(min(self._timeout, lifetime.STOP_FLUSH))

    def _end(self) -> None:
        """End this rank's run here, without a collective: write what is buffered
        (errors logged), stop writing, and release the writer's lock (on rank 0).  At
        exit, at ``gs.shutdown()``, and when a ``with`` block ends in an exception."""
        self._drain()
        self._stop()
        self._release()


ResultSet.__module__ = "gatherstore"  # its public home
