"""Daemon lifecycle: killed clients leak nothing, SIGTERM flushes, restarts recover, a dead daemon
is reported as DaemonUnavailable, health/reflection/metrics answer, the CLI talks to it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvstore import ChainHasher, Client, KVLayout, Namespace
from kvstore.errors import DaemonUnavailable

LAYOUT = KVLayout(model="test/life", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return ChainHasher(seed=seed).chain(np.arange(16 * n), 16)


def _blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for _ in range(n)]


def _wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


KILLED_CLIENT = textwrap.dedent("""
    import sys, numpy as np
    from kvstore import Client, KVLayout, Namespace, ChainHasher
    from kvstore.proto import kvstore_pb2 as pb
    layout = KVLayout(model="test/life", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
    c = Client(sys.argv[1], transport="shm")
    ns = c.register_namespace(Namespace(layout, cache_salt="lease"))
    hashes = ChainHasher(seed=1).chain(np.arange(16 * 8), 16)
    load = c.call("PrepareLoad", pb.PrepareLoadRequest(namespace_id=ns, hashes=hashes[:4]))
    store = c.call("PrepareStore", pb.PrepareStoreRequest(namespace_id=ns, hashes=hashes[4:]))
    print(len(load.table.extent_counts), sum(n > 0 for n in store.table.extent_counts), flush=True)
    sys.stdin.read()   # hold the leases until killed
""")


def test_killed_client_leaks_no_pins_or_slots(daemon_factory):
    d = daemon_factory("--lease-seconds", "1")
    with d.client(transport="shm") as c:
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt="lease"))
        hashes = _chain(8, seed=1)
        c.put(ns, hashes[:4], _blocks(4, seed=1))
        base = c.stats()["tiers"]["cpu"]["used_bytes"]
        child = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, d.address], stdout=subprocess.PIPE,
                                 stdin=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
        try:
            assert child.stdout.readline().split() == ["4", "4"]
            held = c.stats()
            assert held["leases"] == 2
            assert held["tiers"]["cpu"]["used_bytes"] > base   # 4 reserved slots
        finally:
            child.kill()
            child.wait()
        _wait_for(lambda: c.stats()["leases"] == 0, what="leases to expire")
        stats = c.stats()
        assert stats["tiers"]["cpu"]["used_bytes"] == base    # reservations released
        assert stats["counters"]["leases_expired"] == 2
        assert c.exists(ns, hashes[4:]) == [False] * 4        # never completed: never visible
        # The load pins are gone: deleting frees the slots at once (a pinned block would linger).
        assert c.delete(ns, hashes[:4]) == 4
        assert c.stats()["tiers"]["cpu"]["used_bytes"] == 0


def test_sigterm_flushes_and_restart_recovers(daemon_factory, tmp_path):
    nvme = str(tmp_path / "shared-nvme")
    d = daemon_factory(nvme_path=nvme)
    hashes = _chain(6, seed=2)
    blocks = _blocks(6, seed=2)
    with d.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt="restart"))
        assert c.put(ns, hashes, blocks) == ["stored"] * 6    # write-back: CPU only so far
        assert c.stats()["tiers"]["nvme"]["blocks"] == 0
    assert d.stop(signal.SIGTERM) == 0
    assert "6 blocks flushed" in d.log()
    assert not os.path.exists(d.arena_path)                  # the arena is unlinked on exit
    d2 = daemon_factory(nvme_path=nvme)
    with d2.client() as c:
        ns2 = c.register_namespace(Namespace(LAYOUT, cache_salt="restart"))
        assert ns2 == ns
        assert c.lookup(ns, hashes).num_hit == 6
        assert c.get(ns, hashes) == [b.tobytes() for b in blocks]


def test_daemon_down_raises_daemon_unavailable_quickly(daemon_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # closed again: nothing listens there
    c = Client(f"127.0.0.1:{port}", timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        c.lookup(b"\x00" * 16, [b"\x01" * 16])
    assert time.monotonic() - t0 < 10   # bounded by the deadline, not hanging
    assert c.health() is False
    c.close()
    # A daemon that dies under a connected client: the next call raises DaemonUnavailable too.
    d = daemon_factory()
    clients = {t: d.client(timeout_s=1.0, transport=t) for t in ("shm", "bulk", "grpc")}
    namespaces = {t: c.register_namespace(Namespace(LAYOUT)) for t, c in clients.items()}
    assert {t: c.active_transport for t, c in clients.items()} == {"shm": "shm", "bulk": "bulk", "grpc": "grpc"}
    d.kill()
    for t, c in clients.items():
        with pytest.raises(DaemonUnavailable):
            c.put(namespaces[t], _chain(1), _blocks(1, seed=3))
        with pytest.raises(DaemonUnavailable):
            c.get(namespaces[t], _chain(1))
        with pytest.raises(DaemonUnavailable):
            c.lookup(namespaces[t], _chain(1))
        c.close()


def test_health_reflection_and_metrics(kv_daemon):
    channel = grpc.insecure_channel(kv_daemon.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvstore.v1.KVStore"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= services
    assert db.FindFileContainingSymbol("kvstore.v1.KVStore").name == "kvstore/proto/kvstore.proto"
    channel.close()

    with kv_daemon.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt="metrics"))
        hashes = _chain(2, seed=4)
        c.put(ns, hashes, _blocks(2, seed=4))
        c.get(ns, hashes + [b"\x07" * 16])
    body = urllib.request.urlopen(f"http://127.0.0.1:{kv_daemon.metrics_port}/metrics", timeout=10).read().decode()
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
               if line and not line.startswith("#")}
    assert samples['kvstore_hits_total{tier="cpu"}'] >= 2
    assert samples["kvstore_misses_total"] >= 1
    assert samples['kvstore_tier_capacity_bytes{tier="cpu"}'] == 64 << 20
    assert samples['kvstore_corrupt_blocks_dropped_total{tier="nvme"}'] == 0
    assert samples['kvstore_rpc_seconds_count{method="RegisterNamespace"}'] >= 1
    assert "kvstore_evictions_total" in samples and "kvstore_demotions_total" in samples


def test_cli_health_and_stats(kv_daemon):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = REPO
    run = [sys.executable, "-m", "kvstore.ops.cli"]
    ok = subprocess.run(run + ["health", "--url", kv_daemon.address], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    stats = subprocess.run(run + ["stats", "--url", kv_daemon.address, "--json"], capture_output=True, text=True,
                           env=env)
    assert stats.returncode == 0, stats.stderr
    assert set(json.loads(stats.stdout)["tiers"]) == {"cpu", "nvme"}
    threads = json.loads(stats.stdout)["server"]["threads"]   # every pool, sized from the daemon's cores
    assert threads["cores"] == len(os.sched_getaffinity(0)) and threads["rpc"] >= 16 and threads["slow_reads"] >= 4
    table = subprocess.run(run + ["stats", "--url", kv_daemon.address], capture_output=True, text=True, env=env)
    assert table.returncode == 0 and "cpu" in table.stdout and "capacity" in table.stdout
    assert "threads:" in table.stdout and f"cores {threads['cores']}," in table.stdout and f"rpc {threads['rpc']}," in table.stdout
    down = subprocess.run(run + ["health", "--url", "127.0.0.1:1", "--timeout", "1"], capture_output=True,
                          text=True, env=env)
    assert down.returncode == 1


def test_cli_bench_json_smoke(tmp_path):
    """`kvstore bench` against its own private daemon: every path verified byte-identical, ratios present."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = REPO
    r = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "bench", "--sizes", "256KiB", "--total", "1MiB", "--json"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    row = report["sizes"][str(256 << 10)]
    for path in ("grpc", "bulk", "shm"):
        assert row[path]["verified"] is True
        assert row[path]["get_gbps"] > 0 and row[path]["put_gbps"] > 0
    assert row["shm_get_vs_memcpy"] > 0 and row["bulk_get_vs_tcp"] > 0
    assert report["lookups"]["batched_per_s"] > 0
