"""Side-channel puts move and store small blocks a run at a time: the client sends a run per
``sendmsg``, the daemon reads a run (of at most ``RUN_BYTES``; issue 14: 64 KiB puts were bound by
per-block work) straight into arena slots reserved for it, or into a scratch buffer stored with one
Store.put where the arena cannot take it. What a put returns must not
depend on where the runs fall: blocks already present on either side of a run boundary are
"exists", the rest "stored", the chain is linked across runs, and every block reads back; and
every byte sent arrives in order, however the kernel splits a ``sendmsg``."""

from __future__ import annotations

import socket
import threading

import numpy as np

from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.service.bulk_rpcs import RUN_BYTES, put_runs
from kvstore.transport import bulk

BLOCK = 64 * 1024


def test_runs_cover_the_blocks_in_order_within_the_bound():
    for sizes in ([BLOCK] * 100, [RUN_BYTES] * 3, [RUN_BYTES * 4, BLOCK, BLOCK], [1, RUN_BYTES, 1], []):
        runs = put_runs(sizes)
        assert [i for a, b in runs for i in range(a, b)] == list(range(len(sizes)))
        assert all(sum(sizes[a:b]) <= RUN_BYTES or b - a == 1 for a, b in runs)
    assert len(put_runs([BLOCK] * 100)) == -(-100 * BLOCK // RUN_BYTES)


def test_a_side_channel_put_across_runs_stores_links_and_reports_every_block(daemon_factory):
    d = daemon_factory(cpu_bytes="64MiB", nvme_bytes="0")
    count = 100
    per_run = RUN_BYTES // BLOCK
    present = sorted({per_run - 1, per_run, per_run + 1, 50, count - 1})
    layout = KVLayout(model="test/runs", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                      block_tokens=16, block_bytes=BLOCK)
    rng = np.random.default_rng(4)
    data = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(count)]
    with d.client(transport="bulk") as c:
        assert c.active_transport == "bulk"
        ns = c.register_namespace(Namespace(layout, cache_salt="runs"))
        hashes = ChainHasher().chain(np.arange(16 * count), 16)
        for i in present:
            assert c.put(ns, [hashes[i]], [data[i]], parent=hashes[i - 1]) == ["stored"]
        results = c.put(ns, hashes, data)
        assert [i for i, r in enumerate(results) if r == "exists"] == present
        assert all(r == "stored" for i, r in enumerate(results) if i not in present)
        outs = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(count)]
        assert c.get_into(ns, hashes, outs) == [BLOCK] * count
        assert all(np.array_equal(o, b) for o, b in zip(outs, data))
        assert c.lookup_many(ns, [hashes])[0].num_hit == count


def test_send_all_delivers_every_byte_in_order_through_a_small_socket_buffer():
    """Buffers of many sizes (empty, tiny, a run's worth, larger than a run) through a socket whose
    send buffer is small, so the kernel takes part of a ``sendmsg`` again and again."""
    rng = np.random.default_rng(11)
    sizes = [0, 1, 7, 4096, 65536, 65536, bulk.SEND_RUN_BYTES, 3 * bulk.SEND_RUN_BYTES + 5, 100] + [65536] * 300
    views = [memoryview(rng.integers(0, 256, n, dtype=np.uint8)).cast("B") for n in sizes]
    want = b"".join(bytes(v) for v in views)
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    a.settimeout(30)   # as the side channel's socket: each sendmsg takes what fits, not all
    got = bytearray()

    def reader():
        while len(got) < len(want):
            chunk = b.recv(7000)
            if not chunk:
                return
            got.extend(chunk)

    t = threading.Thread(target=reader)
    t.start()
    try:
        bulk.send_all(a, views)
        t.join(timeout=30)
    finally:
        a.close()
        b.close()
    assert bytes(got) == want


def test_recv_exact_into_each_fills_every_buffer_in_order_from_small_reads():
    """The daemon's side of a run: many buffers (a run's blocks in their arena slots) filled by
    ``recvmsg_into`` calls that each bring whatever the kernel has, a block's worth or a sliver."""
    rng = np.random.default_rng(12)
    sizes = [1, 7, 4096, 65536, 65536, 100] + [65536] * 300 + [3]
    want = rng.integers(0, 256, sum(sizes), dtype=np.uint8).tobytes()
    bufs = [np.zeros(n, dtype=np.uint8) for n in sizes]
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    b.settimeout(30)

    def writer():
        for at in range(0, len(want), 5000):
            a.sendall(want[at:at + 5000])

    t = threading.Thread(target=writer)
    t.start()
    reads = []
    try:
        bulk.recv_exact_into_each(b, [memoryview(x) for x in bufs], lambda: reads.append(1))
        t.join(timeout=30)
    finally:
        a.close()
        b.close()
    assert b"".join(x.tobytes() for x in bufs) == want
    assert len(reads) > 1


def test_a_side_channel_put_the_arena_cannot_take_lands_below_it(daemon_factory):
    """Raw runs are received into CPU-arena slots reserved for them; when the arena has no room it
    can make (every block in it leased by a lookup), the run is stored as a put would store it:
    in the NVMe tier below, every byte intact."""
    d = daemon_factory("--lease-seconds", "30", cpu_bytes="1MiB", nvme_bytes="64MiB")
    layout = KVLayout(model="test/runs", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                      block_tokens=16, block_bytes=4 * BLOCK)
    rng = np.random.default_rng(5)
    data = [rng.integers(0, 256, 4 * BLOCK, dtype=np.uint8) for _ in range(8)]
    hashes = ChainHasher().chain(np.arange(16 * 8), 16)
    with d.client(transport="bulk") as c:
        assert c.active_transport == "bulk"
        ns = c.register_namespace(Namespace(layout, cache_salt="full"))
        assert c.put(ns, hashes[:4], data[:4]) == ["stored"] * 4
        assert c.lookup(ns, hashes[:4]).tiers == ["cpu"] * 4   # leased: the arena cannot evict them
        assert c.put(ns, hashes[4:], data[4:], parent=hashes[3]) == ["persisted"] * 4   # on NVMe
        assert c.lookup(ns, hashes).tiers == ["cpu"] * 4 + ["nvme"] * 4
        outs = [np.zeros(4 * BLOCK, dtype=np.uint8) for _ in range(8)]
        assert c.get_into(ns, hashes, outs) == [4 * BLOCK] * 8
        assert all(np.array_equal(o, x) for o, x in zip(outs, data))


def test_get_frames_sent_a_run_at_a_time_read_back_block_by_block_with_each_next_size():
    """The daemon's side of a BulkGet writes frames a run per ``sendmsg`` (misses, blocks of
    several pieces, payloads shorter than a block, one larger than a run) through a small send
    buffer; the client reads each block's bytes together with the next frame's size and gets
    every frame back as sent."""
    rng = np.random.default_rng(13)
    frames = [[rng.integers(0, 256, BLOCK, dtype=np.uint8)] for _ in range(40)]
    frames[3] = None
    frames[7] = [rng.integers(0, 256, n, dtype=np.uint8) for n in (4096, 100, BLOCK - 4196)]
    frames[8] = [rng.integers(0, 256, 777, dtype=np.uint8)]
    frames[20] = [rng.integers(0, 256, 2 * bulk.SEND_RUN_BYTES + 3, dtype=np.uint8)]
    frames[39] = None
    frames.insert(0, None)
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    a.settimeout(30)
    b.settimeout(30)
    channel = bulk.BulkChannel.__new__(bulk.BulkChannel)   # the client's reads, on this socket
    channel.sock, channel._head = b, memoryview(bytearray(8))
    got: list = []
    sent_runs = []

    def reader():
        size = channel.read_size()
        for i in range(len(frames)):
            following = None
            if size:
                buf = np.zeros(size, dtype=np.uint8)
                following = channel.recv_into_and_size(buf) if i + 1 < len(frames) else channel.recv_into(buf)
                got.append(buf)
            else:
                got.append(None)
                following = channel.read_size() if i + 1 < len(frames) else None
            size = following

    t = threading.Thread(target=reader)
    t.start()
    try:
        sizes = bulk.send_blocks(a, frames, lambda: sent_runs.append(1))
        t.join(timeout=30)
    finally:
        a.close()
        b.close()
    assert sizes == [0 if f is None else sum(p.nbytes for p in f) for f in frames]
    for frame, back in zip(frames, got, strict=True):
        assert (back is None) if frame is None else np.array_equal(back, np.concatenate(frame))
    assert 1 < len(sent_runs) < len(frames)   # runs of frames, not a call per block
