"""SGLang HiCache L3 storage on a kvstore daemon.

Loaded by SGLang's dynamic backend factory::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name":"kvstore","module_path":"kvstore.connectors.sglang",
        "class_name":"KVStoreHiCacheStorage","interface_v1":1,"url":"127.0.0.1:7300"}'

How a page becomes kvstore blocks
---------------------------------
SGLang's host pool describes a page as a list of contiguous byte *segments*
(``get_page_buffer_meta``): K and V for the paged layouts, K and V per layer for
``layer_first``, one latent segment (or one per layer) for MLA. Each segment is stored as
one kvstore block, written from and read straight into the host pool's memory (no staging
copy), which is the zero-copy ``batch_get_v1`` / ``batch_set_v1`` path. A page hit means
every segment of the page is present.

Why the namespace carries the layout
------------------------------------
A segment's bytes are in its pool's layout and dtype. The namespace records model, layout
name, dtype, page size, layer/head geometry, segment size and the TP/PP/CP shard, so a page
written by a ``page_head`` pool can never be read into a ``page_first`` pool (SGLang's own
file backend keys only model and ranks, and does exactly that). MLA latents are identical on
every TP rank: they are stored once (by SGLang's designated writer rank) under a namespace
without the TP rank, and every rank reads them.

Why nothing raises
------------------
Storage calls run on SGLang's backup and prefetch threads; an exception there kills the
thread. The daemon is reached through ``kvstore.client.NamespaceHandle``: every daemon
failure (down, slow, out of space) is logged once and reported as a miss or a failed set,
so SGLang recomputes; after repeated failures calls are skipped for a few seconds, and a
restarted daemon gets the namespace registered again.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvstore.client import Client, NamespaceHandle
from kvstore.keys import KVLayout, Namespace
from kvstore.wire import MAX_BATCH

logger = logging.getLogger(__name__)


def page_digest(key: str) -> bytes:
    """SGLang page keys are sha256 hex digests; anything else is hashed to one."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(key.encode()).digest()


def segment_hashes(keys: List[str], segments_per_page: int) -> List[bytes]:
    """One block hash per segment: the page digest followed by the segment index."""
    return [page_digest(k) + s.to_bytes(2, "big") for k in keys for s in range(segments_per_page)]


def page_batches(num_pages: int, segments_per_page: int) -> Iterator[Tuple[int, int, slice]]:
    """The calls a run of pages is sent in: whole pages, at most ``MAX_BATCH`` segments per call
    (at least one page). Yields (first page, end page, the slice of their segments)."""
    pages_per_call = max(1, MAX_BATCH // segments_per_page)
    for start in range(0, num_pages, pages_per_call):
        end = min(num_pages, start + pages_per_call)
        yield start, end, slice(start * segments_per_page, end * segments_per_page)


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class PoolGeometry:
    """What one host-pool page looks like as segments, and zero-copy views onto them.

    Built from the pool's own ``get_page_buffer_meta`` for page 0, so it follows whatever
    the installed SGLang reports. Segments must all have one size (kvstore blocks in a
    namespace do) and lie inside the pool's ``kv_buffer`` (views are slices of it, so a bad
    pointer can never be dereferenced).
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.layout = str(pool.layout)
        self.page_size = int(pool.page_size)
        self.is_mla = hasattr(pool, "kv_lora_rank")  # MLATokenToKVPoolHost
        kv_buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.device.type != "cpu":
            raise ValueError(f"kvstore: host pool {type(pool).__name__} has no CPU kv_buffer")
        if not kv_buffer.is_contiguous():
            raise ValueError(f"kvstore: host pool layout {self.layout!r} has a non-contiguous kv_buffer")
        self.base = kv_buffer.data_ptr()
        self.bytes = kv_buffer.view(-1).view(torch.uint8).numpy()  # a view, not a copy
        try:
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        except (ValueError, NotImplementedError, AssertionError) as e:
            raise ValueError(f"kvstore: host pool layout {self.layout!r} is not supported: {e}") from e
        if not sizes or len(set(sizes)) != 1:
            raise ValueError(f"kvstore: host pool layout {self.layout!r} has segments of unequal sizes "
                             f"{sorted(set(sizes))}; kvstore needs one block size per namespace")
        self.segments_per_page = len(ptrs)
        self.segment_bytes = int(sizes[0])
        self.page_bytes = self.segments_per_page * self.segment_bytes
        self.dtype = torch_dtype_name(pool.dtype)

    def segment_views(self, host_indices: torch.Tensor, num_pages: int) -> List[np.ndarray]:
        """Writable uint8 views of the host pool, one per segment, in block-hash order."""
        if host_indices.numel() != num_pages * self.page_size:
            raise ValueError(f"host_indices: {host_indices.numel()} indices for {num_pages} pages "
                             f"of {self.page_size} tokens")
        ptrs, _ = self.pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != num_pages * self.segments_per_page:
            raise ValueError(f"host pool reported {len(ptrs)} segments for {num_pages} pages")
        offsets = np.asarray(ptrs, dtype=np.int64) - self.base
        if offsets.min() < 0 or offsets.max() + self.segment_bytes > self.bytes.size:
            raise ValueError("host pool reported a segment outside its kv_buffer")
        n = self.segment_bytes
        return [self.bytes[o:o + n] for o in offsets.tolist()]

    def flat_page_segments(self, flat_page: torch.Tensor) -> List[np.ndarray]:
        """Segments of a flat data page (the legacy, copying path), in the v1 order.

        A flat page is ``get_data_page(flat=True)``: the pool's own page slice flattened. It
        is the segments back to back, except MHA ``layer_first`` whose flat page is
        ``(kv, layer, ...)`` while its segments go ``layer, kv``.
        """
        raw = flat_page.contiguous().view(-1).view(torch.uint8).numpy()
        if raw.size != self.page_bytes:
            raise ValueError(f"value: a flat page is {self.page_bytes} bytes, got {raw.size}")
        segs = raw.reshape(self.segments_per_page, self.segment_bytes)
        if self.layout == "layer_first" and not self.is_mla:
            layers = self.segments_per_page // 2
            segs = segs.reshape(2, layers, self.segment_bytes).transpose(1, 0, 2).reshape(
                self.segments_per_page, self.segment_bytes)
        return [segs[i] for i in range(self.segments_per_page)]

    def layout_for(self, config: HiCacheStorageConfig) -> KVLayout:
        """The namespace layout: everything that decides what a segment's bytes mean.

        Codecs read the name ``sglang_[mla_]<layout>_segment<N>`` with the layers, heads, head
        dim, page size and segment bytes to find a segment's tokens, heads and layers
        (``kvstore.codecs.engine_layouts``): an MHA segment is one tensor (K or V), an MLA
        segment one layer's or all layers' latents. Names and fields here are namespace
        identity: changing them orphans every stored page.
        """
        pool = self.pool
        if self.is_mla:
            # Replicated across TP: one copy for all ranks; DCP shards differ by dcp rank.
            tp_rank, tp_size = config.dcp_rank, config.dcp_size
            heads, head_dim, kv = 1, int(pool.kv_cache_dim), 1
        else:
            tp_rank, tp_size = config.tp_rank, config.tp_size
            heads, head_dim, kv = int(pool.head_num), int(pool.head_dim), 2
        return KVLayout(
            model=config.model_name or "unknown-model",
            num_layers=int(pool.layer_num), num_kv_heads=heads, head_dim=head_dim,
            dtype=self.dtype, block_tokens=self.page_size,
            layout=f"sglang_{'mla_' if self.is_mla else ''}{self.layout}_segment{self.segments_per_page}",
            kv_per_token=kv, tp_rank=tp_rank, tp_size=tp_size,
            pp_rank=config.pp_rank, pp_size=config.pp_size,
            cp_rank=config.attn_cp_rank, cp_size=config.attn_cp_size,
            block_bytes=self.segment_bytes)


class KVStoreHiCacheStorage(HiCacheStorage):
    """A ``HiCacheStorage`` whose pages live in a kvstore daemon (see the module docstring).

    ``extra_config`` keys: ``url`` (daemon address; default the client's), ``token``,
    ``timeout_s`` (per request, default 5), ``transport`` ("auto", "grpc", "shm"),
    ``tenant``/``cache_salt`` (extra namespace isolation).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        self.config = storage_config
        extra = dict(storage_config.extra_config or {})
        self.url = extra.get("url")
        self.cache_salt = str(extra.get("cache_salt", ""))
        self.tenant = str(extra.get("tenant", ""))
        self._client = Client(url=self.url, token=extra.get("token"),
                              timeout_s=float(extra.get("timeout_s", 5.0)),
                              transport=extra.get("transport", "auto"))
        self.is_writer = storage_config.is_storage_writer
        self.geometry: Optional[PoolGeometry] = None
        self.namespace: Optional[Namespace] = None
        self._handle: Optional[NamespaceHandle] = None   # set with the pool: it fixes the namespace
        self.stats = {"set_pages": 0, "set_failed": 0, "get_pages": 0, "get_missed": 0}

    @property
    def client(self) -> Client:
        """The daemon client (this backend owns it)."""
        return self._client

    @client.setter
    def client(self, client: Client) -> None:
        """Point the backend at another daemon connection (the caller closed the old one)."""
        self._client = client
        if self._handle is not None:
            self._handle.use_client(client)

    # ---- pool registration: fixes the namespace --------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.geometry = PoolGeometry(mem_pool_host)
        self.namespace = Namespace(self.geometry.layout_for(self.config), tenant=self.tenant,
                                   cache_salt=self.cache_salt)
        self._handle = NamespaceHandle(self.namespace, client=self._client, name="kvstore HiCache")
        self._handle.register()  # now if the daemon is up; later calls retry otherwise

    # ---- primitives on segments ---------------------------------------------------------
    def _exists_pages(self, keys: List[str]) -> int:
        """Length of the leading run of pages whose every segment is stored."""
        if not keys or self.geometry is None:
            return 0
        spp = self.geometry.segments_per_page
        hashes = segment_hashes(keys, spp)
        present: List[bool] = []
        for i in range(0, len(hashes), MAX_BATCH):
            got = self._handle.exists(hashes[i:i + MAX_BATCH])
            present.extend(bool(x) for x in got)
            if not all(got):
                break
        for p in range(len(keys)):
            if len(present) < (p + 1) * spp or not all(present[p * spp:(p + 1) * spp]):
                return p
        return len(keys)

    def _put_segments(self, keys: List[str], segments: List[np.ndarray]) -> List[bool]:
        """Store pages given as segments; per page, True if every segment is stored."""
        spp = self.geometry.segments_per_page
        hashes = segment_hashes(keys, spp)
        ok = [False] * len(keys)
        for start, end, segs in page_batches(len(keys), spp):
            if not self._handle.put(hashes[segs], segments[segs]):
                break
            for p in range(start, end):
                ok[p] = True
        self.stats["set_pages"] += sum(ok)
        self.stats["set_failed"] += len(ok) - sum(ok)
        return ok

    def _get_segments(self, keys: List[str], outs: List[np.ndarray]) -> List[bool]:
        """Read pages into segment buffers; a page is True only if every segment arrived."""
        spp = self.geometry.segments_per_page
        hashes = segment_hashes(keys, spp)
        ok = [False] * len(keys)
        for start, end, segs in page_batches(len(keys), spp):
            sizes = self._handle.get_into(hashes[segs], outs[segs])
            for p in range(start, end):
                got = sizes[(p - start) * spp:(p - start + 1) * spp]
                ok[p] = all(s is not None and s == self.geometry.segment_bytes for s in got)
        self.stats["get_pages"] += sum(ok)
        self.stats["get_missed"] += len(ok) - sum(ok)
        return ok

    def _ready(self) -> bool:
        if self.geometry is None:
            logger.error("kvstore: no host pool registered; SGLang calls register_mem_pool_host first")
            return False
        return True

    # ---- zero-copy v1 interface (used when extra_config has "interface_v1": 1) ------------
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not keys or not self._ready():
            return [False] * len(keys)
        try:
            outs = self.geometry.segment_views(host_indices, len(keys))
        except Exception as e:
            logger.error("kvstore batch_get_v1: %s", e)
            return [False] * len(keys)
        return self._get_segments(keys, outs)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not keys:
            return []
        if not self.is_writer:  # MLA: another rank holds the same bytes and writes them
            return [True] * len(keys)
        if not self._ready():
            return [False] * len(keys)
        try:
            segments = self.geometry.segment_views(host_indices, len(keys))
        except Exception as e:
            logger.error("kvstore batch_set_v1: %s", e)
            return [False] * len(keys)
        return self._put_segments(keys, segments)

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        return self._exists_pages(keys)

    # ---- legacy interface: flat page tensors (copies) ----------------------------------
    def exists(self, key: str) -> bool:
        return self._exists_pages([key]) == 1

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        if not keys or not self._ready():
            return [None] * len(keys)
        if target_locations is None or any(t is None for t in target_locations):
            targets = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        else:
            targets = list(target_locations)
        g = self.geometry
        reorder = g.layout == "layer_first" and not g.is_mla
        try:
            # Read straight into the caller's flat pages when their byte order is the segment
            # order (every layout but MHA layer_first); otherwise through a staging page.
            direct = [not reorder and t.is_contiguous() for t in targets]
            staging = [t.view(-1).view(torch.uint8) if d else
                       torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
                       for t, d in zip(targets, direct)]
            outs = [seg for s in staging for seg in self._staging_segments(s)]
        except Exception as e:
            logger.error("kvstore batch_get: %s", e)
            return [None] * len(keys)
        ok = self._get_segments(keys, outs)
        result: List[torch.Tensor | None] = []
        for hit, stage, target, d in zip(ok, staging, targets, direct):
            if not hit:  # (a direct read may have filled part of the page: the caller drops it)
                result.append(None)
                continue
            if not d:
                target.view(-1).view(torch.uint8).copy_(self._staging_to_flat(stage))
            result.append(target)
        return result

    def _staging_segments(self, stage: torch.Tensor) -> List[np.ndarray]:
        """Segment-ordered views of a staging buffer (segments back to back)."""
        g = self.geometry
        if stage.numel() != g.page_bytes:
            raise ValueError(f"target_location: a flat page is {g.page_bytes} bytes, got {stage.numel()}")
        raw = stage.numpy().reshape(g.segments_per_page, g.segment_bytes)
        return [raw[i] for i in range(g.segments_per_page)]

    def _staging_to_flat(self, stage: torch.Tensor) -> torch.Tensor:
        """Segment order -> the pool's flat page order (only MHA layer_first differs)."""
        g = self.geometry
        if g.layout == "layer_first" and not g.is_mla:
            layers = g.segments_per_page // 2
            return stage.view(layers, 2, g.segment_bytes).transpose(0, 1).reshape(-1)
        return stage

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        if not keys:
            return True
        if not self.is_writer:
            return True
        if not self._ready() or values is None or len(values) != len(keys):
            return False
        try:
            segments = [seg for v in values for seg in self.geometry.flat_page_segments(v)]
        except Exception as e:
            logger.error("kvstore batch_set: %s", e)
            return False
        return all(self._put_segments(keys, segments))

    # ---- housekeeping ---------------------------------------------------------------------
    def clear(self) -> None:
        """SGLang's "flush storage": kvstore is shared, so only this backend's counters reset."""
        for k in self.stats:
            self.stats[k] = 0
        if self._handle is not None:
            self._handle.reset_counters()

    def get_stats(self):
        errors = self._handle.counters()["failures"] if self._handle is not None else 0
        return {**self.stats, "daemon_errors": errors}

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:
            pass
