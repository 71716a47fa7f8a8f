"""The store engine over real tiers: demotion, promotion, leases, two-phase ops, damage, bad input."""

from __future__ import annotations

import os
import random
import subprocess
import threading

import numpy as np
import pytest

from kvstore.errors import (BlockTooLarge, InvalidArgument, LeaseExpired, QuotaExceeded, StoreFull, TierIOError,
                            UnknownNamespace, WrongBlockSize)
from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.store import Store, StoreConfig, StoreListener
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.nvme import HEADER_BYTES, NvmeTier
from mounts import mounted

SLOT = 64 * 1024
BLOCK = 2 * SLOT  # two slots per block, so churn makes multi-extent blocks
NVME_FP = HEADER_BYTES + BLOCK


def layout(block_bytes: int = BLOCK, **kw) -> KVLayout:
    return KVLayout(model="test/model", num_layers=2, num_kv_heads=1, head_dim=64, dtype="bfloat16",
                    block_tokens=16, block_bytes=block_bytes, **kw)


def data(h: bytes, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, size, dtype=np.uint8)


def chain(n: int, start: int = 0) -> list[bytes]:
    return ChainHasher().chain(list(range(start, start + 16 * n)), 16)


class Harness:
    """A store with a CPU arena of ``cpu_blocks`` and an NVMe directory of ``nvme_blocks``."""

    def __init__(self, path: str | None, cpu_blocks: int = 8, nvme_blocks: int = 64, gpu_blocks: int = 0,
                 **config) -> None:
        tiers = []
        if gpu_blocks:
            tiers.append(GpuTier(gpu_blocks * BLOCK, slot_bytes=SLOT, device="cpu"))
        if cpu_blocks:
            tiers.append(CpuTier(cpu_blocks * BLOCK, slot_bytes=SLOT))
        if path is not None:
            tiers.append(NvmeTier(path, nvme_blocks * NVME_FP))
        self.store = Store(tiers, StoreConfig(**config))
        self.ns = self.store.register_namespace(Namespace(layout()))

    def put(self, hashes, parent=None):
        return self.store.put(self.ns, hashes, [data(h) for h in hashes], parent=parent)

    def check(self, hashes) -> list[bool]:
        """Every block present is byte-identical; returns which were present."""
        got = self.store.get(self.ns, hashes)
        for h, g in zip(hashes, got):
            if g is not None:
                assert g == data(h).tobytes(), "a wrong byte was served"
        return [g is not None for g in got]

    def tier_of(self, h: bytes) -> str | None:
        r = self.store.lookup(self.ns, [h], lease=False)
        return r.tiers[0] if r.num_hit else None

    def close(self):
        self.store.close()


@pytest.fixture
def harness(tmp_path):
    made = []

    def make(**kw):
        kw.setdefault("path", str(tmp_path / f"nvme{len(made)}"))
        h = Harness(**kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


# -- the cascade -------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["lru", "prefix"])
def test_fill_cpu_past_capacity_demotes_to_nvme_and_reads_back(harness, policy):
    h = harness(cpu_blocks=8, eviction_policy=policy)
    chains = [chain(10, start=1000 * c) for c in range(4)]
    for c in chains:
        assert h.put(c) == ["stored"] * 10
    every = [x for c in chains for x in c]
    s = h.store.stats()
    assert s["blocks"] == 40
    assert s["tiers"]["cpu"]["blocks"] == 8 and s["tiers"]["nvme"]["blocks"] == 32
    assert s["counters"]["demotions"] == 32
    h.store.config.promote_on_hit = False
    assert h.check(every) == [True] * 40
    assert h.store.contains(h.ns, every) == [True] * 40
    assert h.store.lookup(h.ns, chains[0]).num_hit == 10
    assert h.put(chains[0]) == ["exists"] * 10


def test_promotion_on_hit(harness):
    h = harness(cpu_blocks=4)
    c = chain(8)
    h.put(c)
    cold = [x for x in c if h.tier_of(x) == "nvme"]
    assert len(cold) == 4
    assert h.check(cold[:1]) == [True]
    assert h.tier_of(cold[0]) == "cpu"
    counters = h.store.stats()["counters"]
    assert counters["hits_nvme"] == 1 and counters["promotions"] == 1
    assert h.check(cold[:1]) == [True]
    assert h.store.stats()["counters"]["hits_cpu"] == 1
    # the NVMe copy is kept: evicting the promoted block again costs no write
    state = next(b for b in h.store.block_states() if b.namespace_id == h.ns and b.block_hash == cold[0])
    assert sorted(state.tiers) == [0, 1]
    assert h.store.stats()["tiers"]["nvme"]["blocks"] == 5  # 4 + the block demoted to make room


def test_lookup_lease_protects_from_eviction(harness):
    h = harness(path=None, cpu_blocks=4, eviction_policy="lru", lease_seconds=60)
    old = chain(4)
    h.put(old)
    assert h.store.lookup(h.ns, old[:2]).num_hit == 2  # leases the two oldest
    new = chain(2, start=5000)
    h.put(new)
    # LRU would have dropped old[0] and old[1]; they are leased, so old[2], old[3] went instead
    assert h.check(old) == [True, True, False, False]
    assert h.store.lookup(h.ns, old).num_hit == 2
    # everything leased or pinned: the store says so instead of dropping a leased block
    h.store.lookup(h.ns, new)
    with pytest.raises(StoreFull, match="pinned"):
        h.put(chain(1, start=9000))
    assert h.check(old[:2] + new) == [True] * 4


def test_lookup_lease_expires(harness):
    h = harness(path=None, cpu_blocks=2, eviction_policy="lru", lease_seconds=0.05)
    a = chain(2)
    h.put(a)
    h.store.lookup(h.ns, a)
    import time
    time.sleep(0.1)
    h.put(chain(1, start=77))  # the lease ran out, so a[0] may go
    assert h.check(a) == [False, True]


def _write_reserved(h: Harness, extents, payload: np.ndarray) -> None:
    arena = h.store.tiers[h.store.cpu_index].arena
    pos = 0
    for off, n in extents:
        arena[off:off + n] = payload[pos:pos + n]
        pos += n


def test_two_phase_store(harness):
    h = harness(cpu_blocks=8)
    c = chain(3)
    h.put(c[:1])
    lease = h.store.leases.prepare_store(h.ns, c, parent=None)
    assert lease.extents[0] is None  # already stored
    assert h.store.contains(h.ns, c) == [True, False, False]  # reserved blocks are invisible
    assert h.store.lookup(h.ns, c).num_hit == 1
    for x, ext in zip(c[1:], lease.extents[1:]):
        _write_reserved(h, ext, data(x))
    assert h.store.leases.complete_store(lease.id) == ["exists", "stored", "stored"]
    assert h.check(c) == [True] * 3
    with pytest.raises(LeaseExpired):
        h.store.leases.complete_store(lease.id)


def test_two_phase_store_abort_and_expiry_free_the_slots(harness):
    h = harness(cpu_blocks=4)
    cpu = h.store.tiers[h.store.cpu_index]
    lease = h.store.leases.prepare_store(h.ns, chain(3))
    assert cpu.used_bytes == 3 * BLOCK
    h.store.leases.abort_store(lease.id)
    assert cpu.used_bytes == 0 and h.store.stats()["blocks"] == 0
    lease = h.store.leases.prepare_store(h.ns, chain(2))
    assert h.store.leases.expire(now=lease.expires - 1) == 0
    assert h.store.leases.expire(now=lease.expires + 1) == 1
    assert cpu.used_bytes == 0
    with pytest.raises(LeaseExpired, match="unknown or expired"):
        h.store.leases.complete_store(lease.id)
    assert h.store.contains(h.ns, chain(2)) == [False, False]


def test_two_phase_load_promotes_pins_and_expires(harness):
    h = harness(cpu_blocks=4, eviction_policy="lru")
    c = chain(8)
    h.put(c)
    cold = [x for x in c if h.tier_of(x) == "nvme"][:2]
    lease = h.store.leases.prepare_load(h.ns, cold + [b"missing-block-hash"])
    assert len(lease.keys) == 2  # stops at the first miss
    arena = h.store.tiers[h.store.cpu_index].arena
    for x, ext in zip(cold, lease.extents):
        got = np.concatenate([arena[o:o + n] for o, n in ext])
        assert np.array_equal(got, data(x))
    h.put(chain(6, start=3000))  # heavy churn: the loaded blocks are pinned in the arena
    for x, ext in zip(cold, lease.extents):
        got = np.concatenate([arena[o:o + n] for o, n in ext])
        assert np.array_equal(got, data(x)), "a pinned block was overwritten"
    h.store.leases.complete_load(lease.id)
    with pytest.raises(LeaseExpired):
        h.store.leases.complete_load(lease.id)
    lease = h.store.leases.prepare_load(h.ns, cold)
    assert h.store.leases.expire(now=lease.expires + 1) == 1
    assert all(b.pins == 0 for b in h.store.block_states())


def test_write_through_acks_persisted(harness, tmp_path):
    h = harness(cpu_blocks=8, write_through=True)
    c = chain(4)
    assert h.put(c) == ["persisted"] * 4
    nvme = h.store.tiers[h.store.durable_index]
    assert all(os.path.exists(nvme.location(h.ns + x)[0]) for x in c)
    # write-back by default: "stored" until flushed
    wb = harness(cpu_blocks=8)
    assert wb.put(c) == ["stored"] * 4
    assert wb.store.flush() == 4 and wb.store.flush() == 0


def test_a_put_batch_reaches_nvme_with_one_flush_not_an_fsync_per_file(harness, tmp_path):
    """Group commit (issue 14): "persisted" follows one filesystem flush for the whole batch,
    through write-through and straight into an NVMe-only store alike."""
    h = harness(cpu_blocks=16, write_through=True)
    nvme = h.store.tiers[h.store.durable_index]
    before = nvme.stats()
    assert h.put(chain(8)) == ["persisted"] * 8
    after = nvme.stats()
    assert after["filesystem_flushes"] - before["filesystem_flushes"] == 1
    assert after["file_fsyncs"] == before["file_fsyncs"]
    alone = Store([NvmeTier(str(tmp_path / "alone"), 64 * NVME_FP)], StoreConfig())
    try:
        ns = alone.register_namespace(Namespace(layout()))
        c = chain(6)
        blocks = [data(x) for x in c]
        assert alone.put(ns, c, blocks) == ["persisted"] * 6
        assert alone.tiers[0].stats()["filesystem_flushes"] == 1 and alone.tiers[0].stats()["file_fsyncs"] == 0
        outs = [np.zeros(BLOCK, np.uint8) for _ in range(6)]
        assert alone.get_into(ns, c, outs) == [BLOCK] * 6
        assert all(np.array_equal(a, b) for a, b in zip(outs, blocks))
    finally:
        alone.close()


def test_a_strided_destination_is_refused_not_filled_through_a_copy(harness):
    h = harness(cpu_blocks=4)
    c = chain(1)
    h.put(c)
    strided = np.zeros((BLOCK, 2), np.uint8)[:, 0]
    with pytest.raises(InvalidArgument, match=r"outs\[0\].*not contiguous"):
        h.store.get_into(h.ns, c, [strided])
    assert not strided.any()


def test_a_block_with_many_children_keeps_its_chain_links_as_they_come_and_go(harness):
    """Children are kept in a tuple while few, a set past ``SMALL_FAMILY``; either way the prefix
    policy sees them: a parent with children in the CPU tier outlives its leaf siblings there, and
    once every child is deleted it is a leaf again, evicted before newer blocks."""
    h = harness(cpu_blocks=16, eviction_policy="prefix")
    root = chain(1, start=0)
    h.put(root)
    kids = [chain(2, start=100 * (k + 1))[1] for k in range(12)]   # 12 children of root
    for kid in kids:
        h.put([kid], parent=root[0])
    other = chain(3, start=50_000)
    h.put(other)   # the CPU tier is full now: 16 blocks
    assert h.check(root) == [True] and h.check(other + kids) == [True] * 15   # the root: least recently used
    assert h.store.delete(h.ns, kids[9:]) == 3   # the last children, past the tuple's
    h.put(chain(5, start=60_000))   # two victims: leaves, never the root with its 9 children
    assert h.tier_of(root[0]) == "cpu"
    assert h.store.delete(h.ns, kids[:9]) == 9
    h.put(chain(16, start=70_000))   # a full tier of new blocks: the childless root goes down too
    assert h.tier_of(root[0]) == "nvme" and h.check(root) == [True]


def test_delete_while_pinned(harness):
    h = harness(cpu_blocks=4)
    c = chain(2)
    h.put(c)
    lease = h.store.leases.prepare_load(h.ns, c)
    assert h.store.delete(h.ns, c) == 2
    assert h.store.contains(h.ns, c) == [False, False]
    assert h.store.lookup(h.ns, c).num_hit == 0
    assert h.check(c) == [False, False]
    arena = h.store.tiers[h.store.cpu_index].arena
    for x, ext in zip(c, lease.extents):  # the reader still sees intact bytes
        assert np.array_equal(np.concatenate([arena[o:o + n] for o, n in ext]), data(x))
    assert h.store.delete(h.ns, c) == 0
    h.store.leases.complete_load(lease.id)
    assert h.store.tiers[h.store.cpu_index].used_bytes == 0
    assert h.store.stats()["blocks"] == 0 and h.store.namespace_bytes(h.ns) == 0
    assert h.put(c) == ["stored", "stored"]  # and it can be stored again
    assert h.check(c) == [True, True]


def test_delete_removes_every_copy(harness):
    h = harness(cpu_blocks=2)
    c = chain(4)
    h.put(c)
    h.check(c)  # promotions: some blocks now have CPU and NVMe copies
    assert h.store.delete(h.ns, c) == 4
    assert h.store.stats()["tiers"]["nvme"]["blocks"] == 0
    assert h.store.stats()["tiers"]["cpu"]["blocks"] == 0
    nvme = h.store.tiers[-1]
    assert list(NvmeTier(nvme.path, nvme.capacity_bytes).recover()) == []   # no slot left with a header


# -- prefix-aware policy on whole chains -------------------------------------------------------------

def test_prefix_policy_keeps_the_head_of_a_long_chain_in_the_fastest_tier(harness):
    h = harness(cpu_blocks=8, eviction_policy="prefix")
    long = chain(40)
    h.put(long)
    tiers = [h.tier_of(x) for x in long]
    assert tiers[:7] == ["cpu"] * 7 and tiers[7:39] == ["nvme"] * 32, tiers  # + the newest block
    # unrelated traffic takes the chain's place in the arena from its tail, never from its head
    for i in range(3):
        h.put(chain(1, start=100_000 + 1000 * i))
    tiers = [h.tier_of(x) for x in long]
    assert tiers == ["cpu"] * 5 + ["nvme"] * 35, tiers
    # a reader uses the head again: now the unrelated blocks are the least recently used
    h.store.config.promote_on_hit = False
    assert h.check(long) == [True] * 40
    for i in range(3):
        h.put(chain(1, start=200_000 + 1000 * i))
    assert [h.tier_of(x) for x in long] == ["cpu"] * 5 + ["nvme"] * 35


def test_prefix_policy_a_new_chain_takes_over_from_an_old_one(harness):
    """The newest chain's head belongs in the fast tier; an old chain leaves it tail first."""
    h = harness(cpu_blocks=8, eviction_policy="prefix")
    old, new = chain(20), chain(20, start=50_000)
    h.put(old)
    h.put(new)
    assert [h.tier_of(x) for x in new][:7] == ["cpu"] * 7
    assert all(h.tier_of(x) == "nvme" for x in old)
    h.store.config.promote_on_hit = False
    assert h.check(old + new) == [True] * 40


def test_prefix_policy_promoted_prefix_stays_together(harness):
    h = harness(cpu_blocks=8, eviction_policy="prefix")
    a, b = chain(12), chain(12, start=50_000)
    h.put(a)
    h.put(b)
    assert h.check(a[:5]) == [True] * 5  # a reader streams a's head back into the arena
    tiers = [h.tier_of(x) for x in a]
    assert tiers[:5] == ["cpu"] * 5, tiers
    tiers_b = [h.tier_of(x) for x in b]
    assert tiers_b[0] == "cpu" and "cpu" not in tiers_b[tiers_b.index("nvme"):], tiers_b


def test_lru_on_a_long_chain_for_comparison(harness):
    h = harness(cpu_blocks=8, eviction_policy="lru")
    long = chain(40)
    h.put(long)
    assert [h.tier_of(x) for x in long][:2] == ["nvme", "nvme"]  # LRU demotes the head first


# -- damage on disk ----------------------------------------------------------------------------------

def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x80]))


@pytest.mark.parametrize("damage", ["bit-flip", "truncate"])
def test_corrupt_nvme_file_is_a_miss_and_counted(harness, damage):
    h = harness(cpu_blocks=2, promote_on_hit=False)
    c = chain(6)
    h.put(c)
    nvme = h.store.tiers[-1]
    on_nvme = [x for x in c if h.tier_of(x) == "nvme"]
    victim = max(on_nvme, key=lambda x: nvme.location(h.ns + x)[1])   # the last slot: a cut harms no other
    path, offset = nvme.location(h.ns + victim)
    if damage == "bit-flip":
        _flip(path, offset + HEADER_BYTES + BLOCK // 2)
    else:
        os.truncate(path, offset + HEADER_BYTES + 1000)
    present = h.check(c)
    assert present[c.index(victim)] is False
    assert sum(present) == 5
    counters = h.store.stats()["counters"]
    assert counters["corrupt_dropped"] == 1 and nvme.stats()["corrupt_dropped"] == 1
    with pytest.raises(KeyError):
        nvme.location(h.ns + victim)
    assert h.store.contains(h.ns, [victim]) == [False]
    assert h.put([victim], parent=c[c.index(victim) - 1] if c.index(victim) else None) == ["stored"]
    assert h.check([victim]) == [True]


def test_damaged_blocks_inside_a_run_read_are_misses_and_their_neighbours_exact(harness):
    """A get of a chain on NVMe reads neighbouring slots in runs (``reads._read_run``): two
    damaged blocks in the middle of one run are each a counted miss, every other block of the
    run is served exactly, none stays pinned, and stored again both are served."""
    h = harness(cpu_blocks=0, nvme_blocks=64, promote_on_hit=False)
    c = chain(24)
    assert h.put(c) == ["persisted"] * 24
    nvme = h.store.tiers[-1]
    offsets = [nvme.location(h.ns + x)[1] for x in c]
    assert offsets == sorted(offsets) and offsets[-1] - offsets[0] == 23 * NVME_FP   # neighbours
    for k in (3, 4):
        path, offset = nvme.location(h.ns + c[k])
        _flip(path, offset + HEADER_BYTES + 10 + k)
    outs = [np.zeros(BLOCK, np.uint8) for _ in c]
    got = h.store.get_into(h.ns, c, outs)
    assert [i for i, g in enumerate(got) if g is None] == [3, 4]
    assert all(np.array_equal(outs[i], data(x)) for i, x in enumerate(c) if i not in (3, 4))
    assert h.store.stats()["counters"]["corrupt_dropped"] == 2
    assert all(b.pins == 0 for b in h.store.block_states())
    assert h.put(c[3:5], parent=c[2]) == ["persisted"] * 2
    assert h.check(c) == [True] * 24


def test_corrupt_nvme_copy_with_a_cpu_copy_still_serves_from_cpu(harness):
    h = harness(cpu_blocks=4, write_through=True)
    c = chain(2)
    h.put(c)
    path, offset = h.store.tiers[-1].location(h.ns + c[0])
    _flip(path, offset + HEADER_BYTES + 3)
    assert h.check(c) == [True, True]  # the fastest copy is intact


def test_corrupt_file_found_at_restart_is_never_served(tmp_path):
    d = str(tmp_path / "n")
    h = Harness(d, cpu_blocks=2, write_through=True)
    c = chain(4)
    h.put(c)
    h.close()
    probe = NvmeTier(d, 1 << 30)
    list(probe.recover())
    (path, last), (_, second_last) = probe.location(h.ns + c[3]), probe.location(h.ns + c[2])
    probe.close()
    assert last > second_last
    os.truncate(path, last + HEADER_BYTES + 10)
    _flip(path, second_last + HEADER_BYTES + 77)
    again = Harness(d, cpu_blocks=2, promote_on_hit=False)
    assert again.store.stats()["counters"]["recovered_blocks"] == 3  # the torn one never got in
    assert again.check(c) == [True, True, False, False]
    assert again.store.stats()["counters"]["corrupt_dropped"] == 1
    again.close()


# -- bad input ---------------------------------------------------------------------------------------

def test_wrong_block_size_and_unknown_namespace(harness):
    h = harness(cpu_blocks=4)
    c = chain(3)
    h.put(c[:1])
    with pytest.raises(WrongBlockSize, match=r"blocks\[1\]: is 100 bytes; this namespace's blocks are 131072"):
        h.store.put(h.ns, c, [data(c[0]), np.zeros(100, np.uint8), data(c[2])])
    assert h.store.contains(h.ns, c) == [True, False, False]  # nothing half-written, nothing lost
    other = Namespace(layout(), tenant="someone-else").id
    for call in (lambda: h.store.put(other, c[:1], [data(c[0])]), lambda: h.store.get(other, c),
                 lambda: h.store.lookup(other, c), lambda: h.store.delete(other, c)):
        with pytest.raises(UnknownNamespace, match="namespace_id: unknown namespace"):
            call()
    with pytest.raises(InvalidArgument, match="hashes"):
        h.store.put(h.ns, [b""], [data(c[0])])
    with pytest.raises(InvalidArgument, match="outs"):
        h.store.get_into(h.ns, c[:1], [np.zeros(10, np.uint8)])
    with pytest.raises(InvalidArgument, match="blocks"):
        h.store.put(h.ns, c, [data(c[0])])
    assert h.check(c[:1]) == [True]


def test_block_larger_than_every_tier(harness):
    h = harness(cpu_blocks=2, nvme_blocks=2)
    h.put(chain(1))
    with pytest.raises(BlockTooLarge, match="exceed every tier"):
        h.store.register_namespace(Namespace(layout(block_bytes=64 << 20)))
    assert h.check(chain(1)) == [True]


def test_block_larger_than_the_cpu_tier_goes_to_nvme(harness):
    h = harness(cpu_blocks=1)  # a 2-slot arena
    big = h.store.register_namespace(Namespace(layout(block_bytes=3 * SLOT)))
    c = chain(2)
    payloads = [data(x, 3 * SLOT) for x in c]
    assert h.store.put(big, c, payloads) == ["persisted", "persisted"]  # straight to the durable tier
    got = h.store.get(big, c)
    assert got == [p.tobytes() for p in payloads]
    assert h.store.stats()["counters"]["promotion_failures"] == 2  # cannot promote: served from NVMe
    assert h.store.lookup(big, c).tiers == ["nvme", "nvme"]


def test_nvme_directory_unwritable(tmp_path):
    blocker = tmp_path / "plain-file"
    blocker.write_text("x")
    with pytest.raises(TierIOError, match=r"plain-file/nvme is not writable"):
        NvmeTier(str(blocker / "nvme"), 1 << 20)
    with mounted("tmpfs", "size=1m") as m:
        subprocess.run(["mount", "-o", "remount,ro", m], check=True)
        with pytest.raises(TierIOError, match="not writable: Read-only file system"):
            NvmeTier(os.path.join(m, "nvme"), 1 << 20)


def test_nvme_full_raises_and_keeps_what_was_stored():
    with mounted("tmpfs", "size=1m") as m:
        # the tier believes it has 64 blocks of room; the filesystem holds about 7
        h = Harness(m, cpu_blocks=0, nvme_blocks=64)
        c = chain(12)
        stored = []
        with pytest.raises(TierIOError, match="disk full"):
            for x in c:
                h.store.put(h.ns, [x], [data(x)], parent=stored[-1] if stored else None)
                stored.append(x)
        assert 2 <= len(stored) < 12
        assert h.check(stored) == [True] * len(stored)
        assert h.store.contains(h.ns, c[len(stored):len(stored) + 1]) == [False]
        assert not any(n.endswith(".tmp") for n in os.listdir(m))
        nvme = h.store.tiers[-1]
        assert nvme.used_bytes == len(stored) * NVME_FP
        h.store.delete(h.ns, stored[-2:])
        h.put([c[len(stored)]], parent=None)  # room again after deleting
        h.close()


def test_a_batch_that_fills_the_disk_keeps_its_leading_blocks_and_nothing_after():
    """Disk-tier writes of one put run several at once (``puts.DiskWrites``); when one fails, the
    blocks before it stay and are served, none after it is left behind, half-written or counted."""
    with mounted("tmpfs", "size=1m") as m:
        h = Harness(m, cpu_blocks=0, nvme_blocks=64)
        c = chain(12)
        with pytest.raises(TierIOError, match="disk full"):
            h.put(c)
        present = h.store.contains(h.ns, c)
        kept = present.index(False)
        assert 2 <= kept < 12 and not any(present[kept:])
        assert h.check(c[:kept]) == [True] * kept
        assert not any(n.endswith(".tmp") for n in os.listdir(m))
        assert h.store.tiers[-1].used_bytes == kept * NVME_FP
        h.close()
        assert len(list(NvmeTier(m, 64 * NVME_FP).recover())) == kept   # no slot of a dropped block


# -- everything at once ------------------------------------------------------------------------------

@pytest.mark.parametrize("tiers", ["cpu+nvme", "gpu+cpu+nvme"])
def test_random_workload_never_serves_a_wrong_byte(harness, tiers):
    """Puts, gets, two-phase loads and deletes in a seeded random mix on tiny tiers, so every
    path (demotion chains, promotion into a full arena, multi-extent blocks) runs many times."""
    h = harness(cpu_blocks=5, nvme_blocks=30, gpu_blocks=3 if tiers.startswith("gpu") else 0)
    # a second namespace whose blocks take one slot: mixed sizes fragment the arena
    small = h.store.register_namespace(Namespace(layout(block_bytes=SLOT - 100)))
    sizes = {h.ns: BLOCK, small: SLOT - 100}
    rng = random.Random(7)
    chains = [(rng.choice(list(sizes)), chain(6, start=10_000 * i)) for i in range(12)]
    arena = h.store.tiers[h.store.cpu_index].arena
    for _ in range(500):
        ns, c = rng.choice(chains)
        size = sizes[ns]
        op = rng.random()
        if op < 0.35:
            n = rng.randint(1, 6)
            h.store.put(ns, c[:n], [data(x, size) for x in c[:n]])
        elif op < 0.7:
            n = rng.randint(1, 6)
            for x, g in zip(c[:n], h.store.get(ns, c[:n])):
                assert g is None or g == data(x, size).tobytes(), "a wrong byte was served"
        elif op < 0.9:
            lease = h.store.leases.prepare_load(ns, c[:rng.randint(1, 4)])
            for key, ext in zip(lease.keys, lease.extents):
                got = np.concatenate([arena[o:o + n] for o, n in ext])
                assert np.array_equal(got, data(key[16:], size)), "prepare_load exposed wrong bytes"
            h.store.leases.complete_load(lease.id)
        else:
            h.store.delete(ns, c[rng.randint(0, 5):])
    s = h.store.stats()
    assert s["counters"]["demotions"] > 20 and s["counters"]["promotions"] > 20
    assert s["counters"].get("corrupt_dropped", 0) == 0
    for i, t in enumerate(h.store.tiers):
        assert t.used_bytes == sum(t.footprint(sizes[b.namespace_id]) for b in h.store.block_states()
                                   if i in b.tiers)


@pytest.mark.parametrize("policy", ["lru", "prefix"])
def test_recovered_blocks_serve_evict_delete_and_come_back_across_restarts(tmp_path, policy):
    """A warm restart holds its blocks as rows of their slabs' columns (``RecoveredRows``) behind
    one shared stand-in per size (``PlainCopy``), no record each: a seeded random mix of puts,
    gets, two-phase loads and deletes, restarted every 80 operations, serves every byte exactly
    while recovered blocks are promoted, evicted from a full NVMe tier, deleted and stored again,
    and each tier's accounting matches the blocks the index names."""
    path = str(tmp_path / "n")
    rng = random.Random(11)
    chains = [chain(6, start=10_000 * i) for i in range(10)]
    recovered = 0
    for restart in range(5):
        h = Harness(path, cpu_blocks=4, nvme_blocks=24, eviction_policy=policy)
        recovered += h.store.stats()["counters"].get("recovered_blocks", 0)
        if restart:
            nvme = h.store.tiers[-1]
            held = [b for b in h.store.block_states() if b.tiers]
            assert held and nvme.stats()["blocks"] == len(held)
            assert h.store.stats()["tiers"]["nvme"]["codec"]["held_raw_blocks"] == len(held)
            b = held[0]
            assert nvme.record(b.namespace_id + b.block_hash).stored_size == BLOCK
        arena = h.store.tiers[h.store.cpu_index].arena
        for _ in range(80):
            c = rng.choice(chains)
            op = rng.random()
            if op < 0.35:
                n = rng.randint(1, 6)
                h.put(c[:n])
            elif op < 0.7:
                h.check(c[:rng.randint(1, 6)])
            elif op < 0.85:
                lease = h.store.leases.prepare_load(h.ns, c[:rng.randint(1, 4)])
                for key, ext in zip(lease.keys, lease.extents):
                    got = np.concatenate([arena[o:o + n] for o, n in ext])
                    assert np.array_equal(got, data(key[16:])), "prepare_load exposed wrong bytes"
                h.store.leases.complete_load(lease.id)
            else:
                h.store.delete(h.ns, c[rng.randint(0, 5):])
        assert h.store.stats()["counters"].get("corrupt_dropped", 0) == 0
        for i, t in enumerate(h.store.tiers):
            assert t.used_bytes == sum(t.footprint(BLOCK) for b in h.store.block_states() if i in b.tiers)
        footprint = h.store.admin.footprints([h.ns])[h.ns]
        assert footprint.tiers["nvme"]["blocks"] == sum(1 for b in h.store.block_states() if 1 in b.tiers)
        h.close()
    assert recovered > 40


def test_concurrent_puts_and_gets(harness):
    h = harness(cpu_blocks=6, nvme_blocks=200)
    errors = []

    def worker(w: int) -> None:
        try:
            for r in range(6):
                c = chain(5, start=1_000_000 * w + 100 * r)
                h.put(c)
                assert h.check(c) == [True] * 5
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert h.store.stats()["blocks"] == 4 * 6 * 5


# -- the seams other layers use ----------------------------------------------------------------------

class Recorder(StoreListener):
    def __init__(self) -> None:
        self.events: list[tuple[str, bytes, list[bytes]]] = []

    def blocks_added(self, namespace_id, block_hashes):
        self.events.append(("added", namespace_id, block_hashes))

    def blocks_removed(self, namespace_id, block_hashes):
        self.events.append(("removed", namespace_id, block_hashes))


def test_subscribe_returns_a_snapshot_then_events_until_unsubscribed(harness):
    h = harness(path=None, cpu_blocks=8)
    held = chain(3)
    h.put(held)
    listener = Recorder()
    assert h.store.subscribe(listener) == {h.ns: held}
    new = chain(1, start=500)
    h.put(new)
    h.store.delete(h.ns, held[:1])
    assert listener.events == [("added", h.ns, new), ("removed", h.ns, held[:1])]
    h.store.unsubscribe(listener)
    h.put(chain(1, start=900))
    assert len(listener.events) == 2


def test_all_tenants_pins_together_hold_at_most_half_the_cpu_tier(harness):
    """With no per-tenant pin limit, two tenants pin half of an 8-block CPU tier between them; a
    third tenant's pin of one more block is refused whole, and its puts still land in the CPU tier
    (evicting only what is not pinned), every pinned block staying there too."""
    h = harness(cpu_blocks=8, eviction_policy="lru")
    h.store.admin.set_limits({}, None)
    ns = {t: h.store.register_namespace(Namespace(layout(), tenant=t)) for t in "abc"}
    mine = {t: chain(4, start=1000 * k) for k, t in enumerate("abc")}
    for t in "ab":
        h.store.put(ns[t], mine[t], [data(x) for x in mine[t]])
        assert h.store.admin.pins.pin(h.store.namespace(ns[t]), mine[t][:2]).pinned == 2
    with pytest.raises(QuotaExceeded, match="more than the .* bytes \\(50% of it\\) pins may hold together"):
        h.store.admin.pins.pin(h.store.namespace(ns["c"]), chain(1, start=9000))
    assert h.store.admin.pins.by_tenant() == {"a": 2 * BLOCK, "b": 2 * BLOCK}   # nothing of c's
    for k in range(3):   # c's traffic pushes everything unpinned out of the CPU tier
        part = chain(4, start=20_000 + 1000 * k)
        h.store.put(ns["c"], part, [data(x) for x in part])
        assert [h.store.lookup(ns["c"], [x], lease=False).tiers for x in part] == [["cpu"]] * 4
    for t in "ab":
        assert h.store.lookup(ns[t], mine[t][:2], lease=False).tiers == ["cpu"] * 2


def test_pinned_keeps_a_block_from_eviction_and_gives_none_for_a_missing_one(harness):
    h = harness(path=None, cpu_blocks=2, eviction_policy="lru")
    c = chain(2)
    h.put(c)
    with h.store.pinned(h.ns, b"missing-block-hash") as block:
        assert block is None
    with h.store.pinned(h.ns, c[0]) as block:
        assert block.tier == "cpu" and block.record.raw_size == BLOCK and block.record.codec == 0
        assert np.array_equal(np.concatenate(block.pieces()), data(c[0]))
        h.put(chain(1, start=700))  # LRU would take c[0]; it is pinned, so c[1] goes
        assert h.store.contains(h.ns, c) == [True, False]
        out = np.empty(BLOCK, np.uint8)
        assert block.read_into(out) == BLOCK and np.array_equal(out, data(c[0]))
    h.put(chain(1, start=800))  # unpinned again (and the pin was no read): now it goes first
    assert h.store.contains(h.ns, c[:1]) == [False]


def test_pinned_block_on_nvme_is_read_into_a_buffer(harness):
    h = harness(cpu_blocks=1, promote_on_hit=False)
    c = chain(2)
    h.put(c)
    assert h.tier_of(c[0]) == "nvme"
    with h.store.pinned(h.ns, c[0]) as block:
        assert block.tier == "nvme" and block.pieces() is None
        out = np.empty(BLOCK, np.uint8)
        assert block.read_into(out) == BLOCK and np.array_equal(out, data(c[0]))


def test_shared_arena_describes_the_cpu_segment(harness):
    h = harness(cpu_blocks=4)
    cpu = h.store.tiers[h.store.cpu_index]
    arena = h.store.shared_arena()
    st = os.stat(cpu.segment_path)
    assert (arena.path, arena.nbytes, arena.capacity_bytes) == (cpu.segment_path, cpu.arena.nbytes, 4 * BLOCK)
    assert (arena.st_dev, arena.st_ino) == (st.st_dev, st.st_ino)
    c = chain(1)
    h.put(c)
    lease = h.store.leases.prepare_load(h.ns, c)
    assert np.array_equal(np.concatenate(arena.views(lease.extents[0])), data(c[0]))
    h.store.leases.complete_load(lease.id)
    assert h.store.largest_block_bytes == 64 * NVME_FP
    assert harness(cpu_blocks=0).store.shared_arena() is None


def test_blocks_that_fill_slots_badly_are_warned_of_and_their_slack_counted(caplog):
    """64 KiB blocks in 256 KiB slots leave three quarters of the arena unused: the operator is
    told once per namespace, at registration, and the CPU tier's stats count the slack as it fills."""
    import logging

    slot, small_block = 256 * 1024, 64 * 1024
    store = Store([CpuTier(16 * slot, slot_bytes=slot)])
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore.store"):
            small = store.register_namespace(Namespace(layout(small_block)))
            store.register_namespace(Namespace(layout(small_block)))   # again: the same namespace
            store.register_namespace(Namespace(layout(small_block), cache_salt="b"))   # another, same size
            whole = store.register_namespace(Namespace(layout(2 * slot)))   # two whole slots: nothing to say
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "75% of it unused" in warnings[0] and "cpu_slot_bytes" in warnings[0] and "cpu tier" in warnings[0]
        short, long = chain(4), chain(2, start=5000)
        assert store.put(small, short, [data(h, small_block) for h in short]) == ["stored"] * 4
        assert store.put(whole, long, [data(h, 2 * slot) for h in long]) == ["stored"] * 2
        cpu = store.stats()["tiers"]["cpu"]
        assert cpu["payload_bytes"] == 4 * small_block + 2 * 2 * slot
        assert cpu["slack_bytes"] == 4 * (slot - small_block) == cpu["used_bytes"] - cpu["payload_bytes"]
        assert store.delete(small, short) + store.delete(whole, long) == 6
        cpu = store.stats()["tiers"]["cpu"]
        assert cpu["payload_bytes"] == cpu["slack_bytes"] == 0
    finally:
        store.close()
