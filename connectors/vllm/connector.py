"""``KVStoreConnector``: the class vLLM loads (``kv_connector_module_path: kvstore.connectors.vllm``).

vLLM makes one instance per role of the same class. The instance reads the settings, names the
namespace and then holds one object for its role — ``SchedulerSide`` (``scheduler_side``) or
``WorkerSide`` (``worker_side``) — built with what that role needs; vLLM's calls are passed on
to it. What both roles share is held here: the settings, the namespace and the counters vLLM
collects.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvstore.client import CircuitBreaker, NamespaceHandle
from kvstore.connectors.vllm.identity import checked_hasher, namespace_for
from kvstore.connectors.vllm.metadata import Counters, KVStoreConnectorMetadata, KVStoreConnectorStats
from kvstore.connectors.vllm.ranks import lookup_namespaces, worker_ranks
from kvstore.connectors.vllm.roles import Role
from kvstore.connectors.vllm.scheduler_side import SchedulerSide
from kvstore.connectors.vllm.settings import ConnectorSettings
from kvstore.connectors.vllm.worker_side import WorkerSide
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.connectors.vllm")


def daemon_handle(settings: ConnectorSettings, namespace: Namespace, timeout_s: float, what: str) -> NamespaceHandle:
    """A namespace on the daemon, failing closed: any failure skips calls for ``retry_after_s``."""
    return NamespaceHandle(namespace, url=settings.url, token=settings.token, timeout_s=timeout_s,
                           transport=settings.transport,
                           breaker=CircuitBreaker(failures_to_open=1, cool_down_s=settings.retry_after_s),
                           name=f"kvstore connector ({what})")


class KVStoreConnector(KVConnectorBase_V1):
    """kvstore as vLLM's external prefix cache, and as the hand-off between prefill and decode
    engines (``kv_role``: ``roles``, ``handoff``; see the package docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        kv_role = Role.of(self._kv_transfer_config.kv_role, settings)
        # A failed load must mean "recompute", never "fail the request" (vLLM's default).
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            try:
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            except Exception:  # noqa: BLE001 - a frozen config: say so, keep going
                logger.warning("kvstore connector: set kv_load_failure_policy='recompute' in the "
                               "kv_transfer_config, or failed loads will fail requests")
        hasher = checked_hasher(settings)
        self.counters = Counters()
        tp_rank, pp_rank = (0, 0) if role == KVConnectorRole.SCHEDULER else worker_ranks()
        self.namespace = namespace_for(vllm_config, kv_cache_config, settings, tp_rank, pp_rank)
        enabled = self.namespace is not None and hasher is not None
        connect = functools.partial(daemon_handle, settings)
        self.connector_scheduler: SchedulerSide | None = None
        self.connector_worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = SchedulerSide(
                settings, kv_role, self.namespace, hasher, int(vllm_config.cache_config.block_size),
                lookup_namespaces(vllm_config, kv_cache_config, settings) if enabled else [],
                connect, self.counters.add)
        else:
            self.connector_worker = WorkerSide(settings, kv_role, self.namespace if enabled else None, tp_rank,
                                               kv_cache_config, connect, self.counters.add)

    @property
    def totals(self) -> dict[str, int | float]:
        """Counters since start (tests, benchmarks)."""
        return self.counters.totals

    # -- scheduler role ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVStoreConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def cached_prompt_tokens(self, request: "Request") -> int:
        """For cache-aware admission (``admission``): leading prompt tokens the daemon holds."""
        assert self.connector_scheduler is not None
        return self.connector_scheduler.cached_prompt_tokens(request)

    def add_admission_stat(self, hit: bool) -> None:
        self.counters.add("admitted_hits" if hit else "admitted_misses")

    # -- worker role ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self.connector_worker is not None
        self.connector_worker.bind_connector_metadata(self._bound_metadata())

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._bound_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.connector_worker is not None
        self.connector_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        self.connector_worker.wait_for_save(self._bound_metadata())

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.handle_preemptions(kv_connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.connector_worker is not None
        return self.connector_worker.get_finished(finished_req_ids)

    def drain_saves(self, timeout_s: float = 10.0) -> None:
        """Block until queued saves reach the daemon (for tests and orderly shutdown)."""
        if self.connector_worker is not None:
            self.connector_worker.drain_saves(timeout_s)

    def _bound_metadata(self) -> KVStoreConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVStoreConnectorMetadata) else None

    # -- stats ------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        return self.counters.collect()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStoreConnectorStats:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """The same counters as vLLM Prometheus series (``prom_metrics.SERIES``)."""
        from kvstore.connectors.vllm.prom_metrics import KVStorePromMetrics

        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- lifetime ---------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
