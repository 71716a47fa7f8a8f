"""vLLM v1 KV connector: vLLM's paged KV cache <-> a kvstore daemon.

Load it out of tree (vLLM 0.32; see docs/vllm.md for the supported range):

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"url": "127.0.0.1:7373"}}'

How a request flows:

* **Scheduler** (``get_num_new_matched_tokens``): hashes the prompt's full blocks with kvstore's own
  seeded chain (vLLM's ``request.block_hashes`` depend on vLLM's hash algorithm, pickle and
  ``PYTHONHASHSEED``, so they are not a stable cross-process key), asks the daemon once how many
  leading blocks it holds (the lookup pins them under a lease), and tells vLLM how many tokens it can
  load. ``build_connector_meta`` turns that into per-step *loads* (daemon -> allocated vLLM blocks)
  and *saves* (full prompt blocks computed this step that the daemon does not hold yet).
* **Worker**: ``start_load_kv`` fetches the planned blocks into a staging buffer and scatters them
  into every layer before the forward pass; ``wait_for_save`` gathers newly computed blocks out of
  the paged cache (a memcpy, so vLLM may reuse the blocks immediately) and a background thread sends
  them to the daemon. The engine never waits on the network for a save.

A block's bytes are the concatenation over layers (in the KV cache group's layer order) of that
layer's page for the block, copied verbatim: the CPU attention kernel stores K transposed inside a
page, so the layout is treated as opaque and named in the namespace (``vllm_cpu`` on CPU), together
with model, layers, KV heads, head dim, dtype, block size and TP/PP rank: differently shaped or
sharded workers never share blocks.

Failure model: the daemon being down, slow or missing a block is a *miss*. Lookups that fail count
as zero hits; a load that fails reports its vLLM block ids through
``get_block_ids_with_load_errors`` and the connector sets ``kv_load_failure_policy="recompute"``,
so vLLM recomputes those tokens; saves that fail are dropped. After a failure the connector stops
calling the daemon for ``retry_after_s`` so a dead daemon costs one timeout, not one per request.
Nothing raised by kvstore or the network reaches vLLM.

Extra config keys (``kv_connector_extra_config``): ``url`` (``host:port`` or ``grpc://host:port``;
default: ``KVSTORE_URL`` or the daemon's default address), ``token``, ``transport`` (auto | shm |
bulk | grpc), ``lookup_timeout_s`` (0.5), ``timeout_s`` (5.0), ``retry_after_s`` (5.0),
``cache_salt`` (namespace salt), ``model_id`` (namespace model name; default: the model path or
id), ``hash_seed`` (0), ``load`` / ``save`` (true), ``max_pending_saves`` (64 batches).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstore.keys import DTYPE_SIZES, ChainHasher, KVLayout, Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.connectors.vllm")


# ---------------------------------------------------------------------------------------------
# Settings and identity
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    url: str | None = None
    token: str | None = None
    transport: str = "auto"
    lookup_timeout_s: float = 0.5
    timeout_s: float = 5.0
    retry_after_s: float = 5.0
    cache_salt: str = ""
    model_id: str | None = None
    hash_seed: int = 0
    load: bool = True
    save: bool = True
    max_pending_saves: int = 64

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        out = {}
        for name, value in extra.items():
            kind = known[name].type
            try:
                if kind == "bool":
                    out[name] = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
                elif kind == "float":
                    out[name] = float(value)
                elif kind == "int":
                    out[name] = int(value)
                else:
                    out[name] = None if value is None else str(value)
            except (TypeError, ValueError):
                raise ValueError(f"kv_connector_extra_config.{name}: cannot use {value!r} as {kind}") from None
        return cls(**out)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_name(device_type: str) -> str:
    """Names the byte order of a block. CPU pages are the CPU attention kernel's packing
    (K transposed per head); other devices get their own name, so they never share with CPU."""
    return "vllm_cpu" if device_type == "cpu" else f"vllm_{device_type}"


def namespace_for(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", settings: ConnectorSettings,
                  tp_rank: int = 0, pp_rank: int = 0) -> Namespace | None:
    """The namespace a worker with these ranks stores into; None if this model is unsupported.

    Derived from the KV cache spec (not from tensors) so the scheduler, which has no tensors,
    computes the same id as the rank-0 worker.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        logger.warning("kvstore connector: %d KV cache groups (hybrid model); disabled", len(groups))
        return None
    spec = groups[0].kv_cache_spec
    needed = ("num_kv_heads", "head_size", "dtype", "block_size", "page_size_bytes")
    if not all(hasattr(spec, a) for a in needed):
        logger.warning("kvstore connector: KV cache spec %s is not attention; disabled", type(spec).__name__)
        return None
    dtype = _dtype_name(spec.dtype)
    if dtype not in DTYPE_SIZES:
        logger.warning("kvstore connector: KV dtype %s unsupported; disabled", dtype)
        return None
    pc = vllm_config.parallel_config
    model = settings.model_id or str(vllm_config.model_config.model)
    layout = KVLayout(model=model, num_layers=len(groups[0].layer_names), num_kv_heads=int(spec.num_kv_heads),
                      head_dim=int(spec.head_size), dtype=dtype, block_tokens=int(spec.block_size),
                      layout=layout_name(vllm_config.device_config.device_type),
                      tp_rank=tp_rank, tp_size=int(pc.tensor_parallel_size),
                      pp_rank=pp_rank, pp_size=int(pc.pipeline_parallel_size),
                      block_bytes=int(spec.page_size_bytes) * len(groups[0].layer_names))
    return Namespace(layout, cache_salt=settings.cache_salt)


def prompt_block_hashes(hasher: ChainHasher, request: "Request", block_tokens: int) -> list[bytes]:
    """kvstore chain hashes of the prompt's full blocks, with vLLM's per-block extra keys
    (LoRA name, multimodal identifiers, cache salt, prompt-embeds digests) mixed in exactly where
    vLLM mixes them into its own hashes. Empty when the prompt cannot be keyed."""
    tokens = request.prompt_token_ids
    if not tokens:
        return []
    n_blocks = len(tokens) // block_tokens
    extra = None
    if (getattr(request, "mm_features", None) or getattr(request, "lora_request", None)
            or getattr(request, "cache_salt", None) or getattr(request, "prompt_embeds", None) is not None):
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        extra, mm_idx = [], 0
        for i in range(n_blocks):
            keys, mm_idx = generate_block_hash_extra_keys(request, i * block_tokens, (i + 1) * block_tokens, mm_idx)
            extra.append(keys)
    return hasher.chain(tokens[:n_blocks * block_tokens], block_tokens, extra_keys=extra)


# ---------------------------------------------------------------------------------------------
# Scheduler -> worker metadata
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class BlockTransfer:
    """Blocks of one request to move: vLLM block ids and the kvstore hashes, index-aligned."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    parent: bytes | None = None   # hash of the block before hashes[0] (saves; eviction uses it)


@dataclasses.dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counters since the last report (vLLM logs ``reduce()`` as "KV Transfer metrics")."""

    def reset(self) -> None:
        self.data = {}

    def add(self, key: str, n: int | float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def aggregate(self, other: KVConnectorStats) -> "KVStoreConnectorStats":
        for k, v in (other.data or {}).items():
            self.add(k, v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# ---------------------------------------------------------------------------------------------
# Daemon access with a circuit breaker
# ---------------------------------------------------------------------------------------------

class DaemonLink:
    """One kvstore Client plus the namespace registration, failing closed.

    ``call(fn)`` runs ``fn(client, ns_id)``; any exception trips the breaker and returns None,
    and while tripped no call is attempted. Each thread that talks to the daemon owns one link.
    """

    def __init__(self, settings: ConnectorSettings, namespace: Namespace, timeout_s: float, what: str) -> None:
        self.settings = settings
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.what = what
        self._client = None
        self._ns_id: bytes | None = None
        self._down_until = 0.0
        self.failures = 0

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def call(self, fn):
        if not self.available():
            return None
        try:
            if self._client is None:
                from kvstore.client import Client

                self._client = Client(self.settings.url, token=self.settings.token, timeout_s=self.timeout_s,
                                      transport=self.settings.transport)
            if self._ns_id is None:
                self._ns_id = self._client.register_namespace(self.namespace)
            return fn(self._client, self._ns_id)
        except Exception as e:  # noqa: BLE001 - the boundary: nothing reaches vLLM
            self.failures += 1
            self._down_until = time.monotonic() + self.settings.retry_after_s
            self._ns_id = None  # a restarted daemon may not know the namespace
            logger.warning("kvstore %s failed (%s: %s); treating as a miss for %.1fs",
                           self.what, type(e).__name__, e, self.settings.retry_after_s)
            return None

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001
                pass
            self._client = None


# ---------------------------------------------------------------------------------------------
# Worker side: the paged KV cache as whole blocks
# ---------------------------------------------------------------------------------------------

class PagedBlocks:
    """Copies whole blocks between vLLM's per-layer paged KV tensors and a flat staging buffer.

    Each layer tensor has one dimension of size ``num_blocks``; a layer's page for block ``b`` is
    the slice at ``b`` on that dimension. A stored block is the pages of all layers back to back.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], layer_names: list[str], num_blocks: int) -> None:
        self.layers: list[torch.Tensor] = []
        self.block_dims: list[int] = []
        self.page_bytes: list[int] = []
        for name in layer_names:
            t = kv_caches[name]
            dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if not dims:
                raise ValueError(f"layer {name}: no dimension of size num_blocks={num_blocks} in {tuple(t.shape)}")
            d = dims[0]
            self.layers.append(t)
            self.block_dims.append(d)
            self.page_bytes.append(t.numel() // num_blocks * t.element_size())
        self.offsets = np.cumsum([0] + self.page_bytes).tolist()
        self.block_bytes = self.offsets[-1]
        self.device = self.layers[0].device
        self._fast = [d == 0 and t.is_contiguous() for t, d in zip(self.layers, self.block_dims)]

    def _as_pages(self, i: int) -> torch.Tensor:
        """Layer ``i`` as uint8 [num_blocks, page_bytes] (a view; fast path only)."""
        t = self.layers[i]
        return t.view(torch.uint8).view(t.shape[0], -1)

    def gather(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` into ``out`` (uint8 [n, block_bytes], on the CPU)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i, t in enumerate(self.layers):
            a, b = self.offsets[i], self.offsets[i + 1]
            if self._fast[i]:
                pages = self._as_pages(i).index_select(0, idx)
            else:
                d = self.block_dims[i]
                pages = t.index_select(d, idx).movedim(d, 0).contiguous().view(torch.uint8).view(len(block_ids), -1)
            out[:, a:b].copy_(pages)

    def scatter(self, block_ids: list[int], src: torch.Tensor) -> None:
        """Copy ``src`` (uint8 [n, block_bytes]) into blocks ``block_ids`` of every layer."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i, t in enumerate(self.layers):
            a, b = self.offsets[i], self.offsets[i + 1]
            pages = src[:, a:b].to(self.device)
            if self._fast[i]:
                self._as_pages(i).index_copy_(0, idx, pages)
            else:
                d = self.block_dims[i]
                shape = list(t.shape)
                shape[d] = 1
                moved = [shape[d]] + shape[:d] + shape[d + 1:]
                for j, blk in enumerate(block_ids):
                    piece = pages[j].contiguous().view(t.dtype).view(moved).movedim(0, d)
                    t.narrow(d, blk, 1).copy_(piece)


class SaveQueue:
    """Sends gathered blocks to the daemon on a background thread; drops work when full or down."""

    def __init__(self, link: DaemonLink, max_pending: int, stats_add) -> None:
        self.link = link
        self.stats_add = stats_add
        self._q: queue.Queue = queue.Queue(maxsize=max(1, max_pending))
        self._thread = threading.Thread(target=self._run, name="kvstore-save", daemon=True)
        self._thread.start()

    def submit(self, hashes: list[bytes], blocks: torch.Tensor, parent: bytes | None) -> None:
        if not self.link.available():
            self.stats_add("save_skipped_blocks", len(hashes))
            return
        try:
            self._q.put_nowait((hashes, blocks, parent))
        except queue.Full:
            self.stats_add("save_dropped_blocks", len(hashes))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            hashes, blocks, parent = item
            arrays = [blocks[i].numpy() for i in range(len(hashes))]
            result = self.link.call(lambda c, ns: c.put(ns, hashes, arrays, parent=parent))
            self.stats_add("saved_blocks" if result is not None else "save_failed_blocks", len(hashes))
            self._q.task_done()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until queued saves are sent (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.drain()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass


# ---------------------------------------------------------------------------------------------
# The connector
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _RequestState:
    """Scheduler-side bookkeeping for one live request."""

    hashes: list[bytes]
    num_hit: int                    # leading blocks the daemon holds (one lookup per request)
    match_start: int = 0            # num_computed_tokens when the hit was offered
    block_ids: list[int] = dataclasses.field(default_factory=list)
    num_stored: int = 0             # leading blocks known to be in the daemon or queued for saving


class KVStoreConnector(KVConnectorBase_V1):
    """kvstore as vLLM's external prefix cache (both roles; see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        # A failed load must mean "recompute", never "fail the request" (vLLM's default).
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            try:
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            except Exception:  # noqa: BLE001 - a frozen config: say so, keep going
                logger.warning("kvstore connector: set kv_load_failure_policy='recompute' in the "
                               "kv_transfer_config, or failed loads will fail requests")
        self.block_size = int(vllm_config.cache_config.block_size)
        self.hasher = ChainHasher("xxh3_128", seed=self.settings.hash_seed)
        self._stats = KVStoreConnectorStats()      # since vLLM last collected them
        self.totals: dict[str, int | float] = {}    # since start (tests, benchmarks, shutdown log)
        self._stats_lock = threading.Lock()
        tp_rank, pp_rank = (0, 0) if role == KVConnectorRole.SCHEDULER else _worker_ranks()
        self.namespace = namespace_for(vllm_config, kv_cache_config, self.settings, tp_rank, pp_rank)
        self.enabled = self.namespace is not None
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: dict[str, BlockTransfer] = {}
        self._lookup_link = (DaemonLink(self.settings, self.namespace, self.settings.lookup_timeout_s, "lookup")
                             if self.enabled and role == KVConnectorRole.SCHEDULER else None)
        # worker side
        self._paged: PagedBlocks | None = None
        self._load_link: DaemonLink | None = None
        self._saver: SaveQueue | None = None
        self._load_errors: set[int] = set()
        self._staging = torch.empty(0, dtype=torch.uint8)

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

    # =============================================================================================
    # Scheduler side
    # =============================================================================================

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
                found = self._lookup_link.call(lambda c, ns: c.lookup(ns, hashes))
                num_hit = found.num_hit if found is not None else 0
                self._add_stat("lookups")
                self._add_stat("lookup_hit_blocks", num_hit)
                self._add_stat("lookup_seconds", time.perf_counter() - t0)
            state = self._requests[request.request_id] = _RequestState(hashes, num_hit, num_stored=num_hit)
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

    def _plan_save(self, meta: KVStoreConnectorMetadata, req_id: str, state: _RequestState, computed: int) -> None:
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

    # =============================================================================================
    # Worker side
    # =============================================================================================

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
        self._load_link = DaemonLink(self.settings, self.namespace, self.settings.timeout_s, "load")
        if self.settings.save:
            self._saver = SaveQueue(DaemonLink(self.settings, self.namespace, self.settings.timeout_s, "save"),
                                    self.settings.max_pending_saves, self._add_stat)
        logger.info("kvstore connector: %d layers, %d bytes per block, namespace %s (%s)",
                    len(paged.layers), paged.block_bytes, self.namespace.id.hex(), self.namespace.layout.layout)

    def _staging_rows(self, n: int) -> torch.Tensor:
        """A reused pinned-size CPU buffer of ``n`` blocks (grown on demand, never shrunk)."""
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
            sizes = self._load_link.call(lambda c, ns: c.get_into(ns, hashes, [rows[i] for i in range(len(hashes))]))
            if sizes is None:
                sizes = [None] * len(hashes)
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
                if not self._saver.link.available():
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

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.close()
            self._saver.link.close()
        for link in (self._load_link, self._lookup_link):
            if link is not None:
                link.close()


def _worker_ranks() -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker; (0, 0) outside a distributed setup."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)
    except Exception:  # noqa: BLE001
        return 0, 0
