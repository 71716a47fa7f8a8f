"""Warming: giving a block a copy in the CPU tier ahead of traffic (``kvstore prewarm``, ``kvstore pin``).

A read promotes a block from NVMe or Redis on its own, but only after the engine asked for it, so
the first request after an upgrade or a restart pays the slow tier. Warming does the same copy
beforehand, through the cascade's own placement (room made by the CPU tier's policy, the CPU
tier's codec applied), so a warmed block is indistinguishable from one promoted by a hit.
"""

from __future__ import annotations

from kvstore.errors import BlockCorrupt, CodecError
from kvstore.store.cascade import PLACEMENT_ERRORS, Cascade
from kvstore.store.index import Entry

#: what ``warm`` did for one block
WARMED, ALREADY_WARM, NO_ROOM, CORRUPT = "warmed", "already", "no_room", "corrupt"


def warm(cascade: Cascade, entry: Entry) -> str:
    """Copy ``entry``'s fastest copy into the CPU tier unless it already has one there (or in a
    faster tier). Caller holds the store lock; ``entry`` is pinned here while it is copied, so
    making room in the CPU tier (which may demote into the very tier being read) cannot take the
    source copy away."""
    c = cascade.cpu_index
    if c is None or entry.fastest <= c:
        return ALREADY_WARM
    src = entry.fastest
    cascade.pin_entry(entry)
    try:
        cascade.make_room(c, entry.raw_size, entry.namespace_id)   # before read_copy: making room may reuse its scratch buffer
        data = cascade.read_copy(entry, src)
        cascade.store_copy(entry, c, data, entry.copies[src])
    except (BlockCorrupt, CodecError):
        if src in entry.copies:
            cascade.discard_corrupt_copy(entry, src)
        return CORRUPT
    except PLACEMENT_ERRORS:
        cascade.count("prewarm_no_room")
        return NO_ROOM
    finally:
        cascade.unpin(entry)
    cascade.count("prewarmed")
    return WARMED
