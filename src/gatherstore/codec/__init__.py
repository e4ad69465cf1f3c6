"""The codec: an object encoded into frames or parts, decoded whole or in chunks, verified.

Its interface is what this package exports, and the rest of gatherstore uses nothing
else of it:

- ``encode(obj) -> Frame``: one rank's object as a frame (pickle 5, out-of-band
  regions: record batches as columns, array and tensor storage spans, CUDA tensors
  through pinned staging); ``Frame.seal`` signs or checksums it for a place;
  ``duplicate`` is a decoded copy.  An object that cannot be pickled raises pickle's
  error, its message naming where in the object the culprit is (``codec.culprit``).
- ``Chunks.first(obj)``: a long list or dict as a run of chunks, each a frame, encoded
  while the earlier ones travel; ``Assembly`` rebuilds them in order on the receiver.
- ``verify(data) -> Verified`` checks a part's digest (XXH3-128, or keyed BLAKE3) and
  binding; ``load(verified)`` rebuilds its object; ``decode`` is both;
  ``load_columns(verified)`` leaves a top-level list of records as its columns
  (``records.Columns``), for what reads a field at a time; ``rebuilding(verified, f)``
  runs what rebuilds them later as ``load`` runs it.
- ``check_picklable(obj, root)`` asks, cheaply and before encoding, whether ``obj`` can
  be pickled; raises pickle's error, naming the culprit, when it cannot.

``release_pinned()`` frees the pinned memory CUDA tensors left through (``gs.shutdown``).
The codec knows no store and no route.

Parts written before the codec had a package of its own name its modules by their old
names (``gatherstore._records``, ...) inside their pickle streams; those names stay
importable, as what they now are, so that such parts, kept in a result set, still load.
"""

import sys as _sys

from gatherstore.codec import columns, frames, records, storage
from gatherstore.codec.as_columns import load_columns
from gatherstore.codec.chunks import Assembly, Chunks, Unchunkable
from gatherstore.codec.culprit import check_picklable
from gatherstore.codec.frames import (
    Frame,
    Verified,
    collection_paused,
    decode,
    duplicate,
    encode,
    load,
    rebuilding,
    verify,
)
from gatherstore.codec.records import Columns
from gatherstore.codec.staging import release as release_pinned

__all__ = [
    "Assembly",
    "Chunks",
    "Columns",
    "Frame",
    "Unchunkable",
    "Verified",
    "check_picklable",
    "collection_paused",
    "decode",
    "duplicate",
    "encode",
    "load",
    "load_columns",
    "rebuilding",
    "release_pinned",
    "verify",
]

#: Old module names that parts written before carry (see above), and what they now are.
_FORMER = {
    "gatherstore._columns": columns,
    "gatherstore._records": records,
    "gatherstore._serialize": frames,
    "gatherstore._storage": storage,
}
for _name, _module in _FORMER.items():
    _sys.modules.setdefault(_name, _module)
