"""``KVStoreConnector``: the class vLLM loads (``kv_connector_module_path: kvstore.connectors.vllm``).

vLLM makes one instance per role — scheduler or worker — of the same class, so the class joins the
two halves (``scheduler_side``, ``worker_side``) and holds what they share: settings, namespace,
the daemon handles and the counters vLLM collects.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvstore.client import CircuitBreaker, NamespaceHandle
from kvstore.connectors.vllm.chunks import ChunkPacking
from kvstore.connectors.vllm.handoff import HandoffWaiter, Wait
from kvstore.connectors.vllm.identity import checked_hasher, namespace_for
from kvstore.connectors.vllm.loader import BackgroundLoader, LoadJob
from kvstore.connectors.vllm.metadata import BlockTransfer, KVStoreConnectorStats
from kvstore.connectors.vllm.paged_blocks import PagedBlocks
from kvstore.connectors.vllm.ranks import lookup_namespaces, worker_ranks
from kvstore.connectors.vllm.roles import Role
from kvstore.connectors.vllm.saver import SaveQueue
from kvstore.connectors.vllm.scheduler_side import RequestState, SchedulerSide
from kvstore.connectors.vllm.settings import ConnectorSettings
from kvstore.connectors.vllm.worker_side import WorkerSide
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvstore.connectors.vllm")


class KVStoreConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1):
    """kvstore as vLLM's external prefix cache, and as the hand-off between prefill and decode
    engines (``kv_role``: ``roles``, ``handoff``; see the package docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.kv_role = Role.of(self._kv_transfer_config.kv_role, self.settings)
        # A failed load must mean "recompute", never "fail the request" (vLLM's default).
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            try:
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            except Exception:  # noqa: BLE001 - a frozen config: say so, keep going
                logger.warning("kvstore connector: set kv_load_failure_policy='recompute' in the "
                               "kv_transfer_config, or failed loads will fail requests")
        self.block_size = int(vllm_config.cache_config.block_size)        # vLLM's
        self.chunk_blocks = self.settings.blocks_per_chunk                # vLLM blocks per kvstore block
        self.chunk_tokens = self.chunk_blocks * self.block_size
        self.hasher = checked_hasher(self.settings)
        self._stats = KVStoreConnectorStats()      # since vLLM last collected them
        self.totals: dict[str, int | float] = {}    # since start (tests, benchmarks, shutdown log)
        self._stats_lock = threading.Lock()
        self.tp_rank, pp_rank = (0, 0) if role == KVConnectorRole.SCHEDULER else worker_ranks()
        self.namespace = namespace_for(vllm_config, kv_cache_config, self.settings, self.tp_rank, pp_rank)
        self.enabled = self.namespace is not None and self.hasher is not None
        # scheduler side (each thread that talks to the daemon owns its handle)
        self._requests: dict[str, RequestState] = {}
        self._pending_loads: dict[str, BlockTransfer] = {}
        self._lookup_links: list[NamespaceHandle] = []
        self._handoff_waiter: HandoffWaiter | None = None   # consumers: waits for producers' blocks
        self._handoff_waits: dict[str, Wait] = {}
        self._handoff_expected: dict[str, tuple[int, str, int]] = {}   # blocks named, how the wait ended, unsaved
        if self.enabled and role == KVConnectorRole.SCHEDULER:
            namespaces = lookup_namespaces(vllm_config, kv_cache_config, self.settings)
            # a producer's lookup gets a save's time: its breaker opening is what tells it that its
            # saves fail (``_offered_handoff``), so it must not open on a call a save would outlast
            timeout_s = self.settings.lookup_timeout_s if self.kv_role.loads else self.settings.timeout_s
            self._lookup_links = [self._daemon_handle(timeout_s, "lookup", ns) for ns in namespaces]
            if self.kv_role.loads and namespaces:
                self._handoff_waiter = HandoffWaiter(
                    [self._daemon_handle(self.settings.lookup_timeout_s, "hand-off", ns) for ns in namespaces],
                    self.settings.pd_poll_s)
        # worker side
        self._paged: PagedBlocks | None = None
        self._packing: ChunkPacking | None = None
        self._load_link: NamespaceHandle | None = None
        self._loader: BackgroundLoader | None = None
        self._saver: SaveQueue | None = None
        self._load_errors: set[int] = set()
        self._failed_async: list[BlockTransfer] = []
        self._layer_job: LoadJob | None = None
        self._layer_hooks_missing = False      # layer mode fell back to loading before the forward pass
        self._layer_saves = None               # save_mode layer: this step's saves, copied layer by layer
        self._layer_save_hooks_missing = False  # ... fell back to copying after the step
        self._saving_reqs: set[str] = set()    # requests the scheduler holds blocks of for saves
        self._finishing: set[str] = set()      # ... that finished; reported once copied out
        self._staging = torch.empty(0, dtype=torch.uint8)

    def _daemon_handle(self, timeout_s: float, what: str, namespace: Namespace | None = None) -> NamespaceHandle:
        """A namespace on the daemon, failing closed: any failure skips calls for ``retry_after_s``."""
        s = self.settings
        return NamespaceHandle(namespace or self.namespace, url=s.url, token=s.token, timeout_s=timeout_s,
                               transport=s.transport,
                               breaker=CircuitBreaker(failures_to_open=1, cool_down_s=s.retry_after_s),
                               name=f"kvstore connector ({what})")

    @property
    def _lookup_link(self) -> NamespaceHandle | None:
        """The scheduler's handle on its own (rank 0) namespace (tests inject faults through it)."""
        return self._lookup_links[0] if self._lookup_links else None

    # -- stats ------------------------------------------------------------------------------------

    def _add_stat(self, key: str, n: int | float = 1) -> None:
        with self._stats_lock:
            self._stats.add(key, n)
            self.totals[key] = self.totals.get(key, 0) + n

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVStoreConnectorStats()
        return out

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
        if self._handoff_waiter is not None:
            self._handoff_waiter.close()
        if self._saver is not None:
            self._saver.close()
            self._saver.handle.close()
        if self._loader is not None:
            self._loader.close()
        for handle in (self._load_link, *self._lookup_links):
            if handle is not None:
                handle.close()
