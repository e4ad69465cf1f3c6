"""How a result set lies in a store: its metadata, and its chunks with their indexes.

A set named ``coco-val/ckpt-1200`` lives under ``gatherstore-results/coco-val/ckpt-1200/``
(``gatherstore gc`` removes job areas only, never this):

- ``meta``: the set's id, whether it is signed, when it was made;
- ``runs/<run>/claim`` and ``runs/<run>/heartbeat``: its writer jobs (see
  ``gatherstore.results.lock``);
- ``chunks/<run>-<rank>-<seq>``: the values one rank flushed at once, with their
  keys, sorted by key;
- ``index/<run>-<rank>-<seq>``: that chunk's keys, count and size, written after the
  chunk: a chunk without its index is not part of the set (a rank died between
  the two), so a reader never sees a partial flush.

Every value is a frame of the codec (``gatherstore.codec.frames``), sealed with the set's
key (a signature) or without one (an XXH3-128 checksum), bound to the set's id, its kind and
its name: a chunk copied from another set or planted under another name fails its check.
Chunk names sort by (run, rank, seq): the order in which a key added more than once is
decided (the first wins).
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from gatherstore import codec
from gatherstore._errors import IntegrityError
from gatherstore.results import order
from gatherstore.stores.base import Store
from gatherstore.stores.failures import KeyExistsError

__all__ = [
    "CHUNKS",
    "INDEX",
    "META",
    "ROOT",
    "ChunkInfo",
    "Meta",
    "check_name",
    "chunk_name",
    "decode_chunk",
    "decode_index",
    "encode_chunk",
    "open_meta",
    "prefix",
    "verify_chunk",
]

ROOT = "gatherstore-results"
META = "meta"
CHUNKS = "chunks/"
INDEX = "index/"
FORMAT = 1
_NAME_PART = re.compile(r"[A-Za-z0-9_=+-][A-Za-z0-9._=+-]*")
_MAX_NAME = 200


def check_name(name: Any) -> str:
    """``name`` when it can name a set: ``/``-separated parts of letters, digits and
    ``. _ = + -``, none starting with a dot.

    Raises:
        ValueError: another name (the message says what a name may hold).
    """
    if (
        not isinstance(name, str)
        or not name
        or len(name) > _MAX_NAME
        or not all(_NAME_PART.fullmatch(part) for part in name.split("/"))
        or any(part.endswith(".chunks") for part in name.split("/"))
    ):
        raise ValueError(
            f"result set name {name!r} is not valid: use '/'-separated parts of letters, "
            "digits and . _ = + - (none starting with a dot), e.g. 'coco-val/ckpt-1200'"
        )
    return name


def prefix(name: str) -> str:
    """The key prefix of the set ``name`` in its store."""
    return f"{ROOT}/{name}"


def chunk_name(run: int, rank: int, seq: int) -> str:
    """The name of a chunk (and of its index): sorts by run, then rank, then seq."""
    return f"{run:06d}-{rank:06d}-{seq:08d}"


def _bind(uid: str, kind: str, name: str) -> bytes:
    return f"gatherstore result set {uid}\0{kind}\0{name}".encode()


@dataclass(frozen=True)
class Meta:
    """What a set's ``meta`` says: its id, whether it is signed, when it was made."""

    uid: str
    signed: bool
    created: float


def _meta_of(raw: Any, key: bytes | None, where: str) -> Meta:
    """The metadata in ``raw``, checked with ``key``.

    Raises:
        IntegrityError: it was sealed with another key, or without one where ``key``
            is given (or the other way round), or it is damaged.
    """
    bind = _bind("", "meta", META)
    try:
        fields = codec.load(codec.verify(raw, key=key, bind=bind, where=where))
    except IntegrityError as exc:
        if key is None:
            why = "it is signed: open it with its key (key= or GATHERSTORE_RESULTS_KEY(_FILE))"
        else:
            try:
                codec.verify(raw, key=None, bind=bind, where=where)
                why = "it was written without a signing key: open it without one"
            except IntegrityError:
                why = "it was written with another signing key (or its metadata was altered)"
        raise IntegrityError(f"result set {where} is refused: {why}", key=where) from exc
    if not isinstance(fields, dict) or fields.get("format") != FORMAT:
        raise IntegrityError(f"result set {where} has metadata of another format", key=where)
    return Meta(str(fields["uid"]), bool(fields["signed"]), float(fields["created"]))


def open_meta(store: Store, key: bytes | None, *, create: bool) -> Meta | None:
    """The set's metadata, checked with ``key``; with ``create``, made first when the set
    is new (None: it does not exist and ``create`` is False).

    Raises:
        IntegrityError: see ``_meta_of``.
        StoreUnavailableError: the store failed.
    """
    where = f"{store}"
    raw = store.get(META)
    if raw is None and create:
        fields = {"format": FORMAT, "uid": uuid.uuid4().hex, "signed": key is not None}
        fields["created"] = time.time()
        frame = codec.encode(fields).seal(key, _bind("", "meta", META))
        with contextlib.suppress(KeyExistsError):  # made by another job at the same moment
            store.put(META, frame.segments)
        raw = store.get(META)
    return None if raw is None else _meta_of(raw, key, where)


@dataclass(frozen=True)
class ChunkInfo:
    """One flushed chunk, as its index says: its keys' range and count, its bytes, what
    decoding it allocates, and its place in the order of chunks (for duplicates)."""

    name: str
    first: order.Key
    last: order.Key
    count: int
    nbytes: int
    rebuilt: int


def encode_chunk(
    items: list[tuple[order.Key, Any]], name: str, key: bytes | None, uid: str
) -> tuple[codec.Frame, codec.Frame]:
    """The sealed chunk and index frames of ``items`` (sorted by key here; of equal keys
    the one added first stays first).

    Raises:
        Exception: what pickling a value raises.
    """
    if all(type(k) is int for k, _ in items):
        items = sorted(items, key=lambda item: item[0])
    else:
        items = sorted(items, key=lambda item: order.order_key(item[0]))
    keys = order.pack([k for k, _ in items])
    data = codec.encode((keys, [v for _, v in items])).seal(key, _bind(uid, "chunk", name))
    fields = {"keys": keys, "count": len(items), "nbytes": data.nbytes, "rebuilt": data.rebuilt}
    index = codec.encode(fields).seal(key, _bind(uid, "index", name))
    return data, index


def decode_index(
    raw: Any, name: str, key: bytes | None, uid: str, where: str
) -> tuple[ChunkInfo, order.Keys]:
    """A chunk's index: what it says, and the chunk's keys.

    Raises:
        IntegrityError: it is damaged, planted or sealed with another key (names it).
    """
    verified = codec.verify(raw, key=key, bind=_bind(uid, "index", name), where=where)
    fields = codec.load(verified)
    keys = fields["keys"]
    if not fields["count"] or len(keys) != fields["count"]:
        raise IntegrityError(f"{where} lists {len(keys)} keys, not {fields['count']}", key=where)
    first, last = order.unpack(keys[:1])[0], order.unpack(keys[-1:])[0]
    sizes = int(fields["nbytes"]), int(fields["rebuilt"])
    return ChunkInfo(name, first, last, len(keys), *sizes), keys


def verify_chunk(
    raw: Any, info: ChunkInfo, key: bytes | None, uid: str, where: str
) -> codec.Verified:
    """Check a chunk read from the store, before anything in it is unpickled.

    Raises:
        IntegrityError: it is damaged, truncated, planted or sealed with another key.
    """
    return codec.verify(raw, key=key, bind=_bind(uid, "chunk", info.name), where=where)


def decode_chunk(
    verified: codec.Verified, info: ChunkInfo, where: str, columnar: bool = False
) -> tuple[order.Keys, Any]:
    """The keys and values of a verified chunk; with ``columnar``, values that travelled
    as one batch of records come as its ``codec.records.Columns``.

    Raises:
        IntegrityError: it holds another count of values than its index says.
        GatherError: a value cannot be rebuilt in this process.
    """
    keys, values = (codec.load_columns if columnar else codec.load)(verified)
    if len(keys) != info.count or len(values) != info.count:
        raise IntegrityError(f"{where} holds {len(values)} values, its index {info.count}")
    return keys, values
