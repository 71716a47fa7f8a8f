"""A departed node's signed directory entry, replayed (issue #35, attack 7), with real daemons, a real
Redis and a real rogue gRPC server.

The attacker can write the fleet's Redis but holds neither the fleet secret nor the peer token. It
saves node d1's signed entry (and the signed checksums of its blocks) while d1 is alive; d1 leaves
cleanly; the attacker binds d1's port on loopback and writes the saved values back while their
signed expiry is still ahead. A daemon that misses must then get nothing from the rogue: no peer
token, no fleet secret, no proof it can use on an honest peer, and no bytes taken from it.
"""

from __future__ import annotations

import hashlib
import time

import grpc
import pytest
import redis

from daemon_util import start_daemon
from fleet_util import BLOCK, NS, SECRET, chain, wait_for, write_fleet_config

from kvstore.fleet import Directory
from kvstore.ops.forging_peer import ForgingPeer, replay
from kvstore.proto import kvstore_pb2 as pb

PEER_TOKEN = "peer-token-of-tenant-t-must-not-leak"
TTL_S = 30.0   # long enough that the saved entry is still ahead of its expiry when it is written back


def node(workdir, redis_url: str, prefix: str, node_id: str):
    """A `kvstore serve` in fleet mode with auth on: the peer token is tenant t's token on every node
    (t is an admin, so its Stats show the fleet's counters)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_fleet_config(workdir, redis_url, prefix, node_id, secret_in_file=False, ttl_s=TTL_S,
                                fleet_extra=f"peer_token: {PEER_TOKEN}\n",
                                extra=f"tokens:\n  {PEER_TOKEN}: t\nadmin_tenants: [t]\n")
    return start_daemon(workdir, "--config", config, cpu_bytes="16MiB", nvme_bytes="0",
                        env={"KVSTORE_FLEET__SECRET": SECRET}, client_kwargs={"token": PEER_TOKEN})


@pytest.fixture
def nodes():
    started = []

    def start(*args):
        d = node(*args)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


def counters(client) -> dict:
    return client.stats()["fleet"]["counters"]


@pytest.mark.parametrize("tombstone", ["kept", "deleted by the attacker"])
def test_a_replayed_entry_of_a_departed_node_gets_no_secret_and_no_usable_proof(nodes, tmp_path, redis_url,
                                                                                 prefix, tombstone):
    hashes, blocks = chain(3, seed=31)
    directory = Directory(redis_url, prefix, secret=SECRET)
    r = redis.Redis.from_url(redis_url)
    nodes_key, holders_key = directory.nodes_key(NS.id), directory.holders_key(NS.id)

    d1 = nodes(tmp_path / "d1", redis_url, prefix, "d1")
    with d1.client(transport="grpc") as c1:
        c1.register_namespace(NS)
        c1.put(NS.id, hashes, blocks)
        wait_for(lambda: directory.entries(NS.id, "d1") == len(hashes), what="d1 to publish")
    # the attacker saves d1's signed entry and its blocks' signed checksums while d1 is alive
    saved_nodes = r.hgetall(nodes_key)
    saved_holders = dict(zip(hashes, r.hmget(holders_key, hashes)))
    assert saved_nodes and all(saved_holders.values())

    d1_address = f"127.0.0.1:{d1.port}"
    assert d1.stop() == 0                                   # a clean leave: d1 withdraws its entries
    assert directory.entries(NS.id, "d1") == 0
    thief = ForgingPeer({h: b.tobytes() for h, b in zip(hashes, blocks)}, NS.id, BLOCK, d1_address)
    try:
        for slot, value in saved_nodes.items():             # written back within the entry's TTL
            r.hset(nodes_key, slot, value)
        for h, value in saved_holders.items():
            r.hset(holders_key, h, value)
        if tombstone == "deleted by the attacker":
            for key in r.scan_iter(f"{prefix}:{{{NS.id.hex()}}}:*"):
                if key.decode() not in (nodes_key, holders_key):
                    r.delete(key)

        victim = nodes(tmp_path / "victim", redis_url, prefix, "victim")
        honest = nodes(tmp_path / "honest", redis_url, prefix, "honest")
        with victim.client(transport="grpc") as cv, honest.client(transport="grpc") as ch:
            cv.register_namespace(NS)
            ch.register_namespace(NS)
            hits = cv.lookup(NS.id, hashes).num_hit
            seen = thief.metadata_text()
            assert PEER_TOKEN not in seen, "the daemon sent its peer token to whoever holds the address"
            assert SECRET not in seen
            assert hits == 0, "the daemon took bytes from an unproven peer"
            assert cv.get(NS.id, hashes) == [None] * 3
            if tombstone == "kept":
                assert thief.calls == [], "a revoked epoch was called"
                assert counters(cv)["rejected_revoked"] >= 1
                return
            assert thief.calls, "the replayed entry was not tried (the test would show nothing)"
            assert counters(cv)["peer_unproven"] >= 1

            # every proof the thief captured is refused by an honest daemon (bound to d1 and its
            # epoch, and to the call it came with)
            with grpc.insecure_channel(f"127.0.0.1:{honest.port}") as channel:
                for method, metadata, request in thief.calls:
                    assert replay(channel, method, metadata, request) == grpc.StatusCode.UNAUTHENTICATED

            # the honest node still serves the victim
            ch.put(NS.id, hashes, blocks)
            wait_for(lambda: directory.entries(NS.id, "honest") == len(hashes), what="honest to publish")
            assert cv.lookup(NS.id, hashes).num_hit == 3
            assert cv.get(NS.id, hashes) == [b.tobytes() for b in blocks]
    finally:
        thief.stop()


def test_a_peer_proof_is_good_for_one_call(nodes, tmp_path, redis_url, prefix):
    """A proof made for the honest node and its epoch (by someone holding the keys) works once;
    the same bytes again, or for another request, are refused."""
    from kvstore.fleet.peer_proof import PeerKeys, caller_header

    honest = nodes(tmp_path / "honest", redis_url, prefix, "honest")
    hashes, blocks = chain(2, seed=32)
    with honest.client(transport="grpc") as ch:
        ch.register_namespace(NS)
        ch.put(NS.id, hashes, blocks)
    directory = Directory(redis_url, prefix, secret=SECRET)
    wait_for(lambda: directory.entries(NS.id, "honest") == 2, what="honest to publish")
    (route,) = directory.route(NS.id, hashes)
    keys = PeerKeys(SECRET, PEER_TOKEN)
    get = "/kvstore.v1.KVStore/Get"
    request = pb.GetRequest(namespace_id=NS.id, hashes=hashes).SerializeToString()
    other = pb.GetRequest(namespace_id=NS.id, hashes=hashes[:1]).SerializeToString()

    def proof(for_request: bytes, epoch: int = route.epoch, ms: int | None = None) -> tuple:
        return (("authorization", caller_header(keys, route.node_id, epoch, get,
                                                hashlib.sha256(for_request).digest(), ms=ms)),)

    with grpc.insecure_channel(f"127.0.0.1:{honest.port}") as channel:
        once = proof(request)
        first = replay(channel, "Get", once, request)
        assert isinstance(first, list), first
        assert [list(pb.GetChunk.FromString(m).sizes) for m in first] == [[len(b) for b in blocks]]   # both, packed
        assert replay(channel, "Get", once, request) == grpc.StatusCode.UNAUTHENTICATED      # used
        assert replay(channel, "Get", proof(request), other) == grpc.StatusCode.UNAUTHENTICATED   # another request
        assert replay(channel, "Get", proof(request, route.epoch + 1), request) == grpc.StatusCode.UNAUTHENTICATED
        stale = proof(request, ms=int(time.time() * 1000) - 120_000)
        assert replay(channel, "Get", stale, request) == grpc.StatusCode.UNAUTHENTICATED
        assert isinstance(replay(channel, "Get", proof(request), request), list)             # a fresh one works


def test_a_tombstone_is_remembered_by_a_reader_that_saw_it(redis_url, prefix):
    """leave() revokes the run; its entry written back is refused, also after the tombstone is
    deleted, by a reader that saw it (one that never did relies on the peer proof)."""
    r = redis.Redis.from_url(redis_url)
    d = Directory(redis_url, prefix, secret=SECRET)
    hashes, _ = chain(2, seed=33)
    entries = {h: b"\0" * 8 + b"\1" for h in hashes}
    slot = d.join(NS.id, "n", "127.0.0.1:1", ttl_s=30, epoch=7)
    d.publish(NS.id, slot, entries)
    assert [(x.node_id, x.epoch) for x in d.route(NS.id, hashes)] == [("n", 7)]
    saved = r.hget(d.nodes_key(NS.id), str(slot))
    d.leave(NS.id, slot, hashes, "n", 7, ttl_s=30)

    r.hset(d.nodes_key(NS.id), str(slot), saved)   # written back, with the holder bits
    d.publish(NS.id, slot, entries)
    assert d.route(NS.id, hashes) == [] and d.counters["rejected_revoked"] >= 1
    r.delete(d.revoked_key(NS.id))
    assert d.route(NS.id, hashes) == []
    assert [x.node_id for x in Directory(redis_url, prefix, secret=SECRET).route(NS.id, hashes)] == ["n"]

    forged = f"{int(time.time() * 1000) + 60_000} " + "00" * 16   # a tombstone without the secret
    r.hset(d.revoked_key(NS.id), "n 8", forged)
    d.publish(NS.id, d.join(NS.id, "n", "127.0.0.1:1", ttl_s=30, epoch=8), entries)   # n restarts
    assert [x.epoch for x in Directory(redis_url, prefix, secret=SECRET).route(NS.id, hashes)] == [8]
    d.sweep(NS.id, grace_s=0)
    assert r.hget(d.revoked_key(NS.id), "n 8") is None   # the janitor deletes what does not verify


def test_a_revoked_key_of_the_wrong_type_costs_routes_until_the_next_heartbeat(redis_url, prefix):
    r = redis.Redis.from_url(redis_url)
    d = Directory(redis_url, prefix, secret=SECRET)
    hashes, _ = chain(2, seed=34)
    slot = d.join(NS.id, "n", "127.0.0.1:1", ttl_s=30, epoch=3)
    d.publish(NS.id, slot, {h: b"\0" * 8 + b"\1" for h in hashes})
    r.set(d.revoked_key(NS.id), "not a hash")
    with pytest.raises(redis.ResponseError):
        d.route(NS.id, hashes)
    assert d.heartbeat([(NS.id, slot)], "n", "127.0.0.1:1", ttl_s=30, epoch=3) == [True]
    assert [x.node_id for x in d.route(NS.id, hashes)] == ["n"]
