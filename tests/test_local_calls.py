"""The shm path's lease calls over the daemon's Unix socket (issue #14: small same-host gets and
puts were their gRPC round trips), against real daemons: the bytes are right, the calls really go
over the socket, a refusal is the daemon's own error by name, hostile callers get nothing and hold
up nobody, and a daemon that is gone or hung is DaemonUnavailable, never a hang or an OSError."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.client import shm_path
from kvstore.errors import DaemonUnavailable
from kvstore.proto import kvstore_pb2 as pb

LAYOUT = KVLayout(model="test/local-calls", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                  block_tokens=16, block_bytes=4096)


@pytest.fixture
def daemon(daemon_factory, tmp_path):
    """Tenants alice and bob, with an arena whose tenant segments take a put of 300 blocks (a
    256 KiB slot each), and where one load lease may pin all 300 (a tenant's leases may pin half
    of it, ``leases.LEASED_SHARE_PER_TENANT``)."""
    return daemon_factory("--token", "alice-token=alice", "--token", "bob-token=bob", "--shm-dir", str(tmp_path),
                          cpu_bytes="192MiB", nvme_bytes="64MiB")


def chain(n: int, seed: int) -> list[bytes]:
    return ChainHasher(seed=seed).chain(np.arange(n * 16), 16)


def blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(n)]


def test_puts_and_gets_lease_over_the_socket_and_read_back_every_byte(daemon):
    hashes, data = chain(300, seed=1), blocks(300, seed=1)   # two store windows (128, 172 blocks)
    with daemon.client(token="alice-token") as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        assert c.active_transport == "shm"
        local = c._negotiation.leases.local
        assert local is not None
        before = local.answered
        assert c.put(ns, hashes, data) == ["stored"] * 300
        assert local.answered - before == 2 * 2   # PrepareStore + CompleteStore per window of 128, 172
        outs = [np.empty(4096, np.uint8) for _ in hashes]
        assert c.get_into(ns, hashes, outs) == [4096] * 300
        c.stats()   # waits for the background CompleteLoads
        load_windows = -(-300 // shm_path.LOAD_WINDOW_BLOCKS)
        assert local.answered - before == 2 * 2 + 2 * load_windows   # and PrepareLoad + CompleteLoad per load window
        assert all(np.array_equal(o, d) for o, d in zip(outs, data))
        assert c.put(ns, hashes[:3], data[:3]) == ["exists"] * 3
        hs = c.call("Handshake", pb.HandshakeRequest(nonce=os.urandom(16)))
        assert hs.lease_socket == hs.lookup_socket and hs.lease_ticket == hs.lookup_ticket


ROGUE = textwrap.dedent("""
    import json, socket, struct, sys
    from kvstore.proto import kvstore_pb2 as pb
    from kvstore.transport import local_calls as C, local_lookup as L
    from kvstore.transport.socket_server import greeting
    path, ticket, tenant, ns = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3], bytes.fromhex(sys.argv[4])
    def connect():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(path)
        s.sendall(greeting(L.MAGIC, ticket, tenant))
        return s
    def recv(s, n):
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf
    def answer(s):
        head = recv(s, 4)
        if head is None:
            return "closed"
        body = recv(s, struct.unpack("!I", head)[0])
        if body[0] == 0:
            return "answered"
        kind, field, message = body[1:].decode().split("\\0", 2)
        return [kind, field]
    s = connect()
    out = {}
    def call(name, method_index, request):
        try:
            s.sendall(struct.pack("!I", 2 + len(request)) + bytes([L.CALL, method_index]) + request)
            out[name] = answer(s)
        except OSError:   # refused at the greeting: the daemon closed the connection
            out[name] = "closed"
    M = C.LEASE_METHODS.index
    call("prepare_load", M("PrepareLoad"), pb.PrepareLoadRequest(namespace_id=ns, hashes=[b"x" * 16]).SerializeToString())
    call("lease_of_nobody", M("CompleteLoad"), pb.LeaseRequest(lease_id=12345).SerializeToString())
    call("garbage", M("PrepareStore"), b"\\xff\\xff\\xff\\xff")
    call("unknown_method", 200, b"")
    call("wrong_block_bytes", M("PrepareStore"),
         pb.PrepareStoreRequest(namespace_id=ns, hashes=[b"y" * 16], block_bytes=999).SerializeToString())
    two = C.encode_call("CompleteLoad", pb.LeaseRequest(lease_id=1).SerializeToString())
    try:
        p = connect()
        p.sendall(two + two)      # the second before the first's answer: the connection is closed
        out["pipelined"] = "closed" in (answer(p), answer(p))
    except OSError:
        out["pipelined"] = True
    print(json.dumps(out))
""")


def test_lease_calls_over_the_socket_are_refused_by_name_and_hostile_frames_get_nothing(daemon):
    hashes = chain(4, seed=2)
    with daemon.client(token="alice-token") as alice, daemon.client(token="bob-token") as bob:
        ns = alice.register_namespace(Namespace(LAYOUT))
        alice.put(ns, hashes, blocks(4, seed=2))
        bob_ns = bob.register_namespace(Namespace(LAYOUT, cache_salt="bob"))
        hs = alice.call("Handshake", pb.HandshakeRequest(nonce=os.urandom(16)))

        def rogue(ticket: bytes, tenant: str, namespace: bytes) -> dict | str:
            r = subprocess.run([sys.executable, "-c", ROGUE, hs.lease_socket, ticket.hex(), tenant, namespace.hex()],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout)

        got = rogue(hs.lease_ticket, "alice", bob_ns)   # alice's own ticket, bob's namespace
        assert got["prepare_load"] == ["UnknownNamespace", ""]          # another tenant's: unknown
        assert got["lease_of_nobody"] == ["LeaseExpired", ""]
        assert got["garbage"][0] == "InvalidArgument"
        assert got["unknown_method"] == ["InvalidArgument", "method"]
        assert got["wrong_block_bytes"][0] == "UnknownNamespace"
        assert got["pipelined"] is True
        own = rogue(hs.lease_ticket, "alice", ns)
        assert own["prepare_load"] == "answered" and own["wrong_block_bytes"][0] == "LayoutMismatch"
        for ticket, tenant in ((hs.lease_ticket, "bob"), (os.urandom(32), "alice")):   # forged: no answers
            assert set(rogue(ticket, tenant, ns).values()) <= {"closed", True}
        outs = [np.empty(4096, np.uint8) for _ in hashes]   # and alice is served as before
        assert alice.get_into(ns, hashes, outs) == [4096] * 4
        assert np.array_equal(outs[3], blocks(4, seed=2)[3])


def test_kept_connections_pushed_out_by_idle_ones_are_replaced_not_trusted(daemon):
    """A client keeps its lease-call connections between calls; 300 idle connections push them out
    of the daemon's bound. The next calls find them closed and connect again: no error, no
    fallback to gRPC, right bytes."""
    hashes, data = chain(8, seed=3), blocks(8, seed=3)
    with daemon.client(token="alice-token") as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        c.put(ns, hashes[:4], data[:4])
        local = c._negotiation.leases.local
        hs = c.call("Handshake", pb.HandshakeRequest(nonce=os.urandom(16)))
        idle = []
        try:
            for _ in range(300):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(hs.lease_socket)
                idle.append(s)
            time.sleep(0.2)
            answered = local.answered
            assert c.put(ns, hashes[4:], data[4:]) == ["stored"] * 4
            outs = [np.empty(4096, np.uint8) for _ in hashes]
            assert c.get_into(ns, hashes, outs) == [4096] * 8
            assert all(np.array_equal(o, d) for o, d in zip(outs, data))
            assert c._negotiation.leases.local is local and local.answered - answered >= 3
        finally:
            for s in idle:
                s.close()


def wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until every thread of ``pid`` is stopped: ``kill`` returns before a running thread has."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        if all(s == "T" for s in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"{pid} did not stop")


def test_a_daemon_that_dies_or_hangs_is_daemon_unavailable_for_puts_and_gets(daemon):
    hashes, data = chain(4, seed=4), blocks(4, seed=4)
    c = daemon.client(token="alice-token", timeout_s=1.0)
    try:
        ns = c.register_namespace(Namespace(LAYOUT))
        c.put(ns, hashes, data)
        assert c._negotiation.leases.local is not None
        os.kill(daemon.pid, signal.SIGSTOP)   # hung: the socket call times out once, not twice
        try:
            wait_stopped(daemon.pid)
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailable):
                c.get_into(ns, hashes, [np.empty(4096, np.uint8) for _ in hashes])
            assert time.monotonic() - t0 < 1.9
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        daemon.kill()
        with pytest.raises(DaemonUnavailable):
            c.put(ns, chain(4, seed=5), data)
        with pytest.raises(DaemonUnavailable):
            c.get_into(ns, hashes, [np.empty(4096, np.uint8) for _ in hashes])
    finally:
        c.close()


STALLER = textwrap.dedent("""
    import fcntl, socket, struct, sys, termios, threading, time
    from kvstore.proto import kvstore_pb2 as pb
    from kvstore.transport import local_calls as C, local_lookup as L
    from kvstore.transport.socket_server import greeting
    path, ticket, ns = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
    hashes = [bytes.fromhex(h) for h in open(sys.argv[4]).read().split()]
    request = C.encode_call("PrepareLoad", pb.PrepareLoadRequest(namespace_id=ns, hashes=hashes)
                            .SerializeToString())
    def queued(s):   # bytes waiting in our receive queue: answers we have not read
        return struct.unpack("i", fcntl.ioctl(s, termios.FIONREAD, bytes(4)))[0]
    def stall(s, full):
        # one call at a time, each sent once the answer before it has arrived whole (so it is no
        # pipelined frame), never reading: until an answer stops arriving halfway (buffers full)
        for _ in range(64):
            before = queued(s)
            s.sendall(request)
            deadline, last = time.monotonic() + 2, -1
            while time.monotonic() < deadline:
                now = queued(s)
                if now == last and now > before:
                    break
                last = now
                time.sleep(0.02)
            if (last - before) % (4 + 40518) and (last - before) < 4 + 40000:
                full.append(s)
                return
    conns = []
    for _ in range(C.CALL_WORKERS + 2):   # more than the daemon has call threads
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(greeting(L.MAGIC, ticket, "alice"))
        conns.append(s)
    full = []
    threads = [threading.Thread(target=stall, args=(s, full)) for s in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("stalled", len(full), flush=True)
    time.sleep(float(sys.argv[5]))
    ended = 0
    for s in conns:   # read what was buffered: a connection the daemon ended then reads EOF
        s.settimeout(0.5)
        try:
            while s.recv(1 << 20):
                pass
            ended += 1
        except OSError:
            pass
    print("ended", ended, flush=True)
""")


def test_callers_that_never_read_their_answers_hold_up_no_daemon_thread(daemon_factory, tmp_path):
    """A caller that stops reading fills its socket with answers; none of the daemon's call
    threads waits on it (the rest is written by the socket's own thread, later), so another
    client's lease calls go on at once, and the stalled connections are ended. Alice's lease budget
    is lifted (``max_leased_bytes_per_tenant``): the answers the callers do not read are whole
    leases of 16 MiB each, 64 times the arena in all, not leases cut short at her budget."""
    from kvstore.transport.socket_server import SEND_WITHIN_S

    d = daemon_factory("--token", "alice-token=alice", "--shm-dir", str(tmp_path), "--cpu-slot-bytes", "4KiB",
                       cpu_bytes="64MiB", nvme_bytes="64MiB", env={"KVSTORE_MAX_LEASED_BYTES_PER_TENANT": "64TiB"})
    hashes = chain(4096, seed=6)
    with d.client(token="alice-token") as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        assert c.put(ns, hashes, [np.zeros(4096, np.uint8)] * 4096) == ["stored"] * 4096
        hs = c.call("Handshake", pb.HandshakeRequest(nonce=os.urandom(16)))
        listing = tmp_path / "hashes.txt"
        listing.write_text(" ".join(h.hex() for h in hashes))
        staller = subprocess.Popen([sys.executable, "-c", STALLER, hs.lease_socket, hs.lease_ticket.hex(), ns.hex(),
                                    str(listing), str(SEND_WITHIN_S + 1.5)], stdout=subprocess.PIPE, text=True)
        try:
            outs = [np.empty(4096, np.uint8) for _ in range(8)]
            slowest, k, t_end = 0.0, 0, time.monotonic() + SEND_WITHIN_S + 1   # while the staller fills its buffers
            while time.monotonic() < t_end:
                t = time.monotonic()
                assert c.get_into(ns, hashes[8 * (k % 512):8 * (k % 512) + 8], outs) == [4096] * 8
                slowest, k = max(slowest, time.monotonic() - t), k + 1
            assert c._negotiation.leases.local is not None
            assert slowest < SEND_WITHIN_S / 2, f"a get waited {slowest:.2f}s behind callers that do not read"
            assert staller.stdout.readline().split() == ["stalled", "6"]   # every one of them was answered too
            assert staller.stdout.readline().split() == ["ended", "6"]
        finally:
            staller.kill()
            staller.wait()


EXITS_WHILE_HUNG = textwrap.dedent("""
    import sys, threading, time
    import numpy as np
    from kvstore import ChainHasher, KVLayout, Namespace
    from kvstore.client import Client
    layout = KVLayout(model="test/local-calls", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                      block_tokens=16, block_bytes=4096)
    c = Client(sys.argv[1], token="alice-token", timeout_s=float(sys.argv[2]))
    ns = c.register_namespace(Namespace(layout))
    c.put(ns, ChainHasher(seed=7).chain(np.arange(16), 16), [np.zeros(4096, np.uint8)])
    print("ready", flush=True)
    sys.stdin.readline()   # the daemon is stopped now
    hashes = ChainHasher(seed=8).chain(np.arange(300 * 16), 16)   # two store windows: the second is prepared ahead
    threading.Thread(target=c.put, args=(ns, hashes, [np.zeros(4096, np.uint8)] * 300), daemon=True).start()
    time.sleep(0.3)
    print("exiting", flush=True)
""")


def test_an_engine_exits_at_once_while_its_daemon_hangs(daemon):
    """An engine that exits while the daemon is hung must not wait for the client's lease calls in
    flight (a put's next window is prepared on a kept thread) to time out."""
    timeout_s = 6.0
    engine = subprocess.Popen([sys.executable, "-c", EXITS_WHILE_HUNG, daemon.address, str(timeout_s)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "ready"
        os.kill(daemon.pid, signal.SIGSTOP)
        wait_stopped(daemon.pid)
        engine.stdin.write("go\n")
        engine.stdin.flush()
        assert engine.stdout.readline().strip() == "exiting"
        t0 = time.monotonic()
        engine.wait(timeout=2 * timeout_s)
        assert time.monotonic() - t0 < timeout_s / 3, f"exit waited {time.monotonic() - t0:.1f}s for the hung daemon"
    finally:
        engine.kill()
        engine.wait()
        os.kill(daemon.pid, signal.SIGCONT)
