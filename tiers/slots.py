"""Fixed-size slot allocation inside one pre-allocated arena (shared by the CPU and GPU tiers).

The arena is carved into equal slots once; a block takes ``ceil(size / slot_bytes)`` slots.
There is no per-block malloc and no external fragmentation: any free slot fits any piece.
Slots handed out together are usually adjacent (the free list is kept so that pops ascend),
so a block is typically one extent and is copied with one memcpy; after churn it may be a few.
"""

from __future__ import annotations

import threading

from kvstore.buffers import Extent
from kvstore.errors import BlockTooLarge, TierFull


class SlotTable:
    def __init__(self, arena_bytes: int, slot_bytes: int, tier_name: str) -> None:
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be > 0")
        self.slot_bytes = slot_bytes
        self.num_slots = arena_bytes // slot_bytes
        self.tier_name = tier_name
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._blocks: dict[bytes, tuple[list[Extent], int, list[int]]] = {}
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slots_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.slot_bytes))

    def footprint(self, nbytes: int) -> int:
        n = self.slots_for(nbytes)
        if n > self.num_slots:
            raise BlockTooLarge(f"a {nbytes}-byte block exceeds the {self.tier_name} tier "
                                f"({self.capacity_bytes} bytes)")
        return n * self.slot_bytes

    def allocate(self, key: bytes, nbytes: int) -> list[Extent]:
        n = self.slots_for(nbytes)
        with self._lock:
            if key in self._blocks:
                raise KeyError(f"{key.hex()} already allocated in {self.tier_name}")
            if n > len(self._free):
                raise TierFull(f"{self.tier_name} tier has {len(self._free)} free slots, needs {n}")
            slots = [self._free.pop() for _ in range(n)]
            extents = _coalesce(sorted(slots), self.slot_bytes, nbytes)
            self._blocks[key] = (extents, nbytes, slots)
            return extents

    def lookup(self, key: bytes) -> tuple[list[Extent], int]:
        extents, nbytes, _ = self._blocks[key]
        return extents, nbytes

    def release(self, key: bytes) -> int:
        """Free a block's slots; returns the bytes it accounted (0 if absent)."""
        with self._lock:
            entry = self._blocks.pop(key, None)
            if entry is None:
                return 0
            slots = entry[2]
            self._free.extend(sorted(slots, reverse=True))
            return len(slots) * self.slot_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)


def _coalesce(sorted_slots: list[int], slot_bytes: int, nbytes: int) -> list[Extent]:
    """Turn slot indices into (offset, length) runs covering exactly ``nbytes``."""
    extents: list[Extent] = []
    remaining = nbytes
    start = prev = sorted_slots[0]
    for s in sorted_slots[1:] + [None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        length = min((prev - start + 1) * slot_bytes, remaining)
        if length > 0:
            extents.append((start * slot_bytes, length))
        remaining -= length
        if s is not None:
            start = prev = s
    return extents
