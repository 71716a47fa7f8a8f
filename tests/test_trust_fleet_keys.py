"""A broken or full directory key costs only its own namespace, and only until the janitor repairs
it (issue 35, items 9 and 10): real fleet daemons, a real Redis, and an attacker process that can
write Redis but holds no fleet secret.

Before: one namespace's ``nodes`` key set to a plain string (WRONGTYPE), or its 4,096 slots filled
with garbage ("no free slot"), disconnected the daemon from the fleet for every namespace
(``connected`` False, an honest peer's block no longer fetched) until someone deleted the key.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from fleet_util import LAYOUT, NS, chain, wait_for
from kvstore.fleet import MAX_SLOTS, Directory
from kvstore.keys import Namespace
from test_fleet_trust import daemons, fleet_counters  # noqa: F401 - daemons: the fixture

OTHER = Namespace(LAYOUT, tenant="t", cache_salt="fleet-other")

ATTACK = textwrap.dedent("""
    import sys, time, redis
    url, prefix, ns_hex, how, slots = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    r = redis.Redis.from_url(url)
    nodes = f"{prefix}:{{{ns_hex}}}:nodes"
    if how == "wrong_type":
        r.delete(nodes)
        r.set(nodes, "not a hash")
    else:   # every slot taken by an unsigned entry that claims to live for an hour
        future = int(time.time() * 1000) + 3_600_000
        r.delete(nodes)
        r.hset(nodes, mapping={str(s): f"{future} squatter-{s} 127.0.0.1:1" for s in range(slots)})
""")


@pytest.mark.parametrize("how", ["wrong_type", "full"])
def test_a_broken_namespace_key_costs_only_that_namespace_until_repaired(daemons, tmp_path, redis_url, prefix, how):
    d1 = daemons(tmp_path / "d1", redis_url, prefix, "d1")
    d2 = daemons(tmp_path / "d2", redis_url, prefix, "d2")
    directory = Directory(redis_url, prefix, secret="test-fleet-secret-0123456789abcdef")
    victim, victim_blocks = chain(3, seed=11)
    other, other_blocks = chain(3, seed=12)
    later, later_blocks = chain(2, seed=13)
    with d1.client(transport="grpc") as c1, d2.client(transport="grpc") as c2:
        for c in (c1, c2):
            c.register_namespace(NS)
            c.register_namespace(OTHER)
        c1.put(NS.id, victim, victim_blocks)
        wait_for(lambda: directory.entries(NS.id, "d1") == 3, what="d1 to publish the victim namespace")
        subprocess.run([sys.executable, "-c", ATTACK, redis_url, prefix, NS.id.hex(), how, str(MAX_SLOTS)],
                       check=True, timeout=60)
        c1.put(OTHER.id, other, other_blocks)           # published while the victim's key is broken
        wait_for(lambda: directory.entries(OTHER.id, "d1") == 3, what="d1 to publish the other namespace")
        time.sleep(1.0)                                   # several heartbeats (0.2 s) meet the broken key
        for c in (c1, c2):
            assert c.stats()["fleet"]["connected"], "one namespace's key disconnected the whole fleet"
        assert c2.lookup(OTHER.id, other).num_hit == 3                         # fetched from the peer
        assert c2.get(OTHER.id, other) == [b.tobytes() for b in other_blocks]
        # the janitor repairs the key: the victim namespace is published, routed and fetched again
        c1.put(NS.id, later, later_blocks, parent=victim[-1])
        wait_for(lambda: directory.entries(NS.id, "d1") == 5, timeout_s=20, what="the victim namespace repaired")
        assert c2.lookup(NS.id, victim).num_hit == 3
        assert c2.get(NS.id, victim) == [b.tobytes() for b in victim_blocks]
        counters = fleet_counters(c1)
        assert counters["namespace_errors"] >= 1 and counters["namespaces_repaired"] >= 1, counters
        assert counters.get("redis_errors", 0) == 0, counters
