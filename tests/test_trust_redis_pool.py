"""The shared Redis pool is untrusted storage (issue 35, item 11): a real fleet daemon with the
Redis tier, a real Redis, and an attacker process that can write Redis but holds no fleet secret.

Before: only the directory was signed. A block value written straight into the pool (a valid
header, the payload's own checksum, ``POISON!!`` bytes) was fetched from the pool on a local miss
and served as the block. Now every pool value carries a MAC under the fleet secret bound to its
namespace and block hash; planted, forged and copied values are misses, and a value a fleet
member wrote is still served.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from daemon_util import start_daemon
from fleet_util import BLOCK, NS, SECRET, chain, write_fleet_config
from kvstore.tiers.base import BlockRecord
from kvstore.tiers.redis import RedisTier

PLANT = textwrap.dedent("""
    import struct, sys, redis, xxhash
    url, key, how, copy_from = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    r = redis.Redis.from_url(url)
    if how == "copied":   # a genuine signed value of another block, under this block's key
        r.set(key, r.get(copy_from), px=60_000)
    else:
        payload = (b"POISON!!" * (int(sys.argv[5]) // 8))
        if how == "checksummed":   # the old format: the payload's own xxh3, no secret needed
            head = struct.pack("<4sBBHQQQ", b"KVSR", 1, 0, 0, len(payload), len(payload), xxhash.xxh3_64_intdigest(payload))
        else:                      # the signed format with a MAC of the attacker's making
            head = struct.pack("<4sBBHQQ16s", b"KVSR", 2, 0, 0, len(payload), len(payload), b"\\x42" * 16)
        r.set(key, head + payload, px=60_000)
""")


def fleet_pool_daemon(tmp_path, redis_url: str, prefix: str):
    workdir = tmp_path / "d"
    workdir.mkdir()
    config = write_fleet_config(workdir, redis_url, prefix, "victim")
    with open(config, "a") as f:
        f.write(textwrap.dedent(f"""
            redis_tier:
              enabled: true
              url: {redis_url}
              key_prefix: {prefix}-pool
              capacity_bytes: 16MiB
              ttl_s: 120
            """))
    return start_daemon(workdir, "--config", config, cpu_bytes="16MiB", nvme_bytes="0")


def pool_key(prefix: str, h: bytes) -> str:
    return f"{prefix}-pool:blk:{{{NS.id.hex()}}}:{h.hex()}"


def test_planted_forged_and_copied_pool_values_are_never_served(tmp_path, redis_url, prefix):
    hashes, blocks = chain(4, seed=21)
    member = RedisTier(16 << 20, redis_url, key_prefix=f"{prefix}-pool", ttl_s=120, secret=SECRET.encode())
    for h, block in zip(hashes[:2], blocks[:2]):   # what another fleet member put in the pool
        record = BlockRecord(NS.id, h, None, stored_size=BLOCK, raw_size=BLOCK)
        member.allocate(record)
        member.write(record, block)
    for h, how in zip(hashes[2:], ("checksummed", "forged")):
        subprocess.run([sys.executable, "-c", PLANT, redis_url, pool_key(prefix, h), how, "", str(BLOCK)],
                       check=True, timeout=60)
    d = fleet_pool_daemon(tmp_path, redis_url, prefix)
    try:
        with d.client(transport="grpc") as c:
            c.register_namespace(NS)
            # a fleet member's values verify: fetched from the pool on a local miss
            assert c.lookup(NS.id, hashes[:2]).num_hit == 2
            assert c.get(NS.id, hashes[:2]) == [b.tobytes() for b in blocks[:2]]
            # the planted ones are misses, never POISON
            for h in hashes[2:]:
                assert c.lookup(NS.id, [h]).num_hit == 0
                assert c.get(NS.id, [h]) == [None]
            # a genuine value copied under another block's key does not verify for that key
            victim, _ = chain(1, seed=22)
            subprocess.run([sys.executable, "-c", PLANT, redis_url, pool_key(prefix, victim[0]), "copied",
                            pool_key(prefix, hashes[0]), str(BLOCK)], check=True, timeout=60)
            assert c.lookup(NS.id, victim).num_hit == 0 and c.get(NS.id, victim) == [None]
            assert c.stats()["tiers"]["redis"]["forged_refused"] >= 2
    finally:
        assert d.stop() == 0
        member.close()
    assert "POISON" not in d.log()
