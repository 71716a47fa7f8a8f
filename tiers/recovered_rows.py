"""The blocks an NVMe slab held at start-up, kept as columns until each is dropped.

Why columns: a warm restart of millions of blocks would otherwise make one ``BlockRecord`` (96
bytes), one dict slot (42-55 bytes) and one slot number (32 bytes) per block in the tier, beside
the index's own entry. Here a block is one row: its key's hash (``hash(key)``, 8 bytes, sorted:
found by binary search), references to its key and its parent's key (the objects the index
holds; 8 bytes each), its slot, stored and raw sizes and codec (13 bytes). Its checksum stays in
its slab's column (``Slab.checksum``). A block written after the restart is held the usual way
(a record in the tier's dict); a recovered one stays a row for as long as it is held.

A row is dropped by setting its slot to -1 and letting go of its keys; the columns themselves
are freed when the last row is. Not thread-safe for drops: the tier's lock guards them; a lookup
concurrent with a drop sees the row either way.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvstore.tiers.base import BlockRecord, RecoveredBlocks


class RecoveredRows:
    """The recovered blocks of one slab (``slab``): rows sorted by their key's hash."""

    def __init__(self, slab, found: RecoveredBlocks, slots: list[int]) -> None:
        assert len(slots) == len(found), "one slot per block found"
        self.slab = slab
        hashes = np.fromiter(map(hash, found.keys), np.int64, len(found))
        order = np.argsort(hashes, kind="stable")
        self._hashes = hashes[order]
        rows = order.tolist()
        self._keys: list[bytes | None] = [found.keys[i] for i in rows]
        self._parents: list[bytes | None] = [found.parent_keys[i] for i in rows]
        self._slots = np.asarray(slots, np.int32)[order]   # -1: dropped
        self._stored = _column(found.stored_sizes)[order]
        self._raw = _column(found.raw_sizes)[order]
        self._codecs = np.asarray(found.codecs, np.uint8)[order]
        self.held = len(rows)

    def __len__(self) -> int:
        return self.held

    def find(self, key: bytes) -> int:
        """The row of ``key`` if this slab holds it as a recovered block, else -1."""
        h = hash(key)
        hashes, keys = self._hashes, self._keys
        row = int(np.searchsorted(hashes, h))
        while row < len(hashes) and hashes[row] == h:
            if keys[row] == key:
                return row
            row += 1
        return -1

    def where(self, row: int) -> tuple[int, int]:
        """(stored size, slot) of a row; ``KeyError`` once it is dropped (a drop may come between
        ``find`` and this call: drops take the tier's lock, its readers do not)."""
        slot = int(self._slots[row])
        if slot < 0:
            raise KeyError(row)
        return int(self._stored[row]), slot

    def drop(self, row: int) -> int:
        """Forget a held row; its slot (the caller erases it and gives it back)."""
        slot = int(self._slots[row])
        assert slot >= 0 and self._keys[row] is not None, "a row dropped twice"
        self._slots[row] = -1
        self._keys[row] = self._parents[row] = None
        self.held -= 1
        return slot

    def record(self, row: int) -> BlockRecord:
        """A held row's record, made now (its checksum 0: its slab keeps it)."""
        key = self._keys[row]
        assert key is not None, "a dropped row"
        return BlockRecord.of_keys(key, self._parents[row], int(self._stored[row]), int(self._raw[row]),
                                   int(self._codecs[row]), slot=int(self._slots[row]))

    def records(self) -> Iterator[BlockRecord]:
        for row in np.flatnonzero(self._slots >= 0).tolist():
            yield self.record(row)


def _column(sizes: list[int]) -> np.ndarray:
    """Sizes as 4-byte ints, or 8-byte ones where a size does not fit in 4."""
    return np.asarray(sizes, np.uint32 if max(sizes, default=0) < 1 << 32 else np.uint64)
