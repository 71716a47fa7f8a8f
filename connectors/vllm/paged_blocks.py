"""Whole blocks in and out of vLLM's per-layer paged KV tensors.

vLLM keeps one KV tensor per layer with the block index on one of its dimensions; kvstore stores a
block as every layer's page for it, back to back. Contiguous layers with the block index first
move with one ``index_select`` / ``index_copy_`` each; any other arrangement takes a slower path.

On CUDA the host side of every copy is page-locked memory (``host_buffer``: DMA, never a pageable
bounce) and the copies run as non-blocking transfers on a stream of their own: a gather waits for
the compute stream's work so far, then for its own copy to land (the caller reads the bytes next);
a scatter records one event per layer, and ``wait_layer`` makes the compute stream wait for it
before that layer's attention runs, so loading layer i+1 overlaps computing layer i. On the CPU
(CI, vLLM's CPU build) the same calls are plain synchronous copies.
"""

from __future__ import annotations

import threading

import numpy as np
import torch


class PagedBlocks:
    """Copies whole blocks between vLLM's per-layer paged KV tensors and a flat staging buffer.

    Each layer tensor has one dimension of size ``num_blocks``; a layer's page for block ``b`` is
    the slice at ``b`` on that dimension. A stored block is the pages of all layers back to back.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], layer_names: list[str], num_blocks: int) -> None:
        self.layers: list[torch.Tensor] = []
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.block_dims: list[int] = []
        self.page_bytes: list[int] = []
        self.page_shapes: list[tuple[int, ...]] = []   # each layer's page in logical order (block axis out)
        for name in layer_names:
            t = kv_caches[name]
            dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if not dims:
                raise ValueError(f"layer {name}: no dimension of size num_blocks={num_blocks} in {tuple(t.shape)}")
            d = dims[0]
            self.layers.append(t)
            self.block_dims.append(d)
            self.page_bytes.append(t.numel() // num_blocks * t.element_size())
            self.page_shapes.append(tuple(t.shape[:d]) + tuple(t.shape[d + 1:]))
        self.offsets = np.cumsum([0] + self.page_bytes).tolist()
        self.block_bytes = self.offsets[-1]
        self.device = self.layers[0].device
        self._fast = [d == 0 and t.is_contiguous() for t, d in zip(self.layers, self.block_dims)]
        # the fast path moves pages as the widest words that divide them: index_select /
        # index_copy_ move one element at a time, and bytes were ~6x slower than 8-byte words
        self._word = next(dt for dt in (torch.int64, torch.int32, torch.int16, torch.uint8)
                          if all(p % dt.itemsize == 0 for p in self.page_bytes))
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._layer_events: dict[int, torch.cuda.Event] = {}
        self._events_lock = threading.Lock()

    def host_buffer(self, rows: int) -> torch.Tensor:
        """uint8 [rows, block_bytes] on the host: page-locked when the KV cache is on CUDA."""
        return torch.empty((rows, self.block_bytes), dtype=torch.uint8, pin_memory=self.cuda)

    def wait_layer(self, i: int) -> None:
        """Make the compute stream wait until layer ``i``'s last scatter has landed (CUDA; a no-op
        on the CPU, where scatters are synchronous)."""
        with self._events_lock:
            event = self._layer_events.pop(i, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_all_layers(self) -> None:
        with self._events_lock:
            layers = list(self._layer_events)
        for i in layers:
            self.wait_layer(i)

    def settle(self) -> None:
        """Wait until every copy queued so far has finished (CUDA), so a reused host buffer can
        be written again; a no-op on the CPU."""
        if self.cuda:
            self._stream.synchronize()

    def to_device(self, rows: torch.Tensor, keep: list[int] | None = None) -> torch.Tensor:
        """Blocks fetched into ``rows`` (a ``host_buffer``), as the source of ``scatter_layer``:
        on CUDA one non-blocking DMA of the whole buffer on the copy stream (then ``keep``'s rows
        picked out on the device); on the CPU ``rows`` itself (or ``rows[keep]``). The host
        buffer must stay untouched until the scatters are waited for."""
        if not self.cuda:
            return rows if keep is None else rows[keep]
        with torch.cuda.stream(self._stream):
            on_device = rows.to(self.device, non_blocking=True)
            return on_device if keep is None else on_device[torch.tensor(keep, device=self.device)]

    def to_device_columns(self, rows: torch.Tensor, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Bytes ``[lo, hi)`` of every row of ``rows`` (a ``host_buffer``) into ``out`` (allocated
        like ``rows`` on the device when None), for rows that arrive a range at a time (layer-wise
        loads from a remote daemon): on CUDA a non-blocking copy on the copy stream, ordered before
        the scatters that read it; on the CPU ``rows`` itself."""
        if not self.cuda:
            return rows
        with torch.cuda.stream(self._stream):
            if out is None:
                out = torch.empty(rows.shape, dtype=rows.dtype, device=self.device)
            out[:, lo:hi].copy_(rows[:, lo:hi], non_blocking=True)
        return out

    def _as_pages(self, i: int) -> torch.Tensor:
        """Layer ``i`` as [num_blocks, page words] of ``_word`` (a view; fast path only)."""
        t = self.layers[i]
        return t.view(torch.uint8).view(t.shape[0], -1).view(self._word)

    def gather(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` into ``out`` (uint8 [n, block_bytes], on the host; from
        ``host_buffer`` on CUDA). Returns once the bytes are in ``out``."""
        if not self.cuda:
            self._gather(block_ids, out)
            return
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))   # the pages as computed so far
        with torch.cuda.stream(stream):
            self._gather(block_ids, out)
        stream.synchronize()

    def _gather(self, block_ids: list[int], out: torch.Tensor) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i in range(len(self.layers)):
            self._gather_layer(i, idx, out)

    def gather_layer(self, i: int, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Copy layer ``i``'s pages of blocks ``idx`` (a long tensor on the KV cache's device) into
        that layer's byte range of ``out``'s rows (a ``host_buffer``), as soon as the layer is
        computed (per-layer saves). On CUDA it returns once the copy is queued on the copy stream
        after the compute so far: ``settle()`` before reading ``out``. On the CPU a plain copy."""
        if not self.cuda:
            self._gather_layer(i, idx, out)
            return
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))   # layer i's pages as just computed
        with torch.cuda.stream(stream):
            self._gather_layer(i, idx, out)

    def _gather_layer(self, i: int, idx: torch.Tensor, out: torch.Tensor) -> None:
        t = self.layers[i]
        a, b = self.offsets[i], self.offsets[i + 1]
        if self._fast[i]:
            pages = self._as_pages(i).index_select(0, idx)
        else:
            d = self.block_dims[i]
            pages = t.index_select(d, idx).movedim(d, 0).contiguous().view(torch.uint8).view(len(idx), -1)
        out[:, a:b].view(pages.dtype).copy_(pages, non_blocking=self.cuda)

    def scatter(self, block_ids: list[int], src: torch.Tensor) -> None:
        """Copy ``src`` (uint8 [n, block_bytes]) into blocks ``block_ids`` of every layer."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i in range(len(self.layers)):
            self.scatter_layer(i, block_ids, src, idx)

    def scatter_layer(self, i: int, block_ids: list[int], src: torch.Tensor, idx: torch.Tensor | None = None) -> None:
        """Copy layer ``i``'s slice of ``src`` (uint8 [n, block_bytes]) into its pages ``block_ids``:
        a block's layer ``i`` is the fixed byte range ``offsets[i]:offsets[i + 1]`` of it. On CUDA
        it returns once the copy is queued; ``wait_layer(i)`` orders the compute stream after it,
        and ``src`` must stay untouched until then (the loader keeps it until the step ends)."""
        self.write_layer(i, lambda: self._scatter_layer(i, block_ids, src, idx))

    def write_layer(self, i: int, copy) -> None:
        """Run ``copy`` (it writes pages of layer ``i``): inline on the CPU; on CUDA queued on the
        copy stream after the compute so far, with layer ``i``'s event recorded for ``wait_layer``."""
        if not self.cuda:
            copy()
            return
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))   # nobody reads those pages any more
        with torch.cuda.stream(stream):
            copy()
            event = torch.cuda.Event()
            event.record(stream)
        with self._events_lock:
            self._layer_events[i] = event

    def _scatter_layer(self, i: int, block_ids: list[int], src: torch.Tensor, idx: torch.Tensor | None) -> None:
        if idx is None:
            idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        t = self.layers[i]
        a, b = self.offsets[i], self.offsets[i + 1]
        pages = src[:, a:b].to(self.device, non_blocking=self.cuda)
        if self._fast[i]:
            self._as_pages(i).index_copy_(0, idx, pages.view(self._word))
        else:
            d = self.block_dims[i]
            shape = list(t.shape)
            shape[d] = 1
            moved = [shape[d]] + shape[:d] + shape[d + 1:]
            for j, blk in enumerate(block_ids):
                piece = pages[j].contiguous().view(t.dtype).view(moved).movedim(0, d)
                t.narrow(d, blk, 1).copy_(piece)
