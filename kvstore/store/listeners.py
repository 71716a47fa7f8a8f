"""Who hears about blocks appearing in, moving between tiers of, and leaving the store (the fleet
publishes from this; the same-host lookup index mirrors it).

Events are sent with the store lock held, in the order the index changes, so a listener sees a
block's "added" (followed by a "moved" naming the tier it landed in) before its "removed". That is also why a listener must only enqueue
or do a few memory writes, never block. A block is "removed" once it stops being served (deleted
while pinned counts: it is freed later, silently).
"""

from __future__ import annotations

from itertools import groupby
from operator import attrgetter


class StoreListener:
    """Told when blocks appear in or leave the store. Called with the store lock held:
    implementations must only enqueue, never block."""

    def blocks_added(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        pass

    def blocks_removed(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        pass

    def block_moved(self, namespace_id: bytes, block_hash: bytes, fastest_tier: int) -> None:
        """A served block's fastest copy is now in tier ``fastest_tier`` (an index into the
        store's tiers): it was promoted, demoted, or lost a copy."""

    def blocks_moved(self, namespace_id: bytes, block_hashes: list[bytes], fastest_tier: int) -> None:
        """``block_moved`` for each of ``block_hashes`` in order, all now fastest in one tier (a
        listener may take them at once)."""
        for h in block_hashes:
            self.block_moved(namespace_id, h, fastest_tier)


class Listeners:
    """The registered listeners and the fan-out of each event to them. Caller holds the store lock."""

    def __init__(self) -> None:
        self._registered: list[StoreListener] = []

    def add(self, listener: StoreListener) -> None:
        if listener not in self._registered:
            self._registered.append(listener)

    def remove(self, listener: StoreListener) -> None:
        if listener in self._registered:
            self._registered.remove(listener)

    def added_run(self, entries) -> None:
        """Blocks made visible together (index entries, in order). A listener that takes both
        kinds of event hears, for each block in turn, "added", then "moved" naming its fastest
        tier; one that takes only "added" hears a run of one namespace at once, and one that takes
        only moves a run of one namespace and tier at once (``blocks_moved``)."""
        registered = self._registered
        if not registered or not entries:
            return
        adders = [x for x in registered if type(x).blocks_added is not StoreListener.blocks_added]
        movers = [x for x in registered if type(x).block_moved is not StoreListener.block_moved
                  or type(x).blocks_moved is not StoreListener.blocks_moved]
        both = [x for x in adders if x in movers]
        for e in entries if both else ():
            for listener in both:
                listener.blocks_added(e.namespace_id, [e.block_hash])
                listener.block_moved(e.namespace_id, e.block_hash, e.fastest)
        adders = [x for x in adders if x not in both]
        movers = [x for x in movers if x not in both]
        for (ns, tier), run in groupby(entries, attrgetter("namespace_id", "fastest")) if adders or movers else ():
            hashes = [e.block_hash for e in run]
            for listener in adders:
                listener.blocks_added(ns, hashes)
            for listener in movers:
                listener.blocks_moved(ns, hashes, tier)

    def removed(self, entries) -> None:
        """Each of ``entries`` left the store: each namespace's stretch of them in one call."""
        if not self._registered:
            return
        for ns, run in groupby(entries, attrgetter("namespace_id")):
            hashes = [e.block_hash for e in run]
            for listener in self._registered:
                listener.blocks_removed(ns, hashes)

    def moved(self, namespace_id: bytes, block_hash: bytes, fastest_tier: int) -> None:
        for listener in self._registered:
            listener.block_moved(namespace_id, block_hash, fastest_tier)
