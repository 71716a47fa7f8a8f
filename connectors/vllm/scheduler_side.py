"""The scheduler half of the connector: one lookup per request, then per-step load and save plans.

The scheduler never moves bytes. It learns once per request how many leading prompt blocks the
daemon holds (a lookup pins them under a lease until the worker loads them), offers those tokens to
vLLM — to be loaded before the step's forward pass (``sync``, ``layer``) or between steps while
other requests run (``async``) — and each step turns vLLM's allocations into ``BlockTransfer`` loads
and saves for the workers.

Saves cover every block that becomes full: prompt blocks as prefill computes them and, with
``save_decode``, blocks filled by generated tokens, hashed as the continuation of the prompt's chain
— so the next turn of a conversation (prompt + answer + new message) hits through the answer.
Workers copy saved blocks out in the background, so a finished request that had saves keeps its
blocks (``request_finished`` answers ``True``) until the workers report it through ``get_finished``.

With ``blocks_per_chunk`` N > 1 every kvstore block is a *chunk* of N consecutive vLLM blocks
(``chunk_tokens`` = N x block size): hashes chain chunk to chunk, lookups count whole chunks, only
full chunks are saved, and a load whose first chunk vLLM's own prefix cache has partly computed
fetches the chunk but places only the vLLM blocks still needed (the others are -1 in the plan).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from kvstore.client import NamespaceHandle
from kvstore.connectors.vllm.handoff import Expected, Handoff, HandoffWaiter, Wait
from kvstore.connectors.vllm.identity import block_hashes, prompt_block_hashes
from kvstore.connectors.vllm.metadata import BlockTransfer, KVStoreConnectorMetadata
from kvstore.connectors.vllm.ranks import hits_on_every_rank
from kvstore.connectors.vllm.roles import Role
from kvstore.connectors.vllm.settings import ConnectorSettings
from kvstore.keys import ChainHasher, Namespace

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.connectors.vllm")


@dataclasses.dataclass
class RequestState:
    """Scheduler-side bookkeeping for one live request."""

    request: "Request"
    hashes: list[bytes]             # chain hashes of its full chunks known so far (prompt, then generated)
    num_hit: int                    # leading chunks the daemon holds (one lookup per request)
    cacheable: bool = True          # False: the prompt cannot be keyed, nothing of it is saved
    match_start: int = 0            # num_computed_tokens when the hit was offered
    block_ids: list[int] = dataclasses.field(default_factory=list)   # vLLM's, N per chunk
    num_stored: int = 0             # leading chunks known to be in the daemon or queued for saving
    num_held: int = 0               # leading chunks the daemon held on arrival (not saved by this request)
    saved_any: bool = False         # a save went to the workers: its blocks are freed after they report


class SchedulerSide:
    """The scheduler role of ``KVStoreConnector``. It owns the live requests' state, the loads
    planned for the next step, and its daemon handles: a lookup handle on each rank's namespace
    (``rank_namespaces``; the scheduler's own first) and, where it loads, the hand-off waiter.
    ``namespace`` or ``hasher`` None (none could be named, or hashing failed its self-check):
    disabled, it offers and saves nothing. A chunk of N = 1 is one vLLM block."""

    def __init__(self, settings: ConnectorSettings, kv_role: Role, namespace: Namespace | None,
                 hasher: ChainHasher | None, block_size: int, rank_namespaces: list[Namespace],
                 connect: Callable[[Namespace, float, str], NamespaceHandle],
                 count: Callable[..., None]) -> None:
        self.settings = settings
        self.kv_role = kv_role
        self.namespace = namespace
        self.hasher = hasher
        self.enabled = namespace is not None and hasher is not None
        self.block_size = block_size                      # vLLM's
        self.chunk_blocks = settings.blocks_per_chunk     # vLLM blocks per kvstore block
        self.chunk_tokens = self.chunk_blocks * block_size
        self._add_stat = count
        self._requests: dict[str, RequestState] = {}
        self._pending_loads: dict[str, BlockTransfer] = {}
        self._lookup_links: list[NamespaceHandle] = []
        self._handoff_waiter: HandoffWaiter | None = None   # consumers: waits for producers' blocks
        self._handoff_waits: dict[str, Wait] = {}
        self._handoff_expected: dict[str, Expected] = {}
        self._handoffs_admitted = 0                   # requests let in this step after a hand-off wait
        self._inflight_waits: dict[str, Wait] = {}    # requests waiting for blocks another one computes
        self._inflight_settled: set[str] = set()      # requests asked once whether to wait so
        if self.enabled:
            # a producer's lookup gets a save's time: its breaker opening is what tells it that its
            # saves fail (``_offered_handoff``), so it must not open on a call a save would outlast
            timeout_s = settings.lookup_timeout_s if kv_role.loads else settings.timeout_s
            self._lookup_links = [connect(ns, timeout_s, "lookup") for ns in rank_namespaces]
            if kv_role.loads and rank_namespaces:
                self._handoff_waiter = HandoffWaiter(
                    [connect(ns, settings.lookup_timeout_s, "hand-off") for ns in rank_namespaces],
                    settings.pd_poll_s)

    @property
    def _lookup_link(self) -> NamespaceHandle | None:
        """The handle on its own (rank 0) namespace (tests inject faults through it)."""
        return self._lookup_links[0] if self._lookup_links else None

    def shutdown(self) -> None:
        if self._handoff_waiter is not None:
            self._handoff_waiter.close()
        for handle in self._lookup_links:
            handle.close()

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            if self._awaiting_handoff(request) or self._awaiting_inflight(request):
                return None, False     # vLLM asks again next pass; the request stays queued
            n = self._matched_tokens(request, num_computed_tokens)
        except Exception as e:  # noqa: BLE001
            logger.warning("kvstore connector: lookup for %s failed: %s", request.request_id, e)
            return 0, False
        return n, n > 0 and self.settings.load_mode == "async"

    # -- prefixes another live request computes ----------------------------------------------------

    def _awaiting_inflight(self, request: "Request") -> bool:
        """True while the request waits for leading prompt blocks that another live request of this
        engine is computing and will save (vLLM's own prefix cache off, it would compute them a
        second time; at a busy engine's request rates, the requests sharing a prefix arrive while
        the first of them is still in prefill). Decided on the request's first pass: a request
        that shares leading blocks with a scheduled one is looked up here (the others when vLLM
        asks for their matched tokens), and waits only for blocks the daemon does not hold yet.
        The hand-off waiter polls the daemon for them, so each pass here is a dictionary read;
        the wait ends when they are all there (the request is looked up again and loads them),
        after ``inflight_wait_s``, or when the daemon does not answer. A request waits at most
        once."""
        rid = request.request_id
        wait = self._inflight_waits.get(rid)
        if wait is None:
            if rid in self._inflight_settled or self._handoff_waiter is None or not self.kv_role.saves_prompt \
                    or self.settings.inflight_wait_s <= 0 or not self.enabled:
                return False
            self._inflight_settled.add(rid)
            state = self._requests.get(rid)   # (made on arrival by cache-aware admission)
            try:
                hashes = state.hashes if state is not None else prompt_block_hashes(self.hasher, request,
                                                                                    self.chunk_tokens)
            except Exception:  # noqa: BLE001 - a prompt kvstore cannot key: ``_new_state`` says so
                return False
            loadable = hashes[:(request.num_tokens - 1) // self.chunk_tokens]
            shared = self._computed_elsewhere(rid, loadable)
            if not shared or shared <= self._state(request).num_hit:   # (its one lookup, made now if not yet)
                return False
            self._inflight_waits[rid] = self._handoff_waiter.watch(rid, loadable[:shared],
                                                                   self.settings.inflight_wait_s)
            self._add_stat("inflight_waits")
            return True
        if wait.outcome is None:
            return True
        del self._inflight_waits[rid]
        self._add_stat("inflight_wait_seconds", wait.seconds)
        self._add_stat(f"inflight_{wait.outcome}")
        state = self._requests.get(rid)
        if state is not None:      # looked up before the blocks were there: again
            state.num_hit = self._lookup(state.hashes)
        return False

    def _computed_elsewhere(self, rid: str, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` another live request shares (chain hashes: a shared hash
        is a shared prefix) that is scheduled (has blocks: it computes them, or has loaded them,
        and saves what it computes; a request still waiting counts for nothing, so two never
        wait for each other)."""
        shared = 0
        for other, state in self._requests.items():
            if other == rid or not state.cacheable or not state.block_ids:
                continue
            i, n = 0, min(len(hashes), len(state.hashes))
            while i < n and state.hashes[i] == hashes[i]:
                i += 1
            shared = max(shared, i)
        return shared

    # -- prefill/decode hand-off (``handoff``) ------------------------------------------------------

    def _awaiting_handoff(self, request: "Request") -> bool:
        """True while a consumer's request waits for the blocks its producer named; the waiter
        polls the daemon, so each pass here is a dictionary read. False once they arrived, the
        wait timed out or the daemon did not answer (the lookup that follows then finds what
        there is), and for requests without a hand-off."""
        rid = request.request_id
        if self._handoff_waiter is None or rid in self._requests:
            return False
        wait = self._handoff_waits.get(rid)
        if wait is None:
            handoff = self._handoff_of(request)
            if handoff is None:
                return False
            hashes, unsaved, node = handoff
            if not hashes:      # the producer saved none of it: nothing to wait for
                self._handoff_expected[rid] = Expected(0, unsaved)
                return False
            self._handoff_waits[rid] = self._handoff_waiter.watch(rid, hashes, self.settings.pd_wait_s, node)
            self._handoff_expected[rid] = Expected(len(hashes), unsaved)
            self._add_stat("pd_waits")
            return True
        if wait.outcome is None:
            return True
        limit = self.settings.pd_admit_per_step
        if limit and self._handoffs_admitted >= limit:
            self._add_stat("pd_admit_deferrals")
            return True     # its load and prompt tail go into a later step (``build_connector_meta``)
        self._handoffs_admitted += 1
        del self._handoff_waits[rid]
        expected = self._handoff_expected[rid]
        expected.outcome, expected.polls = wait.outcome, wait.describe()
        self._add_stat("pd_wait_seconds", wait.seconds)
        return False

    def _handoff_of(self, request: "Request") -> tuple[list[bytes], int, str] | None:
        """The hashes of the blocks the request's hand-off params name, how many blocks after
        them its producer did not save, and the producer's fleet node ("" when not named), when
        the params speak of this very prompt in this namespace; None for requests without params,
        and (counted, logged) for params that do not."""
        try:
            handoff = Handoff.from_params(request.kv_transfer_params)
            if handoff is None or handoff.blocks + handoff.unsaved == 0:
                return None
            hashes = prompt_block_hashes(self.hasher, request, self.chunk_tokens)
            why = handoff.mismatch(self.namespace.id, self.chunk_tokens, hashes)
        except Exception as e:  # noqa: BLE001 - malformed params, or a prompt kvstore cannot key
            why = str(e)
        if why is not None:
            logger.warning("kvstore connector: hand-off params of %s refused: %s", request.request_id, why)
            self._add_stat("pd_params_refused")
            return None
        return hashes[:handoff.blocks], handoff.unsaved, handoff.node or ""

    def _settle_handoff(self, request: "Request", num_hit: int) -> None:
        """Count how a hand-off ended once the request's lookup has found ``num_hit`` blocks: the
        named blocks all there (loaded), and any block it spoke of that is not (recomputed)."""
        told = self._handoff_expected.pop(request.request_id, None)
        if told is None:
            return
        expected, unsaved = told.named, told.unsaved
        if not expected and not unsaved:
            return
        if expected and num_hit >= expected:
            self._add_stat("pd_loaded_requests")
            self._add_stat("pd_loaded_blocks", expected)
        missing = expected + unsaved - min(num_hit, expected + unsaved)
        if not missing:
            return
        reason = ("evicted" if told.outcome == "arrived" else told.outcome) if num_hit < expected else "unsaved"
        self._add_stat("pd_recomputes")
        self._add_stat(f"pd_recomputes_{reason}")
        self._add_stat("pd_recomputed_blocks", missing)
        logger.warning("kvstore connector: %s: %d of the %d blocks its prefill computed are in the daemon (%s); "
                       "recomputing the rest", request.request_id, num_hit, expected + unsaved,
                       {"timeout": f"not all there after pd_wait_s={self.settings.pd_wait_s}s: {told.polls}",
                        "unavailable": "the daemon did not answer",
                        "evicted": "evicted after they arrived",
                        "unsaved": f"the prefill did not save {unsaved} of them"}[reason])

    def _hands_off(self, request: "Request") -> bool:
        """Whether the request's finished prefill names its saved blocks to a decode engine: every
        producer's request, and a ``kv_both`` request that asks for it (``do_remote_decode``)."""
        if self.kv_role.is_producer:
            return True
        params = request.kv_transfer_params
        return isinstance(params, dict) and bool(params.get("do_remote_decode"))

    def _offered_handoff(self, request: "Request", state: RequestState | None) -> dict[str, Any] | None:
        """A producer's finished request: ``kv_transfer_params`` naming the prompt blocks its
        daemon holds or gets from its saves (asked for by ``kv_producer``, or by a ``kv_both``
        request with ``do_remote_decode``). Blocks its daemon held on arrival were not saved by it
        and may have been evicted since: one leased lookup re-checks them now and pins what it
        finds (``_pinned_for_decode``). When its daemon failed to answer a call lately (the
        breaker is open: saves are failing too) it names none of them and marks them unsaved, so
        a consumer recomputes at once instead of waiting for blocks that are not coming."""
        params = request.kv_transfer_params or {}
        if state is None or not state.cacheable or not self.kv_role.saves_prompt:
            return None
        if not self._hands_off(request):
            return None
        n = min(state.num_stored, len(request.prompt_token_ids or ()) // self.chunk_tokens, len(state.hashes))
        if n == 0:
            return None
        unsaved = 0
        if state.num_held and all(link.available() for link in self._lookup_links):
            n, unsaved = self._pinned_for_decode(request, state, n)
        if not all(link.available() for link in self._lookup_links):
            n, unsaved = 0, n + unsaved
            logger.warning("kvstore connector: %s: the daemon does not answer; naming none of the %d prompt "
                           "blocks to decode", request.request_id, unsaved)
        if unsaved:
            self._add_stat("pd_unsaved_blocks", unsaved)
        self._add_stat("pd_offered_blocks", n)
        return Handoff(self.namespace.id, n, self.chunk_tokens, state.hashes[n + unsaved - 1], self.settings.url,
                       unsaved, self._fleet_node()).to_params()

    def _fleet_node(self) -> str | None:
        """The fleet node id its daemon goes by (the handshake's; None outside a fleet), named in
        the params so the consumer's daemon can fetch the blocks from it directly."""
        link = self._lookup_link
        if link is None or not link.available():
            return None
        try:
            return link.client.fleet_node or None
        except Exception:  # noqa: BLE001 - not negotiated (the daemon is down): named by the next one
            return None

    def _pinned_for_decode(self, request: "Request", state: RequestState, n: int) -> tuple[int, int]:
        """The ``n`` leading blocks about to be named, looked up again with a lease on every rank's
        namespace: the daemon pins the leading ones it holds for its ``lease_seconds`` from now,
        so blocks held on arrival cannot be evicted between the hand-off and the consumer's wait
        (whose polls pin them in turn, ``HandoffWaiter``). When fewer than those held on arrival
        are left, a consumer could load no block past the first gone one: ``(found, n - found)``
        names what is left and marks the rest unsaved, so it recomputes them without waiting.
        Blocks this request saves and that have not landed yet are not counted as gone."""
        held = min(state.num_held, n)
        found = self._timed_lookup(state.hashes[:n], lease=True)
        if found >= held or not all(link.available() for link in self._lookup_links):
            return n, 0     # all still there (or no answer: the caller names none)
        self._add_stat("pd_evicted_blocks", held - found)
        logger.warning("kvstore connector: %s: %d of the %d prompt blocks its daemon held on arrival were "
                       "evicted before the hand-off; naming the %d before them to decode", request.request_id,
                       held - found, held, found)
        return found, n - found

    def cached_prompt_tokens(self, request: "Request") -> int:
        """Leading prompt tokens the daemon holds (cache-aware admission asks on arrival; the
        lookup, and its pins, are the one ``get_num_new_matched_tokens`` then reuses). 0 when
        the lookup fails: an unknown request is a cold one."""
        if not self.enabled or not self.kv_role.loads:
            return 0
        if self._handoff_waiter is not None and request.request_id not in self._requests:
            try:
                if Handoff.from_params(request.kv_transfer_params) is not None:
                    return 0   # its blocks are on their way: a lookup now would race them
            except ValueError:
                pass           # refused later, when vLLM asks for its matched tokens
        try:
            state = self._state(request)
        except Exception as e:  # noqa: BLE001
            logger.warning("kvstore connector: lookup for %s failed: %s", request.request_id, e)
            return 0
        return min(state.num_hit * self.chunk_tokens, len(request.prompt_token_ids or ()))

    def _matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        if not self.enabled or not self.kv_role.loads and not self.kv_role.saves:
            return 0
        state = self._state(request)
        state.match_start = num_computed_tokens
        # At least one token must be computed by vLLM to produce logits.
        loadable_end = min(state.num_hit * self.chunk_tokens, request.num_tokens - 1)
        return max(0, loadable_end - num_computed_tokens)

    def _state(self, request: "Request") -> RequestState:
        """The request's state, made (with its one lookup) the first time it is asked for."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = self._new_state(request)
        return state

    def _new_state(self, request: "Request") -> RequestState:
        cacheable = bool(request.prompt_token_ids)
        try:
            hashes = prompt_block_hashes(self.hasher, request, self.chunk_tokens)
        except Exception as e:  # noqa: BLE001 - an extra key kvstore cannot encode: no caching
            logger.info("kvstore connector: request %s not cacheable (%s)", request.request_id, e)
            hashes, cacheable = [], False
        num_hit = held = 0
        if hashes and self.kv_role.loads:
            num_hit = held = self._lookup(hashes)
        elif hashes and self.kv_role.saves_prompt:
            held = self._held(hashes)   # a producer: not loaded, not saved again, named to decode
        self._settle_handoff(request, num_hit)
        # a consumer saves no prompt block: blocks before the first one generated tokens fill
        # count as stored
        prompt_blocks = len(request.prompt_token_ids or ()) // self.chunk_tokens
        stored = held if self.kv_role.saves_prompt else max(held, prompt_blocks)
        return RequestState(request, hashes, num_hit, cacheable=cacheable, num_stored=stored, num_held=held)

    def _lookup(self, hashes: list[bytes]) -> int:
        """Leading chunks that every rank's namespace holds (each lookup pins its blocks)."""
        num_hit = self._timed_lookup(hashes, lease=True)
        self._add_stat("lookup_hit_blocks", num_hit)
        return num_hit

    def _held(self, hashes: list[bytes]) -> int:
        """A producer's lookup: leading chunks every rank's namespace already holds, without a
        lease (they are never loaded here; ``_pinned_for_decode`` pins those it names to decode at
        the hand-off). Its saves start after them. A lookup that fails
        opens the handle's breaker, which ``_offered_handoff`` reads."""
        held = self._timed_lookup(hashes, lease=False)
        self._add_stat("pd_held_blocks", held)
        return held

    def _timed_lookup(self, hashes: list[bytes], lease: bool) -> int:
        """Leading chunks every rank's namespace holds, counted in ``lookups`` and ``lookup_seconds``.
        A role that never loads asks for its daemon's own blocks only: a fleet daemon would
        otherwise copy blocks from its peers that this engine never reads, while its scheduler
        waits."""
        t0 = time.perf_counter()
        found = hits_on_every_rank(self._lookup_links, hashes, lease=lease, local_only=not self.kv_role.loads)
        self._add_stat("lookups")
        self._add_stat("lookup_seconds", time.perf_counter() - t0)
        return found

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
        n = self.chunk_blocks
        first = state.match_start // self.chunk_tokens
        end = -(-(state.match_start + num_external_tokens) // self.chunk_tokens)
        end = min(end, len(state.hashes), -(-len(state.block_ids) // n))
        if end > first:
            # vLLM blocks its prefix cache computed (before match_start) stay as they are
            computed = state.match_start // self.block_size
            ids = [b if j >= computed else -1 for j, b in enumerate(state.block_ids[:end * n])]
            ids += [-1] * (end * n - len(ids))
            self._pending_loads[request.request_id] = BlockTransfer(
                request.request_id, ids[first * n:], state.hashes[first:end],
                asynchronous=self.settings.load_mode == "async")
            self._add_stat("load_planned_blocks", end - first)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVStoreConnectorMetadata:
        self._handoffs_admitted = 0     # the step is scheduled: the next one admits afresh
        meta = KVStoreConnectorMetadata(loads=list(self._pending_loads.values()), load_mode=self.settings.load_mode,
                                        preempted=bool(getattr(scheduler_output, "preempted_req_ids", None)))
        self._pending_loads.clear()
        if not self.enabled or not self.kv_role.saves:
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
        """Save the chunks that are full once this step's forward has run."""
        if not state.cacheable:
            return
        request, n = state.request, self.chunk_blocks
        end = min(computed, request.num_tokens) // self.chunk_tokens
        if not self.kv_role.saves_decode:
            end = min(end, len(request.prompt_token_ids) // self.chunk_tokens)
        end = min(end, len(state.block_ids) // n)
        start = state.num_stored
        if end <= start:
            return
        if end > len(state.hashes):  # blocks filled by generated tokens: continue the chain
            known = len(state.hashes)
            state.hashes += block_hashes(self.hasher, request, self.chunk_tokens, known, end,
                                         state.hashes[-1] if known else None)
        meta.saves.append(BlockTransfer(req_id, state.block_ids[start * n:end * n], state.hashes[start:end],
                                        parent=state.hashes[start - 1] if start else None,
                                        handoff=self._hands_off(request)))
        state.num_stored = end
        state.saved_any = True

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Blocks that failed to load are recomputed by vLLM: never offer them again (a request
        whose async load failed asks again), and save them again once they are computed."""
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad:
            return
        n = self.chunk_blocks
        for state in self._requests.values():
            for i, block_id in enumerate(state.block_ids[:max(state.num_stored, state.num_hit) * n]):
                if block_id in bad:   # its whole chunk is lost
                    state.num_hit = min(state.num_hit, i // n)
                    state.num_stored = min(state.num_stored, i // n)
                    break

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Workers copy saved blocks out in the background; they report the request through
        # get_finished once nothing reads its blocks any more.
        state = self._requests.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        waits = [w.pop(request.request_id, None) for w in (self._handoff_waits, self._inflight_waits)]
        if any(w is not None for w in waits):   # aborted while waiting
            self._handoff_waiter.cancel(request.request_id)
        self._inflight_settled.discard(request.request_id)
        self._handoff_expected.pop(request.request_id, None)
        return state is not None and state.saved_any, self._offered_handoff(request, state)
