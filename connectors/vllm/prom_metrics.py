"""The connector's counters as vLLM Prometheus series (``build_prom_metrics``), beside the
"KV Transfer metrics" vLLM logs from the same stats.

vLLM hands every engine's aggregated ``KVStoreConnectorStats`` to ``observe`` each time it
records scheduler stats; each known key becomes one counter, labelled like vLLM's own series
(model name, engine index), so a dashboard can put hit blocks, load failures and seconds spent
loading beside vLLM's TTFT. Unknown keys are ignored: the series set is fixed at start.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

#: stats key -> (series name, help). Keys are what the connector counts (``_add_stat``).
SERIES: dict[str, tuple[str, str]] = {
    "lookups": ("vllm:kvstore_lookups", "Requests the scheduler looked up in kvstore"),
    "lookup_hit_blocks": ("vllm:kvstore_lookup_hit_blocks", "Blocks kvstore held for those lookups"),
    "lookup_seconds": ("vllm:kvstore_lookup_seconds", "Seconds the scheduler spent in kvstore lookups"),
    "load_planned_blocks": ("vllm:kvstore_load_planned_blocks", "Blocks scheduled to load from kvstore"),
    "loaded_blocks": ("vllm:kvstore_loaded_blocks", "Blocks loaded from kvstore into the KV cache"),
    "load_failed_blocks": ("vllm:kvstore_load_failed_blocks", "Blocks whose load failed (recomputed)"),
    "load_local_blocks": ("vllm:kvstore_load_local_blocks",
                          "vLLM blocks of loaded chunks that vLLM's prefix cache held already (not placed)"),
    "load_seconds": ("vllm:kvstore_load_seconds", "Seconds spent loading blocks from kvstore"),
    "layer_wait_seconds": ("vllm:kvstore_layer_wait_seconds", "Seconds the forward pass waited for a layer"),
    "saved_blocks": ("vllm:kvstore_saved_blocks", "Blocks saved to kvstore"),
    "save_failed_blocks": ("vllm:kvstore_save_failed_blocks", "Blocks whose save failed"),
    "save_skipped_blocks": ("vllm:kvstore_save_skipped_blocks", "Blocks not saved: the daemon failed lately (breaker open)"),
    "save_dropped_blocks": ("vllm:kvstore_save_dropped_blocks", "Blocks not saved: the save queue was full"),
    "save_gather_seconds": ("vllm:kvstore_save_gather_seconds", "Seconds spent copying blocks out to save"),
    # prefixes another live request computes (scheduler_side._awaiting_inflight)
    "inflight_waits": ("vllm:kvstore_inflight_waits",
                       "Requests that waited for prompt blocks another request of this engine computes"),
    "inflight_wait_seconds": ("vllm:kvstore_inflight_wait_seconds", "Seconds those requests waited"),
    "inflight_arrived": ("vllm:kvstore_inflight_arrived", "... and found the blocks in the daemon"),
    "inflight_timeout": ("vllm:kvstore_inflight_timeout", "... until inflight_wait_s passed"),
    "inflight_unavailable": ("vllm:kvstore_inflight_unavailable", "... until the daemon did not answer"),
    # prefill/decode hand-off (handoff.py)
    "pd_offered_blocks": ("vllm:kvstore_pd_offered_blocks", "Producer: prompt blocks named to decode engines"),
    "pd_held_blocks": ("vllm:kvstore_pd_held_blocks",
                       "Producer: prompt blocks the daemon already held (named, not saved again)"),
    "pd_unsaved_blocks": ("vllm:kvstore_pd_unsaved_blocks",
                          "Producer: prompt blocks marked unsaved in params (the daemon did not answer, "
                          "or a held block before them was evicted)"),
    "pd_evicted_blocks": ("vllm:kvstore_pd_evicted_blocks",
                          "Producer: prompt blocks its daemon held on arrival, evicted before the hand-off"),
    "pd_waits": ("vllm:kvstore_pd_waits", "Consumer: requests that waited for a producer's blocks"),
    "pd_wait_seconds": ("vllm:kvstore_pd_wait_seconds", "Consumer: seconds requests waited for them"),
    "pd_admit_deferrals": ("vllm:kvstore_pd_admit_deferrals",
                           "Consumer: scheduler passes that held a request whose blocks were there for a later "
                           "step (pd_admit_per_step)"),
    "pd_loaded_requests": ("vllm:kvstore_pd_loaded_requests", "Consumer: hand-offs whose blocks were all there"),
    "pd_loaded_blocks": ("vllm:kvstore_pd_loaded_blocks", "Consumer: blocks of those hand-offs"),
    "pd_recomputes": ("vllm:kvstore_pd_recomputes", "Consumer: hand-offs that recomputed blocks"),
    "pd_recomputed_blocks": ("vllm:kvstore_pd_recomputed_blocks", "Consumer: blocks the params spoke of, recomputed"),
    "pd_recomputes_timeout": ("vllm:kvstore_pd_recomputes_timeout", "... because pd_wait_s passed"),
    "pd_recomputes_unavailable": ("vllm:kvstore_pd_recomputes_unavailable", "... because the daemon did not answer"),
    "pd_recomputes_evicted": ("vllm:kvstore_pd_recomputes_evicted", "... because blocks were evicted after arriving"),
    "pd_recomputes_unsaved": ("vllm:kvstore_pd_recomputes_unsaved", "... because the producer did not save them"),
    "pd_params_refused": ("vllm:kvstore_pd_params_refused", "Consumer: hand-off params refused (malformed, other prompt or model)"),
}


class KVStorePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                          per_engine_labelvalues)
            for key, (name, doc) in SERIES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = getattr(transfer_stats_data, "data", transfer_stats_data) or {}
        for key, value in data.items():
            per_engine = self.counters.get(key)
            if per_engine is not None and engine_idx in per_engine and value > 0:
                per_engine[engine_idx].inc(value)
