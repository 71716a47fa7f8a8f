"""Same-host zero-copy with authentication on (issue #17, case 7), against real daemons.

With tokens set, every tenant's same-host clients get shared memory, and each maps only its own
tenant's segments of the CPU arena: the arena is no file anybody can open, the descriptors come
from the daemon's segment broker after a ticket check, a segment that passes to another tenant
gets fresh memory first, and a client cannot shrink a segment under the daemon. The attackers
are real processes talking to the real broker socket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.client.shm_path import lease_slots
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.proto import kvstore_pb2 as pb
from kvstore.transport.socket_server import MAX_PENDING

LAYOUT = KVLayout(model="test/tenant-segments", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=32, layout="kv,layer,token,head,dim")   # 32 KiB blocks
TOKENS = ("--token", "alice-token=alice", "--token", "bob-token=bob")


def chain(n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    hashes = ChainHasher(seed=seed).chain(np.arange(n * LAYOUT.block_tokens) + seed, LAYOUT.block_tokens)
    rng = np.random.default_rng(seed)
    return hashes, [rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for _ in hashes]


@pytest.fixture
def auth_daemon(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    d = start_local_daemon(tmp_path / "d", *TOKENS, "--cpu-slot-bytes", "64KiB", "--shm-dir", str(shm_dir),
                           cpu_bytes="4MiB", nvme_bytes="64MiB", env={"KVSTORE_CPU_SEGMENT_BYTES": "256KiB"})
    d.shm_dir = str(shm_dir)
    yield d
    assert d.stop() == 0


def segments_of(client, ns: bytes, hashes: list[bytes], segment_bytes: int) -> set[int]:
    """The segments a load lease of these blocks names (the lease is completed at once)."""
    lease = client.call("PrepareLoad", pb.PrepareLoadRequest(namespace_id=ns, hashes=hashes,
                                                             block_bytes=LAYOUT.block_bytes))
    client.call("CompleteLoad", pb.LeaseRequest(lease_id=lease.lease_id))
    return {e.offset // segment_bytes for e in lease_slots(lease)[1]}


def handshake(client) -> pb.HandshakeResponse:
    return client.call("Handshake", pb.HandshakeRequest(nonce=os.urandom(16)))


ROGUE = textwrap.dedent("""
    import json, os, sys
    from kvstore.transport import segments
    path, ticket, tenant, wanted = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    try:
        got = segments.ask(path, ticket, tenant, wanted).handed
    except PermissionError:
        print(json.dumps({"refused": True})); sys.exit(0)
    out = {"refused": False, "segments": [s for s, _, _ in got]}
    fd = got[0][1] if got else None
    if fd is not None:
        try:
            os.ftruncate(fd, 0)        # shrink it under the daemon's mapping (SIGBUS there)
            out["shrunk"] = True
        except OSError as e:
            out["shrunk"] = False
            out["errno"] = e.errno
    print(json.dumps(out))
""")


def rogue(hs: pb.HandshakeResponse, ticket: bytes, tenant: str, wanted: list[int]) -> dict:
    r = subprocess.run([sys.executable, "-c", ROGUE, hs.segment_socket, ticket.hex(), tenant, json.dumps(wanted)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_with_auth_on_each_tenant_gets_shared_memory_in_its_own_segments(auth_daemon):
    d = auth_daemon
    (ha, ba), (hb, bb) = chain(4, seed=1), chain(4, seed=2)
    with d.client(token="alice-token") as alice, d.client(token="bob-token") as bob:
        assert alice.active_transport == bob.active_transport == "shm"
        ns_a, ns_b = alice.register_namespace(Namespace(LAYOUT)), bob.register_namespace(Namespace(LAYOUT))
        assert alice.put(ns_a, ha, ba) == bob.put(ns_b, hb, bb) == ["stored"] * 4
        assert alice.get(ns_a, ha) == [b.tobytes() for b in ba]
        assert bob.get(ns_b, hb) == [b.tobytes() for b in bb]
        hs = handshake(alice)
        assert hs.arena_path == "" and hs.segment_socket and hs.segment_bytes == 256 * 1024
        mine, theirs = segments_of(alice, ns_a, ha, hs.segment_bytes), segments_of(bob, ns_b, hb, hs.segment_bytes)
        assert mine and theirs and not mine & theirs
    # nothing in the shared-memory directory is the arena: only the broker's socket is there
    assert [n for n in os.listdir(d.shm_dir) if not n.endswith(".sock")] == []


def test_a_tenant_is_never_handed_another_tenant_s_segments(auth_daemon):
    d = auth_daemon
    (ha, ba), (hb, bb) = chain(3, seed=3), chain(3, seed=4)
    with d.client(token="alice-token") as alice, d.client(token="bob-token") as bob:
        ns_a, ns_b = alice.register_namespace(Namespace(LAYOUT)), bob.register_namespace(Namespace(LAYOUT))
        alice.put(ns_a, ha, ba)
        bob.put(ns_b, hb, bb)
        hs_a, hs_b = handshake(alice), handshake(bob)
        alices = sorted(segments_of(alice, ns_a, ha, hs_a.segment_bytes))
        bobs = sorted(segments_of(bob, ns_b, hb, hs_b.segment_bytes))
        # bob's own ticket: his segments, yes; alice's (alone or mixed in with his), no
        assert rogue(hs_b, hs_b.segment_ticket, "bob", bobs)["segments"] == bobs
        assert rogue(hs_b, hs_b.segment_ticket, "bob", alices)["refused"]
        assert rogue(hs_b, hs_b.segment_ticket, "bob", bobs + alices)["refused"]
        # bob's ticket claiming to be alice, or a made-up ticket: refused
        assert rogue(hs_b, hs_b.segment_ticket, "alice", alices)["refused"]
        assert rogue(hs_b, os.urandom(32), "alice", alices)["refused"]
        # free segments belong to nobody: not handed out either
        every = int(hs_a.arena_bytes // hs_a.segment_bytes)
        unclaimed = [s for s in range(every) if s not in alices and s not in bobs][:4]
        assert unclaimed and rogue(hs_b, hs_b.segment_ticket, "bob", unclaimed)["refused"]
        assert alice.get(ns_a, ha) == [b.tobytes() for b in ba]


def test_a_client_cannot_shrink_a_segment_under_the_daemon(auth_daemon):
    d = auth_daemon
    ha, ba = chain(2, seed=5)
    with d.client(token="alice-token") as alice:
        ns = alice.register_namespace(Namespace(LAYOUT))
        alice.put(ns, ha, ba)
        hs = handshake(alice)
        mine = sorted(segments_of(alice, ns, ha, hs.segment_bytes))
        out = rogue(hs, hs.segment_ticket, "alice", mine)
        assert out["refused"] is False and out["shrunk"] is False and out["errno"] == 1   # EPERM: sealed
        assert alice.get(ns, ha) == [b.tobytes() for b in ba]
    assert d.alive()


def test_a_segment_that_changes_tenant_gets_fresh_memory(auth_daemon):
    """Alice's blocks are evicted (demoted to NVMe) by bob's; a segment bob then takes over is
    new memory: alice's earlier mapping of it shows none of bob's bytes, and what alice writes
    through that old mapping does not reach bob's blocks. Alice's blocks come back from NVMe
    into segments of hers at a new generation, which her client maps again."""
    d = auth_daemon
    ha, ba = chain(8, seed=6)
    with d.client(token="alice-token") as alice, d.client(token="bob-token") as bob:
        ns_a, ns_b = alice.register_namespace(Namespace(LAYOUT)), bob.register_namespace(Namespace(LAYOUT))
        alice.put(ns_a, ha, ba)
        assert alice.get(ns_a, ha) == [b.tobytes() for b in ba]
        seg_bytes = handshake(alice).segment_bytes
        old = {s: alice.mapped_arena[s * seg_bytes:(s + 1) * seg_bytes]
               for s in segments_of(alice, ns_a, ha, seg_bytes)}
        assert old
        bob_blocks = []
        for seed in range(100, 124):    # 24 x 8 blocks of 32 KiB: 6 MiB through a 4 MiB arena
            hb, bb = chain(8, seed=seed)
            assert bob.put(ns_b, hb, bb) == ["stored"] * 8
            bob_blocks.append((hb, bb))
        hs_b = handshake(bob)
        taken = [s for s in old if not rogue(hs_b, hs_b.segment_ticket, "bob", [s])["refused"]]
        assert taken, "bob should have taken over a segment alice held before"
        for s in taken:
            view = old[s]
            stale = view.tobytes()
            assert not any(blk.tobytes() in stale for _, bb in bob_blocks for blk in bb)
            view[:] = 0xAB                 # alice scribbles through her stale mapping
        for hb, bb in bob_blocks:
            assert bob.get(ns_b, hb) == [b.tobytes() for b in bb]
        assert alice.get(ns_a, ha) == [b.tobytes() for b in ba]   # back from NVMe, remapped


def test_idle_and_garbage_broker_connections_hold_up_no_client(auth_daemon):
    import socket

    d = auth_daemon
    hs_path = None
    with d.client(token="alice-token") as alice:
        hs_path = handshake(alice).segment_socket
    idle = []
    for _ in range(100):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(hs_path)
        idle.append(s)
    junk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    junk.connect(hs_path)
    junk.sendall(b"\xff" * 600)
    try:
        ha, ba = chain(2, seed=7)
        with d.client(token="alice-token") as alice:
            assert alice.active_transport == "shm"
            ns = alice.register_namespace(Namespace(LAYOUT))
            alice.put(ns, ha, ba)
            assert alice.get(ns, ha) == [b.tobytes() for b in ba]
    finally:
        for s in idle + [junk]:
            s.close()
    assert MAX_PENDING < 100   # the broker pushed the oldest idle ones out rather than grow
