"""INT8, symmetric: one byte per element plus a bf16 scale per (token, head) — FP8's size, a
uniform grid instead of a floating one.

``scale = amax / 127`` (rounded up to bf16, so nothing saturates), ``code = rint(x / scale)`` in
[-127, 127], ``x' = code * scale`` (exact in float32, then rounded to the block's dtype). A row's
elements are within half a step (``amax / 254``) of the input, against e4m3's 1/16 of each value:
coarser for values far below the row's largest, finer for the rest, and on a real model's KV
(SmolLM2-135M: ``benchmarks/results/codec_screen_real.md``) the attention output and next-token
distribution came out several times closer to the raw KV's than with FP8. For a one-tensor block
(a K-only or V-only segment, an MLA latent: ``heads`` 1) the row is the token's vector.

The rotated form (``int8_had``) quantises each key row after a Hadamard rotation along head_dim
(``rotation.py``) and rotates the dequantised row back: the rotation spreads a key's outlier
channels over the row, so the row's step ``amax / 127`` shrinks towards its RMS. Values, which
have no outlier channels, are quantised as they are (rotating them too changed nothing measurable
on a real model's KV, at twice the cost); a one-tensor block, whose role the layout does not say,
is rotated. Same sections, same size. Rotating back sums ``n`` errors of up to half a step of the rotated row each: an
element's error is at most ``n`` such half steps, about ``sqrt(n)`` of them typically, and the
rotated row's step is what shrinks (``benchmarks/results/codec_screen_real.md``).
"""

from __future__ import annotations

import torch

from kvstore.codecs import rotation
from kvstore.codecs.base import Section, SectionCodec
from kvstore.codecs.exact import div_exact, finiteness_check, max_abs, nonzero_or_one, round_up
from kvstore.codecs.fast_runner import shares, words32_ok
from kvstore.codecs.layout import BlockShape, canonical_shape, kv_views

INT8_MAX = 127.0
SCALE_DTYPE = torch.bfloat16


class Int8Codec(SectionCodec):
    """``rotated``: key rows (or a one-tensor block's rows) rotated before quantising (the header's
    parameter is then the largest rotation, 64; plain rows write 0)."""

    def __init__(self, name: str, codec_id: int, rotated: bool = False) -> None:
        self.name, self.codec_id, self.rotated = name, codec_id, rotated
        self.param = rotation.MAX_SIZE if rotated else 0

    def rotation_size(self, s: BlockShape) -> int:
        """The rotation of the first tensor's rows (K, or the one tensor); V is never rotated."""
        return rotation.size(s.dim) if self.rotated else 1

    def sections(self, s: BlockShape) -> list[Section]:
        return [Section("codes", torch.uint8, canonical_shape(s)),
                Section("scales", SCALE_DTYPE, canonical_shape(s)[:-1])]

    def quantize(self, x: torch.Tensor, s: BlockShape, parts: dict[str, torch.Tensor],
                 check: torch.Tensor) -> None:
        n = self.rotation_size(s)
        if n > 1:
            x[0] = rotation.rotate_for_encode(x[0], n)
        amax = max_abs(x, 4)   # per (token, head) row; NaN/Inf propagate
        finiteness_check(amax, check)
        scale = round_up(div_exact(amax, INT8_MAX), SCALE_DTYPE, out=parts["scales"])  # not amax / 127
        x.div_(nonzero_or_one(scale)[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX)
        parts["codes"].view(torch.int8).copy_(x)

    def dequantize(self, parts: dict[str, torch.Tensor], s: BlockShape, block: torch.Tensor) -> None:
        x = parts["codes"].view(torch.int8).float()
        scales = parts["scales"][..., None]
        n = self.rotation_size(s)
        if n > 1:   # code * scale in float32, K rotated back, stored rounded
            y = x.mul_(scales)
            y[0] = rotation.rotate(y[0], n)
            for view, i in kv_views(block, s):
                view.copy_(y[i])
            return
        for view, i in kv_views(block, s):   # code * scale in float32, stored rounded
            torch.mul(x[i], scales[i], out=view)

    def fast_ok(self, s: BlockShape) -> bool:
        return words32_ok(s)   # decode writes two bf16 per 32-bit word

    def fast_jobs(self, kernels, tensors: list, sections: dict, s: BlockShape, encode: bool) -> list:
        codes, scales = shares(sections["codes"], s.parts), shares(sections["scales"], s.parts)
        n = self.rotation_size(s)
        jobs = []
        for i, ((words, (off, L, T, H, D, sl, st, sh)), c, sc) in enumerate(zip(tensors, codes, scales)):
            if n > 1 and i == 0:
                jobs.append(self._rotated_job(words, (off, L, T, H, D, sl, st, sh), c, sc, n, encode))
            elif encode:
                jobs.append((lambda a, b, c=c, sc=sc, w=words, g=(off, T, H, D, sl, st, sh): kernels.int8_encode(
                    w, *g, a, b, c, sc), L * T))
            else:
                g = (off // 2, T, H, D // 2, sl // 2, st // 2, sh // 2)
                jobs.append((lambda a, b, c=c.view("<u2"), sc=sc, w=words.view("<u4"), g=g: kernels.int8_decode(
                    c, sc, w, *g, a, b), L * T))
        return jobs

    @staticmethod
    def _rotated_job(words, geometry, c, sc, n: int, encode: bool):
        from kvstore.codecs import fast_rotated as kernels   # (numba: only reached once fast_cpu imported)
        off, L, T, H, D, sl, st, sh = geometry
        if encode:
            g = (off, T, H, D, sl, st, sh)
            return (lambda a, b: kernels.int8_rot_encode(words, *g, n, a, b, c, sc), L * T)
        g = (off // 2, T, H, D // 2, sl // 2, st // 2, sh // 2)
        return (lambda a, b, w=words.view("<u4"): kernels.int8_rot_decode(c, sc, w, *g, n, a, b), L * T)
