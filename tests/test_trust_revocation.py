"""A reload that removes or changes a token revokes it on every transport (issue 35, item 1).

A real ``kvstore serve`` with two tenants; alice's token is removed (or rotated) by editing the
config file and sending SIGHUP. Before, gRPC refused alice, but her old tickets still got segment
descriptors from the broker, answered (and leased) lookups and PrepareStore/CompleteStore over
the Unix socket, and her existing ``Client`` kept putting and getting: tickets were HMACs of the
tenant under a per-run secret that nothing checked against the current tokens.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import textwrap
import time

import grpc
import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.errors import Unauthenticated
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.transport import local_lookup, lookup_index, segments
from kvstore.transport.bulk import BulkChannel
from kvstore.transport.socket_server import greeting

LAYOUT = KVLayout(model="test/revocation", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16",
                  block_tokens=16)
TRANSPORTS = ["shm", "bulk", "grpc"]


def chain(n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    hashes = ChainHasher(seed=seed).chain(list(range(16 * n)), 16)
    return hashes, [np.random.default_rng(seed * 100 + i).integers(0, 256, LAYOUT.block_bytes, np.uint8)
                    for i in range(n)]


def write_tokens(path, tokens: str) -> None:
    path.write_text(textwrap.dedent(f"""
        tokens: {tokens}
        admin_tenants: [ops]
    """))


@pytest.fixture
def daemon(daemon_factory, tmp_path):
    config = tmp_path / "kv.yaml"
    write_tokens(config, "{alice-token: alice, bob-token: bob, ops-token: ops}")
    d = daemon_factory("--config", str(config), "--shm-dir", str(tmp_path), cpu_bytes="16MiB", nvme_bytes="64MiB")
    d.config = config
    return d


def reload_tokens(d, tokens: str) -> None:
    before = d.log().count("reload: applied")
    write_tokens(d.config, tokens)
    os.kill(d.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while d.log().count("reload: applied") == before:
        assert time.monotonic() < deadline, d.log()[-2000:]
        time.sleep(0.05)


def handshake(d, token: str) -> pb.HandshakeResponse:
    """What a same-host client gets from Handshake: socket paths and tickets."""
    with grpc.insecure_channel(d.address) as channel:
        return pb_grpc.KVStoreStub(channel).Handshake(pb.HandshakeRequest(nonce=secrets.token_bytes(16)),
                                                      metadata=[("authorization", f"Bearer {token}")], timeout=10)


def lookup_over(sock: socket.socket, ns: bytes, hashes: list[bytes]) -> bytes | None:
    """One lookup frame on an open, greeted connection; its answer, or None when the daemon closed it."""
    try:
        sock.sendall(local_lookup.encode_lookup(ns, hashes, local_lookup.LOOKUP))
        return local_lookup.recv_frame(sock)
    except OSError:
        return None


def greeted(path: str, ticket: bytes, tenant: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    sock.sendall(greeting(local_lookup.MAGIC, ticket, tenant))
    return sock


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("change", ["removed", "rotated"])
def test_an_existing_client_is_refused_on_its_next_call(daemon, transport, change):
    hashes_a, blocks_a = chain(3, seed=1)
    hashes_b, blocks_b = chain(3, seed=2)
    more, more_blocks = chain(5, seed=3)
    with daemon.client(token="alice-token", transport=transport) as alice, \
            daemon.client(token="bob-token", transport=transport) as bob:
        ns_a = alice.register_namespace(Namespace(LAYOUT))
        ns_b = bob.register_namespace(Namespace(LAYOUT))
        assert alice.put(ns_a, hashes_a, blocks_a) == ["stored"] * 3
        assert bob.put(ns_b, hashes_b, blocks_b) == ["stored"] * 3
        assert alice.lookup(ns_a, hashes_a).num_hit == 3 and alice.get(ns_a, hashes_a)[0] == blocks_a[0].tobytes()
        assert alice.active_transport == transport
        reload_tokens(daemon, "{bob-token: bob, ops-token: ops}" if change == "removed"
                      else "{alice-new-token: alice, bob-token: bob, ops-token: ops}")
        for call in (lambda: alice.put(ns_a, more[3:], more_blocks[3:], parent=more[2]),
                     lambda: alice.get(ns_a, hashes_a),
                     lambda: alice.lookup(ns_a, hashes_a),
                     lambda: alice.exists(ns_a, hashes_a)):
            with pytest.raises(Unauthenticated):
                call()
        # bob, on the same transports, is untouched
        assert bob.put(ns_b, more[:3], more_blocks[:3]) == ["stored"] * 3
        assert bob.get(ns_b, hashes_b) == [b.tobytes() for b in blocks_b]
        assert bob.lookup(ns_b, hashes_b).num_hit == 3
        assert bob.active_transport == transport
    if change == "rotated":   # the same tenant under its new token sees its blocks
        with daemon.client(token="alice-new-token", transport=transport) as rotated:
            assert rotated.register_namespace(Namespace(LAYOUT)) == ns_a
            assert rotated.get(ns_a, hashes_a) == [b.tobytes() for b in blocks_a]


@pytest.mark.parametrize("change", ["removed", "rotated"])
def test_old_tickets_open_nothing_and_open_connections_close(daemon, change):
    hashes, blocks = chain(2, seed=5)
    with daemon.client(token="alice-token", transport="shm") as alice:
        ns = alice.register_namespace(Namespace(LAYOUT))
        alice.put(ns, hashes, blocks)
    hs = handshake(daemon, "alice-token")
    assert hs.lookup_socket and hs.segment_socket and hs.bulk_port and hs.lease_socket, hs
    held = greeted(hs.lookup_socket, hs.lookup_ticket, "alice")
    assert lookup_over(held, ns, hashes) is not None            # answered before the reload
    held_calls = greeted(hs.lease_socket, hs.lease_ticket, "alice")
    assert lookup_over(held_calls, ns, hashes) is not None
    mapped = local_lookup.LocalLookup(hs.lookup_socket, hs.lookup_ticket, "alice")   # with the lookup index
    if lookup_index.supported():
        assert mapped.index is not None and mapped.index.leading_hits(ns, hashes) == (2, ["cpu"] * 2)
    assert segments.ask(hs.segment_socket, hs.segment_ticket, "alice", []).handed == []
    bulk = BulkChannel("127.0.0.1", hs.bulk_port, hs.bulk_ticket, 5.0)
    hs_b = handshake(daemon, "bob-token")
    reload_tokens(daemon, "{bob-token: bob, ops-token: ops}" if change == "removed"
                  else "{alice-new-token: alice, bob-token: bob, ops-token: ops}")
    # the connections opened before the reload are closed (within a tick of the server's loop)
    for sock in (held, held_calls):
        deadline = time.monotonic() + 5
        while lookup_over(sock, ns, hashes) is not None:
            assert time.monotonic() < deadline, "a connection greeted with a revoked ticket is still answered"
            time.sleep(0.1)
        sock.close()
    # the tenant's mapped lookup index is closed: it answers nothing, and a lookup goes to the daemon
    if lookup_index.supported():
        assert mapped.index.leading_hits(ns, hashes) is None
    with pytest.raises((OSError, local_lookup.CallFailed)):
        mapped.lookup(ns, hashes, lease=False)
    mapped.close()
    # a new connection with the old ticket is refused before any frame is answered
    with greeted(hs.lookup_socket, hs.lookup_ticket, "alice") as again:
        assert lookup_over(again, ns, hashes) is None
    with greeted(hs.lease_socket, hs.lease_ticket, "alice") as again:
        assert lookup_over(again, ns, hashes) is None
    # the broker hands out nothing for the old ticket
    with pytest.raises(PermissionError):
        segments.ask(hs.segment_socket, hs.segment_ticket, "alice", [])
    # the side-channel session is closed and the old ticket opens no new one
    deadline = time.monotonic() + 5
    while bulk.alive():
        assert time.monotonic() < deadline, "a side-channel session of a revoked token stays open"
        time.sleep(0.1)
    with pytest.raises(OSError):
        BulkChannel("127.0.0.1", hs.bulk_port, hs.bulk_ticket, 5.0)
    # bob's tickets from before the reload still work (his token did not change)
    assert segments.ask(hs_b.segment_socket, hs_b.segment_ticket, "bob", []).handed == []
    BulkChannel("127.0.0.1", hs_b.bulk_port, hs_b.bulk_ticket, 5.0).sock.close()
    with greeted(hs_b.lookup_socket, hs_b.lookup_ticket, "bob") as sock:
        assert lookup_over(sock, ns, hashes) is not None   # answered (alice's namespace: an error by name)
