"""A load that stages blocks from NVMe into the arena reads them several at once, outside the
store lock (issue 14: ``Leases.prepare_load``, ``reads.read_staged``). Damage found by those
reads must still be a counted miss and never wrong bytes, even when several damaged copies are
read in one run of staged blocks (each is dropped, not only the first), on shared memory and on
the streaming paths (which stage through the same leases); the blocks around them are served
exactly, and stored again the damaged ones are served too."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.tiers.nvme import find_blocks

BLOCK = 256 * 1024


@pytest.mark.parametrize("transport", ["shm", "bulk", "grpc"])
def test_several_damaged_copies_in_one_staging_run_are_each_a_counted_miss(daemon_factory, transport):
    d = daemon_factory("--no-promote-on-hit", "--cpu-slot-bytes", "256KiB", cpu_bytes="4MiB", nvme_bytes="64MiB")
    layout = KVLayout(model="test/staging", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                      block_tokens=16, block_bytes=BLOCK)
    count = 40
    rng = np.random.default_rng(9)
    data = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(count)]
    with d.client(transport=transport) as c:
        assert c.active_transport == transport
        ns = c.register_namespace(Namespace(layout, cache_salt="staging"))
        hashes = ChainHasher(seed=9).chain(np.arange(16 * count), 16)
        assert set(c.put(ns, hashes, data)) <= {"stored", "persisted"}
        on_nvme = [i for i, h in enumerate(hashes) if c.lookup(ns, [h], lease=False).tiers == ["nvme"]]
        assert len(on_nvme) >= 20
        damaged = on_nvme[2:5] + on_nvme[7:8]   # three in a row, and one more, within one run of 16
        slots = find_blocks(d.nvme_path)
        for i in damaged:
            path, offset = slots[ns + hashes[i]]
            with open(path, "r+b") as f:          # one payload byte flipped
                f.seek(offset + 4096 + 1000)
                b = f.read(1)
                f.seek(offset + 4096 + 1000)
                f.write(bytes([b[0] ^ 0x40]))
        before = c.stats()["counters"].get("corrupt_dropped", 0)
        for _ in range(2):   # the second get finds them gone, not half-dropped
            outs = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(count)]
            sizes = c.get_into(ns, hashes, outs)
            assert [i for i, s in enumerate(sizes) if s is None] == damaged
            assert all(np.array_equal(outs[i], data[i]) for i in range(count) if i not in damaged)
        stats = c.stats()
        assert stats["counters"].get("corrupt_dropped", 0) - before == len(damaged)
        assert stats["leases"] == 0
        assert set(c.put(ns, [hashes[i] for i in damaged], [data[i] for i in damaged],
                         parent=hashes[damaged[0] - 1])) <= {"stored", "persisted"}
        outs = [np.zeros(BLOCK, dtype=np.uint8) for _ in damaged]
        assert c.get_into(ns, [hashes[i] for i in damaged], outs) == [BLOCK] * len(damaged)
        assert all(np.array_equal(o, data[i]) for o, i in zip(outs, damaged))
