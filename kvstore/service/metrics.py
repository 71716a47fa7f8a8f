"""Prometheus metrics: what the store counts, plus per-RPC latency, served on their own port.

Store-side numbers (hits and misses per tier, bytes in/out, evictions, demotions, occupancy,
corrupt blocks dropped, leases) are read from ``Store.stats()`` at scrape time by a custom
collector, so there is one source of truth and nothing to keep in sync on the hot path. Only what
the store cannot know — RPC latency, RPC errors, bytes per transport, configuration reloads — is
recorded by the server. The HTTP side (``/metrics`` and the routers' JSON endpoint beside it) is
``http_endpoint``.

Per-tenant, per-namespace and fleet series have bounded cardinality. Tenant names and model ids
come from callers (without auth a caller names its own tenant), so one series per value would let
callers grow the scrape without bound. Each scrape therefore keeps the ``top_n`` tenants and the
``top_n`` namespaces by bytes held, and sums the rest into one series labelled ``other``. A tenant
or namespace that moves in or out of the top N moves its counts between its own series and
``other``: Prometheus sees a counter reset there, which ``rate()`` absorbs. Everything is read at
scrape time from the store, the lookup usage and the fleet: nothing here runs on a request path.
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Buckets from 100 us (a cached lookup) to 10 s (a large batch from NVMe).
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 10)

# store counter name -> (metric name, help)
_STORE_COUNTERS = {
    "misses": ("kvstore_misses", "Block reads that found nothing"),
    "bytes_in": ("kvstore_store_bytes_in", "Payload bytes stored"),
    "bytes_out": ("kvstore_store_bytes_out", "Payload bytes served"),
    "evictions": ("kvstore_evictions", "Blocks that left the store entirely"),
    "demotions": ("kvstore_demotions", "Copies moved down a tier to make room"),
    "promotions": ("kvstore_promotions", "Copies moved up a tier on a hit"),
    "puts": ("kvstore_puts", "Blocks stored"),
    "lookups": ("kvstore_lookups", "Lookup calls"),
    "leases_expired": ("kvstore_leases_expired", "Leases released because their holder never came back"),
    "put_rejected_full": ("kvstore_put_rejected_full", "Puts refused because no tier had room"),
    "put_rejected_busy": ("kvstore_put_rejected_busy",
                          "Puts refused because the block was deleted while a reader still held it"),
    "recovered_blocks": ("kvstore_recovered_blocks", "Blocks found on durable tiers at start-up"),
    "prewarmed": ("kvstore_prewarmed_blocks", "Blocks copied into the CPU tier by prewarm or pin"),
    "admin_dropped_blocks": ("kvstore_admin_dropped_blocks", "Blocks dropped by ns drop or evict"),
    "pins_refused_limit": ("kvstore_pins_refused", "Pins refused by max_pinned_bytes_per_tenant"),
    "load_leases_capped": ("kvstore_load_leases_capped",
                           "Load leases cut short at max_leased_bytes_per_tenant"),
}


class StoreCollector(Collector):
    """Reads ``store.stats()`` on every scrape."""

    def __init__(self, store) -> None:
        self.store = store

    def collect(self):
        stats = self.store.stats()
        counters = stats.get("counters", {})
        hits = CounterMetricFamily("kvstore_hits", "Block reads served, by tier", labels=["tier"])
        for name, value in counters.items():
            if name.startswith("hits_"):
                hits.add_metric([name[5:]], value)
        yield hits
        for key, (metric, doc) in _STORE_COUNTERS.items():
            yield CounterMetricFamily(metric, doc, value=counters.get(key, 0))
        corrupt = CounterMetricFamily("kvstore_corrupt_blocks_dropped",
                                      "Blocks that failed their checksum and were dropped", labels=["tier"])
        used = GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes occupied, by tier", labels=["tier"])
        cap = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity, by tier", labels=["tier"])
        blocks = GaugeMetricFamily("kvstore_tier_blocks", "Block copies held, by tier", labels=["tier"])
        for tier, t in stats.get("tiers", {}).items():
            corrupt.add_metric([tier], t.get("corrupt_dropped", 0))
            used.add_metric([tier], t.get("used_bytes", 0))
            cap.add_metric([tier], t.get("capacity_bytes", 0))
            blocks.add_metric([tier], t.get("policy_blocks", t.get("blocks", 0)))
        yield from (corrupt, used, cap, blocks)
        yield GaugeMetricFamily("kvstore_blocks", "Visible blocks", value=stats.get("blocks", 0))
        yield GaugeMetricFamily("kvstore_leases", "Leases in flight", value=stats.get("leases", 0))
        yield GaugeMetricFamily("kvstore_namespaces", "Registered namespaces", value=stats.get("namespaces", 0))


class Metrics:
    """The daemon's registry: the store collector plus what the server records per RPC (the daemon
    registers the tenant, GC and fleet collectors on ``registry`` too)."""

    def __init__(self, store) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(store))
        self.latency = Histogram("kvstore_rpc_seconds", "RPC latency", ["method"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.errors = Counter("kvstore_rpc_errors", "RPCs answered with an error", ["method", "code"],
                              registry=self.registry)
        self.wire_bytes = Counter("kvstore_wire_bytes", "Payload bytes moved, by direction and transport",
                                  ["direction", "transport"], registry=self.registry)
        self.reloads = Counter("kvstore_config_reloads", "Configuration reloads, by result (applied / refused)",
                               ["result"], registry=self.registry)
        for result in ("applied", "refused"):
            self.reloads.labels(result)

    def reloaded(self, ok: bool) -> None:
        self.reloads.labels("applied" if ok else "refused").inc()

    def observe(self, method: str, seconds: float, code: str | None = None) -> None:
        self.latency.labels(method).observe(seconds)
        if code is not None:
            self.errors.labels(method, code).inc()

    def moved(self, direction: str, transport: str, nbytes: int) -> None:
        if nbytes:
            self.wire_bytes.labels(direction, transport).inc(nbytes)


OTHER = "other"
NAMESPACE_LABELS = ["namespace", "model", "tenant"]
#: fleet events exported from the first scrape on, at 0 until they happen (dashboards plot them)
KNOWN_EVENTS = ("fetches", "fetched_blocks", "peer_misses", "peer_errors", "pool_blocks", "pool_errors",
                "redis_errors", "route_errors", "heartbeats", "published", "direct_fetches", "direct_blocks",
                "direct_failures")


#: per-tenant and per-namespace gauges: row field -> (metric, help)
_TENANT_GAUGES = {
    "bytes": ("kvstore_tenant_bytes", "Raw bytes of the blocks each tenant's namespaces hold (top N tenants by "
              "bytes, the rest as tenant=\"other\")"),
    "charged_bytes": ("kvstore_tenant_charged_bytes", "Bytes counted against each tenant's quota (blocks plus "
                      "reservations in flight)"),
    "pinned_bytes": ("kvstore_tenant_pinned_bytes", "Bytes of the CPU tier each tenant's pinned prefixes hold "
                     "(slot footprints, segments kept)"),
    "namespaces": ("kvstore_tenant_namespaces", "Registered namespaces per tenant"),
}
_NAMESPACE_GAUGES = {
    "bytes": ("kvstore_namespace_bytes", "Raw bytes of each namespace's blocks (top N namespaces by bytes, the rest "
              "as namespace=\"other\")"),
    "blocks": ("kvstore_namespace_blocks", "Blocks of each namespace"),
}


def top_and_other(rows: dict[tuple, dict], n: int) -> list[tuple[list[str], dict]]:
    """``(label values, row)`` of the ``n`` rows holding the most bytes, then, if any are left, the
    field-wise sum of the rest, labelled ``other``."""
    ordered = sorted(rows.items(), key=lambda kv: (-kv[1]["bytes"], kv[0]))
    top = [(list(labels), row) for labels, row in ordered[:n]]
    if len(ordered) <= n:
        return top
    other: dict[str, float] = defaultdict(float)
    for _, row in ordered[n:]:
        for field, value in row.items():
            if isinstance(value, (int, float)):
                other[field] += value
    return top + [([OTHER] * len(top[0][0]), dict(other))]


def _families(rows: list, labels: list[str], gauges: dict, by: str):
    """A gauge per ``gauges`` field and the lookups counter by result, a sample per row."""
    families = {field: GaugeMetricFamily(name, doc, labels=labels) for field, (name, doc) in gauges.items()}
    lookups = CounterMetricFamily(f"kvstore_{by}_lookup_blocks", f"Blocks asked by lookups, by {by} and result "
                                  "(hit = found)", labels=labels + ["result"])
    for values, row in rows:
        for field, family in families.items():
            family.add_metric(values, row[field])
        lookups.add_metric(values + ["hit"], row["lookup_hits"])
        lookups.add_metric(values + ["miss"], row["lookup_blocks"] - row["lookup_hits"])
    return [*families.values(), lookups]


class TenantCollector(Collector):
    """``kvstore_tenant_*`` and ``kvstore_namespace_*`` series, top N plus ``other``."""

    def __init__(self, store, usage, top_n: int = 10) -> None:
        self.store = store
        self.usage = usage          # kvstore.service.usage.NamespaceUsage
        self.top_n = top_n

    def _rows(self) -> tuple[dict, dict]:
        """Rows by namespace ``(id, model, tenant)`` and by ``(tenant,)``."""
        usage = self.usage.snapshot()
        namespaces: dict[tuple[str, str, str], dict] = {}
        tenants: dict[tuple[str], dict] = defaultdict(lambda: {"bytes": 0, "namespaces": 0, "lookup_blocks": 0,
                                                               "lookup_hits": 0})
        for ns in self.store.namespaces():
            held = self.store.namespace_bytes(ns.id)
            used = usage.get(ns.id)
            asked, hits = (used.lookup_blocks, used.lookup_hits) if used else (0, 0)
            namespaces[(ns.id.hex(), ns.layout.model, ns.tenant)] = {
                "bytes": held, "blocks": held // max(ns.block_bytes, 1), "lookup_blocks": asked, "lookup_hits": hits}
            t = tenants[(ns.tenant,)]
            t["bytes"] += held
            t["namespaces"] += 1
            t["lookup_blocks"] += asked
            t["lookup_hits"] += hits
        pinned = self.store.admin.pins.by_tenant()
        for (tenant,), row in tenants.items():
            row["charged_bytes"] = self.store.tenant_bytes(tenant)
            row["pinned_bytes"] = pinned.get(tenant, 0)
        return namespaces, dict(tenants)

    def collect(self):
        namespaces, tenants = self._rows()
        tenant_rows = top_and_other(tenants, self.top_n)
        yield from _families(tenant_rows, ["tenant"], _TENANT_GAUGES, "tenant")
        quota = GaugeMetricFamily("kvstore_tenant_quota_bytes", "Each tenant's byte quota (tenants with one)",
                                  labels=["tenant"])
        limits = self.store.admin.quota_limits()
        for [tenant], _ in tenant_rows[:self.top_n]:   # not "other"
            if tenant in limits:
                quota.add_metric([tenant], limits[tenant])
        yield quota
        yield from _families(top_and_other(namespaces, self.top_n), NAMESPACE_LABELS, _NAMESPACE_GAUGES, "namespace")

_FLEET_GAUGES = {
    "connected": ("kvstore_fleet_connected", "1 while the fleet directory (Redis) answers"),
    "published_blocks": ("kvstore_fleet_published_blocks", "Blocks this node has published to the directory"),
    "namespaces": ("kvstore_fleet_namespaces", "Namespaces this node publishes"),
    "peer_clients": ("kvstore_fleet_peer_clients", "Open connections to peers"),
}


class FleetCollector(Collector):
    """``kvstore_fleet_*``: membership, what this node publishes, and the fleet's event counters
    (peer fetches, pool reads, directory errors, ...), whose names are fixed in kvstore.fleet."""

    def __init__(self, fleet) -> None:
        self.fleet = fleet

    def collect(self):
        stats = self.fleet.stats()
        for field, (name, doc) in _FLEET_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(stats.get(field) or 0))   # connected: 1 or 0
        events = CounterMetricFamily("kvstore_fleet_events", "Fleet events by kind (fetched_blocks, peer_errors, "
                                     "pool_blocks, redis_errors, ...)", labels=["event"])
        counters = {name: 0 for name in KNOWN_EVENTS}
        counters.update(stats.get("counters", {}))
        for name, value in sorted(counters.items()):
            events.add_metric([name], value)
        yield events
