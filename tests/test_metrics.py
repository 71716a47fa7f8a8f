"""Metrics and the HTTP endpoint of a live fleet daemon: every series the Grafana dashboard uses is
exported, per-tenant and per-namespace series stay bounded (top N plus "other"), fleet counters are
there, and POST /v1/route gives routers the Route answer as JSON, behind the same auth."""

from __future__ import annotations

import json
import os
import re
import textwrap
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.errors import Unauthenticated
from kvstore.ops import admin_cli

DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "deploy", "grafana", "kvstore.json")
LAYOUT = KVLayout(model="test/metrics", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=16)
SECRET = "test-fleet-secret-0123456789abcdef"


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + 16 * n))


def put_chain(client, ns: bytes, n: int, start: int = 0) -> list[bytes]:
    hashes = ChainHasher().chain(tokens(n, start), 16)
    client.put(ns, hashes, [np.full(LAYOUT.block_bytes, i, np.uint8) for i in range(n)])
    return hashes


def dashboard_series() -> set[str]:
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    return {name for e in exprs for name in re.findall(r"\bkvstore_[a-z0-9_]+", e)}


def scrape(port: int) -> dict[str, list]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def post(port: int, body, token: str | None = None, path: str = "/v1/route") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def fleet_daemon(tmp_path_factory, redis_url):
    import uuid

    import redis
    from daemon_util import start_daemon

    prefix = f"kvstest-{uuid.uuid4().hex[:12]}"
    workdir = tmp_path_factory.mktemp("metrics")
    config = workdir / "kv.yaml"
    config.write_text(textwrap.dedent(f"""
        tokens: {{alice-token: alice, bob-token: bob, ops-token: ops}}
        admin_tenants: [ops]
        quotas: {{alice: 8MiB}}
        metrics_top_n: 1
        fleet:
          enabled: true
          redis_url: {redis_url}
          key_prefix: {prefix}
          node_id: node-a
          heartbeat_s: 0.2
          ttl_s: 1.5
          secret: {SECRET}
    """))
    d = start_daemon(workdir, "--config", str(config), "--metrics-port", "0", cpu_bytes="16MiB", nvme_bytes="32MiB")
    yield d
    d.kill()
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture(scope="module")
def traffic(fleet_daemon):
    """Two tenants' namespaces, lookups that hit and miss, a pin, and a refused call."""
    d = fleet_daemon
    with d.client(token="alice-token") as alice, d.client(token="bob-token") as bob, \
            d.client(token="ops-token") as ops:
        ns_a = alice.register_namespace(Namespace(LAYOUT))
        hashes_a = put_chain(alice, ns_a, 4)
        alice.lookup(ns_a, hashes_a + ChainHasher().chain(tokens(2, 90_000), 16))
        ns_b = bob.register_namespace(Namespace(LAYOUT, cache_salt="b"))
        hashes_b = put_chain(bob, ns_b, 2, start=5000)
        bob.lookup(ns_b, hashes_b)
        alice.get(ns_a, hashes_a)
        admin_cli.prefix_call(ops, "Pin", ns_a, hashes_a[:2])
    with d.client(token="wrong-token") as stranger, pytest.raises(Unauthenticated):
        stranger.stats()
    return ns_a, hashes_a, ns_b


def test_every_series_the_dashboard_uses_is_exported(fleet_daemon, traffic):
    wanted = dashboard_series()
    assert len(wanted) >= 25
    samples = scrape(fleet_daemon.metrics_port)
    missing = sorted(name for name in wanted if not samples.get(name))
    assert not missing, f"the dashboard plots series the daemon does not export: {missing}"


def test_collection_pauses_are_shown_and_start_up_objects_are_frozen(fleet_daemon, traffic):
    """Every garbage collection stops every request in flight: the daemon times each (per
    generation) and keeps what start-up built out of later collections (gc.freeze), so a full
    collection no longer walks tens of thousands of objects that live for good."""
    samples = scrape(fleet_daemon.metrics_port)
    frozen = samples["kvstore_gc_frozen_objects"][0].value
    assert frozen > 10_000   # the imported modules, gRPC's and numpy's among them
    assert {s.labels["generation"] for s in samples["kvstore_gc_pause_seconds_total"]} == {"0", "1", "2"}
    assert {s.labels["generation"] for s in samples["kvstore_gc_pause_max_seconds"]} == {"0", "1", "2"}
    with fleet_daemon.client(token="ops-token") as ops, fleet_daemon.client(token="alice-token") as alice:
        gc_stats = ops.stats()["server"]["gc"]
        assert "gc" not in alice.stats()["server"]   # store-wide figures: admins only
    assert gc_stats["frozen_objects"] == frozen
    young = gc_stats["generations"]["0"]
    assert young["collections"] > 0 and 0 < young["pause_max_ms"] <= young["pause_total_ms"]


def test_tenant_and_namespace_series_are_bounded_with_other(fleet_daemon, traffic):
    ns_a, _, ns_b = traffic
    samples = scrape(fleet_daemon.metrics_port)
    assert {s.labels["tenant"] for s in samples["kvstore_tenant_bytes"]} == {"alice", "other"}   # top 1 + other
    by_tenant = {s.labels["tenant"]: s.value for s in samples["kvstore_tenant_bytes"]}
    assert by_tenant == {"alice": 4 * LAYOUT.block_bytes, "other": 2 * LAYOUT.block_bytes}
    assert {s.labels["namespace"] for s in samples["kvstore_namespace_bytes"]} == {ns_a.hex(), "other"}
    hits = {(s.labels["tenant"], s.labels["result"]): s.value for s in samples["kvstore_tenant_lookup_blocks_total"]}
    assert hits[("alice", "hit")] == 4 and hits[("alice", "miss")] == 2 and hits[("other", "hit")] == 2
    assert {s.labels["tenant"]: s.value for s in samples["kvstore_tenant_quota_bytes"]} == {"alice": 8 << 20}
    assert {s.labels["tenant"]: s.value for s in samples["kvstore_tenant_pinned_bytes"]}["alice"] == \
        2 * (256 << 10)   # what 2 pins hold of the CPU tier: a 256 KiB slot (and segment) each
    fleet = {s.labels["event"] for s in samples["kvstore_fleet_events_total"]}
    assert {"fetched_blocks", "peer_errors", "redis_errors", "heartbeats"} <= fleet
    assert samples["kvstore_fleet_connected"][0].value == 1
    assert samples["kvstore_config_reloads_total"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{fleet_daemon.metrics_port}/metrics", timeout=10).read()
    assert b"alice-token" not in body and SECRET.encode() not in body


def test_http_route_answers_routers_behind_the_same_auth(fleet_daemon, traffic):
    ns_a, hashes_a, _ = traffic
    port = fleet_daemon.metrics_port
    by_hash = {"namespace_id": ns_a.hex(), "hashes": [h.hex() for h in hashes_a]}

    def routed():
        status, answer = post(port, by_hash, "alice-token")
        return status == 200 and answer["nodes"] and answer["nodes"][0]["blocks"] == 4 and answer

    deadline = time.monotonic() + 15
    while not (answer := routed()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert answer, "the node never appeared in the route answer"
    [node] = answer["nodes"]
    assert node["node_id"] == "node-a" and node["address"] == fleet_daemon.address
    assert node["tokens"] == 64 and answer["block_tokens"] == 16
    status, by_tokens = post(port, {"namespace_id": ns_a.hex(), "token_ids": tokens(4) + [1, 2, 3]}, "alice-token")
    assert status == 200 and by_tokens["nodes"] == answer["nodes"]       # hashed here, the partial block ignored
    assert post(port, by_hash)[0] == 401                                  # no token
    assert post(port, by_hash, "wrong-token")[0] == 401
    status, err = post(port, by_hash, "bob-token")                         # another tenant's namespace
    assert status == 404 and err["field"] is None and "unknown namespace" in err["error"]
    status, err = post(port, {"namespace_id": ns_a.hex(), "token_ids": ["x"]}, "alice-token")
    assert status == 400 and err["field"] == "token_ids"
    assert post(port, b"{not json", "alice-token")[0] == 400
    assert post(port, by_hash, "alice-token", path="/v1/nope")[0] == 404
