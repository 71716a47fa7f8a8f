"""INT4 with each block's first token kept exactly (``int4_g64_t0``): token 0 of every (layer, head)
is stored in the block's own dtype, and tokens ``1..T-1`` are ``int4``'s KIVI-style quantisation
of them alone: keys per channel over those ``T - 1`` tokens, values per token in groups of 64
dims (``int4.Int4Codec`` on the shorter shape, the same kernels; token 0's rows through
``fast_t0``'s).

Why token 0: a sequence's first token is an *attention sink* (most heads put much of their
attention on it, and its keys and values are unlike the rest), and it is always token 0 of the
sequence's first block. Quantised with the block, its error is weighted by that attention, and its
outlying keys widen every key channel's range over the block. A codec does not know which block
comes first, so it keeps token 0 of every block: one token in ``T`` at the dtype's size. What
that buys and costs on a real model's KV is measured in ``benchmarks/results/codec_screen_real_t0.md``
and ``fidelity_real_t0.md`` (docs/codecs.md quotes them).

Sections: ``int4``'s for ``T - 1`` tokens (``k_codes``, ``v_codes``, ``k_scale``, ``k_min``,
``v_scale``, ``v_min``), then ``first`` ``[parts, L, H, D]`` in the block's dtype (a -0 stored as
+0, as every INT4 statistic is, so the payload never depends on which zero a block holds). A one-tensor
block (a K-only or V-only segment, an MLA latent) keeps its token 0 the same way and is quantised
per channel, as ``int4`` does. Blocks of one token are refused (``group``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from kvstore.codecs.base import Section, SectionCodec
from kvstore.codecs.exact import canonical_zero
from kvstore.codecs.fast_runner import words32_ok
from kvstore.codecs.int4 import Int4Codec
from kvstore.codecs.layout import BlockShape, part_views
from kvstore.codecs.refusal import Refused


@functools.cache
def _first_kernels():
    from kvstore.codecs import fast_t0   # (numba: only reached once fast_cpu imported)
    return fast_t0


def rest(s: BlockShape) -> BlockShape:
    """The shape INT4 quantises: the block without its first token."""
    return dataclasses.replace(s, tokens=s.tokens - 1)


class Int4FirstTokenCodec(SectionCodec):
    """Header parameter: the value group (dims); keys are grouped over all ``T - 1`` tokens."""

    def __init__(self, name: str, codec_id: int, group: int) -> None:
        self.name, self.codec_id, self.param = name, codec_id, group
        self.inner = Int4Codec(name, codec_id, group=group, key_group=1 << 30)   # key group: min(., T - 1)

    def check_shape(self, s: BlockShape) -> None:
        if s.tokens < 2:
            raise Refused("group", f"{self.name}: a block of {s.tokens} token keeps no token to quantise")
        self.inner.check_shape(rest(s))

    def fast_ok(self, s: BlockShape) -> bool:
        return words32_ok(s)

    def sections(self, s: BlockShape) -> list[Section]:
        return self.inner.sections(rest(s)) + [Section("first", s.dtype, (s.parts, s.layers, s.heads, s.dim))]

    def quantize(self, x: torch.Tensor, s: BlockShape, parts: dict[str, torch.Tensor],
                 check: torch.Tensor) -> None:
        parts["first"].copy_(canonical_zero(x[:, :, 0]))   # (x holds the block's values: exact in its dtype)
        self.inner.quantize(x[:, :, 1:].contiguous(), rest(s), parts, check)
        check.add_(x[:, :, 0].sum(dtype=torch.float64).mul_(0))   # NaN / Inf in token 0 propagate

    def dequantize(self, parts: dict[str, torch.Tensor], s: BlockShape, block: torch.Tensor) -> None:
        views = part_views(block, s)
        self.inner.dequantize_into(parts, rest(s), [v[:, 1:] for v in views])
        for i, v in enumerate(views):
            v[:, 0].copy_(parts["first"][i])

    def fast_jobs(self, kernels, tensors: list, sections: dict, s: BlockShape, encode: bool) -> list:
        shifted = [(words, (off + st, L, T - 1, H, D, sl, st, sh)) for words, (off, L, T, H, D, sl, st, sh) in tensors]
        jobs = self.inner.fast_jobs(kernels, shifted, sections, rest(s), encode)
        first_rows = _first_kernels()
        n = s.layers * s.heads * s.dim
        out = []
        for i, ((fn, units), (words, (off, L, T, H, D, sl, st, sh))) in enumerate(zip(jobs, tensors)):
            first, g = sections["first"][i * n:(i + 1) * n], (off, L, H, D, sl, sh)
            if encode:
                copy = (lambda w=words, g=g, f=first: first_rows.first_rows_encode(w, *g, f))
            else:
                copy = (lambda w=words, g=g, f=first: first_rows.first_rows_decode(f, w, *g) or 0)
            # token 0's rows (one token in T) go with the piece of units that starts at 0: exactly one
            # piece per call does (pieces partition the units)
            out.append((lambda a, b, fn=fn, copy=copy: (fn(a, b) or 0) + (copy() if a == 0 else 0), units))
        return out
