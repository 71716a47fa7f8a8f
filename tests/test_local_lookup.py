"""Same-host Lookup over the daemon's Unix socket (issue #14, the scheduler path), against real
daemons: the answers are the gRPC Lookup's, tenants stay apart, hostile and idle connections
hold up nobody, and a daemon that goes away is DaemonUnavailable, never a hang or an OSError."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.errors import DaemonUnavailable, UnknownNamespace
from kvstore.proto import kvstore_pb2 as pb

LAYOUT = KVLayout(model="test/local-lookup", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                  block_tokens=16, block_bytes=4096)


@pytest.fixture
def daemon(two_tenant_daemon):
    return two_tenant_daemon


def chain(n: int, seed: int) -> list[bytes]:
    return ChainHasher(seed=seed).chain(np.arange(n * 16), 16)


def stored_and_shaken(client, layout: KVLayout, hashes: list[bytes]):
    """``client`` registers ``layout``'s namespace and puts ``hashes`` (blocks of zeros); returns the
    namespace and its Handshake answer: the lookup socket and this client's ticket to it."""
    ns = client.register_namespace(Namespace(layout))
    client.put(ns, hashes, [np.zeros(layout.block_bytes, np.uint8)] * len(hashes))
    return ns, client.call("Handshake", pb.HandshakeRequest(nonce=os.urandom(16)))


def test_lookups_go_over_the_unix_socket_and_answer_as_grpc_does(daemon):
    hashes = chain(40, seed=1)
    with daemon.client(token="alice-token") as local, daemon.client(token="alice-token", transport="grpc") as remote:
        ns = local.register_namespace(Namespace(LAYOUT))
        local.put(ns, hashes[:30], [np.zeros(4096, np.uint8)] * 30)
        assert local.active_transport == "shm" and remote.active_transport == "grpc"
        assert local._negotiation.lookups is not None and remote._negotiation.lookups is None
        for probe in (hashes, hashes[:30], hashes[:1], hashes[5:], []):
            assert local.lookup(ns, probe) == remote.lookup(ns, probe)
        got = local.lookup(ns, hashes)
        assert got.num_hit == 30 and set(got.tiers) == {"cpu"}
        served = local.call("Handshake", pb.HandshakeRequest(nonce=os.urandom(16)))
        assert served.lookup_socket and os.path.dirname(served.lookup_socket) == os.path.dirname(
            served.segment_socket)


def test_another_tenant_s_namespace_looks_missing_over_the_socket_too(daemon):
    hashes = chain(4, seed=2)
    with daemon.client(token="alice-token") as alice, daemon.client(token="bob-token") as bob:
        ns = alice.register_namespace(Namespace(LAYOUT))
        alice.put(ns, hashes, [np.zeros(4096, np.uint8)] * 4)
        bob.register_namespace(Namespace(LAYOUT))
        assert bob.active_transport == "shm" and bob._negotiation.lookups is not None   # negotiated
        with pytest.raises(UnknownNamespace):
            bob.lookup(ns, hashes)
        assert bob._negotiation.lookups is not None   # a refusal is an answer, not a broken socket


ROGUE = textwrap.dedent("""
    import socket, struct, sys
    from kvstore.transport import local_lookup as L
    from kvstore.transport.socket_server import greeting
    path, ticket, tenant, ns = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3], bytes.fromhex(sys.argv[4])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    s.sendall(greeting(L.MAGIC, ticket, tenant) + L.encode_lookup(ns, [b"x" * 16], True))
    print("answered" if s.recv(64) else "closed")
""")


def test_a_forged_ticket_gets_no_answer_and_idle_connections_hold_up_nobody(daemon):
    hashes = chain(8, seed=3)
    with daemon.client(token="alice-token") as alice:
        ns, hs = stored_and_shaken(alice, LAYOUT, hashes)
        for ticket, tenant in ((os.urandom(32), "alice"), (hs.lookup_ticket, "bob")):
            r = subprocess.run([sys.executable, "-c", ROGUE, hs.lookup_socket, ticket.hex(), tenant, ns.hex()],
                               capture_output=True, text=True, timeout=60)
            assert r.stdout.strip() == "closed", r.stderr
        r = subprocess.run([sys.executable, "-c", ROGUE, hs.lookup_socket, hs.lookup_ticket.hex(), "alice", ns.hex()],
                           capture_output=True, text=True, timeout=60)
        assert r.stdout.strip() == "answered", r.stderr
        idle = []
        for _ in range(300):     # more than the server keeps: it pushes the oldest out, grows nothing
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(hs.lookup_socket)
            idle.append(s)
        try:
            threads = threading.active_count()
            with daemon.client(token="alice-token") as fresh:
                assert fresh.lookup(ns, hashes).num_hit == 8
                assert fresh._negotiation.lookups is not None   # connected past the 300 idle ones
            assert threading.active_count() <= threads + 2
        finally:
            for s in idle:
                s.close()


def test_a_daemon_that_dies_is_daemon_unavailable(daemon):
    hashes = chain(4, seed=4)
    c = daemon.client(token="alice-token", timeout_s=2.0)
    try:
        ns = c.register_namespace(Namespace(LAYOUT))
        c.put(ns, hashes, [np.zeros(4096, np.uint8)] * 4)
        assert c.lookup(ns, hashes).num_hit == 4 and c._negotiation.lookups is not None
        daemon.kill()
        with pytest.raises(DaemonUnavailable):
            c.lookup(ns, hashes)
    finally:
        c.close()
