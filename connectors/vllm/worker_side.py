"""The worker half of the connector: load planned blocks before the forward pass, gather computed
blocks after it and hand them to the background saver.

A load that does not deliver a whole block reports that block's vLLM id as a load error, so vLLM
recomputes it (``kv_load_failure_policy="recompute"``); nothing raised here reaches vLLM.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata
from kvstore.connectors.vllm.paged_blocks import PagedBlocks
from kvstore.connectors.vllm.saver import SaveQueue

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

logger = logging.getLogger("kvstore.connectors.vllm")


class WorkerSide:
    """Worker-role methods of ``KVStoreConnector`` (state is set up by its ``__init__``:
    ``_paged``, ``_load_link``, ``_saver``, ``_load_errors``, ``_staging``, ``namespace``)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        try:
            group = self._kv_cache_config.kv_cache_groups[0]
            paged = PagedBlocks(kv_caches, list(group.layer_names), int(self._kv_cache_config.num_blocks))
            if paged.block_bytes != self.namespace.block_bytes:
                raise ValueError(f"KV pages hold {paged.block_bytes} bytes per block, the spec says "
                                 f"{self.namespace.block_bytes}")
        except Exception as e:  # noqa: BLE001
            logger.error("kvstore connector disabled on this worker: %s", e)
            self.enabled = False
            return
        self._paged = paged
        self._load_link = self._daemon_handle(self.settings.timeout_s, "load")
        if self.settings.save:
            self._saver = SaveQueue(self._daemon_handle(self.settings.timeout_s, "save"),
                                    self.settings.max_pending_saves, self._add_stat)
        logger.info("kvstore connector: %d layers, %d bytes per block, namespace %s (%s)",
                    len(paged.layers), paged.block_bytes, self.namespace.id.hex(), self.namespace.layout.layout)

    def _staging_rows(self, n: int) -> torch.Tensor:
        """A reused CPU buffer of ``n`` blocks (grown on demand, never shrunk)."""
        need = n * self._paged.block_bytes
        if self._staging.numel() < need:
            self._staging = torch.empty(need, dtype=torch.uint8)
        return self._staging[:need].view(n, self._paged.block_bytes)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self._paged is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        block_ids = [b for t in meta.loads for b in t.block_ids]
        hashes = [h for t in meta.loads for h in t.hashes]
        t0 = time.perf_counter()
        try:
            staging = self._staging_rows(len(hashes))
            rows = staging.numpy()
            sizes = self._load_link.get_into(hashes, [rows[i] for i in range(len(hashes))])
            good = [i for i, n in enumerate(sizes) if n == self._paged.block_bytes]
            if good:
                if len(good) == len(hashes):
                    self._paged.scatter(block_ids, staging)
                else:
                    self._paged.scatter([block_ids[i] for i in good], staging[good])
            bad = {block_ids[i] for i, n in enumerate(sizes) if n != self._paged.block_bytes}
        except Exception as e:  # noqa: BLE001
            logger.warning("kvstore connector: load failed: %s", e)
            good, bad = [], set(block_ids)
        self._load_errors |= bad
        self._add_stat("loaded_blocks", len(good))
        self._add_stat("load_failed_blocks", len(bad))
        self._add_stat("load_seconds", time.perf_counter() - t0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are gathered across layers in wait_for_save

    def wait_for_save(self) -> None:
        if self._paged is None or self._saver is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata):
            return
        t0 = time.perf_counter()
        for t in meta.saves:
            try:
                if not self._saver.handle.available():
                    self._add_stat("save_skipped_blocks", len(t.hashes))
                    continue
                blocks = torch.empty((len(t.block_ids), self._paged.block_bytes), dtype=torch.uint8)
                self._paged.gather(t.block_ids, blocks)
                self._saver.submit(t.hashes, blocks, t.parent)
            except Exception as e:  # noqa: BLE001
                logger.warning("kvstore connector: save of %s failed: %s", t.req_id, e)
        if meta.saves:
            self._add_stat("save_gather_seconds", time.perf_counter() - t0)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def drain_saves(self, timeout_s: float = 10.0) -> None:
        """Block until queued saves reach the daemon (for tests and orderly shutdown)."""
        if self._saver is not None:
            self._saver.drain(timeout_s)
