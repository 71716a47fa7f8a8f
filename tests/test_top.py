"""``kvstore top``: the frame computed from real store stats, and --once against a real daemon."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from rich.console import Console

from kvstore.ops import top
from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.store import Store, StoreConfig
from kvstore.tiers.cpu import CpuTier

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = KVLayout(model="top/test", num_layers=2, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)


def _blocks(n, seed=0):
    hashes = ChainHasher(seed=seed).chain(list(range(n * 16)), 16)
    payloads = [np.full(Namespace(LAYOUT).block_bytes, i, dtype=np.uint8) for i in range(n)]
    return hashes, payloads


def _text(renderable) -> str:
    console = Console(record=True, width=140, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_frame_from_real_store_stats():
    store = Store([CpuTier(1 << 20, slot_bytes=4096)], StoreConfig())
    try:
        ns = store.register_namespace(Namespace(LAYOUT))
        hashes, payloads = _blocks(8)
        store.put(ns, hashes, payloads)
        before = store.stats()
        store.get(ns, hashes[:6])                               # 6 hits
        store.get(ns, _blocks(2, seed=1)[0])                    # 2 misses
        after = store.stats()
    finally:
        store.close()
    v = top.view(after, before, dt=2.0)
    assert v["hit_rate_now"] == 6 / 8
    assert v["rates"]["hits_cpu"] == 3.0 and v["rates"]["misses"] == 1.0
    assert v["rates"]["bytes_out"] == 6 * LAYOUT.block_bytes / 2.0
    cpu = v["tiers"][0]
    assert cpu["name"] == "cpu" and cpu["blocks"] == 8 and cpu["used_bytes"] == 8 * LAYOUT.block_bytes
    text = _text(top.render(after, before, 2.0, address="127.0.0.1:1"))
    assert "now 75.0%" in text and "cpu" in text and "3.0" in text
    # no previous poll: totals only, rates shown as dashes
    assert "—" in _text(top.render(after))


def test_frame_lists_top_namespaces_by_bytes():
    stats = {"blocks": 3, "tiers": {"cpu": {"capacity_bytes": 100, "used_bytes": 50}}, "counters": {},
             "namespace_usage": [{"id": "aa" * 16, "model": "small", "tenant": "t1", "bytes": 10},
                                 {"id": "bb" * 16, "model": "big", "tenant": "t2", "bytes": 40, "blocks": 4}]}
    text = _text(top.render(stats))
    assert "top namespaces" in text
    assert text.index("big") < text.index("small")


def test_once_against_a_real_daemon(daemon_factory):
    d = daemon_factory()
    c = d.client()
    try:
        ns = c.register_namespace(Namespace(LAYOUT))
        hashes, payloads = _blocks(4)
        c.put(ns, hashes, payloads)
        assert all(x is not None for x in c.get(ns, hashes))
        assert c.get(ns, _blocks(1, seed=9)[0]) == [None]
    finally:
        c.close()
    env = {**os.environ, "PYTHONPATH": REPO, "COLUMNS": "140"}
    out = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "top", "--once", "--url", d.url, "--interval", "0.2"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "kvstore top" in out.stdout and d.url in out.stdout
    assert "since start 80.0%" in out.stdout           # 4 hits, 1 miss
    assert "nvme" in out.stdout and "cpu" in out.stdout
    d.stop()
    down = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "top", "--once", "--url", d.url],
                          capture_output=True, text=True, timeout=60, env=env)
    assert down.returncode == 1 and "unavailable" in down.stderr
