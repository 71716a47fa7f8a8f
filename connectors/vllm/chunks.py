"""One kvstore block holding N consecutive vLLM blocks of a request (``blocks_per_chunk``), in the
byte order its layout name promises.

A stored vLLM block is every layer's page back to back (``paged_blocks``). Concatenating N such
blocks would *not* be a block of N x block_size tokens in any layout codecs know: the token axis
of each page would be cut into N runs with the other axes in between. So a chunk is repacked into
exactly what the layout name says for ``block_tokens`` = N x vLLM's block size, and unpacked on
load:

* ``layer,kv,token,head,dim`` (and any named axes with ``layer`` outermost): per layer, each
  run of the axes before ``token`` holds the N pages' token ranges one after the other
  (``[outer, N, tokens x rest]``);
* ``vllm_cpu``: per layer and head, K transposed ``[head_dim, N x block_size]`` (token fastest,
  so each of the head_dim rows gathers N token runs) followed by V ``[N x block_size, head_dim]``.

A chunk of N blocks of T tokens is therefore byte-identical to one block of N x T tokens, and the
FP8 / INT4 tier codecs (``kvstore.codecs.layout``) find K, V, tokens, heads and dims in it as they
do in a block. With N = 1 both directions are the identity (no copy): today's blocks, namespaces
and bytes are unchanged.

Saves gather N blocks and repack them (``to_chunks``, on the saver's thread). Loads place each
layer straight out of the fetched chunks (``place_layer``: one ``index_copy_`` per position in the
chunk from a strided view), so a chunked load costs no more copies than a block load.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvstore.keys import DTYPE_SIZES, KVLayout

# one layer: (its pages of C*N blocks as [C, N, page], its part of C chunks as [C, N*page]) ->
# pairs of views of the same shape (blocks side, chunk side) whose copies repack the layer
_Pairs = Callable[[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]


class ChunkPacking:
    """Converts between rows of vLLM blocks ``[C*N, block_bytes]`` and rows of chunks
    ``[C, N*block_bytes]`` (uint8 host tensors), for the layout the namespace names."""

    def __init__(self, layout: KVLayout, page_bytes: list[int], page_shapes: list[tuple[int, ...]],
                 blocks_per_chunk: int) -> None:
        self.n = int(blocks_per_chunk)
        self.page_bytes = list(page_bytes)
        self.block_bytes = sum(self.page_bytes)
        self.chunk_bytes = self.n * self.block_bytes
        self._offsets = [sum(self.page_bytes[:i]) for i in range(len(self.page_bytes))]
        self.cpu_layout = layout.layout == "vllm_cpu"
        self._heads, self._dim = layout.num_kv_heads, layout.head_dim
        esize = DTYPE_SIZES[layout.dtype]
        tokens = layout.block_tokens // self.n     # vLLM's block size
        if layout.layout == "vllm_cpu":
            heads, dim = layout.num_kv_heads, layout.head_dim
            if any(p != heads * 2 * dim * tokens * esize for p in self.page_bytes):
                raise ValueError(f"vllm_cpu pages of {self.page_bytes[0]} bytes are not {heads} heads x "
                                 f"(K^T + V) of {tokens} tokens x {dim} dims")
            runs = [tokens * esize, tokens * dim * esize]
            self._pairs: _Pairs = self._cpu_pairs(heads, dim, tokens * esize)
        else:
            axes = layout.layout.split(",")
            if axes[0] != "layer" or "token" not in axes:
                raise ValueError(f"layout {layout.layout!r}: chunks need layer outermost and a token axis")
            page_axes = axes[1:]
            if any(len(s) != len(page_axes) for s in page_shapes):
                raise ValueError(f"pages shaped {page_shapes[0]} do not have the axes {page_axes}")
            k = page_axes.index("token")
            outer = {math.prod(s[:k]) for s in page_shapes}
            if len(outer) != 1:
                raise ValueError("layers differ in their pages' shapes before the token axis")
            self._outer = outer.pop()
            self._token_axis = k
            runs = [p // self._outer for p in self.page_bytes]
            self._pairs = self._axes_pairs
        # copy with the widest element that divides every run and offset: fewer, larger moves
        self._word = next(w for w in (8, 4, 2, 1)
                          if all(x % w == 0 for x in runs + self.page_bytes + self._offsets))

    def _axes_pairs(self, blocks: torch.Tensor, chunk: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[C, N, outer, run] (blocks) <-> [C, outer, N, run] (chunk)."""
        o = self._outer
        src = blocks.unflatten(-1, (o, -1))
        dst = chunk.unflatten(-1, (o, self.n, -1))
        return [(src, dst.transpose(1, 2))]

    def _cpu_pairs(self, heads: int, dim: int, trun: int) -> _Pairs:
        n = self.n

        def pairs(blocks: torch.Tensor, chunk: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
            w = self._word
            src = blocks.unflatten(-1, (heads, 2, -1))           # [C, N, H, 2, D*T]
            dst = chunk.unflatten(-1, (heads, 2, -1))            # [C, H, 2, N*D*T]
            k_src = src[:, :, :, 0].unflatten(-1, (dim, trun // w))          # [C, N, H, D, T]
            k_dst = dst[:, :, 0].unflatten(-1, (dim, n, trun // w))         # [C, H, D, N, T]
            v_src = src[:, :, :, 1]                                          # [C, N, H, T*D]
            v_dst = dst[:, :, 1].unflatten(-1, (n, -1))                      # [C, H, N, T*D]
            return [(k_src, k_dst.permute(0, 3, 1, 2, 4)), (v_src, v_dst.permute(0, 2, 1, 3))]
        return pairs

    def _layer_views(self, blocks: torch.Tensor, chunks: torch.Tensor):
        """Per layer: (its pages in ``blocks`` as [C, N, page], its part of ``chunks`` as
        [C, N*page]), in words of ``_word`` bytes. A chunk's layer i starts at N x a block's."""
        c, w = chunks.shape[0], self._word
        b = blocks.view(torch.uint8).view(-1).view(self._dtype).view(c, self.n, self.block_bytes // w)
        ch = chunks.view(torch.uint8).view(-1).view(self._dtype).view(c, self.chunk_bytes // w)
        for off, size in zip(self._offsets, self.page_bytes):
            yield (b[:, :, off // w:(off + size) // w],
                   ch[:, self.n * off // w:self.n * (off + size) // w])

    @property
    def _dtype(self) -> torch.dtype:
        return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[self._word]

    def to_chunks(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``blocks`` (uint8 [C*N, block_bytes], contiguous) as chunk rows [C, chunk_bytes]."""
        if self.n == 1:
            return blocks
        c = blocks.shape[0] // self.n
        out = torch.empty((c, self.chunk_bytes), dtype=torch.uint8) if out is None else out
        for src, dst in self._layer_views(blocks, out):
            for s, d in self._pairs(src, dst):
                d.copy_(s)
        return out

    def to_blocks(self, chunks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``chunks`` (uint8 [C, chunk_bytes], contiguous) as vLLM block rows [C*N, block_bytes]."""
        if self.n == 1:
            return chunks
        c = chunks.shape[0]
        out = torch.empty((c * self.n, self.block_bytes), dtype=torch.uint8) if out is None else out
        for src, dst in self._layer_views(out, chunks):
            for s, d in self._pairs(src, dst):
                s.copy_(d)
        return out

    def placement(self, slots: list[int], num_chunks: int, device: torch.device) -> list:
        """The index tensors ``place_layer`` needs for chunks whose vLLM blocks are ``slots`` (N
        per chunk, in order; -1: leave that block alone), made once per load: for each position j
        in a chunk, which chunks' block j to place (None: all) and where."""
        n, plan = self.n, []
        for j in range(n):
            rows = [r for r in range(num_chunks) if slots[r * n + j] >= 0]
            if rows:
                idx = torch.tensor([slots[r * n + j] for r in rows], dtype=torch.long, device=device)
                sel = None if len(rows) == num_chunks else torch.tensor(rows, dtype=torch.long, device=device)
                plan.append((j, sel, idx))
        return plan

    def place_layer(self, paged, i: int, chunks: torch.Tensor, plan: list) -> None:
        """Copy layer ``i`` of ``chunks`` (uint8 [C, chunk_bytes], on the KV cache's device) into
        the vLLM blocks ``plan`` (``placement``) names, through ``paged.write_layer`` (the copy
        stream on CUDA): one ``index_copy_`` per position in the chunk, from a strided view."""
        if plan:
            paged.write_layer(i, lambda: self._place(paged, i, chunks, plan))

    def _place(self, paged, i: int, chunks: torch.Tensor, plan: list) -> None:
        n, off, size = self.n, self._offsets[i], self.page_bytes[i]
        region = chunks[:, n * off:n * (off + size)]                     # [C, N*page] bytes
        targets = self._targets(paged, i, region)
        for j, sel, idx in plan:
            for dim, dst, src in targets:
                # position j of each chunk (of the selected ones: a position partly kept)
                part = (src if sel is None else src.index_select(0, sel)).select(1, j)
                dst.index_copy_(dim, idx, part.movedim(0, dim) if dim else part)

    def _targets(self, paged, i: int, region: torch.Tensor) -> list:
        """(block dim, layer-tensor view, chunk-side view [C, N, ...] with each position's part in
        the shape of that view with the block dim first) triples for layer ``i``."""
        t, n = paged.layers[i], self.n
        if self.cpu_layout:
            if not paged._fast[i]:
                raise ValueError("vllm_cpu chunks need contiguous pages with the block index first")
            h, dim = self._heads, self._dim
            pages = paged._as_pages(i).view(torch.uint8).view(self._dtype).unflatten(-1, (h, 2, -1))  # [NB, H, 2, D*T]
            src = region.view(self._dtype).unflatten(-1, (h, 2, -1))                # [C, H, 2, N*D*T]
            trun = pages.shape[-1] // dim
            k_dst = pages[:, :, 0].unflatten(-1, (dim, trun))                        # [NB, H, D, T]
            k_src = src[:, :, 0].unflatten(-1, (dim, n, trun)).permute(0, 3, 1, 2, 4)  # [C, N, H, D, T]
            v_src = src[:, :, 1].unflatten(-1, (n, -1)).transpose(1, 2)              # [C, N, H, T*D]
            return [(0, k_dst, k_src), (0, pages[:, :, 1], v_src)]
        if paged._fast[i]:   # pages [NB, outer, run] in words; each chunk is [outer, N, run]
            pages = paged._as_pages(i).view(torch.uint8).view(self._dtype).unflatten(-1, (self._outer, -1))
            return [(0, pages, region.view(self._dtype).unflatten(-1, (self._outer, n, -1)).transpose(1, 2))]
        d, shape, k = paged.block_dims[i], paged.page_shapes[i], self._token_axis
        src = region.view(t.dtype).unflatten(-1, (*shape[:k], n, *shape[k:])).movedim(1 + k, 1)
        return [(d, t, src)]
