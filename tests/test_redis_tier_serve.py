"""The Redis tier from `kvstore serve`'s configuration (``redis_tier:``), on the real Redis: placed below
NVMe, blocks demoted into it with the configured codec and TTL, served back byte-exact, also from a
real three-shard Redis Cluster (``redis_tier.cluster: true``); a Redis that does not answer degrades
the daemon instead of stopping it."""

from __future__ import annotations

import textwrap

import numpy as np
import redis

from test_fleet import redis_cluster  # noqa: F401 - the real three-shard cluster fixture

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.ops import admin_cli
from kvstore.service.config import load_settings
from kvstore.tiers.redis import HEADER_BYTES

LAYOUT = KVLayout(model="test/redis-serve", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=16, block_bytes=256 * 1024)


def compressible(i: int) -> np.ndarray:
    """A block zstd shrinks: one random 4 KiB pattern repeated."""
    return np.tile(np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8), LAYOUT.block_bytes // 4096)


def write_config(path, redis_url: str, prefix: str, **extra) -> str:
    lines = "".join(f"  {k}: {v}\n" for k, v in extra.items())
    path.write_text(textwrap.dedent(f"""
        redis_tier:
          enabled: true
          url: {redis_url}
          key_prefix: {prefix}
          capacity_bytes: 64MiB
          ttl_s: 120
    """) + lines)
    return str(path)


def test_redis_tier_from_config_sits_below_nvme_and_serves_back(daemon_factory, tmp_path, redis_url, prefix):
    config = write_config(tmp_path / "kv.yaml", redis_url, prefix, codec="zstd")
    d = daemon_factory("--config", config, cpu_bytes="4MiB", nvme_bytes="8MiB")
    assert d.info["tiers"] == ["cpu", "nvme", "redis"]
    hashes = ChainHasher().chain(list(range(60 * 16)), 16)
    blocks = [compressible(i) for i in range(60)]      # 15 MiB through 12 MiB of local tiers
    with d.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        for i in range(0, 60, 10):
            c.put(ns, hashes[i:i + 10], blocks[i:i + 10], parent=hashes[i - 1] if i else None)
        stats = c.stats()
        held = stats["tiers"]["redis"]["policy_blocks"]
        assert held > 0 and stats["blocks"] == 60            # nothing dropped: the rest went to Redis
        [row] = admin_cli.list_namespaces(c)
        assert row["tiers"]["redis"]["blocks"] == held
        assert row["tiers"]["redis"]["bytes"] < held * LAYOUT.block_bytes // 4   # stored zstd-encoded
        assert c.get(ns, hashes) == [b.tobytes() for b in blocks]              # byte-exact, Redis included
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{prefix}:blk:*", count=1000))
    assert keys and all(0 < r.pttl(k) <= 120_000 for k in keys)
    assert all(r.strlen(k) < HEADER_BYTES + LAYOUT.block_bytes // 4 for k in keys)


def test_redis_cluster_tier_from_config_serves_demoted_blocks_back(daemon_factory, tmp_path, redis_cluster):
    seed = redis_cluster.replace("redis+cluster://", "redis://")      # cluster: true turns it into the same
    config = write_config(tmp_path / "kv.yaml", seed, "kvsclt", cluster="true")
    d = daemon_factory("--config", config, cpu_bytes="4MiB", nvme_bytes="8MiB")
    assert d.info["tiers"] == ["cpu", "nvme", "redis"]
    hashes = ChainHasher().chain(list(range(60 * 16)), 16)
    blocks = [np.random.default_rng([9, i]).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for i in range(60)]
    with d.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        for i in range(0, 60, 10):                       # 15 MiB through 12 MiB of local tiers
            c.put(ns, hashes[i:i + 10], blocks[i:i + 10], parent=hashes[i - 1] if i else None)
        stats = c.stats()
        held = stats["tiers"]["redis"]["policy_blocks"]
        assert held > 0 and stats["blocks"] == 60 and stats["counters"].get("demotion_failures", 0) == 0
        in_redis = [i for i, t in enumerate(c.lookup(ns, hashes, lease=False).tiers) if t == "redis"]
        assert in_redis and len(in_redis) <= held
        assert c.get(ns, hashes) == [b.tobytes() for b in blocks]     # byte-identical, those from the cluster too
    cluster = redis.RedisCluster.from_url(seed)
    try:
        keys = list(cluster.scan_iter(match="kvsclt:blk:*", count=1000, target_nodes=redis.RedisCluster.ALL_NODES))
        assert len(keys) >= held and all(0 < cluster.pttl(k) <= 120_000 for k in keys)
    finally:
        cluster.close()


def test_a_redis_that_does_not_answer_degrades_instead_of_stopping_the_daemon(daemon_factory, tmp_path, prefix):
    config = write_config(tmp_path / "kv.yaml", "redis://127.0.0.1:1/0", prefix, socket_timeout_s=0.2)
    d = daemon_factory("--config", config, cpu_bytes="4MiB", nvme_bytes="0")
    assert "redis_tier: redis://127.0.0.1:1/0 does not answer now" in d.log()
    hashes = ChainHasher().chain(list(range(24 * 16)), 16)
    blocks = [compressible(i) for i in range(24)]
    with d.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        c.put(ns, hashes, blocks)                            # overflow cannot be demoted: dropped, counted
        stats = c.stats()
        assert stats["counters"]["demotion_failures"] > 0
        assert stats["blocks"] == 16
        present = [i for i, here in enumerate(c.exists(ns, hashes)) if here]
        assert len(present) == 16
        assert c.get(ns, [hashes[i] for i in present]) == [blocks[i].tobytes() for i in present]


def test_cluster_setting_and_url_redaction():
    settings = load_settings(None, redis_tier={"enabled": True, "url": "redis://10.0.0.5:7000", "cluster": True})
    assert settings.redis_tier.connect_url == "redis+cluster://10.0.0.5:7000"
    try:
        load_settings(None, redis_tier={"url": 5, "ttl_s": -1})
    except ValueError as e:
        assert "redis_tier.ttl_s" in str(e) and "redis_tier.url" in str(e) and "got <redacted>" in str(e)
    else:
        raise AssertionError("bad redis_tier settings were accepted")
