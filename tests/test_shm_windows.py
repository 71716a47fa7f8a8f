"""Same-host puts go to the arena a store lease (window) at a time, the next lease asked for
while the current window is copied and each window completed while the next is copied (issue
14: the daemon's per-block work overlaps the copies); a get likewise takes a load lease a window at
a time, the next asked for while the current one is copied. What a put or get returns must not depend
on where the windows fall: blocks already present on either side of a window boundary, a chain
linked across windows, an arena with no unpinned room left for a later window (the rest is
streamed), misses anywhere in a get, a get of more blocks than the arena holds; and no lease is
left open afterwards."""

from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest

from kvstore.client import shm_path
from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.ops import admin_cli

BLOCK = 64 * 1024


def layout(block_bytes: int) -> KVLayout:
    return KVLayout(model="test/windows", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                    block_tokens=16, block_bytes=block_bytes)


def blocks_of(count: int, block_bytes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(count)]


def read_back(c, ns: bytes, hashes: list[bytes], block_bytes: int) -> tuple[list, list[np.ndarray]]:
    outs = [np.zeros(block_bytes, dtype=np.uint8) for _ in hashes]
    return c.get_into(ns, hashes, outs), outs


def test_put_windows_cover_the_put_in_order():
    for count in (1, 127, 128, 129, 384, 385, 4096):
        spans = shm_path.put_windows(count)
        assert spans[0][0] == 0 and spans[-1][1] == count
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert all(0 < stop - start <= shm_path.MAX_WINDOW_BLOCKS for start, stop in spans)
    assert len(shm_path.put_windows(shm_path.FIRST_WINDOW_BLOCKS)) == 1   # a small put: one lease, as before


def test_a_put_across_windows_stores_links_and_reports_every_block(daemon_factory):
    d = daemon_factory("--cpu-slot-bytes", "64KiB", cpu_bytes="128MiB", nvme_bytes="0")
    count = 600
    spans = shm_path.put_windows(count)
    assert len(spans) >= 3, "the put must span several store leases"
    edges = {stop for _, stop in spans[:-1]}
    present = sorted({e - 1 for e in edges} | edges | {3})   # both sides of each boundary, and one inside
    with d.client(transport="shm") as c:
        assert c.active_transport == "shm"
        ns = c.register_namespace(Namespace(layout(BLOCK), cache_salt="put-windows"))
        hashes = ChainHasher().chain(np.arange(16 * count), 16)
        data = blocks_of(count, BLOCK, seed=3)
        for i in present:   # stored before, each with its own parent
            assert c.put(ns, [hashes[i]], [data[i]], parent=hashes[i - 1] if i else None) == ["stored"]
        results = c.put(ns, hashes, data)
        assert [i for i, r in enumerate(results) if r == "exists"] == present
        assert all(r == "stored" for i, r in enumerate(results) if i not in present)
        sizes, outs = read_back(c, ns, hashes, BLOCK)
        assert sizes == [BLOCK] * count
        assert all(np.array_equal(o, b) for o, b in zip(outs, data))
        assert c.lookup_many(ns, [hashes])[0].num_hit == count   # one chain, linked across the windows
        assert c.stats()["leases"] == 0


def wire_bytes(d, transport: str, direction: str = "in") -> float:
    """The daemon's ``kvstore_wire_bytes_total`` counter for payload bytes in (or out) over ``transport``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
    found = re.search(r'kvstore_wire_bytes_total\{direction="%s",transport="%s"\} (\S+)' % (direction, transport), text)
    return float(found.group(1)) if found else 0.0


def test_a_later_window_without_room_streams_the_rest(daemon_factory):
    """256 slots of arena and a pin declared on the chain's first window before it is put: that
    window (128 blocks) is stored through the arena and held there; the second finds 128 free
    slots and no block it may evict, so the rest of the put (172 blocks) goes over gRPC, lower down (NVMe),
    after the stored window. Every block is stored once, in the chain, and reads back."""
    d = daemon_factory("--metrics-port", "0", cpu_bytes="64MiB", nvme_bytes="256MiB",
                       env={"KVSTORE_MAX_PINNED_BYTES_PER_TENANT": "64MiB"})
    size, count, first = 256 * 1024, 300, shm_path.FIRST_WINDOW_BLOCKS
    with d.client(transport="shm") as c:
        ns = c.register_namespace(Namespace(layout(size), cache_salt="no-room"))
        hashes = ChainHasher(seed=6).chain(np.arange(16 * count), 16)
        assert admin_cli.prefix_call(c, "Pin", ns, hashes[:first])["blocks"] == first
        data = blocks_of(count, size, seed=6)
        results = c.put(ns, hashes, data)
        assert results[:first] == ["stored"] * first
        assert len(results) == count and set(results[first:]) <= {"stored", "persisted"}
        assert wire_bytes(d, "shm") == first * size              # one window through the arena ...
        assert wire_bytes(d, "grpc") == (count - first) * size   # ... the rest streamed, once
        sizes, outs = read_back(c, ns, hashes, size)
        assert sizes == [size] * count
        assert all(np.array_equal(o, b) for o, b in zip(outs, data))
        assert c.lookup_many(ns, [hashes], lease=False)[0].num_hit == count
        assert c.stats()["leases"] == 0


def test_an_arena_full_of_pinned_blocks_streams_the_whole_put(daemon_factory):
    d = daemon_factory("--lease-seconds", "60", cpu_bytes="8MiB", nvme_bytes="64MiB")
    size = 256 * 1024
    with d.client(transport="shm") as c:
        ns = c.register_namespace(Namespace(layout(size), cache_salt="full"))
        held = ChainHasher(seed=7).chain(np.arange(16 * 32), 16)
        assert set(c.put(ns, held, blocks_of(32, size, seed=7))) == {"stored"}
        assert c.lookup_many(ns, [held])[0].num_hit == 32   # every slot pinned
        hashes = ChainHasher(seed=8).chain(np.arange(16 * 40), 16)
        data = blocks_of(40, size, seed=8)
        assert set(c.put(ns, hashes, data)) <= {"stored", "persisted"}
        sizes, outs = read_back(c, ns, hashes, size)
        assert sizes == [size] * 40 and all(np.array_equal(o, b) for o, b in zip(outs, data))


def test_misses_anywhere_in_a_get_are_reported_exactly(daemon_factory, monkeypatch):
    """Load leases of 128 blocks here (the client's own constant: the daemon is unchanged), so 400
    blocks cross window boundaries at 128 and 256, with misses on either side of them."""
    monkeypatch.setattr(shm_path, "LOAD_WINDOW_BLOCKS", 128)
    d = daemon_factory(cpu_bytes="128MiB", nvme_bytes="0")
    count = 400
    missing = {0, 5, 127, 128, 129, 200, 201, count - 1}
    with d.client(transport="shm") as c:
        ns = c.register_namespace(Namespace(layout(BLOCK), cache_salt="misses"))
        hashes = ChainHasher().chain(np.arange(16 * count), 16)
        data = blocks_of(count, BLOCK, seed=1)
        assert c.put(ns, hashes, data) == ["stored"] * count
        assert c.delete(ns, [hashes[i] for i in sorted(missing)]) == len(missing)
        sizes, outs = read_back(c, ns, hashes, BLOCK)
        assert [i for i, s in enumerate(sizes) if s is None] == sorted(missing)
        for i in range(count):
            if i in missing:
                assert not outs[i].any(), f"a missed block's buffer was written ({i})"
            else:
                assert sizes[i] == BLOCK and np.array_equal(outs[i], data[i]), f"block {i}"
        assert [read_back(c, ns, [h], BLOCK)[0][0] for h in hashes] == sizes   # one block at a time
        assert c.stats()["leases"] == 0


@pytest.mark.parametrize("block_bytes", [64 * 1024, 256 * 1024, 1024 * 1024])
def test_a_get_larger_than_the_arena_stages_it_lease_by_lease(daemon_factory, block_bytes):
    """8 MiB of arena, 24 MiB of blocks: most live on NVMe only when the get starts; each lease
    stages what the arena has room for, so few blocks are left to stream."""
    d = daemon_factory("--metrics-port", "0", cpu_bytes="8MiB", nvme_bytes="64MiB")
    count = (24 << 20) // block_bytes
    with d.client(transport="shm") as c:
        ns = c.register_namespace(Namespace(layout(block_bytes), cache_salt="staging"))
        hashes = ChainHasher(seed=2).chain(np.arange(16 * count), 16)
        data = blocks_of(count, block_bytes, seed=2)
        assert set(c.put(ns, hashes, data)) <= {"stored", "persisted"}
        for _ in range(2):   # a second get finds other blocks in the arena than the first
            sizes, outs = read_back(c, ns, hashes, block_bytes)
            assert sizes == [block_bytes] * count
            assert all(np.array_equal(o, b) for o, b in zip(outs, data))
        assert wire_bytes(d, "grpc", "out") <= 0.1 * 2 * count * block_bytes   # staged, not streamed
        assert c.stats()["leases"] == 0
