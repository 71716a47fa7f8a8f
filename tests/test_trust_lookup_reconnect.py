"""Same-host lookup connections under a flood of other connections (issue 35, item 6), against a
real two-tenant ``kvstore serve`` and a real attacker process.

Before: 300 connections from anyone pushed a client's lookup connection out, and its lookups
then stayed on gRPC (p50 17 us -> 929 us) until the next negotiation. Now connection caps are per
tenant (another tenant's connections, greeted or silent, push out none of ours), and a client
whose connection was pushed out connects again on its next lookup.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.client import negotiation
from kvstore.proto import kvstore_pb2 as pb
from kvstore.transport.bulk import readable_within

LAYOUT = KVLayout(model="test/lookup-reconnect", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                  block_tokens=16, block_bytes=4096)
FLOOD = 300

FLOODER = textwrap.dedent("""
    import socket, sys
    from kvstore.transport import local_lookup as L
    from kvstore.transport.socket_server import greeting
    path, ticket, tenant, n = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    held = []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        if ticket:   # greeted, and admitted as that tenant (a lookup on it is answered)
            s.sendall(greeting(L.MAGIC, ticket, tenant) + L.encode_lookup(b"x" * 16, [b"y" * 16], L.LOOKUP))
            L.recv_frame(s)
        held.append(s)
    print("ready", flush=True)
    sys.stdin.read()   # hold them until told
""")


@pytest.fixture
def daemon(two_tenant_daemon):
    return two_tenant_daemon


def flood(path: str, ticket: bytes, tenant: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", FLOODER, path, ticket.hex(), tenant, str(FLOOD)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def stop(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.wait(30)


def pushed_out(bob, hashes) -> tuple:
    """Bob stores 8 blocks and looks them up over his lookup connection, then a flood of his own
    tenant's connections pushes that connection out and stops: (namespace, the pushed-out
    connection, the Handshake that named the socket)."""
    ns = bob.register_namespace(Namespace(LAYOUT))
    bob.put(ns, hashes, [np.zeros(4096, np.uint8)] * 8)
    assert bob.lookup(ns, hashes).num_hit == 8
    first = bob._negotiation.lookups
    hs = bob.call("Handshake", pb.HandshakeRequest(nonce=os.urandom(16)))
    p = flood(hs.lookup_socket, hs.lookup_ticket, "bob")
    deadline = time.monotonic() + 10   # the daemon admits the flood's greetings as it reads them
    while not readable_within(first._sock):
        assert time.monotonic() < deadline, "the flood did not push the client's connection out"
        time.sleep(0.05)
    stop(p)
    return ns, first, hs


def test_another_tenant_s_connections_push_out_none_of_ours(daemon):
    hashes = ChainHasher(seed=1).chain(np.arange(8 * 16), 16)
    with daemon.client(token="bob-token") as bob, daemon.client(token="alice-token") as alice:
        ns = bob.register_namespace(Namespace(LAYOUT))
        bob.put(ns, hashes, [np.zeros(4096, np.uint8)] * 8)
        assert bob.lookup(ns, hashes).num_hit == 8
        kept = bob._negotiation.lookups
        assert kept is not None
        hs = alice.call("Handshake", pb.HandshakeRequest(nonce=os.urandom(16)))
        floods = [flood(hs.lookup_socket, hs.lookup_ticket, "alice"), flood(hs.lookup_socket, b"", "")]
        try:
            assert bob.lookup(ns, hashes).num_hit == 8
            assert bob._negotiation.lookups is kept and not readable_within(kept._sock), \
                "another tenant's connections pushed this client's lookup connection out"
        finally:
            for p in floods:
                stop(p)


def test_a_pushed_out_connection_comes_back_on_the_next_lookup(daemon):
    """The tenant's own connections (up to its cap) push its oldest out; the client connects
    again on its next lookup rather than staying on gRPC."""
    hashes = ChainHasher(seed=2).chain(np.arange(8 * 16), 16)
    with daemon.client(token="bob-token") as bob:
        ns, first, _ = pushed_out(bob, hashes)
        assert bob.lookup(ns, hashes).num_hit == 8
        again = bob._negotiation.lookups
        assert again is not None and again is not first, "lookups stayed on gRPC"
        assert bob.lookup(ns, hashes).num_hit == 8 and bob._negotiation.lookups is again


def test_while_the_socket_cannot_be_reached_lookups_go_over_grpc_and_attempts_back_off(daemon, monkeypatch):
    """The client's connection is pushed out and the socket's path is gone: every lookup is
    still answered (over gRPC), the client tries the socket again with back-off rather than on
    every lookup, and it is back on the socket soon after the path returns."""
    hashes = ChainHasher(seed=3).chain(np.arange(8 * 16), 16)
    attempts = []
    real = negotiation.LocalLookup

    def counted(*args, **kwargs):   # the real connection; only its attempts are counted
        attempts.append(time.monotonic())
        return real(*args, **kwargs)

    with daemon.client(token="bob-token") as bob:
        ns, first, hs = pushed_out(bob, hashes)
        monkeypatch.setattr(negotiation, "LocalLookup", counted)
        os.rename(hs.lookup_socket, hs.lookup_socket + ".away")
        try:
            answered, end = 0, time.monotonic() + 1.0
            while time.monotonic() < end:
                assert bob.lookup(ns, hashes).num_hit == 8
                answered += 1
                time.sleep(0.005)
            assert bob._negotiation.lookups is None
            assert answered >= 10 and 1 <= len(attempts) <= 7, (answered, len(attempts))   # 0.05, 0.1, 0.2... s apart
        finally:
            os.rename(hs.lookup_socket + ".away", hs.lookup_socket)
        deadline = time.monotonic() + 5
        while bob._negotiation.lookups is None:
            assert time.monotonic() < deadline, "the client did not come back to the socket"
            assert bob.lookup(ns, hashes).num_hit == 8
            time.sleep(0.05)
        assert bob.lookup(ns, hashes).num_hit == 8 and bob._negotiation.lookups is not first
