"""Reading one block by value: its fastest copy into the caller's buffer, as stored or decoded.

A reader names the codecs it decodes itself (``accept``): a copy encoded with one of them is
handed over as stored (smaller; the caller learns the codec id), any other is decoded here. A
copy that fails its checksum or its decode is dropped (counted) and the next copy tried; a hit
on a slower tier is promoted, from the payload just read (no second read or decode). A payload
decoded here is read in place when it is one piece of the CPU arena (the pin holds it), else into
a buffer of this module's, never the cascade's scratch, which a promotion's demotions reuse.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from kvstore.buffers import SCRATCH_KEEP_BYTES, Scratch
from kvstore.errors import BlockCorrupt, CodecError
from kvstore.store.cascade import Cascade

# Not the cascade's scratch: a read payload must outlive the promotion it feeds, which can demote
# another block through the cascade's buffer.
_payloads = Scratch(trim_above=SCRATCH_KEEP_BYTES, aligned=True, min_bytes=1 << 20)   # one per thread


def read_block(cascade: Cascade, namespace_id: bytes, block_hash: bytes, dst: np.ndarray,
               accept: Collection[int] = ()) -> tuple[int, int] | None:
    """Copy one block's fastest copy into ``dst`` (at least a block long): ``(bytes, codec id)``,
    or None for a miss."""
    while True:
        with cascade.lock:
            entry = cascade.pin(namespace_id, block_hash)
            if entry is None:
                cascade.counters["misses"] += 1
                return None
            t = entry.fastest
        record = entry.copies[t]
        tier = cascade.tiers[t]
        decoded = None
        try:
            codec = record.codec
            if codec != 0 and codec not in accept:
                payload = cascade.read_copy(entry, t, _payloads)
                decoded = cascade.transcoder.decode(namespace_id, entry.raw_size, record, payload, out=dst)
                n, codec = decoded.nbytes, 0
            else:
                n = tier.read_into(entry.key, dst)
                payload = dst[:n]
        except (BlockCorrupt, CodecError):
            with cascade.lock:
                cascade.discard_corrupt_copy(entry, t)
                cascade.unpin(entry)
            continue  # try the next copy, or report a miss
        with cascade.lock:
            cascade.counters[f"hits_{tier.name}"] += 1
            cascade.counters["bytes_out"] += n
            cascade.index.policies[t].touch(entry.key)
            if t > 0 and cascade.config.promote_on_hit and not entry.doomed:
                cascade.promote(entry, t, payload, decoded)
            cascade.unpin(entry)
        return n, codec
