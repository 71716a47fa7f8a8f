"""Fleet mode against a real Redis: directory publishing, expiry of dead nodes, Redis restarts,
KV-aware routing, and peer fetch with checksum verification.

Daemons are real Stores (CPU arena in a temp dir). Where a test needs a node to die by SIGKILL or
a Redis to restart, it is a real process. Peer transfers in the in-process tests go straight to
the peer's Store (``StorePeer``); the gRPC path is covered by the daemon tests at the end, which
run real ``kvstore serve`` processes. Hostile directories: tests/test_fleet_trust.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import redis
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet_util import BLOCK, BLOCK_TOKENS, NS, SECRET, StorePeer, chain, wait_for, write_fleet_config
from redis_util import free_port, start_redis

from kvstore.errors import InvalidArgument
from kvstore.fleet import Directory, Fleet, pack_entry, route_main
from kvstore.fleet.records import HOLDER_PREFIX_BYTES, holds
from kvstore.fleet.routing import leading_runs
from kvstore.store import Store, StoreConfig
from kvstore.tiers.cpu import CpuTier

# -- fixtures: redis_url and prefix come from tests/redis_util.py (via conftest.py) ----------


@pytest.fixture
def make_node(tmp_path, redis_url, prefix):
    """Build (store, fleet) pairs sharing one directory; peers reach each other in-process."""
    made = []
    peers: dict[str, StorePeer] = {}

    def make(node_id: str, cpu_blocks: int = 64, before_start=None, **fleet_kw):
        """``before_start(store)`` runs before the fleet starts (blocks it holds from the outset)."""
        tier = CpuTier(cpu_blocks * BLOCK, slot_bytes=BLOCK, shm_dir=str(tmp_path))
        store = Store([tier], StoreConfig(lease_seconds=0.0))
        store.register_namespace(NS)
        if before_start is not None:
            before_start(store)
        addr = f"inproc-{node_id}:1"
        peers[addr] = StorePeer(store)
        kw = dict(key_prefix=prefix, heartbeat_s=0.2, ttl_s=1.5, client_factory=lambda a, _: peers[a], secret=SECRET)
        kw.update(fleet_kw)
        fleet = Fleet(store, kw.pop("redis_url", redis_url), node_id, addr, **kw).start()
        made.append((store, fleet))
        return store, fleet

    make.peers = peers
    yield make
    for store, fleet in made:
        fleet.close()
        store.close()


# -- directory publishing ----------------------------------------------------------------------

def test_put_publishes_entries_with_checksums_and_delete_withdraws(make_node, redis_url, prefix):
    store, fleet = make_node("n1")
    hashes, blocks = chain(5)
    store.put(NS.id, hashes, blocks)
    assert fleet.wait_published()
    d = Directory(redis_url, prefix, secret=SECRET)
    assert d.entries(NS.id, "n1") == 5
    (route,) = d.route(NS.id, hashes)
    assert d.checksums(NS.id, route.slot, hashes) == [xxhash.xxh3_64_intdigest(b) for b in blocks]
    for key in (d.holders_key(NS.id), d.nodes_key(NS.id)):
        assert d.redis.pttl(key) > 0, "every directory key expires unless heartbeats keep it"
        assert "{" + NS.id.hex() + "}" in key, "namespace keys must share one cluster hash tag"
    expiry_ms = int(d.redis.hget(d.nodes_key(NS.id), str(route.slot)).split()[0])
    assert 0 < expiry_ms - time.time() * 1000 <= 1500, "a node's slot lives for ttl_s past its last heartbeat"

    store.delete(NS.id, hashes[3:])
    assert fleet.wait_published()
    assert d.entries(NS.id, "n1") == 3
    assert d.checksums(NS.id, route.slot, hashes[3:]) == [None, None]


def test_eviction_withdraws_entries(make_node, redis_url, prefix):
    store, fleet = make_node("n1", cpu_blocks=4)
    hashes, blocks = chain(10)
    for h, b, p in zip(hashes, blocks, [None] + hashes[:-1]):
        store.put(NS.id, [h], [b], parent=p)
    assert fleet.wait_published()
    d = Directory(redis_url, prefix, secret=SECRET)
    slot = fleet.publisher.slots[NS.id]
    published = [c is not None for c in d.checksums(NS.id, slot, hashes)]
    assert published == store.contains(NS.id, hashes)
    assert sum(published) == 4


def test_blocks_held_before_start_are_published(make_node, redis_url, prefix):
    hashes, blocks = chain(3)
    store, fleet = make_node("late", before_start=lambda store: store.put(NS.id, hashes, blocks))
    assert fleet.wait_published()
    assert Directory(redis_url, prefix, secret=SECRET).entries(NS.id, "late") == 3


def test_close_withdraws_this_nodes_entries(make_node, redis_url, prefix):
    store, fleet = make_node("n1")
    hashes, blocks = chain(2)
    store.put(NS.id, hashes, blocks)
    assert fleet.wait_published()
    fleet.close()
    d = Directory(redis_url, prefix, secret=SECRET)
    assert d.entries(NS.id, "n1") == 0
    assert d.route(NS.id, hashes) == []


def test_bad_config_names_the_field(tmp_path, redis_url):
    store = Store([CpuTier(4 * BLOCK, slot_bytes=BLOCK, shm_dir=str(tmp_path))])
    try:
        with pytest.raises(InvalidArgument, match="fleet.node_id"):
            Fleet(store, redis_url, "has space", "127.0.0.1:1")
        with pytest.raises(InvalidArgument, match="fleet.ttl_s"):
            Fleet(store, redis_url, "n", "127.0.0.1:1", heartbeat_s=5, ttl_s=2)
    finally:
        store.close()


def test_a_node_with_different_bytes_for_a_hash_is_not_advertised(make_node, redis_url, prefix):
    """Two nodes computed different bytes for the same prefix (non-deterministic kernels): the
    directory keeps the first checksum and does not list the second node as a holder."""
    s1, f1 = make_node("n1")
    s2, f2 = make_node("n2")
    hashes, blocks = chain(2)
    s1.put(NS.id, hashes, blocks)
    assert f1.wait_published()
    s2.put(NS.id, hashes, [blocks[0], np.zeros(BLOCK, dtype=np.uint8)])
    assert f2.wait_published()
    assert f2.counters["checksum_conflicts"] == 1
    routes = Directory(redis_url, prefix, secret=SECRET).route(NS.id, hashes)
    assert [(r.node_id, r.blocks) for r in routes] == [("n1", 2), ("n2", 1)]


def test_dead_slots_are_swept_and_a_restarted_node_replaces_its_old_slot(make_node, redis_url, prefix):
    s1, f1 = make_node("n1")
    s2, f2 = make_node("n2", sweep_every=1)
    hashes, blocks = chain(3)
    s1.put(NS.id, hashes, blocks)
    s2.put(NS.id, hashes[:1], blocks[:1])
    assert f1.wait_published() and f2.wait_published()
    d = Directory(redis_url, prefix, secret=SECRET)
    old_slot = f1.publisher.slots[NS.id]
    f1.close(unpublish=False)              # like a crash: nothing withdrawn, the slot just stops beating
    wait_for(lambda: d.route(NS.id, hashes) and d.route(NS.id, hashes)[0].node_id == "n2",
             timeout_s=5, what="n1 to drop out of routing once its slot expires")
    wait_for(lambda: d.redis.hget(d.nodes_key(NS.id), str(old_slot)) is None, timeout_s=10,
             what="the janitor to free n1's slot")
    assert d.redis.hlen(d.holders_key(NS.id)) == 1, "only the block n2 holds is left"

    # the same node id comes back (a restarted daemon): it takes a slot, the old one no longer counts
    s1b, f1b = make_node("n1")
    s1b.put(NS.id, hashes[:2], blocks[:2])
    assert f1b.wait_published()
    assert [(r.node_id, r.blocks) for r in d.route(NS.id, hashes)] == [("n1", 2), ("n2", 1)]


def test_route_reports_blocks_on_disk(tmp_path, redis_url, prefix):
    from kvstore.tiers.nvme import NvmeTier
    cpu = CpuTier(2 * BLOCK, slot_bytes=BLOCK, shm_dir=str(tmp_path))
    store = Store([cpu, NvmeTier(str(tmp_path / "nvme"), 64 * BLOCK + 64 * 4096)],
                  StoreConfig(promote_on_hit=False))
    store.register_namespace(NS)
    hashes, blocks = chain(4)
    store.put(NS.id, hashes, blocks)         # two of them are demoted to NVMe before the fleet starts
    fleet = Fleet(store, redis_url, "disky", "127.0.0.1:1", key_prefix=prefix, heartbeat_s=0.2, ttl_s=2,
                  secret=SECRET).start()
    try:
        assert fleet.wait_published()
        (r,) = fleet.route(NS.id, hashes)
        on_disk = sum(t == "nvme" for t in store.lookup(NS.id, hashes, lease=False).tiers)
        assert on_disk == 2 and r.tiers == {"memory": 2, "disk": 2}
    finally:
        fleet.close()
        store.close()


# -- routing -----------------------------------------------------------------------------------

def test_route_picks_the_node_with_the_longest_cached_prefix(make_node):
    s1, f1 = make_node("n1")
    s2, f2 = make_node("n2")
    s3, f3 = make_node("n3")
    hashes, blocks = chain(8)
    s1.put(NS.id, hashes[:2], blocks[:2])
    s2.put(NS.id, hashes[:6], blocks[:6])
    s3.put(NS.id, hashes[1:8], blocks[1:8], parent=hashes[0])   # lacks the first block: serves 0
    for f in (f1, f2, f3):
        assert f.wait_published()
    routes = f3.route(NS.id, hashes)
    assert [(r.node_id, r.blocks, r.tokens) for r in routes] == [("n2", 6, 6 * BLOCK_TOKENS),
                                                                ("n1", 2, 2 * BLOCK_TOKENS)]
    assert routes[0].tiers == {"memory": 6, "disk": 0}
    assert routes[0].address == "inproc-n2:1"

    tokens = (np.arange(8 * BLOCK_TOKENS) * 7919) % 50_000
    by_tokens = f1.route(NS.id, token_ids=tokens.tolist() + [1, 2, 3])   # a partial tail block is ignored
    assert [(r.node_id, r.blocks) for r in by_tokens] == [("n2", 6), ("n1", 2)]


def test_route_of_a_long_prompt_and_unknown_prefix(make_node):
    s1, f1 = make_node("n1", cpu_blocks=700)
    hashes, blocks = chain(600)
    for i in range(0, 600, 100):
        s1.put(NS.id, hashes[i:i + 100], blocks[i:i + 100], parent=hashes[i - 1] if i else None)
    assert f1.wait_published()
    assert [(r.node_id, r.blocks) for r in f1.route(NS.id, hashes)] == [("n1", 600)]
    other, _ = chain(4, seed=9)
    assert f1.route(NS.id, other) == []
    with pytest.raises(InvalidArgument, match="hashes"):
        f1.route(NS.id)


def _runs_one_block_at_a_time(values, slots):
    """Each slot's leading run and its blocks on disk, read a value and a bit at a time."""
    runs, disks = [], []
    for s in slots:
        run = disk = 0
        for v in values:
            if not holds(v, s):
                break
            run += 1
            disk += v[HOLDER_PREFIX_BYTES + s // 4] >> (2 * (s % 4) + 1) & 1
        runs.append(run)
        disks.append(disk)
    return runs, disks


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_leading_runs_match_the_bitmaps_read_one_block_at_a_time(data):
    """The vectorised run counting against the plain reading of the holders bitmaps: values of
    any length (shorter than a slot's byte: it does not hold), missing blocks, any slots."""
    slots = sorted(data.draw(st.sets(st.integers(0, 40), min_size=1, max_size=12)))
    width = HOLDER_PREFIX_BYTES + max(slots) // 4 + 1
    value = st.one_of(st.none(), st.binary(min_size=0, max_size=width + 4),
                      st.binary(min_size=width, max_size=width))
    values = data.draw(st.lists(value, min_size=0, max_size=300))
    if data.draw(st.booleans()):   # mostly held: long runs, some running to the end
        values = [None if v is None else v[:HOLDER_PREFIX_BYTES] + bytes(b | 0x55 for b in v[HOLDER_PREFIX_BYTES:])
                  for v in values]
    runs, disks = leading_runs(values, slots)
    assert (runs.tolist(), disks.tolist()) == _runs_one_block_at_a_time(values, slots)


def test_leading_runs_of_a_long_prompt_held_in_full():
    """2000 blocks held by slots 0-3 (slot 1 on disk throughout), slot 5 up to block 1500: runs
    longer than a uint8 count reaches."""
    full = bytes(HOLDER_PREFIX_BYTES) + bytes([0b01011101, 0b0100])
    part = bytes(HOLDER_PREFIX_BYTES) + bytes([0b01011101, 0])
    values = [full] * 1500 + [part] * 500
    runs, disks = leading_runs(values, [0, 1, 2, 3, 5])
    assert runs.tolist() == [2000, 2000, 2000, 2000, 1500] and disks.tolist() == [0, 2000, 0, 0, 0]


def test_leading_runs_of_huge_values_use_memory_for_the_slots_asked_only():
    """A directory writer's 1 MiB holders value among 1024 blocks is cut to the bytes the slots
    asked for need, not padded to: the rows stay ~50 KiB, not a GiB."""
    import tracemalloc

    held = bytes(HOLDER_PREFIX_BYTES) + bytes([0b01010101] * 2)
    values = [held] * 1023 + [held + b"\xff" * (1 << 20)]
    tracemalloc.start()
    try:
        runs, _ = leading_runs(values, [0, 3, 7])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert runs.tolist() == [1024, 1024, 1024]
    assert peak < 8 << 20


def test_route_cli(make_node, redis_url, prefix, capsys, monkeypatch):
    monkeypatch.setenv("KVSTORE_FLEET__SECRET", SECRET)
    s1, f1 = make_node("n1")
    hashes, blocks = chain(3)
    s1.put(NS.id, hashes, blocks)
    assert f1.wait_published()
    rc = route_main(["--redis", redis_url, "--key-prefix", prefix, "--namespace", NS.id.hex(),
                     "--hashes", ",".join(h.hex() for h in hashes), "--block-tokens", str(BLOCK_TOKENS), "--json"])
    assert rc == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["nodes"][0]["node_id"] == "n1" and out["nodes"][0]["tokens"] == 3 * BLOCK_TOKENS
    tokens = ((np.arange(3 * BLOCK_TOKENS) * 7919) % 50_000).tolist()
    assert route_main(["--redis", redis_url, "--key-prefix", prefix, "--namespace", NS.id.hex(),
                       "--tokens", ",".join(map(str, tokens)), "--block-tokens", str(BLOCK_TOKENS)]) == 0
    text = capsys.readouterr().out
    assert "n1" in text and f" {3 * BLOCK_TOKENS} " in text
    assert route_main(["--redis", "redis://127.0.0.1:1/0", "--namespace", NS.id.hex(), "--hashes", "00"]) == 1
    with pytest.raises(SystemExit):
        route_main(["--namespace", "zz", "--hashes", "00"])


# -- peer fetch --------------------------------------------------------------------------------

def test_lookup_miss_is_filled_from_the_peer_holding_the_prefix(make_node):
    s1, f1 = make_node("n1")
    s2, f2 = make_node("n2")
    s3, f3 = make_node("n3")
    hashes, blocks = chain(6)
    s1.put(NS.id, hashes, blocks)
    s3.put(NS.id, hashes[:2], blocks[:2])
    assert f1.wait_published() and f3.wait_published()
    result = f3.lookup(NS.id, hashes)
    assert result.num_hit == 6
    got = s3.get(NS.id, hashes)
    assert all(g == b.tobytes() for g, b in zip(got, blocks))
    assert f3.counters["fetched_blocks"] == 4
    assert f3.wait_published()
    assert {r.node_id for r in f2.route(NS.id, hashes) if r.blocks == 6} == {"n1", "n3"}


def test_peer_bytes_that_fail_the_published_checksum_are_never_stored(make_node):
    s1, f1 = make_node("n1")
    s3, f3 = make_node("n3")
    hashes, blocks = chain(3)
    s1.put(NS.id, hashes, blocks)
    assert f1.wait_published()
    make_node.peers["inproc-n1:1"].corrupt_next = True
    assert f3.lookup(NS.id, hashes).num_hit == 0
    assert f3.counters["peer_checksum_mismatch"] == 1
    assert s3.contains(NS.id, hashes) == [False] * 3


def test_stale_directory_entry_is_a_miss_not_wrong_bytes(make_node, redis_url, prefix):
    """The owner replaced a block's bytes but its directory entry still carries the old checksum
    (a publish not yet flushed): the fetcher must refuse the new bytes."""
    s1, f1 = make_node("n1")
    s3, f3 = make_node("n3")
    hashes, blocks = chain(2)
    s1.put(NS.id, hashes, blocks)
    assert f1.wait_published()
    f1.close()   # stop publishing; re-plant the entries as they were, then swap the bytes under them
    d = Directory(redis_url, prefix, secret=SECRET)
    slot = d.join(NS.id, "n1", "inproc-n1:1", ttl_s=30)
    d.publish(NS.id, slot, {h: pack_entry(xxhash.xxh3_64_intdigest(b), "cpu") for h, b in zip(hashes, blocks)})
    s1.delete(NS.id, hashes[1:])
    s1.put(NS.id, hashes[1:], [np.zeros(BLOCK, dtype=np.uint8)], parent=hashes[0])
    assert f3.lookup(NS.id, hashes).num_hit == 1
    assert s3.get(NS.id, hashes[:1]) == [blocks[0].tobytes()]
    assert f3.counters["peer_checksum_mismatch"] == 1


def test_redis_down_means_local_service_and_no_peers(tmp_path):
    port = free_port()   # nothing listens here
    store = Store([CpuTier(8 * BLOCK, slot_bytes=BLOCK, shm_dir=str(tmp_path))])
    store.register_namespace(NS)
    fleet = Fleet(store, f"redis://127.0.0.1:{port}/0", "lonely", "127.0.0.1:1", heartbeat_s=0.1, ttl_s=1,
                  secret=SECRET).start()
    try:
        hashes, blocks = chain(3)
        assert store.put(NS.id, hashes, blocks) == ["stored"] * 3
        assert fleet.lookup(NS.id, hashes).num_hit == 3
        other, _ = chain(2, seed=5)
        assert fleet.lookup(NS.id, other).num_hit == 0
        assert fleet.route(NS.id, hashes) == []
        wait_for(lambda: fleet.counters["redis_errors"] > 0, what="a counted directory error")
        assert not fleet.connected
    finally:
        fleet.close()
        store.close()


# -- Redis restarts -----------------------------------------------------------------------

def test_redis_restart_midrun_reconnects_and_republishes(make_node, tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = start_redis(port)
    try:
        s1, f1 = make_node("n1", redis_url=url)
        s2, f2 = make_node("n2", redis_url=url)
        hashes, blocks = chain(5)
        s1.put(NS.id, hashes, blocks)
        assert f1.wait_published()
        assert [r.node_id for r in f2.route(NS.id, hashes)] == ["n1"]

        server.kill()
        server.wait()
        more, more_blocks = chain(3, seed=3)
        assert s1.put(NS.id, more, more_blocks) == ["stored"] * 3      # local service goes on
        assert f2.lookup(NS.id, hashes).num_hit == 0                   # no directory: a miss
        wait_for(lambda: not f1.connected, what="n1 to notice Redis is gone")

        server = start_redis(port)
        d = Directory(url, f1.directory.prefix, secret=SECRET)
        wait_for(lambda: d.entries(NS.id, "n1") == 8, what="n1 to republish everything it holds")
        assert f1.counters["republishes"] >= 2
        wait_for(lambda: f2.lookup(NS.id, hashes).num_hit == 5, what="n2 to reconnect and fetch from n1")
        assert s2.get(NS.id, hashes) == [b.tobytes() for b in blocks]
    finally:
        server.kill()
        server.wait()


# -- Redis Cluster ----------------------------------------------------------------------------

@pytest.fixture
def redis_cluster(tmp_path):
    """A real three-shard Redis Cluster on loopback ports (redis-server + redis-cli --cluster)."""
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        pytest.skip("redis-server / redis-cli are not installed")
    ports = _cluster_ports(3)
    procs = []
    for port in ports:
        (tmp_path / str(port)).mkdir()
        procs.append(subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                                       "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no"],
                                      cwd=tmp_path / str(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        for port in ports:
            wait_for(lambda: _pings(port), what=f"cluster node {port}")
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        wait_for(lambda: b"cluster_state:ok" in subprocess.run([cli, "-p", str(ports[0]), "cluster", "info"],
                                                               capture_output=True).stdout, what="cluster ok")
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _cluster_ports(n: int) -> list[int]:
    """Free ports whose cluster bus port (port + 10000) is free too; Redis needs port <= 55535."""
    import random
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(20000, 55535)
        if port in ports:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        ports.append(port)
    return ports


def _pings(port: int) -> bool:
    try:
        return redis.Redis(port=port, socket_connect_timeout=0.2).ping()
    except redis.ConnectionError:
        return False


def test_directory_routing_peer_fetch_and_pool_on_a_redis_cluster(tmp_path, redis_cluster):
    from kvstore.tiers.redis import RedisTier
    peers: dict[str, StorePeer] = {}
    made = []

    def node(node_id):
        store = Store([CpuTier(32 * BLOCK, slot_bytes=BLOCK, shm_dir=str(tmp_path))], StoreConfig(lease_seconds=0))
        store.register_namespace(NS)
        peers[node_id] = StorePeer(store)
        fleet = Fleet(store, redis_cluster, node_id, node_id, key_prefix="kvscl", heartbeat_s=0.2, ttl_s=1.5,
                      sweep_every=1, client_factory=lambda a, _: peers[a], secret=SECRET).start()
        made.append((store, fleet))
        return store, fleet

    try:
        s1, f1 = node("a")
        s2, f2 = node("b")
        hashes, blocks = chain(5)
        s1.put(NS.id, hashes, blocks)
        assert f1.wait_published(), dict(f1.counters)
        assert [(r.node_id, r.blocks) for r in f2.route(NS.id, hashes)] == [("a", 5)]
        assert f2.lookup(NS.id, hashes).num_hit == 5
        assert s2.get(NS.id, hashes) == [b.tobytes() for b in blocks]
        f1.close(unpublish=False)
        wait_for(lambda: [r.node_id for r in f2.route(NS.id, hashes)] == ["b"], what="a to expire")

        pool = RedisTier(1 << 20, redis_cluster, key_prefix="kvscl")
        store3 = Store([CpuTier(BLOCK, slot_bytes=BLOCK, shm_dir=str(tmp_path)), pool])
        store3.register_namespace(NS)
        store3.put(NS.id, hashes, blocks)
        assert store3.get(NS.id, hashes) == [b.tobytes() for b in blocks]
        assert [x is not None for x in pool.load(NS.id, hashes)][:4] == [True] * 4
        store3.close()
    finally:
        for store, fleet in made:
            fleet.close()
            store.close()


# -- real daemons: gRPC peer fetch, SIGKILL, Redis restart ----------------------------------

# Real `kvstore serve` processes in fleet mode (fleet.* settings in their config file).
class FleetDaemon:
    def __init__(self, workdir, redis_url: str, prefix: str, node_id: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        self.node_id = node_id
        config = write_fleet_config(workdir, redis_url, prefix, node_id)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.ops.cli", "serve", "--config", config,
                                      "--listen", "127.0.0.1:0", "--ready-file", str(workdir / "ready.json")],
                                     env=env, stdout=subprocess.DEVNULL, stderr=open(workdir / "log", "wb"))
        ready = workdir / "ready.json"
        deadline = time.monotonic() + 90
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"fleet daemon {node_id} exited:\n{(workdir / 'log').read_text()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise TimeoutError(f"fleet daemon {node_id} did not start")
            time.sleep(0.05)
        import json
        self.address = json.loads(ready.read_text())["address"]
        from kvstore.client import Client
        self.client = Client(self.address, timeout_s=10.0, transport="grpc")

    def kill(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def fleet_daemons(tmp_path):
    started: list[FleetDaemon] = []

    def start(redis_url: str, prefix: str, *node_ids: str) -> list[FleetDaemon]:
        out = [FleetDaemon(tmp_path / n, redis_url, prefix, n) for n in node_ids]
        started.extend(out)
        return out

    yield start
    for d in started:
        d.kill()


def test_three_daemons_share_prefixes_and_survive_a_sigkill(fleet_daemons, redis_url, prefix):
    d1, d2, d3 = fleet_daemons(redis_url, prefix, "d1", "d2", "d3")
    ns_ids = {d.client.register_namespace(NS) for d in (d1, d2, d3)}
    assert ns_ids == {NS.id}
    shared, shared_blocks = chain(6, seed=1)      # will also be copied to d2
    only_d1, only_d1_blocks = chain(4, seed=2)    # never leaves d1
    d1.client.put(NS.id, shared, shared_blocks)
    d1.client.put(NS.id, only_d1, only_d1_blocks)
    directory = Directory(redis_url, prefix, secret=SECRET)
    wait_for(lambda: directory.entries(NS.id, "d1") == 10, what="d1 to publish")

    # a prefix stored via daemon 1 is served by daemon 3 (peer fetch over gRPC, verified)
    assert d3.client.lookup(NS.id, shared).num_hit == 6
    assert d3.client.get(NS.id, shared) == [b.tobytes() for b in shared_blocks]
    # routing picks the node with the longest cached prefix
    assert d2.client.lookup(NS.id, shared[:3]).num_hit == 3
    wait_for(lambda: directory.entries(NS.id, "d2") == 3, what="d2 to publish its copies")
    wait_for(lambda: directory.entries(NS.id, "d3") == 6, what="d3 to publish its copies")
    routes = directory.route(NS.id, shared)
    assert [r.blocks for r in routes] == [6, 6, 3]
    # the same answer over the daemon's Route RPC (what a router calls)
    assert [(r["node_id"], r["blocks"]) for r in d2.client.route(NS.id, shared)] == \
        [(r.node_id, r.blocks) for r in routes]
    assert {r.node_id for r in routes[:2]} == {"d1", "d3"} and routes[2].node_id == "d2"
    assert routes[0].address in (d1.address, d3.address)

    # kill -9 daemon 1: its entries expire; requests still succeed, from a peer or as a miss
    d1.kill()
    wait_for(lambda: directory.entries(NS.id, "d1") == 0, timeout_s=10, what="d1's entries to expire")
    assert all(r.node_id != "d1" for r in directory.route(NS.id, shared))
    assert d2.client.lookup(NS.id, shared).num_hit == 6           # the rest comes from d3
    assert d2.client.get(NS.id, shared) == [b.tobytes() for b in shared_blocks]
    assert d2.client.lookup(NS.id, only_d1).num_hit == 0          # only the dead node had it
    assert d2.client.get(NS.id, only_d1) == [None] * 4


def test_daemon_lookup_before_the_dead_peer_expires_is_a_miss_not_an_error(fleet_daemons, redis_url, prefix):
    d1, d2 = fleet_daemons(redis_url, prefix, "d1", "d2")
    d2.client.register_namespace(NS)
    d1.client.register_namespace(NS)
    hashes, blocks = chain(3, seed=4)
    d1.client.put(NS.id, hashes, blocks)
    directory = Directory(redis_url, prefix, secret=SECRET)
    wait_for(lambda: directory.entries(NS.id, "d1") == 3, what="d1 to publish")
    d1.kill()                                                     # entries still in the directory
    assert [r.node_id for r in directory.route(NS.id, hashes)] == ["d1"]
    assert d2.client.lookup(NS.id, hashes).num_hit == 0
    assert d2.client.get(NS.id, hashes) == [None] * 3


def test_daemons_republish_after_redis_restarts(fleet_daemons, tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = start_redis(port)
    try:
        d1, d2 = fleet_daemons(url, "kvsrestart", "d1", "d2")
        for d in (d1, d2):
            d.client.register_namespace(NS)
        hashes, blocks = chain(5, seed=6)
        d1.client.put(NS.id, hashes, blocks)
        directory = Directory(url, "kvsrestart", secret=SECRET)
        wait_for(lambda: directory.entries(NS.id, "d1") == 5, what="d1 to publish")
        server.kill()
        server.wait()
        assert d2.client.lookup(NS.id, hashes).num_hit == 0       # no directory, still an answer
        more, more_blocks = chain(2, seed=7)
        assert d1.client.put(NS.id, more, more_blocks) == ["stored"] * 2
        time.sleep(0.5)
        server = start_redis(port)
        wait_for(lambda: directory.entries(NS.id, "d1") == 7, timeout_s=15, what="d1 to republish")
        wait_for(lambda: d2.client.lookup(NS.id, hashes).num_hit == 5, what="d2 to reconnect and fetch from d1")
        assert d2.client.get(NS.id, hashes) == [b.tobytes() for b in blocks]
    finally:
        server.kill()
        server.wait()


def test_route_rpc_on_a_daemon_without_fleet_mode_is_a_failed_precondition(tmp_path):
    from daemon_util import start_daemon

    from kvstore.errors import KVStoreError

    d = start_daemon(tmp_path, "--nvme-bytes", "0")
    try:
        with d.client() as c:
            c.register_namespace(NS)
            with pytest.raises(KVStoreError, match="fleet mode is off") as err:
                c.route(NS.id, chain(2, seed=3)[0])
            assert err.value.grpc_status == "FAILED_PRECONDITION"
    finally:
        d.stop()
