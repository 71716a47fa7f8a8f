"""Direct fetch of a P/D hand-off's blocks (``kvstore.fleet.direct``): real ``kvstore serve``
processes in one fleet on the real Redis, each test under a key prefix of its own.

A lookup that names the blocks' producer (``LookupRequest.producer``, what a decode engine's
connector sends while it waits for a hand-off) makes the daemon fetch what it misses from that
fleet member at once, without the directory's records of those blocks; a producer that is no
member, is the daemon itself or is no node id gets no call and the lookup goes on as without it;
a block whose bytes do not match the checksum its member signed is never stored.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import redis

from fleet_util import NS, SECRET, chain, wait_for, write_fleet_config
from redis_util import free_port

from kvstore.client import Client
from kvstore.fleet import Directory
from kvstore.proto import kvstore_pb2 as pb


def _fleet_daemon(daemon_factory, tmp_path, redis_url: str, prefix: str, node_id: str, *, port: int = 0,
                  advertise: str = "", heartbeat_s: float = 0.2, bulk_channel: bool = False):
    workdir = tmp_path / node_id
    workdir.mkdir()
    config = write_fleet_config(workdir, redis_url, prefix, node_id, heartbeat_s=heartbeat_s, bulk_channel=bulk_channel,
                                ttl_s=max(1.5, 3 * heartbeat_s),
                                fleet_extra=f"advertise_addr: {advertise}\n" if advertise else "")
    flags = ["--config", config] + (["--listen", f"127.0.0.1:{port}"] if port else [])
    return daemon_factory(*flags, tmp=workdir / "daemon", nvme_bytes="0")


def _unpublished(redis_url: str, prefix: str, hashes: list[bytes]) -> None:
    """Take ``hashes`` out of the directory, as if their holder had not flushed them yet."""
    r = redis.Redis.from_url(redis_url)
    r.hdel(Directory(redis_url, prefix, secret=SECRET).holders_key(NS.id), *hashes)
    r.close()


def _counters(client) -> dict:
    return client.stats()["fleet"]["counters"]


@pytest.fixture
def fleet(daemon_factory, tmp_path, redis_url, prefix):
    """Daemons A and B in one fleet, the namespace registered on both, A a member of it (it
    published a first block). B beats every 5 s, so it reads a namespace's membership that
    seldom, unless it lacks the node a lookup names. A offers a side channel, which its peers'
    gets take."""
    a = _fleet_daemon(daemon_factory, tmp_path, redis_url, prefix, "a", bulk_channel=True)
    b = _fleet_daemon(daemon_factory, tmp_path, redis_url, prefix, "b", heartbeat_s=5.0)
    ca, cb = a.client(), b.client()
    for c in (ca, cb):
        c.register_namespace(NS)
    first, first_blocks = chain(1, seed=90)
    ca.put(NS.id, first, first_blocks)
    directory = Directory(redis_url, prefix, secret=SECRET)
    wait_for(lambda: directory.entries(NS.id, "a") == 1, what="A to join the namespace")
    yield ca, cb, directory
    ca.close()
    cb.close()


def test_the_named_producer_serves_blocks_the_directory_does_not_list(fleet, redis_url, prefix):
    ca, cb, directory = fleet
    assert (ca.fleet_node, cb.fleet_node) == ("a", "b")      # what a producer names (Handshake)
    hashes, blocks = chain(6, seed=91)
    ca.put(NS.id, hashes, blocks)
    wait_for(lambda: directory.entries(NS.id, "a") == 7, what="A to publish")
    _unpublished(redis_url, prefix, hashes)
    assert directory.route(NS.id, hashes) == []
    # without the name, B finds them nowhere: the directory lists no holder
    assert cb.lookup(NS.id, hashes).num_hit == 0
    # named, B gets them from A in one batch, verified
    assert cb.lookup(NS.id, hashes, producer="a").num_hit == 6
    assert cb.get(NS.id, hashes) == [b.tobytes() for b in blocks]
    got = _counters(cb)
    assert (got["direct_fetches"], got["direct_blocks"], got["direct_checksum_mismatch"]) == (1, 6, 0)
    assert _counters(ca)["checksums_served"] == 6
    assert ca.stats()["server"]["bulk_channel"]["sessions_opened"] == 1    # the bytes came over A's side channel
    # `kvstore stats` shows them to the operator
    shown = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "stats", "--url", cb.address],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "120"}).stdout
    assert "fleet node b" in shown and any(line.split() == ["direct_blocks", "6"] for line in shown.splitlines())
    # already here: the next lookup calls no one
    assert cb.lookup(NS.id, hashes, producer="a").num_hit == 6
    assert _counters(ca)["checksums_served"] == 6
    # B publishes the copies it fetched, so the directory names it from now on
    wait_for(lambda: directory.entries(NS.id, "b") == 6, what="B to publish its copies")


def test_a_producer_that_is_no_member_is_not_called_and_the_directory_still_serves(fleet, redis_url, prefix):
    ca, cb, directory = fleet
    hidden, hidden_blocks = chain(3, seed=92)        # in no directory record
    listed, listed_blocks = chain(4, seed=93)        # published as usual
    ca.put(NS.id, hidden, hidden_blocks)
    ca.put(NS.id, listed, listed_blocks)
    wait_for(lambda: directory.entries(NS.id, "a") == 8, what="A to publish")
    _unpublished(redis_url, prefix, hidden)
    for producer in ("nobody", "b", "a b", "{a}", "x" * 1000, "a\n"):
        assert cb.lookup(NS.id, hidden, producer=producer).num_hit == 0
    got = _counters(cb)
    assert (got["direct_refused_unknown"], got["direct_refused_self"], got["direct_refused_malformed"]) == (1, 1, 4)
    assert got["direct_fetches"] == got["direct_blocks"] == 0
    assert _counters(ca)["checksums_served"] == 0    # A was never asked
    # the lookup goes on as without the name: blocks the directory lists come from their holder
    assert cb.lookup(NS.id, listed, producer="nobody").num_hit == 4
    assert cb.get(NS.id, listed) == [b.tobytes() for b in listed_blocks]
    got = _counters(cb)
    assert (got["direct_refused_unknown"], got["fetched_blocks"], got["direct_blocks"]) == (2, 4, 0)


def test_a_producer_that_joins_after_it_was_refused_is_found_at_once(fleet, daemon_factory, tmp_path, redis_url,
                                                                     prefix):
    ca, cb, directory = fleet
    hashes, blocks = chain(3, seed=95)
    assert cb.lookup(NS.id, hashes, producer="c").num_hit == 0        # no node c yet: B's view lacks it
    assert _counters(cb)["direct_refused_unknown"] == 1
    refused = time.monotonic()
    cc = _fleet_daemon(daemon_factory, tmp_path, redis_url, prefix, "c").client()
    cc.register_namespace(NS)
    cc.put(NS.id, hashes, blocks)
    wait_for(lambda: directory.entries(NS.id, "c") == 3, what="C to join the namespace")
    _unpublished(redis_url, prefix, hashes)
    # B reads the membership again when it lacks the node named, within less than its heartbeat
    assert time.monotonic() - refused < 5.0
    assert cb.lookup(NS.id, hashes, producer="c").num_hit == 3
    assert _counters(cb)["direct_blocks"] == 3
    cc.close()


class _CorruptingProxy:
    """A TCP relay in front of a daemon that flips one byte wherever ``marker`` passes from the
    daemon to its caller: a block's bytes corrupted in transit, the gRPC framing left intact."""

    def __init__(self, upstream_port: int, marker: bytes) -> None:
        self.marker = marker
        self.upstream = upstream_port
        self.corrupted = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                caller, _ = self.listener.accept()
            except OSError:
                return
            daemon = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(caller, daemon, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(daemon, caller, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, corrupt: bool) -> None:
        # the tail of what came so far is held back, so a marker split over reads is seen; it goes
        # on once nothing more comes for 10 ms (a short frame must not wait for the next one)
        held = b""
        keep = len(self.marker) - 1
        src.settimeout(0.01)
        try:
            while True:
                try:
                    data = src.recv(1 << 16)
                except TimeoutError:
                    dst.sendall(held)
                    held = b""
                    continue
                if not data:
                    break
                if not corrupt:
                    dst.sendall(data)
                    continue
                held += data
                at = held.find(self.marker)
                while at >= 0:
                    held = held[:at] + bytes([held[at] ^ 0xFF]) + held[at + 1:]
                    self.corrupted += 1
                    at = held.find(self.marker, at + 1)
                dst.sendall(held[:len(held) - keep])
                held = held[len(held) - keep:]
            dst.sendall(held)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def test_a_block_that_fails_its_signed_checksum_in_transit_is_not_stored(daemon_factory, tmp_path, redis_url,
                                                                          prefix):
    hashes, blocks = chain(5, seed=94)
    port = free_port()
    proxy = _CorruptingProxy(port, blocks[2][1000:1032].tobytes())   # inside block 2's bytes
    try:
        # A's signed entry names the relay: that is where its peers reach it
        a = _fleet_daemon(daemon_factory, tmp_path, redis_url, prefix, "a", port=port,
                          advertise=f"127.0.0.1:{proxy.port}")
        b = _fleet_daemon(daemon_factory, tmp_path, redis_url, prefix, "b")
        ca, cb = a.client(), b.client()
        for c in (ca, cb):
            c.register_namespace(NS)
        ca.put(NS.id, hashes, blocks)
        directory = Directory(redis_url, prefix, secret=SECRET)
        wait_for(lambda: directory.entries(NS.id, "a") == 5, what="A to publish")
        _unpublished(redis_url, prefix, hashes)
        assert cb.lookup(NS.id, hashes, producer="a").num_hit == 2   # the run stops at the corrupt block
        assert proxy.corrupted >= 1
        got = _counters(cb)
        assert (got["direct_checksum_mismatch"], got["direct_blocks"]) == (1, 2)
        assert cb.exists(NS.id, hashes) == [True, True, False, False, False]
        assert cb.get(NS.id, hashes[:2]) == [b.tobytes() for b in blocks[:2]]
        ca.close()
        cb.close()
    finally:
        proxy.close()


def test_a_local_only_lookup_answers_from_the_daemon_s_own_blocks_and_fetches_nothing(fleet):
    """What a P/D producer asks (which prompt blocks it need not save): a fleet daemon answers it
    from its own blocks, over the same-host lookup socket its handshake offers in fleet mode too,
    and calls no peer and no directory; a plain lookup of the same blocks still fetches them."""
    ca, cb, directory = fleet
    hashes, blocks = chain(5, seed=97)
    ca.put(NS.id, hashes, blocks)
    wait_for(lambda: directory.entries(NS.id, "a") == 6, what="A to publish")
    offered = cb.call("Handshake", pb.HandshakeRequest(nonce=os.urandom(16)))
    assert offered.lookup_socket and offered.lookup_ticket
    before = _counters(cb)
    with Client(cb.address, transport="grpc") as over_grpc:    # the Lookup RPC's local_only
        over_grpc.register_namespace(NS)
        for client in (cb, over_grpc):
            for producer in ("", "a"):
                assert client.lookup(NS.id, hashes, lease=False, producer=producer, local_only=True).num_hit == 0
    after = _counters(cb)
    moved = ("fetches", "fetched_blocks", "direct_fetches", "direct_misses", "fetch_directory_errors")
    assert {k: after.get(k, 0) - before.get(k, 0) for k in moved} == dict.fromkeys(moved, 0)
    assert _counters(ca)["checksums_served"] == 0
    # the same lookup without local_only completes the run from A, after which local_only finds it
    assert cb.lookup(NS.id, hashes).num_hit == 5
    assert _counters(cb)["fetched_blocks"] - before.get("fetched_blocks", 0) == 5
    assert cb.lookup(NS.id, hashes, lease=False, local_only=True).num_hit == 5
    assert cb.get(NS.id, hashes) == [b.tobytes() for b in blocks]
