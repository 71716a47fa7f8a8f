"""An accounting-only tier: it keeps sizes, never bytes. The sizing planner runs the real Store on it.

The planner (``kvstore plan``) asks "how would the production store behave with 32 GiB of RAM and
256 GiB of NVMe?" without having that RAM. It builds the real ``Store`` with the real eviction
policies over these tiers: ``allocate`` / ``drop`` / ``footprint`` do exactly the accounting the
real tier does (slot rounding for the CPU arena, header + page rounding for NVMe files, the same
``TierFull`` / ``BlockTooLarge`` decisions), while ``write`` and ``read_into`` move nothing.
So every eviction, demotion and promotion decision is the production one, at metadata cost.

Use ``MetadataTier.like_cpu`` / ``like_nvme`` to mirror a real tier's accounting; exact agreement
with the real tiers is tested in ``tests/test_plan.py``.
"""

from __future__ import annotations

import tempfile

from kvstore.errors import BlockTooLarge, TierFull
from kvstore.tiers.base import BlockRecord, Tier
from kvstore.tiers.nvme import ALIGN as NVME_ALIGN
from kvstore.tiers.nvme import HEADER_BYTES as NVME_HEADER_BYTES


class MetadataTier(Tier):
    """A tier that accounts like a real one and stores nothing.

    Exactly one of ``slot_bytes`` (fixed slots, as the CPU/GPU arenas) or ``page_bytes`` (a
    per-block header plus page rounding, as NVMe files) describes the footprint rule.
    A durable metadata tier gets a directory (``path``) because the Store keeps its namespace
    registry beside the durable tier; nothing else is ever written there.
    """

    def __init__(self, name: str, capacity_bytes: int, *, slot_bytes: int | None = None,
                 page_bytes: int | None = None, header_bytes: int = 0, durable: bool = False,
                 path: str | None = None) -> None:
        if (slot_bytes is None) == (page_bytes is None):
            raise ValueError("give exactly one of slot_bytes (arena) or page_bytes (files)")
        if slot_bytes is not None and slot_bytes <= 0 or page_bytes is not None and page_bytes <= 0:
            raise ValueError("slot_bytes / page_bytes must be > 0")
        if slot_bytes is not None:
            capacity_bytes = (int(capacity_bytes) // slot_bytes) * slot_bytes  # whole slots only
        super().__init__(capacity_bytes)
        self.name = name
        self.durable = durable
        self.slot_bytes = slot_bytes
        self.page_bytes = page_bytes
        self.header_bytes = header_bytes
        self._tmpdir = None
        if durable and path is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix=f"kvstore-plan-{name}-")
            path = self._tmpdir.name
        self.path = path
        self._sizes: dict[bytes, tuple[int, int]] = {}  # key -> (stored size, footprint)
        self.bytes_placed = 0  # stored bytes of every copy ever placed here: what the medium would write

    @classmethod
    def like_cpu(cls, capacity_bytes: int, slot_bytes: int = 256 * 1024, name: str = "cpu") -> "MetadataTier":
        """Accounts like ``CpuTier`` (and ``GpuTier``): a block takes ceil(size / slot) slots."""
        return cls(name, capacity_bytes, slot_bytes=slot_bytes)

    @classmethod
    def like_nvme(cls, capacity_bytes: int, path: str | None = None, name: str = "nvme") -> "MetadataTier":
        """Accounts like ``NvmeTier``: a 4 KiB header plus the payload rounded up to 4 KiB."""
        return cls(name, capacity_bytes, page_bytes=NVME_ALIGN, header_bytes=NVME_HEADER_BYTES,
                   durable=True, path=path)

    def footprint(self, nbytes: int) -> int:
        if self.slot_bytes is not None:
            fp = max(1, -(-nbytes // self.slot_bytes)) * self.slot_bytes
        else:
            fp = self.header_bytes + -(-nbytes // self.page_bytes) * self.page_bytes
        if fp > self.capacity_bytes:
            raise BlockTooLarge(f"a {nbytes}-byte block exceeds the {self.name} tier "
                                f"({self.capacity_bytes} bytes)")
        return fp

    def allocate(self, record: BlockRecord) -> None:
        fp = self.footprint(record.stored_size)
        key = record.key
        if key in self._sizes:
            raise KeyError(f"{key.hex()} already allocated in {self.name}")
        if fp > self.free_bytes:
            raise TierFull(f"{self.name} tier has {self.free_bytes} free bytes, needs {fp}")
        self._sizes[key] = (record.stored_size, fp)
        self.used_bytes += fp
        self.bytes_placed += record.stored_size

    def write(self, record: BlockRecord, data) -> None:
        """Nothing to write: the planner only needs the accounting done by ``allocate``."""

    def read_into(self, key: bytes, out) -> int:
        """Copies nothing; returns the stored size (``KeyError`` if absent, as a real tier)."""
        return self._sizes[key][0]

    def drop(self, key: bytes) -> None:
        entry = self._sizes.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry[1]

    def close(self) -> None:
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "blocks": len(self._sizes)}
