"""Cache-aware admission: requests whose prompt kvstore mostly holds are scheduled first.

Why: under first come, first served a hit waits behind every cold prompt that arrived before it,
though its own prefill is only the tail kvstore does not hold; on a busy engine its time to first
token is then most of a cold prompt's, whatever the connector loads. Ordering hits first costs
the cold prompts one short step each (a hit's prefill is small) and gives hits the TTFT the cache
promises.

How: vLLM's priority queue (``scheduling_policy="priority"``) orders waiting requests by
``(priority, arrival)``. ``add_request`` asks the kvstore connector, once per request, how many
leading prompt tokens the daemon holds (the lookup the connector makes anyway, done on arrival
instead of on first scheduling) and re-ranks the request as ``2 * priority`` when they cover at
least ``admission_hit_fraction`` of the prompt, ``2 * priority + 1`` otherwise: callers'
priorities still come first, and within one priority hits go ahead of misses, each first come,
first served. With FCFS, without a kvstore connector, or when the lookup fails, nothing changes.

Use it through ``scheduler_cls``: ``CacheAwareAsyncScheduler`` where vLLM schedules
asynchronously (its default), ``CacheAwareScheduler`` where it does not (docs/vllm.md,
"Cache-aware admission").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.connectors.vllm")


class CacheAwareAdmission:
    """Mixed into a vLLM scheduler: re-ranks each new request by what kvstore holds of it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ranks_requests = False
        if self.policy != SchedulingPolicy.PRIORITY:
            logger.warning("kvstore cache-aware admission needs scheduling_policy='priority'; "
                           "requests stay first come, first served")
        elif not hasattr(self.connector, "cached_prompt_tokens"):
            logger.warning("kvstore cache-aware admission: the KV connector is not kvstore's; "
                           "requests keep their priorities")
        else:
            self._ranks_requests = True
            self._hit_fraction = self.connector.settings.admission_hit_fraction
            logger.info("kvstore cache-aware admission: requests with >= %.0f%% of their prompt cached go first",
                        100 * self._hit_fraction)

    def add_request(self, request: "Request") -> None:
        if self._ranks_requests and request.request_id not in self.requests and request.prompt_token_ids:
            cached = self.connector.cached_prompt_tokens(request)   # 0 when the daemon is away
            hit = cached > 0 and cached >= self._hit_fraction * len(request.prompt_token_ids)
            request.priority = 2 * request.priority + (0 if hit else 1)
            self.connector.add_admission_stat(hit)
        super().add_request(request)


class CacheAwareScheduler(CacheAwareAdmission, Scheduler):
    """vLLM's scheduler with cache-aware admission (engines that do not schedule asynchronously)."""


class CacheAwareAsyncScheduler(CacheAwareAdmission, AsyncScheduler):
    """vLLM's asynchronous scheduler with cache-aware admission (vLLM's default scheduling)."""
