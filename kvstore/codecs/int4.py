"""INT4, asymmetric, group-wise, KIVI-style (Liu et al. 2024, "KIVI: a tuning-free asymmetric
2bit quantization for KV cache").

Keys have a few outlier *channels* (dims with 10-50x the magnitude of the rest, stable across
tokens), so keys are quantised **per channel**: each (layer, head, dim) gets its own min/scale
over a group of ``min(group, block_tokens)`` tokens. Values have no channel outliers but vary per
token, so values are quantised **per token**: groups of ``min(group, head_dim)`` along head_dim.

``code = round((x - min) / scale)`` in [0, 15], ``scale = (max - min) / 15``; two codes per byte
(even element in the low nibble). Minima and scales are stored in the block's own dtype (for
bf16/fp16 blocks: 2 + 2 bytes per group); the minimum is rounded down and the scale up so the
group's range is always covered.
"""

from __future__ import annotations

import torch

from kvstore.codecs.base import (Section, SectionCodec, canonical_zero, check_finite, div_exact,
                                 round_down, round_up)
from kvstore.codecs.layout import BlockShape
from kvstore.errors import CodecError

LEVELS = 15


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15] (even count) -> half as many bytes, even index in the low nibble."""
    flat = q.reshape(-1, 2)
    return flat[:, 0] | (flat[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(-1)


class Int4Codec(SectionCodec):
    def __init__(self, name: str, codec_id: int, group: int) -> None:
        self.name, self.codec_id, self.group = name, codec_id, group
        self.param = group

    def groups(self, s: BlockShape) -> tuple[int, int]:
        """(tokens per key group, dims per value group)."""
        return min(self.group, s.tokens), min(self.group, s.dim)

    def check_shape(self, s: BlockShape) -> None:
        kg, vg = self.groups(s)
        if s.tokens % kg:
            raise CodecError(f"{self.name}: block_tokens={s.tokens} is not a multiple of the key "
                             f"group ({kg} tokens)")
        if s.dim % vg:
            raise CodecError(f"{self.name}: head_dim={s.dim} is not a multiple of the value group "
                             f"({vg} dims)")
        if (s.layers * s.tokens * s.heads * s.dim) % 2:
            raise CodecError(f"{self.name}: an odd number of elements per K/V cannot be packed "
                             "two per byte")

    def sections(self, s: BlockShape) -> list[Section]:
        kg, vg = self.groups(s)
        n = s.layers * s.tokens * s.heads * s.dim
        k_stats = (s.layers, s.tokens // kg, s.heads, s.dim)
        v_stats = (s.layers, s.tokens, s.heads, s.dim // vg)
        return [Section("k_codes", torch.uint8, (n // 2,)), Section("v_codes", torch.uint8, (n // 2,)),
                Section("k_scale", s.dtype, k_stats), Section("k_min", s.dtype, k_stats),
                Section("v_scale", s.dtype, v_stats), Section("v_min", s.dtype, v_stats)]

    def _grouped(self, s: BlockShape) -> tuple[tuple[int, ...], int, tuple[int, ...], int]:
        kg, vg = self.groups(s)
        return ((s.layers, s.tokens // kg, kg, s.heads, s.dim), 2,
                (s.layers, s.tokens, s.heads, s.dim // vg, vg), 4)

    @staticmethod
    def _quantize_groups(x: torch.Tensor, dim: int, dtype: torch.dtype, what: str):
        lo, hi = torch.aminmax(x, dim=dim)
        check_finite(lo, hi, what)
        lo, hi = canonical_zero(lo), canonical_zero(hi)  # stored stats never depend on -0 vs +0
        mn = round_down(lo, dtype)
        scale = round_up(div_exact(hi - mn.float(), LEVELS), dtype)  # not ... / 15: see div_exact
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
        x.sub_(mn.float().unsqueeze(dim)).div_(safe.unsqueeze(dim)).round_().clamp_(0, LEVELS)
        return pack_nibbles(x.to(torch.uint8)), scale, mn

    def quantize(self, k: torch.Tensor, v: torch.Tensor, s: BlockShape) -> dict[str, torch.Tensor]:
        k_shape, k_dim, v_shape, v_dim = self._grouped(s)
        xk = torch.empty((s.layers, s.tokens, s.heads, s.dim), dtype=torch.float32, device=k.device)
        xk.copy_(k)
        xv = torch.empty_like(xk)
        xv.copy_(v)
        kc, ks, km = self._quantize_groups(xk.view(k_shape), k_dim, s.dtype, "K")
        vc, vs, vm = self._quantize_groups(xv.view(v_shape), v_dim, s.dtype, "V")
        return {"k_codes": kc, "v_codes": vc, "k_scale": ks, "k_min": km, "v_scale": vs, "v_min": vm}

    def dequantize(self, parts: dict[str, torch.Tensor], s: BlockShape,
                   k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        k_shape, k_dim, v_shape, v_dim = self._grouped(s)
        full = (s.layers, s.tokens, s.heads, s.dim)
        for codes, scale, mn, shape, dim, out in (
                (parts["k_codes"], parts["k_scale"], parts["k_min"], k_shape, k_dim, k_out),
                (parts["v_codes"], parts["v_scale"], parts["v_min"], v_shape, v_dim, v_out)):
            x = unpack_nibbles(codes).float().view(shape)
            x.mul_(scale.float().unsqueeze(dim)).add_(mn.float().unsqueeze(dim))
            out.copy_(x.view(full))

    def fast_encode(self, fast, k_src, v_src, parts: dict[str, torch.Tensor]) -> None:
        for name, (words, geom), kernel in (("k", k_src, fast.int4_encode_keys),
                                            ("v", v_src, fast.int4_encode_values)):
            group = min(self.group, geom[2] if name == "k" else geom[4])
            codes = parts[f"{name}_codes"].numpy()
            scale, mn = fast.words(parts[f"{name}_scale"]), fast.words(parts[f"{name}_min"])
            per_layer = codes.size // geom[1]
            bad = fast.by_layers(geom, lambda a, b, g, k=kernel, w=words, c=codes, s=scale, m=mn, n=per_layer,
                                 gr=group: k(w, *g, gr, c[a * n:b * n], s[a:b], m[a:b]))
            if bad:
                raise CodecError(f"block contains NaN or Inf in {name.upper()}; refusing to encode it")

    def fast_decode(self, fast, parts: dict[str, torch.Tensor], kv: int, words, geom) -> None:
        name = "k" if kv == 0 else "v"
        group = min(self.group, geom[2] if kv == 0 else geom[4])
        codes = parts[f"{name}_codes"].numpy()
        scale, mn = fast.words(parts[f"{name}_scale"]), fast.words(parts[f"{name}_min"])
        n = codes.size // geom[1]
        kernel = fast.int4_decode_keys if kv == 0 else fast.int4_decode_values
        fast.by_layers(geom, lambda a, b, g: kernel(codes[a * n:b * n], scale[a:b], mn[a:b], words, *g, group))
