"""Who hears about blocks appearing in, moving between tiers of, and leaving the store (the fleet
publishes from this; the same-host lookup index mirrors it).

Events are sent with the store lock held, in the order the index changes, so a listener sees a
block's "added" (followed by a "moved" naming the tier it landed in) before its "removed". That is also why a listener must only enqueue
or do a few memory writes, never block. A block is "removed" once it stops being served (deleted
while pinned counts: it is freed later, silently).
"""

from __future__ import annotations


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


class Listeners:
    """The registered listeners and the fan-out of each event to them. Caller holds the store lock."""

    def __init__(self) -> None:
        self._registered: list[StoreListener] = []

    def add(self, listener: StoreListener) -> None:
        self._registered.append(listener)

    def remove(self, listener: StoreListener) -> None:
        if listener in self._registered:
            self._registered.remove(listener)

    def added(self, namespace_id: bytes, block_hash: bytes) -> None:
        for listener in self._registered:
            listener.blocks_added(namespace_id, [block_hash])

    def added_run(self, entries) -> None:
        """Blocks made visible together (index entries, in order): for each in turn, "added", then
        "moved" naming its fastest tier (to the listeners that take moves)."""
        registered = self._registered
        if not registered:
            return
        movers = [listener for listener in registered if type(listener).block_moved is not StoreListener.block_moved]
        for e in entries:
            for listener in registered:
                listener.blocks_added(e.namespace_id, [e.block_hash])
            for listener in movers:
                listener.block_moved(e.namespace_id, e.block_hash, e.fastest)

    def removed(self, namespace_id: bytes, block_hash: bytes) -> None:
        for listener in self._registered:
            listener.blocks_removed(namespace_id, [block_hash])

    def moved(self, namespace_id: bytes, block_hash: bytes, fastest_tier: int) -> None:
        for listener in self._registered:
            listener.block_moved(namespace_id, block_hash, fastest_tier)
