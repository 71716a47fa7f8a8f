"""The same-host lookup index (issue #14, scheduler-path lookups): a table the daemon keeps in a
sealed memfd and its clients map read-only. Checked against a model on a real mapping, against the
socket's answers on real daemons as blocks arrive, move between tiers and leave, and as an attacker
would use it: write through the descriptor, read another tenant's blocks, trust a dead daemon's."""

from __future__ import annotations

import mmap
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.errors import DaemonUnavailable, UnknownNamespace
from kvstore.ops.local_daemon import kill_until_released
from kvstore.transport import lookup_index as LI
from test_local_lookup import stored_and_shaken

pytestmark = pytest.mark.skipif(not LI.supported(), reason="the index is offered on x86-64 only")

LAYOUT = KVLayout(model="test/lookup-index", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                  block_tokens=16, block_bytes=4096)
BIG = KVLayout(model="test/lookup-index-big", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
               block_tokens=16, block_bytes=1 << 20)
NS = bytes(range(16))


def chain(n: int, seed: int) -> list[bytes]:
    return ChainHasher(seed=seed).chain(np.arange(n * 16), 16)


def settled(client, ns: bytes, hashes: list[bytes]):
    """The index's answer once the daemon has applied what came before (events reach the table
    under the store lock, so it is current as soon as the call that changed it returned; the
    retry covers the background fill of a fresh table only)."""
    local = client._negotiation.lookups
    for _ in range(200):
        got = local.index.leading_hits(ns, hashes)
        if got is not None:
            return got
        time.sleep(0.01)
    raise AssertionError("the index never answered")


# -- the table, on a real mapping --------------------------------------------------------------

def test_the_table_answers_as_a_model_does_through_inserts_moves_removals_and_overflow():
    """64 slots and keys aimed at 4 homes: long runs, wrap-around, backward shifts, overflow."""
    table = LI.IndexTable(64, ["cpu", "nvme"])
    reader = LI.IndexReader(table.descriptor())
    rng = random.Random(7)
    model: dict[bytes, int] = {}
    pool = []
    for i in range(120):
        home = rng.choice([0, 1, 62, 63])
        h = (home | (i << 8)).to_bytes(8, "little") + rng.randbytes(8)
        pool.append(bytes(a ^ b for a, b in zip(h, NS)))   # so that key_of(NS, h) has that home
    try:
        for step in range(4000):
            h = rng.choice(pool)
            if rng.random() < 0.55:
                tier = rng.randrange(2)
                table.put(LI.key_of(NS, h), tier)
                model[h] = tier
            else:
                table.remove(LI.key_of(NS, h))
                model.pop(h, None)
            if step % 50 == 0:
                probe = rng.sample(pool, 12)
                got = reader.leading_hits(NS, probe)
                if not table.complete:
                    assert got is None       # a miss would prove nothing: the reader asks the daemon
                    continue
                n = next((i for i, p in enumerate(probe) if p not in model), len(probe))
                assert got == (n, [["cpu", "nvme"][model[p]] for p in probe[:n]])
        for h in list(model):
            table.remove(LI.key_of(NS, h))
        assert reader.leading_hits(NS, pool[:5]) == (0, [])
    finally:
        reader.close()
        table.close()


def test_batches_of_keys_answer_as_the_model_does_through_shared_homes_moves_and_overflow():
    """``put_many`` of ``keys_of`` arrays (what the daemon writes as blocks are published), short
    ones looped and long ones (``VECTOR_KEYS`` and more) written in a numpy pass: keys sharing a
    home in one batch, keys already present (moved or not), a batch repeating a key, and batches
    written while some blocks have no slot, against a model, with removals between."""
    table = LI.IndexTable(256, ["cpu", "nvme"])
    reader = LI.IndexReader(table.descriptor())
    rng = random.Random(11)
    homes = rng.sample(range(256), 40) + [0, 255]
    model: dict[bytes, int] = {}
    pool = []
    for i in range(260):
        h = (rng.choice(homes) | (i << 8)).to_bytes(8, "little") + rng.randbytes(8)
        pool.append(bytes(a ^ b for a, b in zip(h, NS)))
    long_batches = 0
    try:
        for step in range(1200):
            if rng.random() < 0.5:
                n = rng.randrange(1, 12) if rng.random() < 0.5 else rng.randrange(LI.VECTOR_KEYS, LI.VECTOR_KEYS + 40)
                batch = [rng.choice(pool) for _ in range(n)]
                tier = rng.randrange(2)
                keys = LI.keys_of(NS, batch)
                assert isinstance(keys, np.ndarray) and keys.shape == (len(batch), 2)
                long_batches += n >= LI.VECTOR_KEYS and table.complete
                table.put_many(keys, tier)
                model.update((h, tier) for h in batch)
            else:
                for h in rng.sample(pool, rng.randrange(1, 60)):
                    table.remove(LI.key_of(NS, h))
                    model.pop(h, None)
            assert table.live + len(table._overflow) == len(model)
            probe = rng.sample(pool, 8)
            got = reader.leading_hits(NS, probe)
            if not table.complete:
                assert got is None
                continue
            n = next((i for i, p in enumerate(probe) if p not in model), len(probe))
            assert got == (n, [["cpu", "nvme"][model[p]] for p in probe[:n]])
        for h in model:
            assert reader.leading_hits(NS, [h]) == (1, [["cpu", "nvme"][model[h]]]) or not table.complete
        assert long_batches > 100   # the numpy pass ran, not only the loop
    finally:
        reader.close()
        table.close()


def test_a_client_cannot_write_the_table_through_its_descriptor():
    table = LI.IndexTable(64, ["cpu"])
    fd = table.descriptor()
    try:
        size = os.fstat(fd).st_size
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size)                      # a shared writable mapping
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\xff" * 8, 8)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        private = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)   # copy-on-write: the client's own pages
        private[LI.HEADER_BYTES:LI.HEADER_BYTES + 8] = b"\xff" * 8
        private.close()
        reader = LI.IndexReader(os.dup(fd))
        assert reader.leading_hits(NS, [b"\xff" * 16]) == (0, [])
        reader.close()
    finally:
        os.close(fd)
        table.close()


def test_a_closed_table_answers_nothing():
    table = LI.IndexTable(64, ["cpu"])
    reader = LI.IndexReader(table.descriptor())
    h = os.urandom(16)
    table.put(LI.key_of(NS, h), 0)
    assert reader.leading_hits(NS, [h]) == (1, ["cpu"])
    table.close()
    assert reader.leading_hits(NS, [h]) is None
    assert reader.leading_hits(NS, [b"short"]) is None   # too narrow to key: the daemon is asked
    reader.close()


def test_hashes_of_any_width_are_keyed_by_their_first_16_bytes():
    """sha256 chains (32 bytes) are viewed in place, odd or mixed widths sliced: the same keys."""
    table = LI.IndexTable(64, ["cpu", "nvme"])
    reader = LI.IndexReader(table.descriptor())
    rng = random.Random(3)
    wide = [rng.randbytes(32) for _ in range(6)]
    for i, h in enumerate(wide[:4]):
        table.put(LI.key_of(NS, h), i % 2)
    try:
        want = (4, ["cpu", "nvme", "cpu", "nvme"])
        assert reader.leading_hits(NS, wide) == want
        assert reader.leading_hits(NS, [h[:20] for h in wide]) == want
        assert reader.leading_hits(NS, [h[:16 + i] for i, h in enumerate(wide)]) == want
        assert reader.leading_hits(NS, [wide[0], wide[1][:15]]) is None   # one too narrow: ask the daemon
        assert reader.leading_hits(NS[:8], wide) is None
    finally:
        reader.close()
        table.close()


# -- against real daemons ------------------------------------------------------------------------

@pytest.fixture
def daemon(two_tenant_daemon):
    return two_tenant_daemon


def test_index_answers_are_the_socket_s_as_blocks_arrive_move_and_leave(daemon):
    a, b = chain(12, seed=1), chain(12, seed=2)
    with daemon.client(token="alice-token") as fast, daemon.client(token="alice-token", lookup_index=False) as slow:
        ns = fast.register_namespace(Namespace(LAYOUT))
        slow.register_namespace(Namespace(LAYOUT))
        slow.put(ns, a[:8], [np.zeros(4096, np.uint8)] * 8)     # before any table: filled from the store
        assert fast.lookup(ns, a) == slow.lookup(ns, a)          # the first names the namespace: socket
        assert fast._negotiation.lookups.index is not None and slow._negotiation.lookups.index is None
        assert settled(fast, ns, a) == (8, ["cpu"] * 8)
        fast.put(ns, b, [np.ones(4096, np.uint8)] * 12)
        fast.delete(ns, a[3:4])
        for probe in (a, b, b[4:], a[:3], [a[0]] + b):
            want = slow.lookup(ns, probe, lease=False)
            assert settled(fast, ns, probe) == (want.num_hit, want.tiers)
            assert fast.lookup(ns, probe, lease=False) == slow.lookup(ns, probe, lease=False)
        big = fast.register_namespace(Namespace(BIG))            # fill the CPU tier: blocks move to NVMe
        c = chain(24, seed=3)
        for i in range(24):
            fast.put(big, c[i:i + 1], [np.full(1 << 20, i, np.uint8)], parent=c[i - 1] if i else None)
        moved = slow.lookup(big, c, lease=False)
        assert moved.num_hit == 24 and "nvme" in moved.tiers and "cpu" in moved.tiers
        assert fast.lookup(big, c, lease=False) == moved
        fast.get(big, c[:1])                                     # promoted back
        assert fast.lookup(big, c[:1], lease=False).tiers == slow.lookup(big, c[:1], lease=False).tiers


def test_a_lookup_answered_from_the_index_still_pins_its_blocks(daemon):
    """The lease is what keeps a looked-up block in the CPU tier until the worker loads it."""
    with daemon.client(token="alice-token") as c:
        ns = c.register_namespace(Namespace(BIG))
        kept, others = chain(4, seed=5), chain(4, seed=6)
        for h in (kept, others):
            c.put(ns, h, [np.zeros(1 << 20, np.uint8)] * 4)
        c.lookup(ns, kept[:1], lease=False)                      # names the namespace over the socket
        got = c.lookup(ns, kept)
        assert (got.num_hit, got.tiers) == c._negotiation.lookups.index.leading_hits(ns, kept)   # from the index
        time.sleep(0.2)                                          # the daemon hears of it (no answer awaited)
        more = chain(12, seed=7)
        c.put(ns, more, [np.ones(1 << 20, np.uint8)] * 12)       # the CPU tier must give up 8+ blocks
        assert c.lookup(ns, kept, lease=False).tiers == ["cpu"] * 4
        assert "nvme" in c.lookup(ns, others, lease=False).tiers


def test_a_tenant_s_index_holds_only_its_own_blocks(daemon):
    with daemon.client(token="alice-token") as alice, daemon.client(token="bob-token") as bob:
        ns_a = alice.register_namespace(Namespace(LAYOUT))
        ns_b = bob.register_namespace(Namespace(LAYOUT))
        alice.put(ns_a, chain(20, seed=8), [np.zeros(4096, np.uint8)] * 20)
        bob.put(ns_b, chain(3, seed=9), [np.zeros(4096, np.uint8)] * 3)
        for c, ns, n in ((alice, ns_a, 20), (bob, ns_b, 3)):
            c.lookup(ns, chain(1, seed=0))
            settled(c, ns, chain(1, seed=0))
            slots = c._negotiation.lookups.index._slots
            assert int(np.count_nonzero(slots[:, 2])) == n       # every live slot is this tenant's
        with pytest.raises(UnknownNamespace):                    # the other's namespace: refused by name
            bob.lookup(ns_a, chain(20, seed=8))
        with pytest.raises(UnknownNamespace):                    # ... every time, not "0 hits" from the index
            bob.lookup(ns_a, chain(20, seed=8))


def indexed(daemon, seed: int, timeout_s: float):
    """A client whose index answers for 4 stored blocks: (client, namespace id, hashes)."""
    hashes = chain(4, seed=seed)
    c = daemon.client(token="alice-token", timeout_s=timeout_s)
    ns = c.register_namespace(Namespace(LAYOUT))
    c.put(ns, hashes, [np.zeros(4096, np.uint8)] * 4)
    c.lookup(ns, hashes)
    assert settled(c, ns, hashes)[0] == 4
    return c, ns, hashes


def test_a_dead_daemon_s_index_is_not_trusted(daemon):
    c, ns, hashes = indexed(daemon, seed=10, timeout_s=2.0)
    try:
        kill_until_released(daemon.pid)          # dead, not yet reaped: its sockets gone, its table intact
        assert c._negotiation.lookups.index.leading_hits(ns, hashes)[0] == 4   # the table would still say so
        with pytest.raises(DaemonUnavailable):
            c.lookup(ns, hashes)
    finally:
        c.close()


ROGUE_TELLER = """
import socket, struct, sys
from kvstore.transport import local_lookup as L
from kvstore.transport.socket_server import greeting
path, ticket, tenant, ns, h = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3], bytes.fromhex(sys.argv[4]), bytes.fromhex(sys.argv[5])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
s.connect(path)
s.sendall(greeting(L.MAGIC, ticket, tenant))
def frame(body): return struct.pack("!I", len(body)) + body
junk = [frame(bytes([L.TOLD_LEASE, 16]) + ns + struct.pack("!HB", 500, 16) + h),    # claims 500 hashes, has 1
        frame(bytes([L.TOLD_LEASE, 16]) + b"\\0" * 16 + struct.pack("!HB", 1, 16) + h + b"\\0\\1"),  # unknown namespace
        frame(bytes([L.TOLD, 16]) + ns + struct.pack("!HB", 1, 16) + h),            # no "asked" count
        frame(bytes([9, 16]) + ns + struct.pack("!HB", 1, 16) + h)]                  # unknown op: answered
s.sendall(b"".join(junk) + L.encode_lookup(ns, [h], L.LOOKUP))
def answer():
    n = struct.unpack("!I", s.recv(4))[0]
    body = b""
    while len(body) < n: body += s.recv(n - len(body))
    return body
print(answer()[0], struct.unpack("!BI", answer()[:5]))
"""


def test_malformed_or_foreign_tells_are_dropped_and_the_connection_keeps_answering(daemon):
    hashes = chain(2, seed=11)
    with daemon.client(token="alice-token") as alice:
        ns, hs = stored_and_shaken(alice, LAYOUT, hashes)
        r = subprocess.run([sys.executable, "-c", ROGUE_TELLER, hs.lookup_socket, hs.lookup_ticket.hex(), "alice",
                            ns.hex(), hashes[0].hex()], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[0] == "1"                    # the unknown op: an error answer
        assert r.stdout.strip().endswith("(0, 1)")           # then the good lookup: one hit
        assert alice.lookup(ns, hashes).num_hit == 2         # and everyone else is still served


def test_a_hung_daemon_s_index_goes_stale_and_lookups_stop_hitting(daemon):
    """A daemon that stops (SIGSTOP: hung, not dead) stops stamping its tables; after STALE_NS a
    client no longer answers from one, and asks the daemon, which does not answer: a miss."""
    c, ns, hashes = indexed(daemon, seed=12, timeout_s=1.0)
    try:
        index = c._negotiation.lookups.index
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            time.sleep(LI.STALE_NS / 1e9 + 0.3)
            assert index.leading_hits(ns, hashes) is None
            with pytest.raises(DaemonUnavailable):
                c.lookup(ns, hashes)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
    finally:
        c.close()


def lookup_blocks(client, ns: bytes) -> int:
    """The daemon's count of blocks asked about in ``ns``'s lookups (``kvstore ns list``)."""
    from kvstore.ops import admin_cli
    return next(row["lookup_blocks"] for row in admin_cli.list_namespaces(client) if row["namespace_id"] == ns.hex())


def test_index_answered_lookups_are_all_told_and_close_tells_what_is_pending(daemon):
    """The notes of index-answered lookups go to the daemon from the client's teller thread, many
    to a send (a lookup no longer pays for waking the daemon): every one must still arrive (each
    pins and is counted), including those still pending when the client closes."""
    c, ns, hashes = indexed(daemon, seed=11, timeout_s=2.0)
    with daemon.client(token="alice-token") as observer:
        before = lookup_blocks(observer, ns)
        local = c._negotiation.lookups
        for _ in range(300):
            assert c.lookup(ns, hashes).num_hit == 4
        deadline = time.monotonic() + 5
        while lookup_blocks(observer, ns) < before + 300 * 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lookup_blocks(observer, ns) == before + 300 * 4 and local.told_dropped == 0
        for _ in range(50):
            c.lookup(ns, hashes)
        c.close()   # straight after: what the teller had not sent yet goes before the connection closes
        deadline = time.monotonic() + 5
        while lookup_blocks(observer, ns) < before + 350 * 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lookup_blocks(observer, ns) == before + 350 * 4


def test_index_answered_lookups_from_many_threads_at_once(daemon):
    """A scheduler and its helpers may share one client: index answers, the liveness check and
    the teller's notes must hold up to lookups from several threads at once."""
    import threading

    c, ns, hashes = indexed(daemon, seed=12, timeout_s=2.0)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(200):
                assert c.lookup(ns, hashes).num_hit == 4
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with daemon.client(token="alice-token") as observer:
        before = lookup_blocks(observer, ns)
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        c.close()
        assert not errors, errors[0]
        deadline = time.monotonic() + 5
        while lookup_blocks(observer, ns) < before + 8 * 200 * 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lookup_blocks(observer, ns) == before + 8 * 200 * 4


@pytest.mark.parametrize("width", [65, 300])
def test_hashes_the_daemon_refuses_are_refused_by_name_not_answered_from_the_index(daemon, width):
    """The index keys a hash by its first 16 bytes, so it would answer for a hash the daemon never
    takes (over 64 bytes); such a lookup must be refused as the daemon refuses it (and the note
    for it could not even be framed past 255 bytes)."""
    from kvstore.errors import InvalidArgument

    c, ns, hashes = indexed(daemon, seed=13, timeout_s=2.0)
    try:
        with pytest.raises(InvalidArgument, match=r"hashes\[0\]"):
            c.lookup(ns, [hashes[0] + b"\0" * (width - len(hashes[0]))])
        assert c._negotiation.lookups is not None   # a refusal is an answer: the socket stays in use
        assert c.lookup(ns, hashes).num_hit == 4
    finally:
        c.close()
