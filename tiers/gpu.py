"""GPU tier: a device pool carved into fixed slots, in device-agnostic torch.

The same code runs with ``device="cpu"`` in CI and on ``cuda`` on a GPU host (the tests are in
``tests/test_tiers.py``; the CUDA one skips without a device). Sized 0 by default: HBM belongs to
the engine unless an operator gives some to the cache. The pool lives in the daemon's process and
is reached only through the Store like any other tier: blocks are copied in and out of it, never
shared with workers.
"""

from __future__ import annotations

from kvstore.buffers import as_bytes
from kvstore.tiers.base import BlockRecord, Tier
from kvstore.tiers.slots import SlotTable


def _torch():
    import torch  # lazy: the daemon runs without torch when no GPU tier or codec needs it
    return torch


class GpuTier(Tier):
    name = "gpu"
    durable = False
    in_memory = True

    def __init__(self, capacity_bytes: int, slot_bytes: int = 256 * 1024, device: str = "cuda") -> None:
        torch = _torch()
        self.slots = SlotTable(capacity_bytes, slot_bytes, self.name)
        super().__init__(self.slots.capacity_bytes)
        self.device = torch.device(device)
        self.pool = torch.zeros(self.capacity_bytes, dtype=torch.uint8, device=self.device)

    def footprint(self, nbytes: int) -> int:
        return self.slots.footprint(nbytes)

    def allocate(self, record: BlockRecord) -> None:
        self.slots.allocate(record.key, record.stored_size)
        self.used_bytes += self.slots.footprint(record.stored_size)

    def _as_tensor(self, buf):
        torch = _torch()
        if isinstance(buf, torch.Tensor):
            return buf.reshape(-1).view(torch.uint8)
        return torch.from_numpy(as_bytes(buf))

    def _host_array(self, buf):
        """A numpy view when both sides live in host memory (device "cpu"): numpy copies there are
        2-3x faster than torch's copy_ on a busy CPU. None otherwise."""
        if self.device.type != "cpu":
            return None
        torch = _torch()
        if isinstance(buf, torch.Tensor):
            return buf.reshape(-1).view(torch.uint8).numpy() if buf.device.type == "cpu" else None
        return as_bytes(buf)

    def write(self, record: BlockRecord, data) -> None:
        self.write_key(record.key, data)

    def write_key(self, key: bytes, data) -> None:
        host = self._host_array(data)
        if host is not None:
            pool = self.pool.numpy()
            pos = 0
            for off, length in self.slots.lookup(key)[0]:
                pool[off:off + length] = host[pos:pos + length]
                pos += length
            return
        src = self._as_tensor(data)
        pos = 0
        for off, length in self.slots.lookup(key)[0]:
            self.pool[off:off + length].copy_(src[pos:pos + length], non_blocking=False)
            pos += length

    def read_into(self, key: bytes, out) -> int:
        extents, nbytes = self.slots.lookup(key)
        host = self._host_array(out)
        if host is not None:
            pool = self.pool.numpy()
            pos = 0
            for off, length in extents:
                host[pos:pos + length] = pool[off:off + length]
                pos += length
            return nbytes
        dst = self._as_tensor(out)
        pos = 0
        for off, length in extents:
            dst[pos:pos + length].copy_(self.pool[off:off + length])
            pos += length
        return nbytes

    def extents(self, key: bytes):
        return self.slots.lookup(key)[0]

    def drop(self, key: bytes) -> None:
        self.used_bytes -= self.slots.release(key)

    def drop_many(self, keys) -> None:
        self.used_bytes -= self.slots.release_many(keys)

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "blocks": len(self.slots), "payload_bytes": self.slots.payload_bytes,
                "slack_bytes": self.used_bytes - self.slots.payload_bytes}
