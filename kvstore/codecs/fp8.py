"""FP8 e4m3: one byte per element plus a bf16 scale per (token, head) — or per head.

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
from kvstore.codecs.layout import BlockShape, kv_views
from kvstore.errors import CodecError

E4M3_MAX = 448.0
SCALE_DTYPE = torch.bfloat16


class Fp8Codec(SectionCodec):
    def __init__(self, name: str, codec_id: int, per_head: bool) -> None:
        self.name, self.codec_id, self.per_head = name, codec_id, per_head
        self.param = 1 if per_head else 0

    def _scale_shape(self, s: BlockShape) -> tuple[int, ...]:
        return (2, s.layers, s.heads) if self.per_head else (2, s.layers, s.tokens, s.heads)

    def sections(self, s: BlockShape) -> list[Section]:
        return [Section("codes", torch.uint8, (2, s.layers, s.tokens, s.heads, s.dim)),
                Section("scales", SCALE_DTYPE, self._scale_shape(s))]

    def _broadcast(self, scale: torch.Tensor) -> torch.Tensor:
        """[2, L, H] or [2, L, T, H] -> broadcastable against [2, L, T, H, D]."""
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

    def fast_encode(self, fast, k_src, v_src, parts: dict[str, torch.Tensor]) -> None:
        codes = parts["codes"].numpy()
        scales = fast.words(parts["scales"])
        for i, ((words, geom), what) in enumerate(((k_src, "K"), (v_src, "V"))):
            sc = scales[i].reshape(geom[1], 1, geom[3]) if self.per_head else scales[i]
            bad = fast.by_layers(geom, lambda a, b, g, c=codes[i], sc=sc, w=words: fast.fp8_encode(
                w, *g, c[a:b], sc[a:b], self.per_head))
            if bad:
                raise CodecError(f"block contains NaN or Inf in {what}; refusing to encode it")

    def fast_decode(self, fast, parts: dict[str, torch.Tensor], kv: int, words, geom) -> None:
        codes = parts["codes"].numpy()[kv]
        scales = fast.words(parts["scales"])[kv]
        sc = scales.reshape(geom[1], 1, geom[3]) if self.per_head else scales
        fast.by_layers(geom, lambda a, b, g: fast.fp8_decode(
            codes[a:b], sc[a:b], fast.E4M3_TO_F32, words, *g, self.per_head))
