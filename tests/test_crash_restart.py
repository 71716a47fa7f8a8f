"""kill -9 mid-way through a write loop, restart on the same directory: every block acknowledged as
persisted is served intact, no torn block is ever served, and leftovers are cleaned up."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstore.keys import KVLayout, Namespace
from kvstore.store import Store, StoreConfig
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.nvme import NvmeTier

BLOCK = 1 << 20

# The writer: a chain of 1 MiB blocks whose bytes derive from their hash, so the checker can tell
# an intact block from a torn or misplaced one without any shared state.
_WRITER = r"""
import sys, numpy as np
from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.store import Store, StoreConfig
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.nvme import NvmeTier
path, mode = sys.argv[1], sys.argv[2]
layout = KVLayout(model="crash/model", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                  block_tokens=16, block_bytes=%(block)d)
store = Store([CpuTier(4 * %(block)d, slot_bytes=%(block)d), NvmeTier(path, 1 << 30)],
              StoreConfig(write_through=(mode == "write_through")))
ns = store.register_namespace(Namespace(layout))
hashes = ChainHasher().chain(list(range(16 * 400)), 16)
parent = None
print("ready", flush=True)
for i, h in enumerate(hashes):
    payload = np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, %(block)d, dtype=np.uint8)
    status = store.put(ns, [h], [payload], parent=parent)[0]
    parent = h
    if mode == "flush" and i %% 3 == 2:
        store.flush()
        print("flushed", flush=True)
    print(("persisted " if status == "persisted" else "stored ") + h.hex(), flush=True)
""" % {"block": BLOCK}


def expected(h: bytes) -> bytes:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def run_and_kill(path: str, mode: str, acks_before_kill: int, extra_delay: float) -> list[bytes]:
    """Start the writer, let it acknowledge some blocks, kill -9 it; return the acknowledged hashes."""
    p = subprocess.Popen([sys.executable, "-c", _WRITER, path, mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    acked: list[bytes] = []
    pending: list[bytes] = []  # written, awaiting a flush (mode "flush")
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        deadline = time.monotonic() + 120
        while len(acked) < acks_before_kill and time.monotonic() < deadline:
            line = p.stdout.readline().strip()
            if not line:
                break
            if line == "flushed":
                acked.extend(pending)
                pending.clear()
            elif line.startswith("persisted "):
                acked.append(bytes.fromhex(line.split()[1]))
            else:
                pending.append(bytes.fromhex(line.split()[1]))
        time.sleep(extra_delay)  # land the kill somewhere inside the next write
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        p.stdout.close()
        p.stderr.close()
        for seg in glob.glob(f"/dev/shm/kvstore-{p.pid}-*"):  # a killed daemon cannot unlink its arena
            os.unlink(seg)
    assert len(acked) >= acks_before_kill, "the writer did not get far enough"
    return acked


@pytest.mark.parametrize("mode,delay", [("write_through", 0.0), ("write_through", 0.013),
                                        ("write_through", 0.037)])
def test_kill_9_mid_write_loop_then_restart(tmp_path, mode, delay):
    path = str(tmp_path / "nvme")
    acked = run_and_kill(path, mode, acks_before_kill=12, extra_delay=delay)

    store = Store([CpuTier(4 * BLOCK, slot_bytes=BLOCK), NvmeTier(path, 1 << 30)],
                  StoreConfig(promote_on_hit=False))
    try:
        assert not any(n.endswith(".tmp") for n in os.listdir(path)), "leftover temp files"
        layout = KVLayout(model="crash/model", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                          block_tokens=16, block_bytes=BLOCK)
        ns = Namespace(layout).id
        assert ns in {n.id for n in store.namespaces()}  # the registry survived too
        # every acknowledged block is served intact
        got = store.get(ns, acked)
        assert [g is not None for g in got] == [True] * len(acked)
        assert all(g == expected(h) for g, h in zip(got, acked))
        # whatever else survived is intact too: no torn block is ever served
        recovered = [b.block_hash for b in store.block_states()]
        assert set(acked) <= set(recovered)
        for h, g in zip(recovered, store.get(ns, recovered)):
            assert g is None or g == expected(h)
        assert store.stats()["counters"].get("corrupt_dropped", 0) == 0
        assert store.lookup(ns, acked, lease=False).num_hit == len(acked)  # chain links rebuilt
    finally:
        store.close()


def test_flush_acknowledges_write_back_blocks(tmp_path):
    path = str(tmp_path / "nvme")
    acked = run_and_kill(path, "flush", acks_before_kill=9, extra_delay=0.02)
    store = Store([NvmeTier(path, 1 << 30)])
    try:
        ns = store.namespaces()[0].id
        got = store.get(ns, acked)
        assert all(g == expected(h) for g, h in zip(got, acked))
    finally:
        store.close()
