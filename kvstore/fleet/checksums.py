"""The checksum a node vouches for a block with: the xxh3_64 of its payload as stored.

The publisher puts it, signed, in the block's directory record; a peer's direct fetch asks the
node for it, signed the same way (``Fleet.signed_checksums``). Both take it here, from the block
pinned by the caller, so a fetcher checks bytes against the same number either way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import xxhash


def payload_checksum(block, buffer: Callable[[int], np.ndarray]) -> int:
    """The xxh3_64 of a pinned block's payload as stored (``block``: what ``Store.pinned`` yields):
    the checksum NVMe keeps in the payload's header, else read zero-copy over the arena, else
    read into ``buffer(nbytes)``."""
    record = block.record
    if record.checksum:
        return record.checksum
    pieces = block.pieces()
    if pieces is not None:
        x = xxhash.xxh3_64()
        for piece in pieces:
            x.update(piece)
        return x.intdigest()
    buf = buffer(record.stored_size)
    n = block.read_into(buf)
    return xxhash.xxh3_64_intdigest(buf[:n])
