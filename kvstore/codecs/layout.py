"""Where K, V, layers, tokens, heads and dims sit inside one block's bytes.

Lossy codecs must quantise along the right axes (keys per channel, values per token), so they
need a block as two tensors ``K, V: [layers, tokens, heads, head_dim]``. This module is the only
place that knows how a layout name maps bytes to those tensors, and back. A layout it does not
know raises ``CodecError``: the caller then stores the block raw instead of guessing.

Layout names understood:

* a permutation of ``kv,layer,token,head,dim`` — the block is a dense tensor whose axes are in
  that order (outermost first). Examples: SGLang ``layer_first`` page = ``kv,layer,token,head,dim``,
  ``page_first`` = ``kv,token,layer,head,dim``, ``page_head`` = ``kv,head,token,layer,dim``;
  vLLM CUDA flash-attn per-block gather = ``layer,kv,token,head,dim``.
* ``vllm_cpu`` — vLLM's CPU attention cache: per layer, per head, K transposed
  ``[head_dim, block_tokens]`` followed by V ``[block_tokens, head_dim]`` (block = ``[L, H, 2*D*T]``).

Refused: MLA (``kv_per_token`` other than 2), padded blocks (``block_bytes`` differs
from the shape), and element dtypes other than bfloat16 / float16 / float32.
"""

from __future__ import annotations

import dataclasses

import torch

from kvstore.errors import CodecError
from kvstore.keys import KVLayout

AXES = ("kv", "layer", "token", "head", "dim")
VLLM_CPU = "vllm_cpu"

#: element dtypes lossy codecs accept, by KVLayout.dtype name
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """A layout understood: sizes and the axis order of the bytes."""

    layers: int
    tokens: int
    heads: int
    dim: int
    dtype: torch.dtype
    order: tuple[str, ...] | None  # axis order of a dense permutation layout; None for vllm_cpu

    @property
    def numel(self) -> int:
        return 2 * self.layers * self.tokens * self.heads * self.dim


def parse(layout: KVLayout) -> BlockShape:
    """The block shape of ``layout``, or ``CodecError`` saying why it cannot be interpreted."""
    if layout.kv_per_token != 2:
        raise CodecError(f"layout.kv_per_token={layout.kv_per_token}: only K+V blocks (2) can be "
                         "quantised; MLA latent blocks are stored raw")
    if layout.dtype not in FLOAT_DTYPES:
        raise CodecError(f"layout.dtype={layout.dtype!r}: codecs accept {sorted(FLOAT_DTYPES)}")
    if layout.block_bytes != layout.shape_bytes:
        raise CodecError(f"layout.block_bytes={layout.block_bytes} differs from the shape "
                         f"({layout.shape_bytes} bytes): padded blocks are not interpreted")
    name = layout.layout
    if name == VLLM_CPU:
        order = None
    else:
        order = tuple(name.split(","))
        if sorted(order) != sorted(AXES):
            raise CodecError(f"layout.layout={name!r} is not a layout codecs understand: use a "
                             f"permutation of {','.join(AXES)} or {VLLM_CPU!r}")
    return BlockShape(layout.num_layers, layout.block_tokens, layout.num_kv_heads, layout.head_dim,
                      FLOAT_DTYPES[layout.dtype], order)


def _sizes(shape: BlockShape) -> dict[str, int]:
    return {"kv": 2, "layer": shape.layers, "token": shape.tokens, "head": shape.heads,
            "dim": shape.dim}


def _canonical(block: torch.Tensor, shape: BlockShape) -> torch.Tensor:
    """A dense permutation layout's block as one strided view ``[2, L, T, H, D]``."""
    sizes = _sizes(shape)
    dense = block.view(*(sizes[a] for a in shape.order))
    return dense.permute(*(shape.order.index(a) for a in AXES))


def split_kv(block: torch.Tensor, shape: BlockShape) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``block`` (a flat tensor of ``shape.dtype``) as strided views ``[L, T, H, D]``.

    Views, not copies: writing into them writes the block in its own byte order, which is how
    decode fills a caller's buffer in place.
    """
    L, T, H, D = shape.layers, shape.tokens, shape.heads, shape.dim
    if shape.order is None:  # vllm_cpu: per layer, per head: K^T [D, T] then V [T, D]
        per_head = block.view(L, H, 2, D * T)
        k = per_head[:, :, 0].view(L, H, D, T).permute(0, 3, 1, 2)
        v = per_head[:, :, 1].view(L, H, T, D).permute(0, 2, 1, 3)
        return k, v
    canonical = _canonical(block, shape)
    return canonical[0], canonical[1]


def kv_views(block: torch.Tensor, shape: BlockShape) -> list[tuple[torch.Tensor, slice | int]]:
    """``block``'s K and V as strided views, each paired with its index into a ``[2, L, T, H, D]``
    tensor (K = 0, V = 1). A dense permutation layout gives one view of both, so one torch op
    (one CUDA kernel) moves the whole block; ``vllm_cpu`` gives K and V apart."""
    if shape.order is None:
        k, v = split_kv(block, shape)
        return [(k, 0), (v, 1)]
    return [(_canonical(block, shape), slice(None))]
