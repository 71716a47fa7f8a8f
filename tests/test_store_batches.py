"""Batched per-call work in the store (issue 14): a put reserves and publishes runs of raw blocks
under one lock acquisition each (``Cascade.reserve_run``), and a get plans, reads and completes
its blocks as one batch (``reads.read_blocks``).
Each must behave exactly as the block-by-block path it shortcuts: same results, same listener
events in the same order, same eviction order, same counters, pins and quota charges."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest

from kvstore.errors import BlockCorrupt, QuotaExceeded, StoreFull
from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.store import Store, StoreConfig, StoreListener, leases, puts, reads
from kvstore.store import store as store_module
from kvstore.store.cascade import Cascade
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.nvme import HEADER_BYTES, NvmeTier
from proc_io import process_write_calls

SLOT = 64 * 1024
BLOCK = 2 * SLOT


def layout(tenant_block: int = BLOCK) -> KVLayout:
    return KVLayout(model="test/batches", num_layers=2, num_kv_heads=1, head_dim=64, dtype="bfloat16",
                    block_tokens=16, block_bytes=tenant_block)


def data(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


def chain(n: int, start: int = 0) -> list[bytes]:
    return ChainHasher().chain(list(range(start, start + 16 * n)), 16)


class Events(StoreListener):
    def __init__(self) -> None:
        self.log: list[tuple] = []

    def per_block(self) -> dict[bytes, list]:
        """Each block's own events, in order: what ``listeners`` promises (a block's "added", then
        its "moved", before its "removed"); a put that makes room for a run first demotes its
        victims before the run's blocks are added, so events of different blocks may interleave
        otherwise than block by block."""
        out: dict[bytes, list] = {}
        for event in self.log:
            if event[0] == "moved":
                out.setdefault(event[1], []).append(("moved", event[2]))
            else:
                for h in event[1]:
                    out.setdefault(h, []).append((event[0],))
        return out

    def one_per_block(self) -> list[tuple]:
        """The log with each "added" or "removed" of several blocks split into one per block, in
        order (blocks deleted or evicted together are announced in one call)."""
        out: list[tuple] = []
        for event in self.log:
            if event[0] == "moved":
                out.append(event)
            else:
                out.extend((event[0], [h]) for h in event[1])
        return out

    def blocks_added(self, namespace_id, block_hashes):
        self.log.append(("added", list(block_hashes)))

    def blocks_removed(self, namespace_id, block_hashes):
        self.log.append(("removed", list(block_hashes)))

    def block_moved(self, namespace_id, block_hash, fastest_tier):
        self.log.append(("moved", block_hash, fastest_tier))


def make_store(tmp_path, name: str, cpu_blocks: int = 8, nvme_blocks: int = 64, slot: int = SLOT,
               segment_bytes: int | None = None, **config) -> tuple[Store, bytes]:
    tiers = [CpuTier(cpu_blocks * BLOCK, slot_bytes=slot, segment_bytes=segment_bytes)]
    if nvme_blocks:
        tiers.append(NvmeTier(str(tmp_path / name), nvme_blocks * (HEADER_BYTES + BLOCK)))
    store = Store(tiers, StoreConfig(**config))
    return store, store.register_namespace(Namespace(layout(), tenant="t"))


def _resident_block_by_block(cascade, ns, hashes, dsts, accept=()):
    """A get whose blocks are all absent or in RAM, one ``read_blocks`` call per block (what one batch
    of them must equal); any other get as it is (its slow-tier reads overlap in any case)."""
    slow = reads.slow_from(cascade)
    with cascade.lock:
        below = any((e := cascade.index.visible(ns, h)) is not None and e.fastest >= slow for h in hashes)
    if below:
        return reads.read_blocks(cascade, ns, hashes, dsts, accept)
    return [reads.read_blocks(cascade, ns, [h], [dst], accept)[0] for h, dst in zip(hashes, dsts)]


@contextlib.contextmanager
def block_by_block(monkeypatch, room_ahead: bool = True):
    """The store as it was before batching: every put block through ``reserve`` (so room is made
    for it alone), every get block read by a call of its own, every written block published on its
    own, every deleted or evicted block dropped on its own. ``room_ahead``: victims written down ahead of a run stay so here too (where they go to a
    tier below, the blocks stay present, so only the order of events differs); without it, room is
    made block by block as well (where victims are dropped: making room ahead here, before a
    leading block is found present, would drop it)."""
    publish_run, drop_entries = Cascade.publish_run, Cascade.drop_entries
    with monkeypatch.context() as m:
        m.setattr(Cascade, "drop_entries", lambda self, entries: [drop_entries(self, [e]) for e in entries])
        if not room_ahead:
            for module in (puts, leases):
                m.setattr(module, "reserve_next", lambda *a, **k: [])
        m.setattr(Cascade, "reserve_run", lambda self, *a, **k: [])
        m.setattr(Cascade, "publish_run", lambda self, entries, payloads: [
            k for k, (entry, data) in enumerate(zip(entries, payloads)) if publish_run(self, [entry], [data])])
        m.setattr(store_module, "read_blocks", _resident_block_by_block)
        yield


def run_workload(store: Store, ns: bytes, seed: int) -> list:
    """A random mix of puts (chains longer than the CPU tier among them), gets, lookups, deletes
    and two-phase operations; returns everything each call answered."""
    rng = random.Random(seed)
    chains = [chain(rng.randint(1, 14), start=1000 * k) for k in range(6)]
    out: list = []
    outs = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(16)]
    for step in range(60):
        c = rng.choice(chains)
        a = rng.randrange(len(c))
        part = c[a:a + rng.randint(1, len(c))]
        parent = c[a - 1] if a else None
        op = rng.choice(["put", "put", "get", "get", "lookup", "delete", "two_phase_store", "two_phase_load"])
        if op == "put":
            if rng.random() < 0.25:   # a hash twice in one put (a hostile or confused client)
                part = part + part[:rng.randint(1, len(part))]
            out.append(store.put(ns, part, [data(h) for h in part], parent=parent))
        elif op == "get":
            got = store.get_into(ns, part, outs[:len(part)])
            out.append(got)
            for h, n, o in zip(part, got, outs):
                if n is not None:
                    assert np.array_equal(o[:n], data(h)), "a wrong byte was served"
        elif op == "lookup":
            r = store.lookup(ns, part, lease=False)
            out.append((r.num_hit, r.tiers))
        elif op == "delete":
            out.append(store.delete(ns, part))
        elif op == "two_phase_store":
            try:
                lease = store.leases.prepare_store(ns, part, parent)
            except StoreFull:
                out.append("full")
                continue
            arena = store.shared_arena()
            for h, ext in zip(part, lease.extents):
                if ext is not None:
                    views = arena.views(ext)
                    pos = 0
                    for v in views:
                        v[:] = data(h)[pos:pos + v.nbytes]
                        pos += v.nbytes
            out.append(store.leases.complete_store(lease.id))
        else:
            lease = store.leases.prepare_load(ns, part)
            out.append([len(e) for e in lease.extents])
            store.leases.complete_load(lease.id)
    out.append(sorted((s.block_hash, s.tiers, s.pins, s.visible) for s in store.block_states()))
    out.append(store.tenant_bytes("t"))
    return out


#: how the CPU tier's arena is carved: a block in two slots, in one slot (taken a run at a time by
#: ``SlotTable.allocate_run``), in one slot of tenant segments
ARENAS = {"two_slots": {}, "one_slot": {"slot": BLOCK}, "segments": {"slot": BLOCK, "segment_bytes": 2 * BLOCK}}


@pytest.mark.parametrize("policy", ["lru", "prefix", "s3fifo"])
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("arena", sorted(ARENAS))
@pytest.mark.parametrize("below", ["nvme", "nothing"])
def test_batched_paths_answer_and_notify_exactly_as_block_by_block(tmp_path, monkeypatch, policy, seed, arena, below):
    """``below``: what is under the CPU tier, where its victims go (written to NVMe, or dropped)."""
    nvme_blocks = 64 if below == "nvme" else 0
    batched, ns_a = make_store(tmp_path, "a", eviction_policy=policy, nvme_blocks=nvme_blocks, **ARENAS[arena])
    single, ns_b = make_store(tmp_path, "b", eviction_policy=policy, nvme_blocks=nvme_blocks, **ARENAS[arena])
    ev_a, ev_b = Events(), Events()
    batched.subscribe(ev_a)
    single.subscribe(ev_b)
    try:
        got_a = run_workload(batched, ns_a, seed)
        with block_by_block(monkeypatch, room_ahead=below == "nvme"):
            got_b = run_workload(single, ns_b, seed)
        assert got_a == got_b
        assert ev_a.per_block() == ev_b.per_block()
        if policy == "s3fifo":   # LRU and prefix-aware tiers make room for a run ahead of it (puts.reserve_next)
            assert ev_a.one_per_block() == ev_b.one_per_block()
        counters_a, counters_b = batched.stats()["counters"], single.stats()["counters"]
        assert counters_a == counters_b
    finally:
        batched.close()
        single.close()


def test_every_added_block_is_followed_by_its_tier_before_the_next(tmp_path):
    store, ns = make_store(tmp_path, "ev", cpu_blocks=64, nvme_blocks=0)
    ev = Events()
    store.subscribe(ev)
    hashes = chain(10)
    assert store.put(ns, hashes, [data(h) for h in hashes]) == ["stored"] * 10
    assert ev.log == [e for h in hashes for e in (("added", [h]), ("moved", h, 0))]
    store.close()


def test_quota_reached_inside_a_batch_keeps_the_blocks_before_it(tmp_path):
    store, ns = make_store(tmp_path, "q", cpu_blocks=64, nvme_blocks=0, tenant_quotas={"t": 5 * BLOCK})
    hashes = chain(8)
    with pytest.raises(QuotaExceeded):
        store.put(ns, hashes, [data(h) for h in hashes])
    assert store.contains(ns, hashes) == [True] * 5 + [False] * 3
    assert store.tenant_bytes("t") == 5 * BLOCK
    assert store.stats()["counters"]["put_rejected_quota"] == 1
    store.close()


def test_a_copy_failing_inside_a_run_publishes_the_blocks_before_and_frees_the_rest(tmp_path, monkeypatch):
    store, ns = make_store(tmp_path, "w", cpu_blocks=64, nvme_blocks=0)
    ev = Events()
    store.subscribe(ev)
    writes = []
    real = CpuTier.write_key   # what a run calls for a block of several slots (``CpuTier.write_keys``)

    def failing(self, key, payload):
        writes.append(key)
        if len(writes) == 3:
            raise OSError("disk on fire")
        real(self, key, payload)

    monkeypatch.setattr(CpuTier, "write_key", failing)
    hashes = chain(6)
    with pytest.raises(OSError):
        store.put(ns, hashes, [data(h) for h in hashes])
    assert store.contains(ns, hashes) == [True, True] + [False] * 4
    assert [s.block_hash for s in store.block_states()] == hashes[:2]
    assert store.tenant_bytes("t") == 2 * BLOCK
    assert store.tiers[0].used_bytes == 2 * BLOCK
    assert [e[0] for e in ev.log] == ["added", "moved"] * 2
    store.close()


def test_a_corrupt_copy_in_a_batched_get_is_dropped_and_the_next_copy_served(tmp_path, monkeypatch):
    store, ns = make_store(tmp_path, "c", write_through=True)
    hashes = chain(4)
    assert store.put(ns, hashes, [data(h) for h in hashes]) == ["persisted"] * 4
    real = CpuTier.read_many_into
    bad = store.namespace(ns).id + hashes[2]

    def corrupt(self, keys, outs):   # the batch's CPU copies are read with one call
        return [BlockCorrupt("flipped bit") if key == bad else n for key, n in zip(keys, real(self, keys, outs))]

    monkeypatch.setattr(CpuTier, "read_many_into", corrupt)
    outs = [np.zeros(BLOCK, dtype=np.uint8) for _ in hashes]
    assert store.get_into(ns, hashes, outs) == [BLOCK] * 4
    for h, o in zip(hashes, outs):
        assert np.array_equal(o, data(h))
    counters = store.stats()["counters"]
    assert counters["corrupt_dropped"] == 1
    assert (counters["hits_cpu"], counters["hits_nvme"]) == (3, 1)
    assert all(s.pins == 0 for s in store.block_states())
    store.close()


def test_a_failed_read_in_a_batched_get_leaves_nothing_pinned(tmp_path, monkeypatch):
    store, ns = make_store(tmp_path, "f", nvme_blocks=0)
    hashes = chain(4)
    store.put(ns, hashes, [data(h) for h in hashes])
    real = CpuTier.read_many_into

    def failing(self, keys, outs):   # the batch's CPU copies are read with one call
        real(self, keys[:2], outs[:2])
        raise OSError("gone")

    monkeypatch.setattr(CpuTier, "read_many_into", failing)
    with pytest.raises(OSError):
        store.get_into(ns, hashes, [np.zeros(BLOCK, dtype=np.uint8) for _ in hashes])
    assert all(s.pins == 0 and s.visible for s in store.block_states())
    assert store.stats()["counters"].get("hits_cpu", 0) == 0
    store.close()


def test_a_put_onto_a_disk_first_tier_keeps_few_blocks_invisible_and_publishes_in_order(tmp_path, monkeypatch):
    """Disk writes go in groups of up to ``puts.WRITE_GROUP_BYTES`` (one ``pwritev`` and one
    record write each), a few groups at once (``puts.WRITES_IN_FLIGHT``), each block published in
    order once its group's write is over: when a group's write starts, every block before the
    last few groups queued is visible, and none from that group on."""
    store = Store([NvmeTier(str(tmp_path / "only"), 16 * (HEADER_BYTES + BLOCK))], StoreConfig())
    ns = store.register_namespace(Namespace(layout(), tenant="t"))
    hashes = chain(12)
    monkeypatch.setattr(puts, "WRITE_GROUP_BYTES", 2 * BLOCK)
    groups, seen = [], {}
    real = NvmeTier.write_many_unsynced

    def write(self, records, payloads, durable=True):
        first = hashes.index(records[0].block_hash)
        assert [hashes.index(r.block_hash) for r in records] == list(range(first, first + len(records)))
        groups.append(first)
        seen[first] = store.contains(ns, hashes)
        return real(self, records, payloads, durable)

    monkeypatch.setattr(NvmeTier, "write_many_unsynced", write)
    assert store.put(ns, hashes, [data(h) for h in hashes]) == ["persisted"] * 12
    assert sorted(groups) == list(range(0, 12, 2))
    for j, first in enumerate(sorted(groups)):
        visible_before = sorted(groups)[max(0, j - puts.WRITES_IN_FLIGHT + 1)]
        assert all(seen[first][:visible_before]) and not any(seen[first][first:])
    assert store.tiers[0].stats()["file_fsyncs"] == 0
    store.close()


@pytest.mark.parametrize("write_through", [False, True])
def test_a_completed_store_lease_writes_through_what_the_writer_put_in_the_slots(tmp_path, write_through):
    """complete_store reads the slots only when something needs their bytes (write-through here)."""
    store, ns = make_store(tmp_path, "wt", write_through=write_through)
    hashes = chain(3)
    lease = store.leases.prepare_store(ns, hashes)
    arena = store.shared_arena()
    for h, ext in zip(hashes, lease.extents):
        pos = 0
        for v in arena.views(ext):
            v[:] = data(h)[pos:pos + v.nbytes]
            pos += v.nbytes
    assert store.leases.complete_store(lease.id) == ["persisted" if write_through else "stored"] * 3
    assert [s.tiers for s in store.block_states()] == [(0, 1) if write_through else (0,)] * 3
    if write_through:   # the NVMe copy holds the bytes the writer put in the slots
        out = np.zeros(BLOCK, dtype=np.uint8)
        for h in hashes:
            assert store.tiers[1].read_into(store.namespace(ns).id + h, out) == BLOCK
            assert np.array_equal(out, data(h))
    outs = [np.zeros(BLOCK, dtype=np.uint8) for _ in hashes]
    assert store.get_into(ns, hashes, outs) == [BLOCK] * 3
    assert all(np.array_equal(o, data(h)) for h, o in zip(hashes, outs))
    store.close()


def test_a_put_into_a_full_lru_tier_writes_its_victims_down_together(tmp_path):
    """A chain longer than a full LRU CPU tier: room for each run is made before it, its victims
    written to NVMe in a few large writes rather than one write each; every block is served exact
    and the CPU tier ends holding the chain's newest blocks, as block by block."""
    store, ns = make_store(tmp_path, "n", cpu_blocks=8, nvme_blocks=64, slot=BLOCK, eviction_policy="lru")
    try:
        first = chain(8)
        store.put(ns, first, [data(h) for h in first])   # the CPU tier full
        rest = chain(32, start=100_000)
        before = process_write_calls()
        assert store.put(ns, rest, [data(h) for h in rest]) == ["stored"] * 32
        writes = process_write_calls() - before
        demoted = store.stats()["counters"]["demotions"]
        assert demoted == 32 and writes <= demoted // 2, (writes, demoted)   # two calls per batch: slots, records
        assert {s.block_hash for s in store.block_states() if 0 in s.tiers} == set(rest[-8:])
        outs = [np.zeros(BLOCK, np.uint8) for _ in first + rest]
        assert store.get_into(ns, first + rest, outs) == [BLOCK] * 40
        assert all(np.array_equal(o, data(h)) for o, h in zip(outs, first + rest))
    finally:
        store.close()


def test_a_put_into_a_full_prefix_tier_writes_older_chains_down_together(tmp_path):
    """Under the prefix-aware policy, a new chain into a CPU tier full of older chains: room for
    each run is made before it, the older chains given up tail first and written to NVMe in a few
    large writes; the CPU tier ends holding what block by block leaves there (the newest chain and
    the newest older one), and every block is served exact."""
    store, ns = make_store(tmp_path, "p", cpu_blocks=32, nvme_blocks=64, slot=BLOCK, eviction_policy="prefix")
    try:
        old = [chain(8, start=10_000 * k) for k in range(4)]
        for c in old:
            store.put(ns, c, [data(h) for h in c])   # the CPU tier full of four chains
        new = chain(24, start=100_000)
        before = process_write_calls()
        assert store.put(ns, new, [data(h) for h in new]) == ["stored"] * 24
        writes = process_write_calls() - before
        demoted = store.stats()["counters"]["demotions"]
        assert demoted == 24 and writes <= demoted // 2, (writes, demoted)
        assert {s.block_hash for s in store.block_states() if 0 in s.tiers} == set(old[3] + new)
        every = [h for c in old for h in c] + new
        outs = [np.zeros(BLOCK, np.uint8) for _ in every]
        assert store.get_into(ns, every, outs) == [BLOCK] * 56
        assert all(np.array_equal(o, data(h)) for o, h in zip(outs, every))
    finally:
        store.close()


def _fill_then_put(store: Store, ns: bytes, old: list[list[bytes]], new: list[bytes]) -> tuple[list[str], int]:
    """Put the ``old`` chains, then ``new``; returns what the put of ``new`` answered and how many
    times it took the store lock (a thread's outermost acquisitions only)."""
    for c in old:
        store.put(ns, c, [data(h) for h in c])
    lock_type, acquired = type(store._cascade.lock), []
    enter = lock_type.__enter__

    def counting_enter(lock):
        if getattr(lock._held, "depth", 0) == 0:
            acquired.append(1)
        enter(lock)

    lock_type.__enter__ = counting_enter
    try:
        got = store.put(ns, new, [data(h) for h in new])
    finally:
        lock_type.__enter__ = enter
    return got, len(acquired)


#: per policy: the CPU tier's blocks, the chains that fill it, the chain put into it, and the
#: blocks it holds after (block by block: the newest blocks; prefix-aware: the new chain and the
#: newest older chain, the older ones given up tail first)
FULL_LAST_TIER = {
    "lru": (8, [chain(8)], chain(32, start=100_000), lambda old, new: new[-8:]),
    "prefix": (32, [chain(8, start=10_000 * k) for k in range(4)], chain(24, start=100_000),
               lambda old, new: old[3] + new),
}


@pytest.mark.parametrize("policy", sorted(FULL_LAST_TIER))
def test_a_put_into_a_full_last_tier_makes_room_for_each_run_at_once(tmp_path, monkeypatch, policy):
    """A CPU tier with nothing below it, full: a chain put into it drops the room for each run
    under one lock acquisition and goes in a run at a time, taking the store lock at most a
    quarter as often as block by block (three times or more a block); the tier ends holding what
    block by block leaves there, each block exact, and the dropped ones are misses."""
    cpu_blocks, old, new, kept = FULL_LAST_TIER[policy]
    batched, ns_a = make_store(tmp_path, "a", cpu_blocks=cpu_blocks, nvme_blocks=0, slot=BLOCK, eviction_policy=policy)
    single, ns_b = make_store(tmp_path, "b", cpu_blocks=cpu_blocks, nvme_blocks=0, slot=BLOCK, eviction_policy=policy)
    try:
        got, acquired = _fill_then_put(batched, ns_a, old, new)
        with block_by_block(monkeypatch, room_ahead=False):
            got_single, acquired_single = _fill_then_put(single, ns_b, old, new)
        assert got == got_single == ["stored"] * len(new)
        assert acquired_single >= 3 * len(new) and acquired <= acquired_single // 4, (acquired, acquired_single)
        held = set(kept(old, new))
        assert {s.block_hash for s in batched.block_states()} == held
        assert batched.stats()["counters"] == single.stats()["counters"]
        every = [h for c in old for h in c] + new
        outs = [np.zeros(BLOCK, np.uint8) for _ in every]
        assert batched.get_into(ns_a, every, outs) == [BLOCK if h in held else None for h in every]
        assert all(np.array_equal(o, data(h)) for o, h in zip(outs, every) if h in held)
    finally:
        batched.close()
        single.close()


@pytest.mark.parametrize("policy", ["lru", "prefix"])
def test_a_get_promoting_into_a_full_tier_serves_every_block_and_keeps_its_victims(tmp_path, policy):
    """A get of a chain only on NVMe while the CPU tier is full of another chain only there: each
    hit is promoted, its room made by writing a victim down to NVMe; every block is served exact,
    the CPU tier ends holding the blocks read, and the victims stay served from NVMe."""
    store, ns = make_store(tmp_path, "g", cpu_blocks=8, nvme_blocks=64, slot=BLOCK, eviction_policy=policy)
    try:
        cold = chain(8)
        store.put(ns, cold, [data(h) for h in cold])
        hot = chain(8, start=100_000)
        store.put(ns, hot, [data(h) for h in hot])   # cold written down to NVMe; hot only in the CPU tier
        assert {s.block_hash for s in store.block_states() if s.tiers == (1,)} == set(cold)
        demoted = store.stats()["counters"]["demotions"]
        outs = [np.zeros(BLOCK, np.uint8) for _ in cold]
        assert store.get_into(ns, cold, outs) == [BLOCK] * 8
        assert store.stats()["counters"]["demotions"] - demoted == 8
        assert all(np.array_equal(o, data(h)) for o, h in zip(outs, cold))
        assert {s.block_hash for s in store.block_states() if 0 in s.tiers} == set(cold)
        assert store.stats()["counters"]["promotions"] == 8
        outs = [np.zeros(BLOCK, np.uint8) for _ in hot]
        assert store.get_into(ns, hot, outs) == [BLOCK] * 8
        assert all(np.array_equal(o, data(h)) for o, h in zip(outs, hot))
    finally:
        store.close()
