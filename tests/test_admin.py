"""Operator commands against real daemons: `kvstore ns list|drop`, `evict`, `pin`/`unpin`, `prewarm`
(from NVMe, and from a fleet peer), `top`'s namespaces, and who may run them (a tenant only on its own
namespaces)."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.errors import PermissionDenied, QuotaExceeded, UnknownNamespace
from kvstore.ops import admin_cli
from kvstore.ops.cli import main as kvstore
import reliability_runner

BLOCK_TOKENS = 16
LAYOUT = KVLayout(model="test/admin", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=BLOCK_TOKENS, block_bytes=256 * 1024)
OTHER_LAYOUT = KVLayout(model="test/admin-v2", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                        block_tokens=BLOCK_TOKENS, block_bytes=256 * 1024)
SMALL = {"cpu_bytes": "4MiB", "nvme_bytes": "8MiB"}   # 16 blocks in the CPU tier, ~31 on NVMe


def tokens(n_blocks: int, start: int) -> list[int]:
    return list(range(start, start + n_blocks * BLOCK_TOKENS))


def chain(n_blocks: int, start: int) -> list[bytes]:
    return ChainHasher().chain(tokens(n_blocks, start), BLOCK_TOKENS)


def payloads(hashes: list[bytes]) -> list[np.ndarray]:
    return [np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, LAYOUT.block_bytes, np.uint8)
            for h in hashes]


def put_chain(client, ns: bytes, n_blocks: int, start: int) -> list[bytes]:
    hashes = chain(n_blocks, start)
    client.put(ns, hashes, payloads(hashes))
    return hashes


def flood(client, ns: bytes, n_blocks: int, start: int = 1_000_000) -> None:
    for i in range(0, n_blocks, 8):
        put_chain(client, ns, 8, start + i * BLOCK_TOKENS * 1000)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = kvstore(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_pinned_prefix_survives_a_flood_that_evicts_everything_else(daemon_factory, capsys):
    d = daemon_factory(**SMALL)
    with d.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        system_prompt = put_chain(c, ns, 4, start=0)
        other = put_chain(c, ns, 4, start=50_000)
        rc, out, _ = run(capsys, "pin", ns.hex()[:10], "--url", d.address, "--tokens",
                         ",".join(map(str, tokens(4, 0))))
        assert rc == 0 and "pinned 4 more blocks" in out and "4 stored now" in out
        flood(c, ns, 120)            # ~30 MiB through a 4 MiB CPU tier and an 8 MiB NVMe tier
        assert c.lookup(ns, system_prompt, lease=False).tiers == ["cpu"] * 4      # kept, and in the CPU tier
        assert c.get(ns, system_prompt) == [p.tobytes() for p in payloads(system_prompt)]
        assert c.exists(ns, other) == [False] * 4                                 # everything else went
        [row] = admin_cli.list_namespaces(c)
        assert row["pinned_blocks"] == 4 and row["pinned_bytes"] == 4 * LAYOUT.block_bytes

        rc, out, _ = run(capsys, "unpin", ns.hex(), "--url", d.address)
        assert rc == 0 and "unpinned 4 blocks" in out
        flood(c, ns, 120, start=9_000_000)
        assert c.exists(ns, system_prompt) == [False] * 4                         # evictable again


def test_pin_beyond_the_tenant_bound_is_refused_with_the_setting_named(daemon_factory, tmp_path, capsys):
    config = tmp_path / "kv.yaml"
    config.write_text("max_pinned_bytes_per_tenant: 1MiB\n")     # 4 blocks
    d = daemon_factory("--config", str(config), **SMALL)
    with d.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        hashes = put_chain(c, ns, 6, start=0)
        assert admin_cli.prefix_call(c, "Pin", ns, hashes[:3])["blocks"] == 3
        with pytest.raises(QuotaExceeded, match="max_pinned_bytes_per_tenant") as refused:
            admin_cli.prefix_call(c, "Pin", ns, hashes[3:5])
        assert "would exceed its limit of 1048576 bytes" in str(refused.value)
        rc, _, err = run(capsys, "pin", ns.hex(), "--url", d.address, "--hashes", ",".join(h.hex() for h in hashes[3:]))
        assert rc == 1 and "max_pinned_bytes_per_tenant" in err
        [row] = admin_cli.list_namespaces(c)
        assert row["pinned_blocks"] == 3                                           # the refused pins left nothing
        assert admin_cli.prefix_call(c, "Pin", ns, hashes[3:4])["bytes"] == 1 << 20   # exactly at the bound


def test_ns_drop_frees_exactly_that_namespace(daemon_factory, capsys):
    d = daemon_factory(**SMALL)
    with d.client() as c:
        old = c.register_namespace(Namespace(LAYOUT))
        new = c.register_namespace(Namespace(OTHER_LAYOUT))
        old_hashes = put_chain(c, old, 20, start=0)      # spills to NVMe
        new_hashes = put_chain(c, new, 6, start=0)
        before = c.stats()
        rows = {r["namespace_id"]: r for r in admin_cli.list_namespaces(c)}
        dropped = rows[old.hex()]
        rc, out, _ = run(capsys, "ns", "drop", old.hex()[:12], "--url", d.address)
        assert rc == 0 and f"dropped namespace {old.hex()}" in out and f"{dropped['blocks']} blocks" in out
        after = c.stats()
        assert after["blocks"] == before["blocks"] - dropped["blocks"] == 6
        for tier, held in dropped["tiers"].items():    # each tier gave back exactly what the namespace held there
            freed = before["tiers"][tier]["used_bytes"] - after["tiers"][tier]["used_bytes"]
            assert freed >= held["bytes"]
            assert after["tiers"][tier]["policy_blocks"] == before["tiers"][tier]["policy_blocks"] - held["blocks"]
        assert c.get(new, new_hashes) == [p.tobytes() for p in payloads(new_hashes)]
        with pytest.raises(UnknownNamespace):
            c.exists(old, old_hashes)                      # unregistered too
        assert [r["namespace_id"] for r in admin_cli.list_namespaces(c)] == [new.hex()]
        # a client still using it registers it again and starts empty
        assert c.register_namespace(Namespace(LAYOUT)) == old
        assert c.exists(old, old_hashes) == [False] * 20


def test_evict_a_prefix_or_a_whole_namespace(daemon_factory, capsys):
    d = daemon_factory(**SMALL)
    with d.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        hashes = put_chain(c, ns, 8, start=0)
        c.lookup(ns, hashes, lease=False)
        rc, out, _ = run(capsys, "evict", ns.hex(), "--url", d.address, "--tokens", ",".join(map(str, tokens(3, 0))))
        assert rc == 0 and "evicted 3 blocks (768.0 KiB)" in out
        assert c.exists(ns, hashes) == [False] * 3 + [True] * 5
        admin_cli.prefix_call(c, "Pin", ns, hashes[3:5])
        rc, out, _ = run(capsys, "evict", ns.hex(), "--url", d.address, "--json")
        assert rc == 0 and json.loads(out) | {"fetched": 0} == {"blocks": 3, "bytes": 3 * LAYOUT.block_bytes,
                                                                "stored": 0, "skipped": 2, "fetched": 0, "warmed": 0}
        assert c.exists(ns, hashes) == [False] * 3 + [True] * 2 + [False] * 3   # pinned blocks stay
        assert c.lookup(ns, hashes[:1]).num_hit == 0                               # the namespace stays registered


def test_prewarm_moves_nvme_blocks_into_the_cpu_tier(daemon_factory, tmp_path, capsys):
    d = daemon_factory(**SMALL)
    with d.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        hashes = put_chain(c, ns, 6, start=0)
        flood(c, ns, 16)                      # a newer chain fills the CPU tier: ours is demoted
        assert c.lookup(ns, hashes, lease=False).tiers == ["nvme"] * 6
        hashes_file = tmp_path / "prefix.txt"
        hashes_file.write_text("\n".join(h.hex() for h in hashes))
        rc, out, _ = run(capsys, "prewarm", ns.hex(), "--url", d.address, "--hashes-file", str(hashes_file))
        assert rc == 0 and "6 blocks copied into the CPU tier" in out, out
        assert c.lookup(ns, hashes, lease=False).tiers == ["cpu"] * 6
        assert c.get(ns, hashes) == [p.tobytes() for p in payloads(hashes)]
        done = admin_cli.prefix_call(c, "Prewarm", ns, hashes + chain(2, start=777_000))
        assert (done["warmed"], done["stored"], done["skipped"]) == (0, 6, 2)     # already warm; 2 unknown


def test_prewarm_brings_a_prefix_from_a_fleet_peer_into_the_cpu_tier(daemon_factory, tmp_path, redis_url, prefix,
                                                                    capsys):
    from fleet_util import NS, SECRET, chain as fleet_chain, wait_for, write_fleet_config

    from kvstore.fleet import Directory

    def fleet_daemon(node_id):
        (tmp_path / node_id).mkdir()
        config = write_fleet_config(tmp_path / node_id, redis_url, prefix, node_id)
        return daemon_factory("--config", config, cpu_bytes="16MiB", nvme_bytes="0")

    a, b = fleet_daemon("a"), fleet_daemon("b")
    hashes, blocks = fleet_chain(6, seed=11)
    with a.client() as ca:
        ca.register_namespace(NS)
        ca.put(NS.id, hashes, blocks)
    directory = Directory(redis_url, prefix, secret=SECRET)
    wait_for(lambda: directory.entries(NS.id, "a") == 6, what="a to publish the prefix")
    with b.client() as cb:
        cb.register_namespace(NS)
        assert cb.exists(NS.id, hashes) == [False] * 6 and cb.stats()["blocks"] == 0    # nothing on b yet
        hashes_file = tmp_path / "prefix.txt"
        hashes_file.write_text("\n".join(h.hex() for h in hashes))
        rc, out, err = run(capsys, "prewarm", NS.id.hex(), "--url", b.address, "--hashes-file", str(hashes_file))
        assert rc == 0, err
        assert "6 there already" in out and "0 not here or no room" in out and "6 fetched from peers" in out, out
        stats = cb.stats()
        assert stats["tiers"]["cpu"]["policy_blocks"] == 6 and stats["fleet"]["counters"]["fetched_blocks"] == 6
        assert cb.exists(NS.id, hashes) == [True] * 6
        a.kill()                                        # b now serves the prefix on its own, from RAM
        assert cb.lookup(NS.id, hashes, lease=False).tiers == ["cpu"] * 6
        assert cb.get(NS.id, hashes) == [x.tobytes() for x in blocks]
        assert cb.stats()["fleet"]["counters"]["fetched_blocks"] == 6          # no fetch after the prewarm


def test_ns_list_json_and_table_and_top(daemon_factory, capsys):
    d = daemon_factory(**SMALL)
    with d.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt="s1"))
        hashes = put_chain(c, ns, 4, start=0)
        assert c.lookup(ns, hashes + chain(4, start=99_000), lease=False).num_hit == 4
        rc, out, _ = run(capsys, "ns", "list", "--url", d.address, "--json")
        [row] = json.loads(out)
        assert row["namespace_id"] == ns.hex() and row["model"] == "test/admin" and row["cache_salt"] == "s1"
        assert row["blocks"] == 4 and row["bytes"] == 4 * LAYOUT.block_bytes
        assert row["tiers"]["cpu"] == {"blocks": 4, "bytes": 4 * LAYOUT.block_bytes}
        assert row["lookup_blocks"] == 8 and row["hit_ratio"] == 0.5 and row["last_used"] > 0
        assert row["layout"]["block_tokens"] == BLOCK_TOKENS
        rc, out, _ = run(capsys, "ns", "list", "--url", d.address)
        assert rc == 0 and ns.hex()[:12] in out and "test/admin" in out and "50.0%" in out
        assert max(len(line) for line in out.splitlines()) <= 80
        rc, out, _ = run(capsys, "top", "--url", d.address, "--once", "--interval", "0")
        assert rc == 0 and "top namespaces" in out and ns.hex()[:12] in out


@pytest.fixture(scope="module")
def tenants_daemon(tmp_path_factory):
    from daemon_util import start_daemon

    workdir = tmp_path_factory.mktemp("tenants")
    config = workdir / "kv.yaml"
    config.write_text(textwrap.dedent("""
        tokens: {alice-token: alice, bob-token: bob, ops-token: ops}
        admin_tenants: [ops]
    """))
    d = start_daemon(workdir, "--config", str(config), **SMALL)
    yield d
    d.kill()


def test_a_tenant_cannot_list_drop_pin_evict_or_prewarm_another_tenants_namespace(tenants_daemon, capsys):
    d = tenants_daemon
    with d.client(token="alice-token") as alice, d.client(token="bob-token") as bob, \
            d.client(token="ops-token") as ops:
        ns_a = alice.register_namespace(Namespace(LAYOUT))
        hashes = put_chain(alice, ns_a, 4, start=0)
        ns_b = bob.register_namespace(Namespace(LAYOUT))
        assert [r["namespace_id"] for r in admin_cli.list_namespaces(bob)] == [ns_b.hex()]
        assert [r["namespace_id"] for r in admin_cli.list_namespaces(alice)] == [ns_a.hex()]
        for call in (lambda: admin_cli.drop_namespace(bob, ns_a),
                     *(lambda m=m: admin_cli.prefix_call(bob, m, ns_a, hashes)
                       for m in ("Pin", "Unpin", "Evict", "Prewarm"))):
            with pytest.raises(UnknownNamespace):     # exactly like a namespace that does not exist
                call()
        with pytest.raises(PermissionDenied):
            admin_cli.reload(bob)
        rc, _, err = run(capsys, "ns", "drop", ns_a.hex(), "--url", d.address, "--token", "bob-token")
        assert rc == 2 and "no namespace" in err
        assert alice.exists(ns_a, hashes) == [True] * 4          # untouched by every attempt
        # the admin sees and acts on both
        assert {r["namespace_id"] for r in admin_cli.list_namespaces(ops)} == {ns_a.hex(), ns_b.hex()}
        assert admin_cli.prefix_call(ops, "Pin", ns_a, hashes[:2])["blocks"] == 2
        assert admin_cli.list_namespaces(alice)[0]["pinned_blocks"] == 2
        assert admin_cli.prefix_call(alice, "Unpin", ns_a, [])["blocks"] == 2   # a tenant manages its own
        assert admin_cli.drop_namespace(ops, ns_b)["blocks"] == 0
        assert [r["namespace_id"] for r in admin_cli.list_namespaces(ops)] == [ns_a.hex()]


SMALL_BLOCKS = KVLayout(model="test/pins", num_layers=1, num_kv_heads=1, head_dim=64, dtype="bfloat16",
                        block_tokens=BLOCK_TOKENS, block_bytes=2048)


def small_payloads(hashes: list[bytes]) -> list[np.ndarray]:
    return [np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, 2048, np.uint8) for h in hashes]


def test_one_tenants_pins_cannot_starve_another_tenant_of_the_cpu_tier(two_tenant_daemon):
    """A 16 MiB CPU tier of 256 KiB slots, split into 256 KiB tenant segments: a 2 KiB block takes
    a slot and keeps a whole segment. A pin costs that footprint, so alice's pin of all her 64
    blocks (the whole tier) is refused whole, and one pin at a time she gets the default limit,
    a quarter of the tier: 16 blocks. Bob's 32 blocks then still enter the CPU tier, and stay
    there when read."""
    d = two_tenant_daemon
    with d.client(token="alice-token") as alice, d.client(token="bob-token") as bob:
        ns_a = alice.register_namespace(Namespace(SMALL_BLOCKS))
        mine = chain(64, start=0)
        alice.put(ns_a, mine, small_payloads(mine))
        with pytest.raises(QuotaExceeded, match="max_pinned_bytes_per_tenant") as refused:
            admin_cli.prefix_call(alice, "Pin", ns_a, mine)
        assert "16777216 bytes of the CPU tier" in str(refused.value)   # 64 slots of 256 KiB, not 64 x 2 KiB
        assert admin_cli.list_namespaces(alice)[0]["pinned_blocks"] == 0   # refused whole
        pinned = 0
        for h in mine:   # then as many as she is let, one at a time
            try:
                done = admin_cli.prefix_call(alice, "Pin", ns_a, [h])
            except QuotaExceeded:
                break
            pinned += 1
        assert pinned == 16 and done["bytes"] == 4 << 20
        ns_b = bob.register_namespace(Namespace(SMALL_BLOCKS))
        hot = chain(32, start=500_000)
        bob.put(ns_b, hot, small_payloads(hot))
        assert bob.get(ns_b, hot) == [p.tobytes() for p in small_payloads(hot)]
        assert bob.lookup(ns_b, hot, lease=False).tiers == ["cpu"] * 32
        assert alice.lookup(ns_a, mine[:16], lease=False).tiers == ["cpu"] * 16   # her pins held too


def test_with_segments_of_several_slots_a_pin_costs_the_segments_it_keeps(daemon_factory, tmp_path):
    """1 MiB tenant segments of four 256 KiB slots: one pinned 2 KiB block keeps its whole segment
    from the other tenants, and is charged for it, not for its slot."""
    d = daemon_factory("--token", "alice-token=alice", "--shm-dir", str(tmp_path), cpu_bytes="16MiB",
                       nvme_bytes="64MiB", env={"KVSTORE_CPU_SEGMENT_BYTES": "1MiB"})
    with d.client(token="alice-token") as alice:
        ns = alice.register_namespace(Namespace(SMALL_BLOCKS))
        mine = chain(8, start=0)
        alice.put(ns, mine, small_payloads(mine))
        assert admin_cli.prefix_call(alice, "Pin", ns, mine[:1])["bytes"] == 1 << 20
        charged = admin_cli.prefix_call(alice, "Pin", ns, mine)["bytes"]
        assert charged % (1 << 20) == 0 and charged >= 2 << 20, charged    # 8 slots: 2 segments at least
        assert admin_cli.list_namespaces(alice)[0]["pinned_bytes"] == 8 * 2048   # what the blocks themselves are

def test_the_pin_starvation_scenario_leaves_the_other_tenant_its_cpu_tier(tmp_path):
    """The reliability suite's pin_starvation (issue 35, attack 2; ``benchmarks/reliability.py``,
    run in its own process): tenant A pins as many of its 64 blocks of 2 KiB as it can, one
    request at a time, under the default limit and under one as large as the CPU tier."""
    r = reliability_runner.run("pin_starvation", str(tmp_path))
    default, whole = r["cases"]["default limit"], r["cases"]["limit = the CPU tier"]
    assert (default["a_pins_accepted"], default["a_charged_bytes"]) == (16, 4 << 20)
    assert default["a_refused_by"] == {"QuotaExceeded naming max_pinned_bytes_per_tenant": 49}
    assert (whole["a_pins_accepted"], whole["a_charged_bytes"]) == (32, 8 << 20)   # half the tier, all tenants' cap
    assert whole["a_refused_by"] == {"QuotaExceeded naming hashes": 33}
    for case in (default, whole):
        assert case["a_whole_pin"] == "refused" and case["a_pinned_in_cpu"] == case["a_pins_accepted"]
        assert case["b_stored"] == case["b_exact"] == case["b_in_cpu_after_read"] == 32
        assert case["promotion_failures_during_b"] == 0
    assert r["ok"]
