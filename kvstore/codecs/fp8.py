"""FP8 e4m3: one byte per element plus a bf16 scale per (token, head) — or per head.

For a one-tensor block (a K-only or V-only segment, an MLA latent: ``heads`` 1) the row is the
token's vector, so an MLA latent gets one scale per token over its kv_lora_rank + rope dims.

``code = e4m3(x / scale)`` with ``scale = amax / 448`` (rounded up so nothing saturates), and
``x' = e4m3_to_float(code) * scale``. e4m3 keeps ~3 significant bits over a wide exponent range,
so outlier key channels cost precision only within their own (token, head) row. The per-head
variant (one scale for all tokens of a head in the block) is smaller by a rounding error and
coarser wherever token magnitudes differ.

Scales are bf16: as wide as float32 (no overflow for any input) at half the bytes; precision does
not matter because encode quantises with the already-rounded scale.
"""

from __future__ import annotations

import torch

from kvstore.codecs.base import Section, SectionCodec
from kvstore.codecs.exact import div_exact, finiteness_check, max_abs, nonzero_or_one, round_up
from kvstore.codecs.fast_runner import shares, words32_ok
from kvstore.codecs.layout import BlockShape, canonical_shape, kv_views

E4M3_MAX = 448.0
SCALE_DTYPE = torch.bfloat16


class Fp8Codec(SectionCodec):
    def __init__(self, name: str, codec_id: int, per_head: bool) -> None:
        self.name, self.codec_id, self.per_head = name, codec_id, per_head
        self.param = 1 if per_head else 0

    def _scale_shape(self, s: BlockShape) -> tuple[int, ...]:
        return (s.parts, s.layers, s.heads) if self.per_head else (s.parts, s.layers, s.tokens, s.heads)

    def sections(self, s: BlockShape) -> list[Section]:
        return [Section("codes", torch.uint8, canonical_shape(s)),
                Section("scales", SCALE_DTYPE, self._scale_shape(s))]

    def _broadcast(self, scale: torch.Tensor) -> torch.Tensor:
        """[P, L, H] or [P, L, T, H] -> broadcastable against [P, L, T, H, D]."""
        return scale[:, :, None, :, None] if self.per_head else scale[..., None]

    def quantize(self, x: torch.Tensor, s: BlockShape, parts: dict[str, torch.Tensor],
                 check: torch.Tensor) -> None:
        amax = max_abs(x, (2, 4) if self.per_head else 4)  # per row (or head); NaN/Inf propagate
        finiteness_check(amax, check)
        scale = round_up(div_exact(amax, E4M3_MAX), SCALE_DTYPE, out=parts["scales"])  # not amax / 448
        x.div_(self._broadcast(nonzero_or_one(scale))).clamp_(-E4M3_MAX, E4M3_MAX)
        parts["codes"].view(torch.float8_e4m3fn).copy_(x)

    def dequantize(self, parts: dict[str, torch.Tensor], s: BlockShape, block: torch.Tensor) -> None:
        x = parts["codes"].view(torch.float8_e4m3fn).float()
        scales = self._broadcast(parts["scales"])
        for view, i in kv_views(block, s):  # x * scale rounded to float32, stored in the block's dtype
            torch.mul(x[i], scales[i], out=view)

    def fast_ok(self, s: BlockShape) -> bool:
        return words32_ok(s)   # decode writes two bf16 per 32-bit word

    def fast_jobs(self, kernels, tensors: list, sections: dict, s: BlockShape, encode: bool) -> list:
        codes, scales = shares(sections["codes"], s.parts), shares(sections["scales"], s.parts)
        jobs = []
        for (words, (off, L, T, H, D, sl, st, sh)), c, sc in zip(tensors, codes, scales):
            g = (off, T, H, D, sl, st, sh)
            if not encode:   # decode: codes as 16-bit pairs, the block as 32-bit words
                pairs, words32 = c.view("<u2"), words.view("<u4")
                g = (off // 2, T, H, D // 2, sl // 2, st // 2, sh // 2)
                jobs.append((lambda a, b, c=pairs, sc=sc, w=words32, g=g: kernels.fp8_decode(
                    c, sc, self.per_head, w, *g, a, b), L * T))
            elif self.per_head:
                jobs.append((lambda a, b, c=c, sc=sc, w=words, g=g: kernels.fp8_head_encode(w, *g, a, b, c, sc), L))
            else:
                jobs.append((lambda a, b, c=c, sc=sc, w=words, g=g: kernels.fp8_encode(w, *g, a, b, c, sc), L * T))
        return jobs
