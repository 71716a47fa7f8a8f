"""One tenant's load leases cannot pin the CPU tier away from the others (guarantee 32).

A load lease pins every block it names for ``lease_seconds``, and a client may open leases as
fast as it can call. Before the budget, a tenant that asked for its blocks again and again
without ever completing a lease staged them all into the CPU tier and held every slot there:
another tenant's puts and promotions found no room, and the lease table grew with each call.
Now a tenant's open load leases hold at most half the CPU tier (``max_leased_bytes_per_tenant``);
a lease stops at the budget, and the reader gets the rest by value or, once it released its
earlier lease, by a new one.
"""

from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.client.shm_path import lease_slots
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store import Store, StoreConfig
from kvstore.store.leases import LEASED_SHARE
from kvstore.tiers.cpu import CpuTier

BLOCK = 256 << 10   # one CPU slot each: a 16 MiB tier holds 64
LAYOUT = KVLayout(model="test/load-leases", num_layers=1, num_kv_heads=1, head_dim=128, dtype="uint8",
                  block_tokens=16, block_bytes=BLOCK)


def chain(n: int, seed: int) -> list[bytes]:
    return ChainHasher(seed=seed).chain(np.arange(16 * n), 16)


def payloads(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def capped_leases(d) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
    found = re.search(r"^kvstore_load_leases_capped_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def two_tenants(daemon_factory, tmp_path):
    """Alice and Bob on one daemon: a 16 MiB CPU tier (64 slots of 256 KiB) over 64 MiB of NVMe."""
    return daemon_factory("--token", "alice-token=alice", "--token", "bob-token=bob", "--shm-dir", str(tmp_path),
                          "--metrics-port", "0", cpu_bytes="16MiB", nvme_bytes="64MiB")


def test_a_tenant_holding_load_leases_leaves_the_other_tenant_its_cpu_tier(two_tenants):
    d = two_tenants
    with d.client(token="alice-token") as alice, d.client(token="bob-token") as bob:
        assert alice.active_transport == "shm"
        ns_a = alice.register_namespace(Namespace(LAYOUT))
        mine, my_data = chain(64, seed=1), payloads(64, seed=1)   # the whole CPU tier's worth
        assert set(alice.put(ns_a, mine, my_data)) <= {"stored", "persisted"}

        # the attack: load leases on all of it, asked again and again, never completed
        leased = [len(lease_slots(alice.call("PrepareLoad", pb.PrepareLoadRequest(
            namespace_id=ns_a, hashes=mine, block_bytes=BLOCK)))[0]) for _ in range(8)]
        assert sum(leased) == 32, leased   # half the tier: 32 slots, in the first lease; none after it
        assert leased[0] == 32 and capped_leases(d) == 8

        # bob's hot blocks still enter the CPU tier, and are read back exact from there
        ns_b = bob.register_namespace(Namespace(LAYOUT))
        hot, hot_data = chain(16, seed=2), payloads(16, seed=2)
        assert set(bob.put(ns_b, hot, hot_data)) <= {"stored", "persisted"}
        assert bob.get(ns_b, hot) == [p.tobytes() for p in hot_data]
        assert bob.lookup(ns_b, hot, lease=False).tiers == ["cpu"] * 16

        # alice's own get, her budget spent by the leases she never completed: every byte, exact
        # (the blocks her leases cannot take come by value)
        assert alice.get(ns_a, mine) == [p.tobytes() for p in my_data]


def test_a_get_of_more_than_the_budget_is_leased_window_by_window(two_tenants):
    """48 blocks of a 64-slot tier in one get: more than alice's budget of 32, so the first lease
    stops there; the get asks again once that lease is released, and no block goes by value."""
    d = two_tenants
    with d.client(token="alice-token") as alice:
        ns = alice.register_namespace(Namespace(LAYOUT))
        hashes, data = chain(48, seed=3), payloads(48, seed=3)
        assert set(alice.put(ns, hashes, data)) <= {"stored", "persisted"}
        outs = [np.empty(BLOCK, np.uint8) for _ in hashes]
        assert alice.get_into(ns, hashes, outs) == [BLOCK] * 48
        assert all(np.array_equal(o, p) for o, p in zip(outs, data))
        assert capped_leases(d) >= 1
        text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
        assert not re.search(r'kvstore_wire_bytes_total\{direction="out",transport="grpc"\} [1-9]', text)


def test_the_budget_is_given_back_when_a_lease_ends_and_is_per_tenant():
    """In one process: a lease charges its blocks' slot footprints to its tenant, up to half the
    CPU tier; completing or expiring it gives them back; another tenant has a budget of its own."""
    now = [0.0]
    store = Store([CpuTier(16 << 20, slot_bytes=BLOCK)], StoreConfig(lease_seconds=5), clock=lambda: now[0])
    try:
        a = store.register_namespace(Namespace(LAYOUT, tenant="a"))
        b = store.register_namespace(Namespace(LAYOUT, tenant="b"))
        ha, hb = chain(40, seed=4), chain(20, seed=5)
        store.put(a, ha, payloads(40, seed=4))
        store.put(b, hb, payloads(20, seed=5))
        half = int((16 << 20) * LEASED_SHARE)

        first = store.leases.prepare_load(a, ha)
        assert len(first.keys) == half // BLOCK and first.capped
        assert store.leases.leased_bytes("a") == half
        again = store.leases.prepare_load(a, ha)
        assert again.keys == [] and again.capped               # nothing left of a's budget
        other = store.leases.prepare_load(b, hb)
        assert len(other.keys) == 20 and not other.capped      # b's budget is its own
        store.leases.complete_load(first.id)
        assert store.leases.leased_bytes("a") == 0
        assert len(store.leases.prepare_load(a, ha[:8]).keys) == 8
        now[0] = 10.0
        assert store.leases.expire() == 3
        assert store.leases.leased_bytes("a") == store.leases.leased_bytes("b") == 0
        assert store.stats()["tenants"]["a"]["leased_bytes"] == 0

        store.admin.set_limits({}, None, max_leased_bytes_per_tenant=4 * BLOCK)   # the daemon's setting
        assert len(store.leases.prepare_load(a, ha).keys) == 4
    finally:
        store.close()
