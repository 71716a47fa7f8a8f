"""Warming: giving a block a copy in the CPU tier ahead of traffic (``kvstore prewarm``, ``kvstore pin``).

A read promotes a block from NVMe or Redis on its own, but only after the engine asked for it, so
the first request after an upgrade or a restart pays the slow tier. Warming does the same copy
beforehand, through the cascade's own placement (room made by the CPU tier's policy, the CPU
tier's codec applied), so a warmed block is indistinguishable from one promoted by a hit.
"""

from __future__ import annotations

from kvstore.store.cascade import Cascade
from kvstore.store.transfers import COPIED, NO_ROOM
from kvstore.store.index import Entry

#: what ``warm`` did for one block
WARMED, ALREADY_WARM = "warmed", "already"   # or copy_out's NO_ROOM, CORRUPT


def warm(cascade: Cascade, entry: Entry) -> str:
    """Copy ``entry``'s fastest copy into the CPU tier unless it already has one there (or in a
    faster tier, or the block is gone). Takes the lock itself: the block is pinned while its copy
    is read and room is made, both with the lock released (``Cascade.copy_out``)."""
    c = cascade.cpu_index
    with cascade.lock:
        if c is None or not entry.visible or entry.fastest <= c:
            return ALREADY_WARM
        src = entry.fastest
        cascade.pin_entry(entry)
    try:
        done = cascade.copy_out(entry, src, c)
    finally:
        with cascade.lock:
            cascade.unpin(entry)
    if done == COPIED:
        cascade.count("prewarmed")
        return WARMED
    if done == NO_ROOM:
        cascade.count("prewarm_no_room")
    return done
