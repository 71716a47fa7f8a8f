"""Fleet trust against a hostile directory (issue #17, item 3), with real daemons, a real Redis and
a real rogue gRPC peer.

The attacker here can write to the fleet's Redis (the tests write keys directly with redis-py) but
does not hold the fleet secret. It may list a rogue peer that serves bytes of its choosing and
publish their checksum, plant malformed values and huge slot numbers, or copy a valid signed value
under another key. A daemon must never fetch from or send its peer token to such a peer, never
accept a checksum signed for another block, keep fleet mode on, and keep its memory bounded.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import psutil
import pytest
import redis
import xxhash

from daemon_util import start_daemon, wait_codecs_warm
from fleet_util import BLOCK, NS, SECRET, StorePeer, chain, wait_for, write_fleet_config

from kvstore.fleet import MAX_SLOTS, Directory, Fleet, PeerClients
from kvstore.ops.forging_peer import ForgingPeer
from kvstore.store import Store, StoreConfig
from kvstore.tiers.cpu import CpuTier

PEER_TOKEN = "peer-token-that-must-not-leak"


# -- real daemons in fleet mode ------------------------------------------------------------------

def fleet_daemon(workdir, redis_url: str, prefix: str, node_id: str, *flags: str, secret: str | None = SECRET,
                 extra: str = "", client_kwargs: dict | None = None):
    """A `kvstore serve` in fleet mode; the secret comes from KVSTORE_FLEET__SECRET, as an
    operator would pass it, never from the file."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_fleet_config(workdir, redis_url, prefix, node_id, secret_in_file=False,
                                fleet_extra=f"peer_token: {PEER_TOKEN}\n" + extra)
    env = {"KVSTORE_FLEET__SECRET": secret} if secret else {}
    return start_daemon(workdir, "--config", config, *flags, cpu_bytes="16MiB", nvme_bytes="0", env=env,
                        client_kwargs=client_kwargs)


@pytest.fixture
def daemons():
    started = []

    def start(*args, **kwargs):
        d = fleet_daemon(*args, **kwargs)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


def put_and_publish(c1, c2, hashes, blocks, directory: Directory) -> None:
    """Both daemons know the namespace; the first holds ``blocks`` and has published them (as "d1")."""
    c1.register_namespace(NS)
    c2.register_namespace(NS)
    c1.put(NS.id, hashes, blocks)
    wait_for(lambda: directory.entries(NS.id, "d1") == len(hashes), what="d1 to publish")


def fleet_counters(client) -> dict:
    return client.stats()["fleet"]["counters"]


def plant_rogue(r, prefix: str, slot: int, node_value: str, hashes: list[bytes], datas: list[bytes]) -> None:
    """What a directory writer without the secret does: list its node and claim the blocks with the
    checksums of its own bytes. The 16 bytes after each checksum are 0xFF (a made-up MAC), so the
    slot's bit reads as set whichever layout the reader expects."""
    tag = f"{prefix}:{{{NS.id.hex()}}}"
    r.hset(f"{tag}:nodes", str(slot), node_value)
    bitmap = bytearray(slot // 4 + 1)
    bitmap[slot // 4] = 1 << ((slot % 4) * 2)
    for h, data in zip(hashes, datas):
        r.hset(f"{tag}:holders", h, xxhash.xxh3_64_intdigest(data).to_bytes(8, "little") + b"\xff" * 16 + bitmap)


@pytest.mark.parametrize("signature", ["unsigned", "bad_mac"])
def test_a_rogue_peer_listed_by_a_directory_writer_is_never_contacted(daemons, tmp_path, redis_url, prefix,
                                                                      signature):
    hashes, _ = chain(3, seed=1)
    evil = [bytes([0x66]) * BLOCK for _ in hashes]
    rogue = ForgingPeer(dict(zip(hashes, evil)), NS.id, BLOCK)
    try:
        d = daemons(tmp_path / "victim", redis_url, prefix, "victim")
        with d.client(transport="grpc") as c:
            assert c.register_namespace(NS) == NS.id
            expiry = int(time.time() * 1000) + 60_000
            value = f"{expiry} rogue {rogue.address} 1" + (" " + "ab" * 16 if signature == "bad_mac" else "")
            plant_rogue(redis.Redis.from_url(redis_url), prefix, 5, value, hashes, evil)

            assert c.lookup(NS.id, hashes).num_hit == 0          # a miss, never the rogue's bytes
            assert c.get(NS.id, hashes) == [None] * 3
            assert c.route(NS.id, hashes) == []                   # a router is not sent there either
            assert rogue.calls == [], "the daemon connected to an address from an unsigned entry"
            assert not any(PEER_TOKEN in t for t in rogue.tokens_seen())
            assert fleet_counters(c)[f"rejected_{signature}"] >= 1
    finally:
        rogue.stop()


def test_malformed_nodes_and_huge_slots_leave_fleet_mode_on_and_memory_bounded(daemons, tmp_path, redis_url,
                                                                              prefix):
    r = redis.Redis.from_url(redis_url)
    nodes = f"{prefix}:{{{NS.id.hex()}}}:nodes"
    future = int(time.time() * 1000) + 600_000
    garbage = {"abc": "garbage", "7": b"\xff\xfe\x00", "9": "123", "11": "notanumber x y", "13": "",
               "-1": f"{future} neg 127.0.0.1:1", "007": f"{future} padded 127.0.0.1:1",
               "1e3": f"{future} sci 127.0.0.1:1", str(MAX_SLOTS): f"{future} over 127.0.0.1:1",
               "99999999999999999999": f"{future} huge 127.0.0.1:1",
               "4000000000": f"{future} big 127.0.0.1:1 " + "00" * 16}
    r.hset(nodes, mapping=garbage)       # before the daemons join: their join script must cope
    d1 = daemons(tmp_path / "d1", redis_url, prefix, "d1")
    d2 = daemons(tmp_path / "d2", redis_url, prefix, "d2")
    hashes, blocks = chain(4, seed=2)
    with d1.client(transport="grpc") as c1, d2.client(transport="grpc") as c2:
        put_and_publish(c1, c2, hashes, blocks, Directory(redis_url, prefix, secret=SECRET))
        wait_codecs_warm(d2)
        # and again, now that they run: their janitors' sweeps free garbage (during the warm-up too),
        # so it goes back in just before the routes that must skip it
        r.hset(nodes, mapping=garbage)
        rss0 = psutil.Process(d2.pid).memory_info().rss
        assert c2.lookup(NS.id, hashes).num_hit == 4              # peer fetch still works
        assert c2.get(NS.id, hashes) == [b.tobytes() for b in blocks]
        wait_for(lambda: [(x["node_id"], x["blocks"]) for x in c2.route(NS.id, hashes)] == [("d1", 4), ("d2", 4)],
                 what="routes naming exactly the two real daemons")
        other, _ = chain(1024, seed=3)
        for _ in range(20):
            c2.route(NS.id, hashes + other)
        grown = psutil.Process(d2.pid).memory_info().rss - rss0
        assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB"
        stats = c2.stats()["fleet"]
        assert stats["connected"] and stats["counters"]["rejected_malformed"] >= 1
        assert d1.alive() and d2.alive()


def test_every_directory_script_skips_garbage_it_finds(redis_url, prefix):
    """Join, heartbeat, publish, the janitor and route, each over a nodes hash full of garbage."""
    r = redis.Redis.from_url(redis_url)
    d = Directory(redis_url, prefix, secret=SECRET)
    future = int(time.time() * 1000) + 600_000
    r.hset(d.nodes_key(NS.id), mapping={"0": "garbage", "1": b"\xff", "x": "1 a b", "4096": f"{future} a b",
                                        "99999999999999999999": f"{future} a b", "3": f"{future} nomac 127.0.0.1:9 1"})
    hashes, blocks = chain(3, seed=9)
    r.hset(d.holders_key(NS.id), hashes[2], b"short")       # a holders value too short to hold anything
    slot = d.join(NS.id, "n", "127.0.0.1:1", ttl_s=30)
    assert slot == 2                                          # the lowest slot no field claims
    assert d.publish(NS.id, slot, {h: b"\0" * 8 + b"\1" for h in hashes}) == 0
    assert d.heartbeat([(NS.id, slot)], "n", "127.0.0.1:1", ttl_s=30) == [True]
    assert [(x.node_id, x.slot, x.blocks) for x in d.route(NS.id, hashes)] == [("n", 2, 3)]
    assert d.counters["rejected_malformed"] >= 4 and d.counters["rejected_unsigned"] >= 1
    d.sweep(NS.id, grace_s=0)
    assert sorted(r.hkeys(d.nodes_key(NS.id))) == [b"2", b"3"]   # garbage freed, the live ones kept
    assert d.checksums(NS.id, slot, hashes) == [0, 0, 0]


@pytest.mark.parametrize("key", ["nodes", "holders"])
def test_a_directory_key_of_the_wrong_type_fails_one_route_and_leaves_the_connection_clean(redis_url, prefix, key):
    """A directory writer replaces the nodes or the holders hash with a string: the route that
    meets it fails (a node answers no route), and the next route, once the hash is back, reads
    its own replies on the same pooled connection, not one the failed route left unread."""
    r = redis.Redis.from_url(redis_url)
    d = Directory(redis_url, prefix, secret=SECRET)
    d.redis.connection_pool.max_connections = 1   # every route on the one connection
    slot = d.join(NS.id, "n", "127.0.0.1:1", ttl_s=30)
    hashes, _ = chain(1500, seed=4)   # two HMGETs: the first 1024 blocks, then the rest
    d.publish(NS.id, slot, {h: b"\0" * 8 + b"\1" for h in hashes})
    assert [x.blocks for x in d.route(NS.id, hashes)] == [1500]
    name = d.nodes_key(NS.id) if key == "nodes" else d.holders_key(NS.id)
    saved = r.dump(name)
    r.delete(name)
    r.set(name, b"not a hash")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        d.route(NS.id, hashes)
    r.delete(name)
    r.restore(name, 0, saved)
    assert [x.blocks for x in d.route(NS.id, hashes)] == [1500]
    assert [x.blocks for x in d.route(NS.id, hashes[:10])] == [10]


def test_a_signed_value_copied_under_another_key_does_not_verify(tmp_path, redis_url, prefix):
    """n3 published block B first (bytes Y). n1 computed other bytes X for B (not advertised: a
    checksum conflict) and holds block A = X, whose signed checksum a directory writer copies to B,
    claiming n1 holds it. n2 must not take X for B; nor may a node entry copied to another slot
    count as a node."""
    made, peers = [], {}

    def node(node_id):
        store = Store([CpuTier(16 * BLOCK, slot_bytes=BLOCK, shm_dir=str(tmp_path))], StoreConfig(lease_seconds=0))
        store.register_namespace(NS)
        peers[node_id] = StorePeer(store)
        fleet = Fleet(store, redis_url, node_id, node_id, key_prefix=prefix, heartbeat_s=0.2, ttl_s=1.5,
                      secret=SECRET, client_factory=lambda a, _: peers[a]).start()
        made.append((store, fleet))
        return store, fleet

    try:
        (a,), (x,) = chain(1, seed=4)
        (b,), (y,) = chain(1, seed=5)
        s3, f3 = node("n3")
        s3.put(NS.id, [b], [y])
        assert f3.wait_published()
        s1, f1 = node("n1")
        s1.put(NS.id, [a, b], [x, x])   # two roots, same bytes
        assert f1.wait_published() and f1.counters["checksum_conflicts"] == 1
        s2, f2 = node("n2")

        r = redis.Redis.from_url(redis_url)
        holders = f1.directory.holders_key(NS.id)
        r.hset(holders, b, r.hget(holders, a))          # A's signed checksum, and n1's bit, under B
        assert f2.lookup(NS.id, [b]).num_hit == 0
        assert s2.get(NS.id, [b]) == [None]
        assert f2.counters["rejected_bad_mac"] >= 1

        nodes = f1.directory.nodes_key(NS.id)
        n1_slot = f1.publisher.slots[NS.id]
        free = max(f.publisher.slots.get(NS.id, -1) for _, f in made) + 1
        r.hset(nodes, str(free), r.hget(nodes, str(n1_slot)))    # n1's signed entry, under another slot
        before = f2.counters["rejected_bad_mac"]
        assert [rt.slot for rt in f2.route(NS.id, [a])] == [n1_slot]
        assert f2.counters["rejected_bad_mac"] > before
    finally:
        for store, fleet in made:
            fleet.close()
            store.close()


def test_the_peer_client_cache_is_bounded_and_closes_what_it_evicts(tmp_path):
    closed = []

    class FakeClient:
        def __init__(self, address, callee):
            self.address = address

        def close(self):
            closed.append(self.address)

    store = Store([CpuTier(4 * BLOCK, slot_bytes=BLOCK, shm_dir=str(tmp_path))])
    try:
        clients = PeerClients(FakeClient, max_clients=2)
        for address in ("a:1", "b:1", "a:1", "c:1", "d:1"):
            clients.get(address, store, NS.id)
        assert len(clients) == 2 and closed == ["b:1", "a:1"] and clients.evicted == 2
        clients.close()
        assert sorted(closed) == ["a:1", "b:1", "c:1", "d:1"]
    finally:
        store.close()


def test_fleet_mode_without_a_secret_refuses_to_start_and_the_secret_never_shows(tmp_path, redis_url, prefix):
    with pytest.raises(RuntimeError, match=r"fleet\.secret"):
        fleet_daemon(tmp_path / "nosecret", redis_url, prefix, "n", secret=None)

    d = fleet_daemon(tmp_path / "withsecret", redis_url, prefix, "n", "--metrics-port", "0",
                     "--log-level", "DEBUG")
    try:
        with d.client(transport="grpc") as c:
            c.register_namespace(NS)
            hashes, blocks = chain(2, seed=6)
            c.put(NS.id, hashes, blocks)
            c.lookup(NS.id, chain(2, seed=7)[0])
            stats = str(c.stats())
        import urllib.request
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
        for where, text in (("stats", stats), ("metrics", metrics), ("log", d.log())):
            assert SECRET not in text, f"the fleet secret shows in {where}"
            assert PEER_TOKEN not in text, f"the peer token shows in {where}"
    finally:
        d.kill()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test cert")
def test_peers_over_tls_with_a_configured_ca(daemons, tmp_path, redis_url, prefix):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(key),
                    "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    d1 = daemons(tmp_path / "d1", redis_url, prefix, "d1", "--tls-cert", str(cert), "--tls-key", str(key),
                 extra=f"peer_tls_ca: {cert}\n", client_kwargs={"root_ca": str(cert)})
    d2 = daemons(tmp_path / "d2", redis_url, prefix, "d2", extra=f"peer_tls_ca: {cert}\n")
    hashes, blocks = chain(3, seed=8)
    with d1.client(transport="grpc") as c1, d2.client(transport="grpc") as c2:
        put_and_publish(c1, c2, hashes, blocks, Directory(redis_url, prefix, secret=SECRET))
        assert c2.lookup(NS.id, hashes).num_hit == 3
        assert c2.get(NS.id, hashes) == [b.tobytes() for b in blocks]
