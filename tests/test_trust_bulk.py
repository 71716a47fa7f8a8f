"""Trust (issue 17, item 1): the bulk side channel holds up under client churn, idle connections and
callers that use another tenant's session. Against real ``kvstore serve`` daemons, except the
idle-bound test, which drives ``BulkServer`` in-process with a short bound."""

from __future__ import annotations

import contextlib
import selectors
import socket
import time

import grpc
import numpy as np
import psutil
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.transport.bulk import MAGIC, BulkChannel, recv_exact
from kvstore.transport.bulk_server import BulkServer, MAX_SESSIONS
from kvstore.transport.socket_server import FIRST_DEADLINE_S

BLOCK = 16 << 10
LAYOUT = KVLayout(model="test/trust-bulk", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                  block_tokens=16, block_bytes=BLOCK)
SLACK = 8   # sessions / descriptors allowed above the baseline after churn


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return ChainHasher(seed=seed).chain(np.arange(16 * n), 16)


def _block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def _store_one(client, seed: int) -> tuple[bytes, list[bytes]]:
    """A namespace of ``client`` holding one block (``_block(seed)``): its id and the block's hash."""
    hashes = _chain(1, seed=seed)
    ns = client.register_namespace(Namespace(LAYOUT))
    client.put(ns, hashes, [_block(seed)])
    return ns, hashes


def _wait_until(check, timeout_s: float, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every_s)


def _greet(port: int, ticket: bytes) -> tuple[socket.socket, bytes]:
    """A raw side-channel session: the socket and the session id the daemon answered."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(MAGIC + ticket)
    return sock, recv_exact(sock, 16)


def test_client_churn_leaves_no_sessions_or_descriptors_behind(daemon_factory):
    """2,000 clients come and go: every one gets the side channel, and the daemon ends up where it began."""
    d = daemon_factory()
    daemon = psutil.Process(d.pid)
    with d.client(transport="grpc") as observer:
        ns, hashes = _store_one(observer, seed=1)
        with d.client(transport="bulk") as warm:   # the first bulk client starts the daemon's lazy bits
            warm.register_namespace(Namespace(LAYOUT))
            assert warm.get(ns, hashes) == [_block(1).tobytes()]
        time.sleep(0.5)
        sessions_before = observer.stats()["server"]["bulk_sessions"]
        fds_before = daemon.num_fds()
        fallbacks = 0
        for _ in range(2000):
            with d.client(transport="bulk") as c:
                c.register_namespace(Namespace(LAYOUT))
                assert c.get(ns, hashes) == [_block(1).tobytes()]
                fallbacks += c.active_transport != "bulk"
        assert fallbacks == 0, f"{fallbacks} of 2000 clients silently fell back to gRPC"
        assert _wait_until(lambda: observer.stats()["server"]["bulk_sessions"] <= sessions_before + SLACK, 10), \
            f"bulk sessions {sessions_before} -> {observer.stats()['server']['bulk_sessions']}"
        assert _wait_until(lambda: daemon.num_fds() <= fds_before + SLACK, 10), \
            f"daemon descriptors {fds_before} -> {daemon.num_fds()}"
        with d.client(transport="bulk") as last:
            assert last.active_transport == "bulk"
            last.register_namespace(Namespace(LAYOUT))
            assert last.get(ns, hashes) == [_block(1).tobytes()]
        assert d.alive()


def test_idle_connections_cost_no_threads_and_are_closed_after_the_greeting_deadline(daemon_factory):
    d = daemon_factory()
    daemon = psutil.Process(d.pid)
    with d.client(transport="bulk") as c:
        ns, hashes = _store_one(c, seed=2)
        port = c.call("Handshake", pb.HandshakeRequest()).bulk_port
        time.sleep(0.3)
        threads_before = daemon.num_threads()
        idle = []
        try:
            for i in range(300):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                if i % 3 == 0:
                    s.sendall(MAGIC[:3])   # a greeting begun and never finished
                idle.append(s)
            opened = time.monotonic()
            time.sleep(0.5)
            assert daemon.num_threads() <= threads_before + 3, \
                f"daemon threads {threads_before} -> {daemon.num_threads()} for 300 idle connections"
            # a real client is not shut out meanwhile: its greeting completes, its get answers
            with d.client(transport="bulk") as fresh:
                fresh.register_namespace(Namespace(LAYOUT))
                assert fresh.active_transport == "bulk"
                assert fresh.get(ns, hashes) == [_block(2).tobytes()]
            assert c.get(ns, hashes) == [_block(2).tobytes()]
            # every idle connection is closed by the daemon within the deadline (plus scheduling slack)
            sel = selectors.DefaultSelector()
            for s in idle:
                sel.register(s, selectors.EVENT_READ)
            closed = 0
            while closed < len(idle) and time.monotonic() < opened + FIRST_DEADLINE_S + 3:
                for key, _ in sel.select(0.2):
                    with contextlib.suppress(OSError):
                        assert key.fileobj.recv(64) == b""   # EOF, never a session id
                    sel.unregister(key.fileobj)
                    closed += 1
            sel.close()
            assert closed == len(idle), f"{len(idle) - closed} idle connections still open after the deadline"
        finally:
            for s in idle:
                s.close()
        bulk = c.stats()["server"]["bulk_channel"]
        assert bulk["greetings_pending"] == 0
        assert bulk["greetings_timed_out"] + bulk["greetings_pushed_out"] >= 300
        assert daemon.num_threads() <= threads_before + 3
        assert c.health()


def test_a_session_answers_only_the_tenant_that_opened_it(daemon_factory):
    d = daemon_factory("--token", "alice-secret=alice", "--token", "bob-secret=bob")
    h_a, h_b = _chain(1, seed=3), _chain(1, seed=4)
    with d.client(token="alice-secret", transport="bulk") as alice, \
            d.client(token="bob-secret", transport="bulk") as bob:
        assert alice.active_transport == "bulk" and bob.active_transport == "bulk"  # offered with auth on
        ns_a = alice.register_namespace(Namespace(LAYOUT))
        ns_b = bob.register_namespace(Namespace(LAYOUT))
        alice.put(ns_a, h_a, [_block(3)])
        bob.put(ns_b, h_b, [_block(4)])
        hs_a = alice.call("Handshake", pb.HandshakeRequest())
        hs_b = bob.call("Handshake", pb.HandshakeRequest())
        assert hs_a.bulk_ticket != hs_b.bulk_ticket          # tickets are per tenant
        sock, sid = _greet(hs_a.bulk_port, hs_a.bulk_ticket)
        try:
            for method, req in (("BulkGet", pb.BulkRequest(namespace_id=ns_b, hashes=h_b, block_bytes=BLOCK,
                                                           session=sid)),
                                ("BulkPut", pb.BulkRequest(namespace_id=ns_b, hashes=_chain(1, seed=5),
                                                           block_bytes=BLOCK, session=sid))):
                with pytest.raises((InvalidArgument, PermissionDenied)) as refused:
                    bob.call(method, req)
                assert getattr(refused.value, "field", None) == "session"
            # bob learned nothing and broke nothing: alice's session still serves alice, in step
            alice.call("BulkGet", pb.BulkRequest(namespace_id=ns_a, hashes=h_a, block_bytes=BLOCK, session=sid))
            assert int.from_bytes(recv_exact(sock, 8), "little") == BLOCK
            assert recv_exact(sock, BLOCK) == _block(3).tobytes()
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                sock.recv(1)                                  # nothing of bob's went down alice's socket
        finally:
            sock.close()
        # a made-up ticket opens nothing
        forged = socket.create_connection(("127.0.0.1", hs_a.bulk_port), timeout=5)
        forged.sendall(MAGIC + bytes(16))
        assert forged.recv(16) == b""
        forged.close()
        assert alice.get(ns_a, h_a) == [_block(3).tobytes()]
        assert bob.get(ns_b, h_b) == [_block(4).tobytes()]


def test_full_session_table_evicts_the_least_recently_used_and_its_client_reconnects(daemon_factory):
    d = daemon_factory()
    with d.client(transport="bulk") as oldest:
        ns, hashes = _store_one(oldest, seed=6)
        hs = oldest.call("Handshake", pb.HandshakeRequest())
        held = []
        try:
            for _ in range(MAX_SESSIONS):
                held.append(_greet(hs.bulk_port, hs.bulk_ticket)[0])
            assert oldest.stats()["server"]["bulk_sessions"] <= MAX_SESSIONS
            with d.client(transport="bulk") as newest:    # a new client still gets the side channel
                newest.register_namespace(Namespace(LAYOUT))
                assert newest.active_transport == "bulk"
                assert newest.get(ns, hashes) == [_block(6).tobytes()]
            # the evicted client notices before its next transfer and opens a new session
            assert oldest.get(ns, hashes) == [_block(6).tobytes()]
            assert oldest.active_transport == "bulk"
            assert oldest.stats()["server"]["bulk_channel"]["sessions_evicted"] >= 2
        finally:
            for s in held:
                s.close()


def test_a_tenant_filling_the_session_table_pushes_out_its_own_sessions_not_another_tenants():
    """Alice opens sessions far past the table's size; Bob's two idle sessions, older than all of
    hers, stay open and keep serving. When Bob opens one more, an idle one of Alice's makes room."""
    server = BulkServer("127.0.0.1", max_sessions=8)
    channels = []
    try:
        bob = [BulkChannel("127.0.0.1", server.port, server.ticket_for("bob"), 5.0) for _ in range(2)]
        alice_ticket = server.ticket_for("alice")
        alice = [BulkChannel("127.0.0.1", server.port, alice_ticket, 5.0) for _ in range(20)]
        channels = bob + alice
        assert server.session_count == 8
        assert all(server.session(c.session, "bob") is not None for c in bob)
        assert server.stats()["sessions_evicted"] == 14
        assert _wait_until(lambda: not any(c.alive() for c in alice[:14]), 5)   # hers went, oldest first
        assert all(c.alive() for c in bob + alice[14:])
        third = BulkChannel("127.0.0.1", server.port, server.ticket_for("bob"), 5.0)
        channels.append(third)
        assert all(server.session(c.session, "bob") is not None for c in bob + [third])
        assert server.session(alice[14].session, "alice") is None and server.session_count == 8
    finally:
        for c in channels:
            c.close()
        server.close()


def test_sessions_end_when_idle_past_the_bound_or_when_the_client_goes():
    server = BulkServer("127.0.0.1", idle_s=1.5)   # long enough that a busy machine's stall before
    try:                                            # ``gone.close()`` does not expire it first
        ticket = server.ticket_for("t")
        kept = BulkChannel("127.0.0.1", server.port, ticket, 5.0)
        gone = BulkChannel("127.0.0.1", server.port, ticket, 5.0)
        assert server.session_count == 2 and server.session(kept.session, "t") is not None
        assert server.session(kept.session, "other tenant") is None
        gone.close()
        assert _wait_until(lambda: server.session_count == 1, 2)       # EOF noticed while idle
        assert server.stats()["sessions_closed_by_peer"] == 1
        assert kept.alive()
        assert _wait_until(lambda: server.session_count == 0, 5)       # idle past the bound
        assert _wait_until(lambda: not kept.alive(), 1)                 # and the client can tell
        assert server.stats()["sessions_idle_expired"] == 1
        kept.close()
    finally:
        server.close()


def test_stats_never_show_a_session_gone_and_not_yet_counted():
    """A reader of the side channel's stats sees every session either open or counted as closed:
    the table's size and its close counters are read together. (They were read apart, and a session
    the I/O thread had removed but not yet counted made a stats reader see one session vanish.)"""
    server = BulkServer("127.0.0.1", idle_s=30)
    try:
        ticket = server.ticket_for("t")
        torn = []
        stop = time.monotonic() + 3.0
        opened = 0
        while time.monotonic() < stop and opened < 400:
            BulkChannel("127.0.0.1", server.port, ticket, 5.0).close()
            opened += 1
            for _ in range(20):
                s = server.stats()
                closed = s["sessions_closed_by_peer"] + s["sessions_idle_expired"] + s["sessions_evicted"] \
                    + s["sessions_dropped"]
                if s["sessions_opened"] - closed != s["sessions"]:
                    torn.append(s)
        assert _wait_until(lambda: server.stats()["sessions_closed_by_peer"] == opened, 5)
        assert not torn, f"{len(torn)} of the stats reads saw a session gone and not counted: {torn[0]}"
    finally:
        server.close()


def test_a_put_whose_bytes_stop_mid_run_is_cut_and_keeps_only_the_runs_that_arrived(daemon_factory):
    """The daemon reads a side-channel put a run (up to 1 MiB) at a time. A caller that sends one
    whole run and part of the next, then goes silent, is cut after the stall bound (2 s with
    --lease-seconds 1) and loses its session; the whole run is stored, nothing of the cut one, and
    the daemon goes on serving."""
    from kvstore.service.bulk_rpcs import RUN_BYTES

    d = daemon_factory("--lease-seconds", "1")
    per_run = RUN_BYTES // BLOCK
    hashes = _chain(per_run * 2 + 8, seed=21)
    data = [_block(100 + i) for i in range(len(hashes))]
    with d.client(transport="bulk") as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        hs = c.call("Handshake", pb.HandshakeRequest())
        sock, sid = _greet(hs.bulk_port, hs.bulk_ticket)
        try:
            channel = grpc.insecure_channel(d.address)
            future = pb_grpc.KVStoreStub(channel).BulkPut.future(
                pb.BulkRequest(namespace_id=ns, hashes=hashes, block_bytes=BLOCK, session=sid), timeout=30)
            sent = per_run + per_run // 2   # a whole run, then half of the next
            sock.sendall(b"".join(b.tobytes() for b in data[:sent]))
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError):
                future.result(timeout=20)
            channel.close()
            assert time.monotonic() - t0 < 10
            sock.settimeout(5)
            assert sock.recv(1) == b""   # the session's connection was closed
        finally:
            sock.close()
        assert c.exists(ns, hashes) == [True] * per_run + [False] * (len(hashes) - per_run)
        assert c.get(ns, hashes[:per_run]) == [b.tobytes() for b in data[:per_run]]
        assert c.put(ns, hashes[per_run:], data[per_run:], parent=hashes[per_run - 1]) == \
            ["stored"] * (len(hashes) - per_run)
        assert c.get(ns, hashes) == [b.tobytes() for b in data]
