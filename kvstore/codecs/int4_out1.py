"""INT4 with each layer's most range-widening token kept exactly (``int4_g64_out1``): in every
(layer) of a block, the one token whose keys most widen the per-channel key ranges is stored in the
block's own dtype (keys and values), and the keys' per-channel statistics are taken over the other
tokens; everything else is ``int4``'s KIVI-style quantisation (keys per channel over the block,
values per token in groups of 64 dims).

Why: INT4 keys are quantised per channel over the block's tokens, so one token with outlying keys
(an attention sink, a token the heads single out) sets the step of every channel it leads, for
all the others. ``int4_g64_t0`` keeps token 0 for that reason; here the codec looks at the block
and keeps whichever token it would pay most to leave out. The choice, per layer, from its keys
``[T, H, D]``: for each (head, channel), the token holding the maximum gains
``(max - second max) / range`` and the token holding the minimum ``(second min - min) / range``
(what the range would shrink by without it), each floored to a multiple of 2^-16 so the sum is an
exact integer on every device and in the compiled kernels; the token with the largest sum (the
lowest such token on a tie) is kept. On SmolLM2-135M's KV this screened at a next-token KL of
6.9e-3 against ``int4_g64_t0``'s 8.2e-3 (``benchmarks/results/codec_screen_real_out1.md``); what it
does through vLLM is in ``benchmarks/results/fidelity_real_floor.md`` (docs/codecs.md quotes both).

Sections: ``int4``'s for all ``T`` tokens (the kept token's key codes are its neighbour's, token
``(t + 1) % T``, under the others' statistics; its value codes its own: both overwritten on
decode), then ``kept`` ``[parts, L, H, D]`` in the block's dtype (a -0 stored as +0) and
``kept_token`` ``[L]`` (int16). A 32-token block, head_dim 64: 3.05x smaller than bf16 (int4_g64
3.37x, int4_g64_t0 3.13x). A one-tensor block (a K-only or V-only segment, an MLA latent) keeps
its token the same way and is quantised per channel, as ``int4`` does. Blocks of one token are
refused (``group``); a payload whose ``kept_token`` is not a token of the block is refused on
decode.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvstore.codecs.base import Section, SectionCodec
from kvstore.codecs.exact import canonical_zero
from kvstore.codecs.fast_runner import words32_ok
from kvstore.codecs.int4 import Int4Codec
from kvstore.codecs.layout import BlockShape, part_views
from kvstore.codecs.refusal import Refused
from kvstore.errors import CodecError
from kvstore.keys import KVLayout

#: gains are floored to multiples of 1/GAIN_STEPS before they are summed (exact integers)
GAIN_STEPS = 65536.0


@functools.cache
def _kernels():
    from kvstore.codecs import fast_out1   # (numba: only reached once fast_cpu imported)
    return fast_out1


def kept_tokens(k: torch.Tensor) -> torch.Tensor:
    """Per layer of keys ``[L, T, H, D]`` (float32, T >= 2), the token to keep (int64 ``[L]``)."""
    L, T = k.shape[:2]
    top = k.topk(2, dim=1).values                      # [L, 2, H, D]: max, second max
    bot = k.topk(2, dim=1, largest=False).values       # min, second min
    rng = top[:, 0] - bot[:, 0]
    wide = rng > 0
    gains = []
    for a, b in ((top[:, 0], top[:, 1]), (bot[:, 1], bot[:, 0])):
        g = torch.where(wide, (a - b) / rng, 0.0)      # (tensor / tensor: a true division everywhere)
        gains.append(torch.floor(g * GAIN_STEPS).to(torch.int64).view(L, -1))
    score = torch.zeros((L, T), dtype=torch.int64, device=k.device)
    score.scatter_add_(1, k.argmax(1).view(L, -1), gains[0])   # (a tied extreme gains 0: any index)
    score.scatter_add_(1, k.argmin(1).view(L, -1), gains[1])
    return score.argmax(1)                             # the first of equal scores


class Int4OutlierTokenCodec(SectionCodec):
    """Header parameter: the value group (dims); keys are grouped over the block's tokens."""

    def __init__(self, name: str, codec_id: int, group: int) -> None:
        self.name, self.codec_id, self.param = name, codec_id, group
        self.inner = Int4Codec(name, codec_id, group=group, key_group=1 << 30)   # key group: the block

    def check_shape(self, s: BlockShape) -> None:
        if s.tokens < 2:
            raise Refused("group", f"{self.name}: a block of {s.tokens} token has no other token to quantise")
        if s.tokens > 32767:
            raise Refused("group", f"{self.name}: block_tokens={s.tokens} does not fit the int16 kept_token")
        self.inner.check_shape(s)

    def fast_ok(self, s: BlockShape) -> bool:
        return words32_ok(s)

    def sections(self, s: BlockShape) -> list[Section]:
        return self.inner.sections(s) + [Section("kept", s.dtype, (s.parts, s.layers, s.heads, s.dim)),
                                         Section("kept_token", torch.int16, (s.layers,))]

    def check_body(self, body: np.ndarray, layout: KVLayout) -> None:
        s = self.shape_of(layout)
        tok = self._np_sections(body, s)["kept_token"]
        if tok.size and int(tok.max()) >= s.tokens:   # (uint16 words: a negative int16 is >= 32768)
            raise CodecError(f"{self.name}: payload keeps token {int(tok.max())} of a {s.tokens}-token block")

    def quantize(self, x: torch.Tensor, s: BlockShape, parts: dict[str, torch.Tensor],
                 check: torch.Tensor) -> None:
        t = kept_tokens(x[0])
        layers = torch.arange(s.layers, device=x.device)
        kept = x[:, layers, t]                               # [P, L, H, D]: exact in the block's dtype
        parts["kept"].copy_(canonical_zero(kept))
        parts["kept_token"].copy_(t)
        x[0, layers, t] = x[0, layers, (t + 1) % s.tokens]   # keys: the others' statistics alone
        self.inner.quantize(x, s, parts, check)
        check.add_(kept.sum(dtype=torch.float64).mul_(0))    # NaN / Inf in a kept token propagate

    def dequantize(self, parts: dict[str, torch.Tensor], s: BlockShape, block: torch.Tensor) -> None:
        views = part_views(block, s)
        self.inner.dequantize_into(parts, s, views)
        layers = torch.arange(s.layers, device=block.device)
        t = parts["kept_token"].long()
        for i, v in enumerate(views):
            v[layers, t] = parts["kept"][i]

    def fast_jobs(self, kernels, tensors: list, sections: dict, s: BlockShape, encode: bool) -> list:
        fast = _kernels()
        kg, vg = self.inner.groups(s)
        n = s.layers * s.heads * s.dim
        tok = sections["kept_token"]
        kept16 = sections["kept"]
        jobs = []
        for i, (r, (words, (off, L, T, H, D, sl, st, sh))) in enumerate(zip(self.inner.roles(s), tensors)):
            codes, scale, mn = sections[f"{r}_codes"], sections[f"{r}_scale"], sections[f"{r}_min"]
            w = words.view("<u4")
            g = (off // 2, T, H, D // 2, sl // 2, st // 2, sh // 2)
            kept = kept16[i * n:(i + 1) * n]
            if encode and r == "k":   # chooses each layer's token; copies it from every tensor
                other = tensors[1] if len(tensors) > 1 else tensors[0]
                ow, (ooff, _, _, _, _, osl, ost, osh) = other
                okept = kept16[n:2 * n] if len(tensors) > 1 else kept
                jobs.append((lambda a, b, w16=words, w=w, g=g, ow=ow, og=(ooff, osl, ost, osh), c=codes, sc=scale,
                             m=mn, kk=kept, ok=okept: fast.int4_out1_encode_keys(w16, w, *g, ow, *og, a, b, c, sc, m,
                                                                                  kk, ok, tok), L))
            elif encode:              # values: int4's rows (the kept token's overwritten on decode)
                jobs.append((lambda a, b, w16=words, w=w, g=g, c=codes, sc=scale, m=mn: kernels.int4_encode_values(
                    w16, w, *g, vg // 2, a, b, c, sc, m), L * T))
            elif r == "k":
                jobs.append((lambda a, b, w=w, g=g, c=codes, sc=scale, m=mn, kk=kept.view("<u4"):
                             fast.int4_out1_decode_keys(c, sc, m, kk, tok, w, *g, a, b), L))
            else:
                jobs.append((lambda a, b, w=w, g=g, c=codes, sc=scale, m=mn, kk=kept.view("<u4"):
                             fast.int4_out1_decode_values(c, sc, m, kk, tok, w, *g, vg // 2, a, b), L * T))
        return jobs
