"""The worker half of the connector: bring planned blocks in, hand computed blocks to the saver,
and tell vLLM which transfers finished.

Loads, by the metadata's ``load_mode``:

* ``sync``: ``start_load_kv`` fetches the step's blocks and scatters them into every layer before
  the forward pass.
* ``layer``: ``start_load_kv`` starts the fetch on the loader thread and returns;
  ``wait_for_layer_load(layer)`` (called by each attention layer before it runs) waits for the
  fetch and places that layer's slice of every block, so the fetch overlaps the forward pass up to
  the first attention layer and placing overlaps the layers before each one.
* ``async``: each request's blocks are fetched and placed on the loader thread while vLLM runs
  other requests; ``get_finished`` reports the request once they are in place.

With ``blocks_per_chunk`` N > 1 a stored block is a chunk of N vLLM blocks: loads unpack it into
the vLLM blocks the plan names, saves gather N blocks and pack them as one (``chunks``).

A block that did not arrive whole is reported through ``get_block_ids_with_load_errors`` (for an
async load, in the same step that reports the request finished), and vLLM recomputes it
(``kv_load_failure_policy="recompute"``); nothing raised here reaches vLLM.

Saves, by ``save_mode``: ``step`` (default): ``wait_for_save`` queues the step's new full blocks
with the saver, which copies them out in the background; ``layer``: ``save_kv_layer`` copies each
layer's pages of them out as the forward pass computes it (``saver.LayerSaves``) and
``wait_for_save`` hands the copied blocks to the saver's send stage. A finished request that had
saves is reported as finished *sending* once its blocks are copied out (the scheduler held them
through ``request_finished``); a copy the gather thread has not started by then is made on the
engine's thread (``SaveQueue.finish``), so the report never waits on that thread getting the GIL.
A request handed off to a decode engine (every producer's, and a ``kv_both`` request with
``do_remote_decode``: the scheduler marks its saves ``handoff``) also has its worker wait there (at
most ``saver.SEND_WAIT_S``) for its put, so the send thread gets the GIL while a decode engine waits
for those blocks.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from kvstore.client import NamespaceHandle
from kvstore.connectors.vllm.chunks import ChunkPacking
from kvstore.connectors.vllm.identity import page_shape_matches
from kvstore.connectors.vllm.loader import BackgroundLoader, LoadJob
from kvstore.connectors.vllm.metadata import BlockTransfer, KVStoreConnectorMetadata
from kvstore.connectors.vllm.paged_blocks import PagedBlocks
from kvstore.connectors.vllm.ranks import is_writer
from kvstore.connectors.vllm.roles import Role
from kvstore.connectors.vllm.saver import SEND_WAIT_S, LayerSaves, SaveQueue
from kvstore.connectors.vllm.settings import ConnectorSettings
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvstore.connectors.vllm")


class WorkerSide:
    """The worker role of ``KVStoreConnector``. It owns this worker's view of the paged KV cache,
    its load handle, the background loader and saver, and what it owes vLLM: blocks that failed
    to load, async loads that failed, requests whose saved blocks are still being copied out.
    ``namespace`` None (none could be named, or hashing failed its self-check): disabled, every
    planned load is recomputed and nothing is saved. The step's metadata comes with each call
    that uses it (None: none bound, or not kvstore's)."""

    def __init__(self, settings: ConnectorSettings, kv_role: Role, namespace: Namespace | None, tp_rank: int,
                 kv_cache_config: "KVCacheConfig", connect: Callable[[Namespace, float, str], NamespaceHandle],
                 count: Callable[..., None]) -> None:
        self.settings = settings
        self.kv_role = kv_role
        self.namespace = namespace
        self.enabled = namespace is not None   # False also once the KV pages turn out not to fit it
        self.tp_rank = tp_rank
        self.chunk_blocks = settings.blocks_per_chunk     # vLLM blocks per kvstore block
        self._kv_cache_config = kv_cache_config
        self._connect = connect
        self._add_stat = count
        self._paged: PagedBlocks | None = None
        self._packing: ChunkPacking | None = None
        self._load_link: NamespaceHandle | None = None
        self._loader: BackgroundLoader | None = None
        self._saver: SaveQueue | None = None
        self._load_errors: set[int] = set()
        self._failed_async: list[BlockTransfer] = []
        self._layer_job: LoadJob | None = None
        self._layer_hooks_missing = False      # layer mode fell back to loading before the forward pass
        self._layer_saves: LayerSaves | None = None   # save_mode layer: this step's saves, copied layer by layer
        self._layer_save_hooks_missing = False  # ... fell back to copying after the step
        self._saving_reqs: set[str] = set()    # requests the scheduler holds blocks of for saves
        self._finishing: set[str] = set()      # ... that finished; reported once copied out
        self._handoffs: set[str] = set()       # ... whose saves a decode engine waits for (``handoff``)
        self._staging = torch.empty(0, dtype=torch.uint8)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        try:
            group = self._kv_cache_config.kv_cache_groups[0]
            paged = PagedBlocks(kv_caches, list(group.layer_names), int(self._kv_cache_config.num_blocks))
            n = self.chunk_blocks
            if n * paged.block_bytes != self.namespace.block_bytes:
                raise ValueError(f"KV pages hold {paged.block_bytes} bytes per block, the spec says "
                                 f"{self.namespace.block_bytes // n}")
            if not page_shape_matches(self.namespace.layout, paged.page_shapes, n):
                raise ValueError(f"KV pages are shaped {paged.page_shapes[0]}, not what layout "
                                 f"{self.namespace.layout.layout!r} describes (unknown attention backend)")
            packing = ChunkPacking(self.namespace.layout, paged.page_bytes, paged.page_shapes, n) if n > 1 else None
        except Exception as e:  # noqa: BLE001
            logger.error("kvstore connector disabled on this worker: %s", e)
            self.enabled = False
            return
        self._paged, self._packing = paged, packing
        self._load_link = self._connect(self.namespace, self.settings.timeout_s, "load")
        if self.settings.load_mode != "sync":
            self._loader = BackgroundLoader(self._load_link, self._add_stat)
        if self.kv_role.saves and is_writer(self.namespace, self.tp_rank):
            self._saver = SaveQueue(self._connect(self.namespace, self.settings.timeout_s, "save"), paged,
                                    self.settings.max_pending_saves, self._add_stat, packing)
        logger.info("kvstore connector: %d layers, %d bytes per block (%d vLLM blocks), namespace %s (%s), "
                    "loads %s", len(paged.layers), self.namespace.block_bytes, n, self.namespace.id.hex(),
                    self.namespace.layout.layout, self.settings.load_mode)

    def _staging_rows(self, n: int) -> torch.Tensor:
        """A reused CPU buffer of ``n`` blocks (grown on demand, never shrunk)."""
        need = n * self._paged.block_bytes
        if self._staging.numel() < need:
            self._staging = self._paged.host_buffer(n).view(-1)   # page-locked on CUDA
        return self._staging[:need].view(n, self._paged.block_bytes)

    # -- loads ------------------------------------------------------------------------------------

    def bind_connector_metadata(self, meta: KVStoreConnectorMetadata | None) -> None:
        """Async loads start as soon as the step's plan arrives: vLLM calls ``start_load_kv`` after
        the forward pass when a step has no in-step loads, which would idle the loader meanwhile."""
        if meta is None:
            return
        self._layer_saves = None
        if (meta.saves and self.settings.save_mode == "layer" and self._saver is not None
                and not self._layer_save_hooks_missing):
            try:
                self._layer_saves = LayerSaves(meta.saves, self._paged)
            except Exception as e:  # noqa: BLE001 - no buffer: this step copies out after the step
                logger.warning("kvstore connector: per-layer saves unavailable this step: %s", e)
        for t in meta.loads:
            if not t.asynchronous:
                continue
            if self._paged is not None and self._loader is not None:
                self._loader.submit(LoadJob([t], self._paged, asynchronous=True, packing=self._packing),
                                    place_all=True)
            else:  # disabled worker: reported finished with every block to recompute
                self._failed_async.append(t)

    def start_load_kv(self, meta: KVStoreConnectorMetadata | None) -> None:
        in_step = [t for t in meta.loads if not t.asynchronous] if meta is not None else []
        if not in_step:
            return
        if self._paged is None:  # disabled worker: whatever was planned is recomputed
            self._load_errors |= {b for t in in_step for b in t.block_ids if b >= 0}
            return
        job = LoadJob(in_step, self._paged, packing=self._packing)
        if meta.load_mode == "layer" and self._loader is not None and not self._layer_hooks_missing:
            job.by_layers = self._remote_loads()
            self._layer_job = job
            self._loader.submit(job, place_all=False)
            return
        t0 = time.perf_counter()
        job.fetch(self._load_link, self._staging_rows(len(job.hashes) * self.chunk_blocks))
        job.scatter()
        self._paged.wait_all_layers()   # CUDA: the forward pass runs after the pages landed
        self._paged.settle()            # and the reused staging buffer is free for the next step
        job.release()
        self._load_errors |= job.bad
        job.add_stats(self._add_stat)
        self._add_stat("load_seconds", time.perf_counter() - t0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._layer_job
        if job is None:
            return
        t0 = time.perf_counter()
        i = self._paged.layer_index.get(layer_name)
        if i is None:
            job.done.wait()
            job.scatter()
            self._paged.wait_all_layers()
        else:
            job.wait_fetched(i)
            job.scatter_layer(i)
            self._paged.wait_layer(i)
        self._add_stat("layer_wait_seconds", time.perf_counter() - t0)

    def _finish_layer_job(self) -> None:
        """End of the step: report the job's errors. A layer the forward pass never asked for ran
        without its pages (the engine does not call ``wait_for_layer_load``): every block of the
        job is then a load error, so vLLM recomputes, and later steps load before the forward pass."""
        job, self._layer_job = self._layer_job, None
        if job is None:
            return
        job.done.wait()
        if job.good and len(job.layers_placed) < len(self._paged.layers):
            logger.warning("kvstore connector: attention layers did not wait for their pages; "
                           "recomputing and loading before the forward pass from now on")
            self._layer_hooks_missing = True
            job.bad |= set(job.block_ids)
        job.release()
        self._load_errors |= job.bad

    def _remote_loads(self) -> bool:
        """Whether loads cross a network (side channel or gRPC), where fetching a layer group at a
        time lets layer 0 start early; over shared memory one copy of everything is quicker."""
        try:
            return self._load_link.client.active_transport != "shm"
        except Exception:  # noqa: BLE001 - the daemon is away: the fetch fails either way
            return False

    def save_kv_layer(self, layer_name: str) -> None:
        """``save_mode: layer``: copy this layer's pages of the step's saved blocks out now (on
        CUDA queued on the copy stream, overlapping the layers still to run). ``step``: nothing
        here; the saver copies whole blocks out after the step."""
        saves = self._layer_saves
        if saves is None:
            return
        i = self._paged.layer_index.get(layer_name)
        try:
            if i is not None:
                saves.copy_layer(i)
        except Exception as e:  # noqa: BLE001 - never into the forward pass: copied after the step instead
            logger.warning("kvstore connector: per-layer save of %s failed: %s", layer_name, e)
            self._layer_saves = None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # -- saves ------------------------------------------------------------------------------------

    def wait_for_save(self, meta: KVStoreConnectorMetadata | None) -> None:
        self._finish_layer_job()
        if meta is None or not meta.saves:
            return
        for t in meta.saves:
            # Recorded before anything can fail: the scheduler holds this request's blocks until
            # get_finished reports it, so it must be reported even if nothing is saved.
            self._saving_reqs.add(t.req_id)
            if t.handoff:
                self._handoffs.add(t.req_id)
        if self._saver is None:
            return
        saves, self._layer_saves = self._layer_saves, None
        if saves is not None and saves.complete:
            try:
                for t, rows in saves.batches():   # out of the paged cache already: nothing to hold
                    self._saver.send(t.req_id, t.hashes, rows, t.parent)
                self._add_stat("layer_saved_blocks", sum(len(t.hashes) for t in meta.saves))
            except Exception as e:  # noqa: BLE001 - best effort, like every save
                logger.warning("kvstore connector: sending per-layer saves failed: %s", e)
                self._add_stat("save_failed_blocks", sum(len(t.hashes) for t in meta.saves))
            return
        if saves is not None and saves.started:
            logger.warning("kvstore connector: some attention layers did not call save_kv_layer; "
                           "copying saved blocks out after the step from now on")
            self._layer_save_hooks_missing = True
        for t in meta.saves:
            try:
                self._saver.submit(t.req_id, t.block_ids, t.hashes, t.parent)
            except Exception as e:  # noqa: BLE001
                logger.warning("kvstore connector: save of %s failed: %s", t.req_id, e)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Preempted requests' blocks may go to other requests in this step: copy out what the
        saver still has to read before the forward pass overwrites them."""
        if self._saver is not None and getattr(kv_connector_metadata, "preempted", False):
            if not self._saver.wait_gathered():
                logger.warning("kvstore connector: saves still reading preempted blocks after 30 s")

    # -- completions ------------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving: set[str] = set()
        if self._loader is not None:
            for job in self._loader.take_finished():
                if job.asynchronous:
                    self._load_errors |= job.bad
                    recving.update(job.req_ids)
            if recving and self._paged is not None:
                self._paged.wait_all_layers()   # CUDA: later steps' compute runs after those pages landed
        for t in self._failed_async:
            self._load_errors |= {b for b in t.block_ids if b >= 0}
            recving.add(t.req_id)
        self._failed_async = []
        self._finishing |= finished_req_ids & self._saving_reqs
        if self._saver is not None:
            for r in self._finishing:
                # copied out here if the gather thread has not got to it: vLLM steps without
                # pause until the request is reported, and the gather thread may not get the GIL;
                # a request handed off to a decode engine (which waits for these blocks) also
                # has its put go out before the report
                self._saver.finish(r, sent_within_s=SEND_WAIT_S if r in self._handoffs else 0.0)
        sending = {r for r in self._finishing if self._saver is None or self._saver.ungathered(r) == 0}
        self._finishing -= sending
        self._saving_reqs -= sending
        self._handoffs -= sending
        return sending or None, recving or None

    def drain_saves(self, timeout_s: float = 10.0) -> None:
        """Block until queued saves reach the daemon (for tests and orderly shutdown)."""
        if self._saver is not None:
            self._saver.drain(timeout_s)

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.close()
            self._saver.handle.close()
        if self._loader is not None:
            self._loader.close()
        if self._load_link is not None:
            self._load_link.close()
