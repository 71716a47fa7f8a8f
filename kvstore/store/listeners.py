"""Who hears about blocks appearing in and leaving the store (the fleet publishes from this).

Events are sent with the store lock held, in the order the index changes, so a listener sees a
block's "added" before its "removed". That is also why a listener must only enqueue, never block.
"""

from __future__ import annotations


class StoreListener:
    """Told when blocks appear in or leave the store. Called with the store lock held:
    implementations must only enqueue, never block."""

    def blocks_added(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        pass

    def blocks_removed(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        pass


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

    def removed(self, namespace_id: bytes, block_hash: bytes) -> None:
        for listener in self._registered:
            listener.blocks_removed(namespace_id, [block_hash])
