"""Demotion to disk outside the store lock: a call that needs room in a full CPU tier writes its
victim to NVMe with the lock released, so other callers' gets, lookups and deletes never wait on
that disk write. The store here runs over the real CPU and NVMe tiers; the NVMe tier's write of
one chosen block is held open by the test, so "while the disk write is in flight" is a state the
test can stand in, not a race it hopes to hit."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import numpy as np
import pytest

from kvstore.keys import ChainHasher, KVLayout, Namespace, block_key
from kvstore.store import Store, StoreConfig
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.nvme import HEADER_BYTES, NvmeTier, find_blocks
from kvstore.tiers.redis import RedisTier

BLOCK = 64 * 1024
CPU_BLOCKS = 4
NOT_STUCK_S = 10   # a call that waits on the held write would wait for ever: this long means stuck


class HeldIO:
    """A real tier, except that every I/O call on block ``hold`` (its write, its read) waits until
    ``release`` is set (``started`` says one has begun): a slow disk or network, as long as the
    test needs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hold: bytes | None = None
        self.started, self.release = threading.Event(), threading.Event()

    def _wait(self, key: bytes) -> None:
        if key == self.hold:
            self.started.set()
            assert self.release.wait(60), "the test never released the held I/O"

    def write_unsynced(self, record, data, durable: bool = True) -> None:
        self._wait(record.key)
        super().write_unsynced(record, data, durable)

    def write_many_unsynced(self, records, datas, durable: bool = True) -> list:
        for record in records:
            self._wait(record.key)
        return super().write_many_unsynced(records, datas, durable)

    def read_into(self, key, out) -> int:
        self._wait(key)
        return super().read_into(key, out)

    def read_many_into(self, keys, outs) -> list:
        for key in keys:
            self._wait(key)
        return super().read_many_into(keys, outs)


class HeldNvme(HeldIO, NvmeTier):
    def punch(self, slab, dropped) -> None:   # erasing dropped blocks' slots
        for key, _ in dropped:
            self._wait(key)
        super().punch(slab, dropped)


class HeldRedis(HeldIO, RedisTier):
    pass


def data(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


class Setup:
    """A CPU tier of ``CPU_BLOCKS`` blocks over a held ``lower`` tier (NVMe unless given), and
    ``below`` it where given. ``cold`` was put first and pushed down there; ``resident`` fill the
    CPU tier, the first of them its LRU victim."""

    def __init__(self, path: str, lower=None, below=None, config: StoreConfig | None = None) -> None:
        self.lower = lower if lower is not None else HeldNvme(path, 64 * (HEADER_BYTES + BLOCK))
        tiers = [CpuTier(CPU_BLOCKS * BLOCK, slot_bytes=BLOCK), self.lower] + ([below] if below is not None else [])
        self.store = Store(tiers, config or StoreConfig(eviction_policy="lru"))
        lay = KVLayout(model="test/demotion", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                       block_tokens=16, block_bytes=BLOCK)
        self.ns = self.store.register_namespace(Namespace(lay))
        hashes = ChainHasher(seed=7).chain(np.arange(16 * (CPU_BLOCKS + 2)), 16)
        self.cold, self.resident, self.new = hashes[0], hashes[1:CPU_BLOCKS + 1], hashes[CPU_BLOCKS + 1]
        self.victim, self.hot = self.resident[0], self.resident[-1]
        for h in [self.cold] + self.resident:   # one by one: each its own chain's root
            assert self.store.put(self.ns, [h], [data(h)]) in (["stored"], ["persisted"])
        if config is None:   # write-back: the cold block on the lower tier only, the rest in RAM only
            assert self.tiers_of(self.cold) == (1,) and all(self.tiers_of(h) == (0,) for h in self.resident)
        assert 1 in self.tiers_of(self.cold) and all(0 in self.tiers_of(h) for h in self.resident)
        self.lower.hold = block_key(self.ns, self.victim)
        self.pool = concurrent.futures.ThreadPoolExecutor(2)

    def tiers_of(self, h: bytes) -> tuple[int, ...] | None:
        for s in self.store.block_states():
            if s.block_hash == h:
                return s.tiers
        return None

    def exact(self, h: bytes) -> bool:
        out = np.zeros(BLOCK, np.uint8)
        return self.store.get_into(self.ns, [h], [out]) == [BLOCK] and np.array_equal(out, data(h))

    def counters(self) -> dict:
        return self.store.stats()["counters"]

    def close(self) -> None:
        self.lower.release.set()
        self.pool.shutdown(wait=True)
        self.store.close()


@pytest.fixture
def setup(tmp_path):
    s = Setup(str(tmp_path / "nvme"))
    yield s
    s.close()


def _put(s: Setup) -> None:
    assert s.store.put(s.ns, [s.new], [data(s.new)]) == ["stored"]


def _same_host_put(s: Setup) -> None:
    lease = s.store.leases.prepare_store(s.ns, [s.new])
    pos = 0
    for view in s.store.shared_arena().views(lease.extents[0]):
        view[:] = data(s.new)[pos:pos + view.nbytes]
        pos += view.nbytes
    assert s.store.leases.complete_store(lease.id) == ["stored"]


def _get_promoting(s: Setup) -> None:
    out = np.zeros(BLOCK, np.uint8)
    assert s.store.get_into(s.ns, [s.cold], [out]) == [BLOCK] and np.array_equal(out, data(s.cold))


def _same_host_get_staging(s: Setup) -> None:
    lease = s.store.leases.prepare_load(s.ns, [s.cold])
    got = np.concatenate([np.asarray(v) for v in s.store.shared_arena().views(lease.extents[0])])[:BLOCK]
    s.store.leases.complete_load(lease.id)
    assert np.array_equal(got, data(s.cold))


@pytest.mark.parametrize("needs_room", [_put, _same_host_put, _get_promoting, _same_host_get_staging],
                         ids=["put", "same-host put", "get promoting from nvme", "same-host get staging from nvme"])
def test_other_calls_run_while_a_victim_is_written_to_disk(setup, needs_room):
    s = setup
    waiting = s.pool.submit(needs_room, s)
    assert s.lower.started.wait(NOT_STUCK_S), "the call never started writing its victim down"
    # the victim's disk write is in flight: a get of a hot block, a lookup and a delete answer now
    assert s.pool.submit(s.exact, s.hot).result(NOT_STUCK_S)
    assert s.pool.submit(lambda: s.store.lookup(s.ns, [s.hot], lease=False).num_hit).result(NOT_STUCK_S) == 1
    assert s.pool.submit(s.store.delete, s.ns, [s.resident[1]]).result(NOT_STUCK_S) == 1
    assert not waiting.done()   # ... and the call that needs the room waits on its own write
    s.lower.release.set()
    waiting.result(NOT_STUCK_S)
    assert s.tiers_of(s.victim) == (1,) and s.exact(s.victim)   # on disk only, every byte
    assert s.counters()["demotions_outside_lock"] >= 1
    assert all(st.pins == 0 for st in s.store.block_states())


def test_a_victim_deleted_while_it_is_written_is_freed_in_both_tiers(setup):
    s = setup
    waiting = s.pool.submit(_put, s)
    assert s.lower.started.wait(NOT_STUCK_S)
    assert s.store.delete(s.ns, [s.victim]) == 1   # pinned by its demotion: doomed, gone to readers now
    assert not s.exact(s.victim)
    s.lower.release.set()
    waiting.result(NOT_STUCK_S)
    assert s.tiers_of(s.victim) is None
    assert s.lower.used_bytes == HEADER_BYTES + BLOCK   # the cold block's slot only: none left behind
    assert set(find_blocks(s.lower.path)) == {block_key(s.ns, s.cold)}   # its slot's header erased on disk too
    assert s.exact(s.new) and s.exact(s.cold)


def test_a_victim_read_while_it_is_written_keeps_its_arena_copy(setup):
    s = setup
    waiting = s.pool.submit(_put, s)
    assert s.lower.started.wait(NOT_STUCK_S)
    lease = s.store.leases.prepare_load(s.ns, [s.victim])   # a same-host reader pins the victim's arena slots
    s.lower.release.set()
    waiting.result(NOT_STUCK_S)
    got = np.concatenate([np.asarray(v) for v in s.store.shared_arena().views(lease.extents[0])])[:BLOCK]
    s.store.leases.complete_load(lease.id)
    assert np.array_equal(got, data(s.victim))   # its slots were not handed to the new block
    assert s.tiers_of(s.victim) == (0, 1)   # both copies: clean now, a later eviction is a drop
    assert s.tiers_of(s.resident[1]) == (1,)   # the room came from the next victim instead
    assert s.exact(s.new)


def test_a_flush_during_the_write_leaves_that_block_to_its_demotion_and_waits_for_it(setup):
    s = setup
    waiting = s.pool.submit(_put, s)
    assert s.lower.started.wait(NOT_STUCK_S)
    flushing = s.pool.submit(s.store.flush)
    deadline = time.monotonic() + NOT_STUCK_S   # it writes the other blocks down meanwhile ...
    while len(find_blocks(s.lower.path)) < CPU_BLOCKS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(find_blocks(s.lower.path)) == CPU_BLOCKS   # the cold block and every resident one but the victim
    assert not flushing.done()   # ... and does not return before the victim's copy is written and synced
    s.lower.release.set()
    assert flushing.result(NOT_STUCK_S) == CPU_BLOCKS - 1   # written by the flush itself
    waiting.result(NOT_STUCK_S)
    assert s.tiers_of(s.victim) == (1,) and s.exact(s.victim)
    assert s.lower.used_bytes == (CPU_BLOCKS + 1) * (HEADER_BYTES + BLOCK)   # one slot each: no copy twice


def test_a_failed_demotion_write_loses_only_its_victim(setup):
    s = setup
    s.lower.hold = None
    slabs = [f for f in os.listdir(s.lower.path) if f.endswith(".kvs")]
    assert len(slabs) == 1
    os.unlink(os.path.join(s.lower.path, slabs[0]))   # the disk copy's file is gone: its write fails
    _put(s)
    assert s.tiers_of(s.victim) is None and not s.exact(s.victim)   # a miss, as under the lock before
    assert s.counters()["demotion_failures"] == 1
    assert s.exact(s.new) and all(s.exact(h) for h in s.resident[1:])
    assert all(st.pins == 0 for st in s.store.block_states())


def test_a_victim_bound_for_redis_is_written_outside_the_lock_too(tmp_path, redis_url, prefix):
    s = Setup(str(tmp_path), lower=HeldRedis(1 << 30, redis_url, key_prefix=prefix, ttl_s=60))
    try:
        waiting = s.pool.submit(_put, s)
        assert s.lower.started.wait(NOT_STUCK_S)
        assert s.pool.submit(s.exact, s.hot).result(NOT_STUCK_S)   # no wait on the network write
        s.lower.release.set()
        waiting.result(NOT_STUCK_S)
        assert s.tiers_of(s.victim) == (1,) and s.exact(s.victim)
        assert s.counters()["demotions_outside_lock"] >= 1
    finally:
        s.close()


# -- every kind of I/O, held: nothing of it runs under the store lock ----------------------------

def _others_answer(s: Setup, busy: concurrent.futures.Future, held) -> None:
    """While ``held``'s I/O is in flight (``busy`` waits on it): a get of a hot block, a lookup and
    a delete of other blocks answer, and ``busy`` does not finish before the I/O is released."""
    assert held.started.wait(NOT_STUCK_S), "the call never started its held I/O"
    assert s.pool.submit(s.exact, s.hot).result(NOT_STUCK_S)
    assert s.pool.submit(lambda: s.store.lookup(s.ns, [s.hot], lease=False).num_hit).result(NOT_STUCK_S) == 1
    assert s.pool.submit(s.store.delete, s.ns, [s.resident[1]]).result(NOT_STUCK_S) == 1
    assert not busy.done()
    held.release.set()
    busy.result(NOT_STUCK_S)
    assert all(st.pins == 0 for st in s.store.block_states())


def test_a_write_through_runs_outside_the_lock(tmp_path):
    s = Setup(str(tmp_path / "nvme"), config=StoreConfig(eviction_policy="lru", write_through=True))
    try:
        s.lower.hold = block_key(s.ns, s.new)   # the new block's durable copy
        _others_answer(s, s.pool.submit(s.store.put, s.ns, [s.new], [data(s.new)]), s.lower)
        assert s.tiers_of(s.new) == (0, 1) and s.exact(s.new)
    finally:
        s.close()


def test_erasing_a_deleted_block_on_disk_runs_outside_the_lock(setup):
    s = setup
    s.lower.hold = block_key(s.ns, s.cold)   # its slot's punch
    _others_answer(s, s.pool.submit(s.store.delete, s.ns, [s.cold]), s.lower)
    assert s.tiers_of(s.cold) is None and block_key(s.ns, s.cold) not in find_blocks(s.lower.path)


def test_a_read_from_disk_runs_outside_the_lock(setup):
    s = setup
    s.lower.hold = block_key(s.ns, s.cold)
    _others_answer(s, s.pool.submit(_get_promoting, s), s.lower)


def test_a_prewarm_reads_from_disk_outside_the_lock(setup):
    s = setup
    s.lower.hold = block_key(s.ns, s.cold)
    _others_answer(s, s.pool.submit(s.store.admin.prewarm, s.ns, [s.cold]), s.lower)
    assert 0 in s.tiers_of(s.cold)


def test_a_flush_writes_outside_the_lock(setup):
    s = setup
    s.lower.hold = block_key(s.ns, s.resident[2])   # one of the blocks the flush writes down
    _others_answer(s, s.pool.submit(s.store.flush), s.lower)
    assert 1 in s.tiers_of(s.resident[2]) and s.exact(s.resident[2])


def test_a_demotion_out_of_a_full_disk_tier_runs_outside_the_lock(tmp_path, redis_url, prefix):
    """CPU over an NVMe tier of one block over Redis: room for a CPU victim on NVMe means first
    moving NVMe's own victim (the cold block) down into Redis, whose write is held."""
    below = HeldRedis(1 << 30, redis_url, key_prefix=prefix, ttl_s=60)
    s = Setup(str(tmp_path), lower=HeldNvme(str(tmp_path / "nvme"), HEADER_BYTES + BLOCK), below=below)
    try:
        s.lower.hold = None
        below.hold = block_key(s.ns, s.cold)
        _others_answer(s, s.pool.submit(_put, s), below)
        assert s.tiers_of(s.cold) == (2,) and s.exact(s.cold)
        assert s.tiers_of(s.victim) == (1,) and s.exact(s.victim)
    finally:
        below.release.set()
        s.close()
