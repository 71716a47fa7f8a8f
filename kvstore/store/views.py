"""What the store lends to code above it without handing out its internals: one pinned block, the
description of the shared CPU arena that same-host clients map, and a copied-out state of a block
for inspection.

A ``PinnedBlock`` is only valid inside ``Store.pinned``'s ``with`` block: the pin is what keeps the
block from being evicted and its arena slots from being reused while the caller reads them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import numpy as np

from kvstore.buffers import Extent
from kvstore.tiers.base import BlockRecord, Tier
from kvstore.tiers.cpu import CpuTier


@dataclasses.dataclass(frozen=True)
class BlockState:
    """One block as the index sees it, copied out by ``Store.block_states`` (nothing in it refers
    back into the store)."""

    namespace_id: bytes
    block_hash: bytes
    tiers: tuple[int, ...]   # indexes into ``Store.tiers`` of the tiers holding a copy, ascending
    pins: int                # explicit pins (in-flight reads, leases)
    visible: bool            # served to lookups and gets (written, not deleted)


class PinnedBlock:
    """The fastest copy of one block, held in place for the duration of a ``Store.pinned`` block."""

    def __init__(self, record: BlockRecord, tier: Tier) -> None:
        # checksum (from the tier where it keeps it apart), codec, stored_size, raw_size
        self.record = record.replace(checksum=record.checksum or tier.checksum(record.key))
        self.tier: str = tier.name
        self._source = tier

    def pieces(self) -> list[np.ndarray] | None:
        """Zero-copy views of the stored payload, in order, when the copy is in the CPU arena;
        None otherwise (use ``read_into``)."""
        if isinstance(self._source, CpuTier):
            return self._source.view(self.record.key)
        return None

    def read_into(self, out) -> int:
        """Copy the stored payload (``record.stored_size`` bytes, encoded if ``record.codec``)
        into ``out``; returns its length. May raise ``BlockCorrupt`` for a damaged copy."""
        return self._source.read_into(self.record.key, out)


class SharedArena:
    """The CPU tier's shared memory as a same-host client maps it: one file found by path, or
    (tenant segments, with authentication on) segments handed out by descriptor to their tenant
    only (``descriptor_for``)."""

    def __init__(self, tier: CpuTier) -> None:
        self.path: str | None = tier.segment_path      # None: tenant segments, no path at all
        self.nbytes: int = tier.arena.nbytes           # the mapping's size (at least one page)
        self.capacity_bytes: int = tier.capacity_bytes  # of which the slots cover this much
        self.segmented: bool = tier.segmented
        self.segment_bytes: int = tier.slots.segment_bytes if tier.segmented else 0
        self._tier = tier
        self._arena = tier.arena

    @functools.cached_property
    def _stat(self) -> os.stat_result:
        return os.stat(self.path)

    @property
    def st_dev(self) -> int:
        """With ``st_ino``: lets a client check it mapped this very file, not a namesake."""
        return self._stat.st_dev

    @property
    def st_ino(self) -> int:
        return self._stat.st_ino

    def generation_at(self, offset: int) -> int:
        """Which memory the segment holding ``offset`` has now (0 without segments): a client
        whose mapping of that segment is of another generation must map it again."""
        return self._tier.generation_at(offset)

    def descriptor_for(self, segment: int, tenant: str) -> tuple[int, int] | None:
        """``(fd, generation)`` of a segment that holds ``tenant``'s blocks (the caller sends and
        closes the fd), None for any other segment."""
        return self._tier.segment_descriptor(segment, tenant)

    def replaced_for(self, tenant: str) -> list[tuple[int, int]]:
        """``(segment, generation)`` of the replaced segments ``tenant``'s clients still hold:
        a client told them lets go of its mappings."""
        return self._tier.replaced_for(tenant)

    def views(self, extents: Sequence[Extent]) -> list[np.ndarray]:
        """Zero-copy slices of the arena, one per (offset, length) extent (valid while the block
        they belong to is pinned)."""
        return [self._arena[off:off + length] for off, length in extents]
