"""Prometheus metrics: what the store counts, plus per-RPC latency, served on their own port.

Store-side numbers (hits and misses per tier, bytes in/out, evictions, demotions, occupancy,
corrupt blocks dropped, leases) are read from ``Store.stats()`` at scrape time by a custom
collector, so there is one source of truth and nothing to keep in sync on the hot path. Only what
the store cannot know — RPC latency, RPC errors, bytes per transport, configuration reloads — is
recorded by the server. Per-tenant, per-namespace and fleet series come from
``metrics_breakdown`` (bounded: top N plus "other"). The HTTP side (``/metrics`` and the routers'
JSON endpoint beside it) is ``http_endpoint``.
"""

from __future__ import annotations

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
    """The daemon's registry: the store collector plus what the server records per RPC."""

    def __init__(self, store=None) -> None:
        self.registry = CollectorRegistry()
        if store is not None:
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
        self._http = None

    def watch(self, collector) -> None:
        """Export another collector's series (the daemon adds the tenant and fleet breakdowns)."""
        self.registry.register(collector)

    def reloaded(self, ok: bool) -> None:
        self.reloads.labels("applied" if ok else "refused").inc()

    def observe(self, method: str, seconds: float, code: str | None = None) -> None:
        self.latency.labels(method).observe(seconds)
        if code is not None:
            self.errors.labels(method, code).inc()

    def moved(self, direction: str, transport: str, nbytes: int) -> None:
        if nbytes:
            self.wire_bytes.labels(direction, transport).inc(nbytes)

    def serve(self, host: str, port: int, route=None) -> int:
        """Start the HTTP endpoint (``/metrics``, and ``/v1/route`` when ``route`` is given: see
        http_endpoint.py); returns the port (useful when ``port`` is 0)."""
        from kvstore.service.http_endpoint import HttpEndpoint

        self._http = HttpEndpoint(self.registry, route=route)
        return self._http.serve(host, port)

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
