"""The Redis tier against the Tier contract (tiers/base.py) and inside a Store, on a real Redis:
round trips, TTLs, size limits, budget, checksums verified on read, vanished keys as misses,
and the shared pool read by a second daemon through its fleet."""

from __future__ import annotations


import numpy as np
import pytest
import redis

from kvstore.errors import BlockCorrupt, BlockTooLarge, InvalidArgument, TierFull
from kvstore.fleet import Fleet
from kvstore.keys import KVLayout, Namespace
from kvstore.store import Store
from kvstore.tiers.base import BlockRecord
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.redis import HEADER_BYTES, RedisTier, block_redis_key

LAYOUT = KVLayout(model="test/redis-tier", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                  block_tokens=16)
NS = Namespace(LAYOUT)
BLOCK = LAYOUT.block_bytes


@pytest.fixture
def raw(redis_url):
    return redis.Redis.from_url(redis_url)


def rec(i: int, size: int = BLOCK) -> BlockRecord:
    return BlockRecord(NS.id, i.to_bytes(16, "little"), None, size, size)


def payload(i: int, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def test_roundtrip_sets_a_ttl_and_checksum(redis_url, prefix, raw):
    tier = RedisTier(1 << 20, redis_url, key_prefix=prefix, ttl_s=60)
    r, data = rec(1), payload(1)
    tier.allocate(r)
    tier.write(r, data)
    out = np.zeros(BLOCK + 10, dtype=np.uint8)
    assert tier.read_into(r.key, out) == BLOCK
    assert np.array_equal(out[:BLOCK], data)
    key = block_redis_key(prefix, NS.id, r.block_hash)
    assert 0 < raw.pttl(key) <= 60_000
    assert raw.strlen(key) == HEADER_BYTES + BLOCK
    assert r.checksum != 0
    assert tier.used_bytes == HEADER_BYTES + BLOCK
    tier.close()


def test_size_limits_and_budget(redis_url, prefix):
    tier = RedisTier(3 * (BLOCK + HEADER_BYTES), redis_url, key_prefix=prefix, max_block_bytes=BLOCK)
    with pytest.raises(BlockTooLarge, match="max_block_bytes"):
        tier.footprint(BLOCK + 1)
    for i in range(3):
        tier.allocate(rec(i))
    with pytest.raises(TierFull, match="budget"):
        tier.allocate(rec(9))
    tier.drop(rec(0).key)
    tier.allocate(rec(9))
    with pytest.raises(InvalidArgument, match="redis.ttl_s"):
        RedisTier(1 << 20, redis_url, ttl_s=0)
    tier.close()


def test_corrupt_value_is_deleted_and_reported(redis_url, prefix, raw):
    tier = RedisTier(1 << 20, redis_url, key_prefix=prefix)
    r = rec(2)
    tier.allocate(r)
    tier.write(r, payload(2))
    key = block_redis_key(prefix, NS.id, r.block_hash)
    raw.setrange(key, HEADER_BYTES + 100, b"\x00\xff\x00")
    with pytest.raises(BlockCorrupt, match="checksum"):
        tier.read_into(r.key, np.zeros(BLOCK, dtype=np.uint8))
    tier.close()
    assert raw.exists(key) == 0
    assert tier.used_bytes == 0 and tier.corrupt_dropped == 1


def test_drop_deletes_the_key(redis_url, prefix, raw):
    tier = RedisTier(1 << 20, redis_url, key_prefix=prefix)
    r = rec(3)
    tier.allocate(r)
    tier.write(r, payload(3))
    tier.drop(r.key)
    tier.drop(r.key)  # idempotent
    assert tier.used_bytes == 0
    tier.close()      # sends queued deletes
    assert raw.exists(block_redis_key(prefix, NS.id, r.block_hash)) == 0


def store_with_redis_below(tmp_path, redis_url, prefix, cpu_blocks=2, **kw):
    cpu = CpuTier(cpu_blocks * BLOCK, slot_bytes=BLOCK, shm_dir=str(tmp_path))
    tier = RedisTier(64 * (BLOCK + HEADER_BYTES), redis_url, key_prefix=prefix, **kw)
    store = Store([cpu, tier])
    store.register_namespace(NS)
    return store, tier


def test_store_demotes_to_redis_and_reads_back(tmp_path, redis_url, prefix):
    store, tier = store_with_redis_below(tmp_path, redis_url, prefix)
    hashes = [i.to_bytes(16, "little") for i in range(6)]
    blocks = [payload(i) for i in range(6)]
    store.put(NS.id, hashes, blocks)
    assert store.stats()["tiers"]["redis"]["blocks"] >= 4
    assert store.get(NS.id, hashes) == [b.tobytes() for b in blocks]
    assert store.counters["hits_redis"] >= 4
    store.close()


def test_a_key_gone_from_redis_is_a_miss(tmp_path, redis_url, prefix, raw):
    store, tier = store_with_redis_below(tmp_path, redis_url, prefix, cpu_blocks=1)
    hashes = [i.to_bytes(16, "little") for i in range(3)]
    store.put(NS.id, hashes, [payload(i) for i in range(3)])
    assert store.lookup(NS.id, hashes[:1], lease=False).tiers == ["redis"]
    raw.delete(block_redis_key(prefix, NS.id, hashes[0]))   # TTL ran out / maxmemory evicted it
    assert store.get(NS.id, hashes[:1]) == [None]
    assert store.contains(NS.id, hashes[:1]) == [False]
    assert tier.expired_misses == 1
    store.close()


def test_second_daemon_reads_the_shared_pool_through_its_fleet(tmp_path, redis_url, prefix):
    (tmp_path / "a").mkdir()
    store1, _ = store_with_redis_below(tmp_path / "a", redis_url, prefix, cpu_blocks=1)
    hashes = [i.to_bytes(16, "little") for i in range(4)]
    blocks = [payload(10 + i) for i in range(4)]
    store1.put(NS.id, hashes, blocks)                       # 3 of 4 now only in Redis
    (tmp_path / "b").mkdir()
    store2, tier2 = store_with_redis_below(tmp_path / "b", redis_url, prefix, cpu_blocks=8)
    fleet2 = Fleet(store2, redis_url, "b", "127.0.0.1:1", key_prefix=prefix, shared_pool=tier2,
                   peer_fetch=True, secret="test-fleet-secret-0123456789abcdef").start()
    try:
        # block 3 is still only in daemon 1's CPU tier: the pool serves the first three
        assert fleet2.lookup(NS.id, hashes).num_hit == 3
        assert store2.get(NS.id, hashes[:3]) == [b.tobytes() for b in blocks[:3]]
        assert fleet2.counters["pool_blocks"] == 3
    finally:
        fleet2.close()
        store2.close()
        store1.close()
