"""Where K, V (or a block's one tensor), layers, tokens, heads and dims sit inside a block's bytes.

Lossy codecs must quantise along the right axes (keys per channel, values per token), so they see
a block as ``parts`` tensors ``[layers, tokens, heads, head_dim]``: K then V, or one tensor — a
K-only or V-only segment (SGLang stores a page's K and V as separate blocks), or an MLA latent
(one vector per token: ``heads`` 1, ``head_dim`` = kv_lora_rank + rope dim). A one-tensor block is
quantised as keys are (INT4 per channel; FP8 per token), which is safe for either role: values
quantised per channel lose a little, keys quantised per token lose their outlier channels.

This module is the only place that maps bytes to those tensors, and back. Layout names:

* axes, outermost first, from ``kv,layer,token,head,dim``; ``token`` and ``dim`` are required and
  an omitted axis means the block holds one index of it: no ``kv`` = one tensor, no ``layer`` =
  one layer, no ``head`` = one head. Examples: ``kv,layer,token,head,dim`` (SGLang ``layer_first``
  page), ``layer,kv,token,head,dim`` (vLLM FlashAttention / FlashInfer per-block gather),
  ``layer,token,dim`` (vLLM MLA latent pages), ``token,layer,head,dim`` (a K-only segment);
* ``vllm_cpu`` — vLLM's CPU attention cache: per layer, per head, K transposed
  ``[head_dim, block_tokens]`` followed by V ``[block_tokens, head_dim]`` (block ``[L, H, 2*D*T]``);
* SGLang segment names (``engine_layouts``).

Anything else is refused with a ``refusal.Refused`` saying why (the caller stores the block raw):
an unknown name, MLA (``kv_per_token`` 1) with a ``kv`` axis, ``block_bytes`` other than what the
axes add up to, element dtypes other than bfloat16 / float16 / float32.
"""

from __future__ import annotations

import dataclasses

import torch

from kvstore.codecs.engine_layouts import axes_of
from kvstore.codecs.refusal import Refused
from kvstore.keys import DTYPE_SIZES, KVLayout

AXES = ("kv", "layer", "token", "head", "dim")

#: element dtypes lossy codecs accept, by KVLayout.dtype name
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """A layout understood: the tensors in one block, their sizes and the axis order of the bytes."""

    layers: int     # layers in this block (1 for a one-layer segment)
    tokens: int
    heads: int      # heads in this block (1 for an MLA latent or a one-head segment)
    dim: int
    dtype: torch.dtype
    order: tuple[str, ...] | None  # axes present, outermost first; None for vllm_cpu
    parts: int = 2  # 2: K then V; 1: one tensor (K-only or V-only segment, MLA latent)

    @property
    def numel(self) -> int:
        return self.parts * self.layers * self.tokens * self.heads * self.dim

    @property
    def part_names(self) -> tuple[str, ...]:
        """How errors name each tensor."""
        return ("K", "V") if self.parts == 2 else ("the block",)

    def size(self, axis: str) -> int:
        return {"kv": self.parts, "layer": self.layers, "token": self.tokens, "head": self.heads,
                "dim": self.dim}[axis]


def parse(layout: KVLayout) -> BlockShape:
    """The block shape of ``layout``, or ``Refused`` saying why it cannot be interpreted."""
    if layout.kv_per_token not in (1, 2):
        raise Refused("kv_per_token", f"layout.kv_per_token={layout.kv_per_token}: blocks hold K and V (2) "
                      "or one MLA latent (1)")
    if layout.dtype not in FLOAT_DTYPES:
        raise Refused("dtype", f"layout.dtype={layout.dtype!r}: codecs accept {sorted(FLOAT_DTYPES)}")
    axes = axes_of(layout)
    latent = layout.kv_per_token == 1
    if axes is None:  # vllm_cpu
        if latent:
            raise Refused("mla_kv_axis", "layout vllm_cpu with kv_per_token=1: MLA latent pages are not "
                          "in the vllm_cpu K/V packing; name their axes (e.g. layer,token,dim)")
        shape = BlockShape(layout.num_layers, layout.block_tokens, layout.num_kv_heads, layout.head_dim,
                           FLOAT_DTYPES[layout.dtype], None)
    else:
        if len(set(axes)) != len(axes) or not set(axes) <= set(AXES) or not {"token", "dim"} <= set(axes):
            raise Refused("unknown_layout", f"layout.layout={layout.layout!r} is not a layout codecs understand: "
                          f"use axes from {','.join(AXES)} (outermost first, each once, token and dim "
                          "required), 'vllm_cpu' or an SGLang segment layout")
        if latent and "kv" in axes:
            raise Refused("mla_kv_axis", f"layout.layout={layout.layout!r} has a kv axis but kv_per_token=1: "
                          "MLA latent blocks have no K/V; name their axes without kv (e.g. layer,token,dim)")
        shape = BlockShape(layout.num_layers if "layer" in axes else 1, layout.block_tokens,
                           layout.num_kv_heads if "head" in axes else 1, layout.head_dim,
                           FLOAT_DTYPES[layout.dtype], axes, 2 if "kv" in axes else 1)
    expected = shape.numel * DTYPE_SIZES[layout.dtype]
    if layout.block_bytes != expected:
        raise Refused("padded", f"layout.block_bytes={layout.block_bytes} differs from the shape "
                      f"({expected} bytes): padded blocks are not interpreted")
    return shape


def _canonical(block: torch.Tensor, shape: BlockShape) -> torch.Tensor:
    """A dense layout's block as one strided view ``[parts, L, T, H, D]``."""
    full = shape.order + tuple(a for a in AXES if a not in shape.order)  # omitted axes: size 1
    dense = block.view(*(shape.size(a) for a in full))
    return dense.permute(*(full.index(a) for a in AXES))


def part_views(block: torch.Tensor, shape: BlockShape) -> list[torch.Tensor]:
    """The block's tensors (K then V, or its one tensor) as strided views ``[L, T, H, D]`` of
    ``block`` (a flat tensor of ``shape.dtype``).

    Views, not copies: writing into them writes the block in its own byte order, which is how
    decode fills a caller's buffer in place.
    """
    L, T, H, D = shape.layers, shape.tokens, shape.heads, shape.dim
    if shape.order is None:  # vllm_cpu: per layer, per head: K^T [D, T] then V [T, D]
        per_head = block.view(L, H, 2, D * T)
        k = per_head[:, :, 0].view(L, H, D, T).permute(0, 3, 1, 2)
        v = per_head[:, :, 1].view(L, H, T, D).permute(0, 2, 1, 3)
        return [k, v]
    canonical = _canonical(block, shape)
    return [canonical[i] for i in range(shape.parts)]


def kv_views(block: torch.Tensor, shape: BlockShape) -> list[tuple[torch.Tensor, slice | int]]:
    """``block``'s tensors as strided views, each paired with its index into a
    ``[parts, L, T, H, D]`` tensor. A dense layout gives one view of all parts, so one torch op
    (one CUDA kernel) moves the whole block; ``vllm_cpu`` gives K and V apart."""
    if shape.order is None:
        return [(view, i) for i, view in enumerate(part_views(block, shape))]
    return [(_canonical(block, shape), slice(None))]


def canonical_shape(shape: BlockShape) -> tuple[int, ...]:
    """``(parts, L, T, H, D)``: the shape the torch reference quantises."""
    return (shape.parts, shape.layers, shape.tokens, shape.heads, shape.dim)
