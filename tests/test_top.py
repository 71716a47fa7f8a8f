"""``kvstore top``: the frame computed from real store stats, --once against a real daemon, and
``top`` / ``stats`` readable in 80 columns when piped."""

from __future__ import annotations

import json
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


def _text(renderable, width: int = 140) -> str:
    console = Console(record=True, width=width, color_system=None)
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


def _fits_80_columns(text: str) -> None:
    too_long = [line for line in text.splitlines() if len(line) > 80]
    assert not too_long, too_long
    assert "…" not in text                              # no cell cut short


def test_stats_and_top_fit_80_columns_when_piped(daemon_factory):
    d = daemon_factory("--eviction-policy", "s3fifo")
    c = d.client()
    try:
        ns = c.register_namespace(Namespace(LAYOUT))
        hashes, payloads = _blocks(6)
        c.put(ns, hashes, payloads)
        c.get(ns, hashes)
    finally:
        c.close()
    env = {**os.environ, "PYTHONPATH": REPO, "COLUMNS": "80"}
    for command, marker in ((["stats"], "hits_cpu"), (["top", "--once", "--interval", "0.2"], "hits/s")):
        out = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", *command, "--url", d.url],
                             capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        _fits_80_columns(out.stdout)
        assert "capacity" in out.stdout and marker in out.stdout
        rows = [line.split() for line in out.stdout.splitlines()]
        assert any(row[:1] == ["cpu"] and "6" in row for row in rows), out.stdout   # whole cells, 6 blocks
    out = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "top", "--json", "--interval", "0.2",
                          "--url", d.url], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    frame = json.loads(out.stdout)
    assert frame["blocks"] == 6 and frame["rates"]["hits_cpu"] == 0.0   # a rate: two polls 0.2 s apart


def test_namespace_table_wraps_long_models_in_80_columns():
    model = "meta-llama/Llama-3.1-405B-Instruct-FP8-with-a-very-long-revision-name"
    stats = {"blocks": 1, "tiers": {"cpu": {"capacity_bytes": 1 << 30, "used_bytes": 1 << 20}}, "counters": {},
             "namespace_usage": [{"id": "ab" * 16, "model": model, "tenant": "team-a", "bytes": 1 << 20,
                                  "blocks": 4}]}
    text = _text(top.render(stats, width=80), width=80)
    _fits_80_columns(text)
    assert "░" not in text                              # no room for occupancy bars
    assert "░" in _text(top.render(stats, width=140))
    assert "meta-llama" in text and "team-a" in text
