"""The scheduler half of the connector: one lookup per request, then per-step load and save plans.

The scheduler never moves bytes. It learns once per request how many leading prompt blocks the
daemon holds (a lookup pins them under a lease until the worker loads them), offers those tokens to
vLLM, and each step turns vLLM's allocations into ``BlockTransfer`` loads and saves for the workers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from kvstore.connectors.vllm.identity import prompt_block_hashes
from kvstore.connectors.vllm.metadata import BlockTransfer, KVStoreConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.connectors.vllm")


@dataclasses.dataclass
class RequestState:
    """Scheduler-side bookkeeping for one live request."""

    hashes: list[bytes]
    num_hit: int                    # leading blocks the daemon holds (one lookup per request)
    match_start: int = 0            # num_computed_tokens when the hit was offered
    block_ids: list[int] = dataclasses.field(default_factory=list)
    num_stored: int = 0             # leading blocks known to be in the daemon or queued for saving


class SchedulerSide:
    """Scheduler-role methods of ``KVStoreConnector`` (state is set up by its ``__init__``:
    ``_requests``, ``_pending_loads``, ``_lookup_link``, ``hasher``, ``block_size``, ``settings``)."""

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            return self._matched_tokens(request, num_computed_tokens), False
        except Exception as e:  # noqa: BLE001
            logger.warning("kvstore connector: lookup for %s failed: %s", request.request_id, e)
            return 0, False

    def _matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        if not self.enabled or not self.settings.load and not self.settings.save:
            return 0
        state = self._requests.get(request.request_id)
        if state is None:
            try:
                hashes = prompt_block_hashes(self.hasher, request, self.block_size)
            except Exception as e:  # noqa: BLE001 - an extra key kvstore cannot encode: no caching
                logger.info("kvstore connector: request %s not cacheable (%s)", request.request_id, e)
                hashes = []
            num_hit = 0
            if hashes and self.settings.load:
                t0 = time.perf_counter()
                num_hit = self._lookup_link.lookup(hashes).num_hit
                self._add_stat("lookups")
                self._add_stat("lookup_hit_blocks", num_hit)
                self._add_stat("lookup_seconds", time.perf_counter() - t0)
            state = self._requests[request.request_id] = RequestState(hashes, num_hit, num_stored=num_hit)
        state.match_start = num_computed_tokens
        # At least one token must be computed by vLLM to produce logits.
        loadable_end = min(state.num_hit * self.block_size, request.num_tokens - 1)
        return max(0, loadable_end - num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        try:
            state.block_ids = list(blocks.get_block_ids()[0])
        except Exception:  # noqa: BLE001 - no blocks yet / unexpected grouping
            return
        if num_external_tokens <= 0:
            return
        first = state.match_start // self.block_size
        end = -(-(state.match_start + num_external_tokens) // self.block_size)
        end = min(end, len(state.hashes), len(state.block_ids))
        if end > first:
            self._pending_loads[request.request_id] = BlockTransfer(
                request.request_id, state.block_ids[first:end], state.hashes[first:end])
            self._add_stat("load_planned_blocks", end - first)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        if not self.enabled or not self.settings.save:
            return meta
        try:
            scheduled = scheduler_output.num_scheduled_tokens
            for new in scheduler_output.scheduled_new_reqs:
                state = self._requests.get(new.req_id)
                if state is not None:
                    state.block_ids = list(new.block_ids[0])
                    self._plan_save(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                state = self._requests.get(req_id)
                if state is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if req_id in cached.resumed_req_ids and new_ids is not None:
                    state.block_ids = list(new_ids[0])
                elif new_ids is not None:
                    state.block_ids.extend(new_ids[0])
                self._plan_save(meta, req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        except Exception as e:  # noqa: BLE001 - never break scheduling over a save plan
            logger.warning("kvstore connector: save planning failed: %s", e)
        return meta

    def _plan_save(self, meta: KVStoreConnectorMetadata, req_id: str, state: RequestState, computed: int) -> None:
        """Save the prompt blocks that are full once this step's forward has run."""
        end = min(computed // self.block_size, len(state.hashes), len(state.block_ids))
        start = state.num_stored
        if end <= start:
            return
        meta.saves.append(BlockTransfer(req_id, state.block_ids[start:end], state.hashes[start:end],
                                        parent=state.hashes[start - 1] if start else None))
        state.num_stored = end

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy blocks out during the step that computed them, so blocks are free to go now.
        self._requests.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        return False, None
