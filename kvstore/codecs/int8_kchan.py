"""INT8 with per-channel key scales (``int8_kchan``): keys get one bf16 scale per (layer, head,
channel) over the block's tokens, values one per (token, head) row as ``int8``; no rotation.

A real model's keys have a few outlier channels that are large in every token. ``int8`` scales a
key row by its largest element, so those channels set the step of every other channel in the row;
here each channel has its own step, ``amax over the block's tokens / 127`` (rounded up to bf16, so
nothing saturates), and an element is within half its channel's step of the input. Values have no
outlier channels and keep ``int8``'s per-row scales. On SmolLM2-135M's KV, screened in float32,
this gave a next-token KL of 1.4e-4 against ``int8``'s 3.7e-4 at ``int8``'s cost, without a rotation
(``benchmarks/results/codec_screen_real.md``); through vLLM, which computes in bf16, it is not told
apart from ``int8`` or ``int8_had`` (``benchmarks/results/fidelity_real_kchan.md``).

Sections: ``codes`` (int8 bits, K then V, ``[parts, L, T, H, D]``), ``k_scales`` ``[L, H, D]``,
``v_scales`` ``[L, T, H]``: 2*L*H*D*(T + 1) + 2*L*T*H bytes against int8's 2*L*H*D*T + 4*L*T*H (a
32-token block, head_dim 64: 1.91x smaller than bf16, int8 1.94x). A one-tensor block (a K-only or
V-only segment, an MLA latent) is quantised as keys are, per channel, as INT4 does (``layout``).
"""

from __future__ import annotations

import functools

import torch

from kvstore.codecs.base import Section, SectionCodec
from kvstore.codecs.exact import div_exact, finiteness_check, max_abs, nonzero_or_one, round_up
from kvstore.codecs.fast_runner import shares, words32_ok
from kvstore.codecs.layout import BlockShape, canonical_shape, kv_views

INT8_MAX = 127.0
SCALE_DTYPE = torch.bfloat16


@functools.cache
def _key_kernels():
    from kvstore.codecs import fast_kchan   # (numba: only reached once fast_cpu imported)
    return fast_kchan


class Int8KchanCodec(SectionCodec):
    """Header parameter 0 (nothing to choose: the key group is the block)."""

    def __init__(self, name: str, codec_id: int) -> None:
        self.name, self.codec_id, self.param = name, codec_id, 0

    def sections(self, s: BlockShape) -> list[Section]:
        secs = [Section("codes", torch.uint8, canonical_shape(s)),
                Section("k_scales", SCALE_DTYPE, (s.layers, s.heads, s.dim))]
        if s.parts == 2:
            secs.append(Section("v_scales", SCALE_DTYPE, (s.layers, s.tokens, s.heads)))
        return secs

    def quantize(self, x: torch.Tensor, s: BlockShape, parts: dict[str, torch.Tensor],
                 check: torch.Tensor) -> None:
        nk = s.layers * s.heads * s.dim
        amax = torch.empty(nk + (s.layers * s.tokens * s.heads if s.parts == 2 else 0),
                           dtype=torch.float32, device=x.device)   # key channels, then value rows
        amax[:nk].view(s.layers, s.heads, s.dim).copy_(max_abs(x[0], 1))
        if s.parts == 2:
            amax[nk:].view(s.layers, s.tokens, s.heads).copy_(max_abs(x[1], 3))
        finiteness_check(amax, check)
        scale = round_up(div_exact(amax, INT8_MAX), SCALE_DTYPE)   # not amax / 127: see div_exact
        parts["k_scales"].view(-1).copy_(scale[:nk])
        safe = nonzero_or_one(scale)
        x[0].div_(safe[:nk].view(s.layers, 1, s.heads, s.dim))
        if s.parts == 2:
            parts["v_scales"].view(-1).copy_(scale[nk:])
            x[1].div_(safe[nk:].view(s.layers, s.tokens, s.heads, 1))
        x.round_().clamp_(-INT8_MAX, INT8_MAX)
        parts["codes"].view(torch.int8).copy_(x)

    def dequantize(self, parts: dict[str, torch.Tensor], s: BlockShape, block: torch.Tensor) -> None:
        x = parts["codes"].view(torch.int8).float()   # code * scale in float32 (exact), stored rounded
        x[0].mul_(parts["k_scales"].unsqueeze(1))
        if s.parts == 2:
            x[1].mul_(parts["v_scales"].unsqueeze(-1))
        for view, i in kv_views(block, s):
            view.copy_(x[i])

    def fast_ok(self, s: BlockShape) -> bool:
        return words32_ok(s)   # decode writes two bf16 per 32-bit word

    def fast_jobs(self, kernels, tensors: list, sections: dict, s: BlockShape, encode: bool) -> list:
        keys = _key_kernels()
        codes = shares(sections["codes"], s.parts)
        jobs = []
        for i, ((words, (off, L, T, H, D, sl, st, sh)), c) in enumerate(zip(tensors, codes)):
            sc = sections["k_scales" if i == 0 else "v_scales"]
            if i == 0:   # per channel over the tokens: encode a layer at a time
                if encode:
                    jobs.append((lambda a, b, c=c, sc=sc, w=words, g=(off, T, H, D, sl, st, sh):
                                 keys.int8_kchan_encode_keys(w, *g, a, b, c, sc), L))
                else:
                    jobs.append((lambda a, b, c=c, sc=sc, w=words, g=(off, T, H, D, sl, st, sh):
                                 keys.int8_kchan_decode_keys(c, sc, w, *g, a, b), L * T))
            elif encode:   # values: int8's rows
                jobs.append((lambda a, b, c=c, sc=sc, w=words, g=(off, T, H, D, sl, st, sh):
                             kernels.int8_encode(w, *g, a, b, c, sc), L * T))
            else:
                g = (off // 2, T, H, D // 2, sl // 2, st // 2, sh // 2)
                jobs.append((lambda a, b, c=c.view("<u2"), sc=sc, w=words.view("<u4"), g=g:
                             kernels.int8_decode(c, sc, w, *g, a, b), L * T))
        return jobs
