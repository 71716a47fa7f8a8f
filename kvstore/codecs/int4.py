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

from kvstore.codecs.base import Section, SectionCodec
from kvstore.codecs.exact import (canonical_zero, div_exact, finiteness_check, min_max, nonzero_or_one, round_down,
                                  round_up)
from kvstore.codecs.layout import BlockShape, split_kv
from kvstore.errors import CodecError

LEVELS = 15


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

    def quantize(self, x: torch.Tensor, s: BlockShape, parts: dict[str, torch.Tensor],
                 check: torch.Tensor) -> None:
        """K and V groups differ in shape, so only their reductions and group-wise steps run apart;
        their statistics share one tensor (one pass of each rounding step for both) and the
        elementwise steps run over the whole block."""
        k_shape, k_dim, v_shape, v_dim = self._grouped(s)
        k_stats, v_stats = parts["k_scale"].shape, parts["v_scale"].shape
        nk = parts["k_scale"].numel()
        minmax = torch.empty((2, nk + parts["v_scale"].numel()), dtype=torch.float32, device=x.device)
        lo, hi = minmax[0], minmax[1]  # K groups, then V groups
        min_max(x[0].view(k_shape), k_dim, (lo[:nk].view(k_stats), hi[:nk].view(k_stats)))
        min_max(x[1].view(v_shape), v_dim, (lo[nk:].view(v_stats), hi[nk:].view(v_stats)))
        finiteness_check(minmax, check)
        lo, hi = canonical_zero(minmax)  # stored stats never depend on -0 vs +0
        stats = torch.empty((2, minmax.shape[1]), dtype=s.dtype, device=x.device)  # scale, min: payload order
        mn = round_down(lo, s.dtype, out=stats[1])
        scale = round_up(div_exact(hi - mn, LEVELS), s.dtype, out=stats[0])  # not ... / 15: see div_exact
        safe = nonzero_or_one(scale)
        self.rows(parts, ("k_scale", "k_min")).copy_(stats[:, :nk].view(2, *k_stats))
        self.rows(parts, ("v_scale", "v_min")).copy_(stats[:, nk:].view(2, *v_stats))
        for i, shape, dim, groups, n in ((0, k_shape, k_dim, slice(0, nk), k_stats),
                                         (1, v_shape, v_dim, slice(nk, None), v_stats)):
            x[i].view(shape).sub_(mn[groups].view(n).unsqueeze(dim)).div_(safe[groups].view(n).unsqueeze(dim))
        x.round_().clamp_(0, LEVELS)
        pairs = x.view(2, -1, 2)  # two codes per byte, even element in the low nibble
        self.rows(parts, ("k_codes", "v_codes")).copy_(torch.add(pairs[..., 0], pairs[..., 1], alpha=16))

    def dequantize(self, parts: dict[str, torch.Tensor], s: BlockShape, block: torch.Tensor) -> None:
        codes = self.rows(parts, ("k_codes", "v_codes"))
        x = torch.empty((*codes.shape, 2), dtype=torch.float32, device=codes.device)
        # Unpack in uint8, then widen: CUDA has no bitwise kernels writing a float `out`
        # (the CPU accepts it; the first H200 run failed every INT4 decode on that).
        x[..., 0].copy_(torch.bitwise_and(codes, 0x0F))
        x[..., 1].copy_(torch.bitwise_right_shift(codes, 4))
        k_shape, k_dim, v_shape, v_dim = self._grouped(s)
        for i, (name, shape, dim, out) in enumerate(zip("kv", (k_shape, v_shape), (k_dim, v_dim),
                                                        split_kv(block, s))):
            g = x[i].view(shape).mul_(parts[f"{name}_scale"].unsqueeze(dim))
            torch.add(g, parts[f"{name}_min"].unsqueeze(dim), out=out.view(shape))  # float32 sum, stored rounded

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
