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

A one-tensor block (a K-only or V-only segment, whose role the layout does not say; an MLA latent)
is quantised as keys are, per channel: a value tensor loses a little to per-token magnitude
differences that way, while a key tensor quantised per token would lose its outlier channels.

With ``rotated`` every row (keys and values) is rotated along head_dim (a Hadamard rotation,
``rotation.py``) before it is quantised as above, and rotated back after dequantising: a row's
large elements are spread over all of its dims, so a value group's range and a key channel's
range over its tokens cover the rest more finely. Keys are still quantised per channel, now of
the rotated rows (on a real model's KV this beat both unrotated per-channel keys and rotated keys
quantised per token: ``benchmarks/results/codec_screen_real.md``).
"""

from __future__ import annotations

import torch

from kvstore.codecs import rotation
from kvstore.codecs.base import Section, SectionCodec
from kvstore.codecs.exact import (canonical_zero, div_exact, finiteness_check, min_max, nonzero_or_one, round_down,
                                  round_up)
from kvstore.codecs.fast_runner import words32_ok
from kvstore.codecs.layout import BlockShape, part_views
from kvstore.codecs.refusal import Refused

LEVELS = 15


class Int4Codec(SectionCodec):
    """``group``: tokens per key group and dims per value group; ``key_group`` (if given): tokens
    per key group, stored in the header's parameter beside ``group`` (``group + 256 * key_group``);
    ``rotated``: every row rotated first (the codec id says so).
    """

    def __init__(self, name: str, codec_id: int, group: int, key_group: int | None = None,
                 rotated: bool = False) -> None:
        self.name, self.codec_id, self.group, self.key_group = name, codec_id, group, key_group or group
        self.param = group if key_group is None else group + 256 * key_group
        self.rotated = rotated

    def rotation_size(self, s: BlockShape) -> int:
        """The rows' rotation (1: none)."""
        return rotation.size(s.dim) if self.rotated else 1

    @staticmethod
    def roles(s: BlockShape) -> tuple[str, ...]:
        """How each tensor is quantised: "k" per channel, "v" per token."""
        return ("k", "v") if s.parts == 2 else ("k",)

    def groups(self, s: BlockShape) -> tuple[int, int]:
        """(tokens per key group, dims per value group)."""
        return min(self.key_group, s.tokens), min(self.group, s.dim)

    def check_shape(self, s: BlockShape) -> None:
        kg, vg = self.groups(s)
        if s.tokens % kg:
            raise Refused("group", f"{self.name}: block_tokens={s.tokens} is not a multiple of the key "
                          f"group ({kg} tokens)")
        if "v" in self.roles(s) and s.dim % vg:
            raise Refused("group", f"{self.name}: head_dim={s.dim} is not a multiple of the value group "
                          f"({vg} dims)")
        if (s.layers * s.tokens * s.heads * s.dim) % 2:
            raise Refused("group", f"{self.name}: an odd number of elements per tensor cannot be packed "
                          "two per byte")

    def fast_ok(self, s: BlockShape) -> bool:
        return words32_ok(s)

    def _stats_shape(self, s: BlockShape, role: str) -> tuple[int, ...]:
        kg, vg = self.groups(s)
        if role == "k":
            return (s.layers, s.tokens // kg, s.heads, s.dim)
        return (s.layers, s.tokens, s.heads, s.dim // vg)

    def sections(self, s: BlockShape) -> list[Section]:
        n = s.layers * s.tokens * s.heads * s.dim
        roles = self.roles(s)
        return ([Section(f"{r}_codes", torch.uint8, (n // 2,)) for r in roles]
                + [Section(f"{r}_{stat}", s.dtype, self._stats_shape(s, r)) for r in roles for stat in ("scale", "min")])

    def _grouped(self, s: BlockShape, role: str) -> tuple[tuple[int, ...], int]:
        """A tensor [L, T, H, D] viewed with its groups on one axis, and that axis."""
        kg, vg = self.groups(s)
        if role == "k":
            return (s.layers, s.tokens // kg, kg, s.heads, s.dim), 2
        return (s.layers, s.tokens, s.heads, s.dim // vg, vg), 4

    def quantize(self, x: torch.Tensor, s: BlockShape, parts: dict[str, torch.Tensor],
                 check: torch.Tensor) -> None:
        """K and V groups differ in shape, so only their reductions and group-wise steps run apart;
        their statistics share one tensor (one pass of each rounding step for both) and the
        elementwise steps run over the whole block."""
        roles = self.roles(s)
        n = self.rotation_size(s)
        if n > 1:
            x = rotation.rotate_for_encode(x, n)
        counts = [parts[f"{r}_scale"].numel() for r in roles]
        spans = [slice(sum(counts[:i]), sum(counts[:i + 1])) for i in range(len(roles))]
        minmax = torch.empty((2, sum(counts)), dtype=torch.float32, device=x.device)
        lo, hi = minmax[0], minmax[1]  # K groups, then V groups
        for i, r in enumerate(roles):
            shape, dim = self._grouped(s, r)
            n = parts[f"{r}_scale"].shape
            min_max(x[i].view(shape), dim, (lo[spans[i]].view(n), hi[spans[i]].view(n)))
        finiteness_check(minmax, check)
        lo, hi = canonical_zero(minmax)  # stored stats never depend on -0 vs +0
        stats = torch.empty((2, minmax.shape[1]), dtype=s.dtype, device=x.device)  # scale, min: payload order
        mn = round_down(lo, s.dtype, out=stats[1])
        scale = round_up(div_exact(hi - mn, LEVELS), s.dtype, out=stats[0])  # not ... / 15: see div_exact
        safe = nonzero_or_one(scale)
        for i, r in enumerate(roles):
            n = parts[f"{r}_scale"].shape
            self.rows(parts, (f"{r}_scale", f"{r}_min")).copy_(stats[:, spans[i]].view(2, *n))
            shape, dim = self._grouped(s, r)
            x[i].view(shape).sub_(mn[spans[i]].view(n).unsqueeze(dim)).div_(safe[spans[i]].view(n).unsqueeze(dim))
        x.round_().clamp_(0, LEVELS)
        pairs = x.view(len(roles), -1, 2)  # two codes per byte, even element in the low nibble
        self.rows(parts, tuple(f"{r}_codes" for r in roles)).copy_(torch.add(pairs[..., 0], pairs[..., 1], alpha=16))

    def dequantize(self, parts: dict[str, torch.Tensor], s: BlockShape, block: torch.Tensor) -> None:
        self.dequantize_into(parts, s, part_views(block, s))

    def dequantize_into(self, parts: dict[str, torch.Tensor], s: BlockShape, outs: list[torch.Tensor]) -> None:
        """``dequantize`` into the tensors ``outs`` (``[L, T, H, D]`` views of ``s``'s shape, any
        strides)."""
        roles = self.roles(s)
        codes = self.rows(parts, tuple(f"{r}_codes" for r in roles))
        x = torch.empty((*codes.shape, 2), dtype=torch.float32, device=codes.device)
        # Unpack in uint8, then widen: CUDA has no bitwise kernels writing a float `out`
        # (the CPU accepts it; the first H200 run failed every INT4 decode on that).
        x[..., 0].copy_(torch.bitwise_and(codes, 0x0F))
        x[..., 1].copy_(torch.bitwise_right_shift(codes, 4))
        n = self.rotation_size(s)
        for i, (r, out) in enumerate(zip(roles, outs)):
            shape, dim = self._grouped(s, r)
            g = x[i].view(shape).mul_(parts[f"{r}_scale"].unsqueeze(dim))
            if n > 1:   # float32 sum, rotated back, stored rounded
                out.copy_(rotation.rotate(g.add_(parts[f"{r}_min"].unsqueeze(dim)).view(out.shape), n))
                continue
            torch.add(g, parts[f"{r}_min"].unsqueeze(dim), out=out.view(shape))  # float32 sum, stored rounded

    def fast_jobs(self, kernels, tensors: list, sections: dict, s: BlockShape, encode: bool) -> list:
        kg, vg = self.groups(s)
        n = self.rotation_size(s)
        jobs = []
        for r, (words, (off, L, T, H, D, sl, st, sh)) in zip(self.roles(s), tensors):
            w = words.view("<u4")
            g = (off // 2, T, H, D // 2, sl // 2, st // 2, sh // 2)
            codes, scale, mn = sections[f"{r}_codes"], sections[f"{r}_scale"], sections[f"{r}_min"]
            if n > 1:
                from kvstore.codecs import fast_rotated as rotated   # (numba: only reached once fast_cpu imported)
                units, group = (L * (T // kg), kg) if r == "k" else (L * T, vg)
                if encode:
                    kernel = rotated.int4_encode_keys_rot if r == "k" else rotated.int4_encode_values_rot
                    jobs.append((lambda a, b, k=kernel, w16=words, g=(off, T, H, D, sl, st, sh), gr=group, c=codes,
                                 sc=scale, m=mn: k(w16, *g, gr, n, a, b, c, sc, m), units))
                else:
                    kernel = rotated.int4_decode_keys_rot if r == "k" else rotated.int4_decode_values_rot
                    jobs.append((lambda a, b, k=kernel, w=w, g=g, gr=group, c=codes, sc=scale, m=mn: k(
                        c, sc, m, w, *g, gr, n, a, b), units))
                continue
            if r == "k":
                units, group = L * (T // kg), kg
                kernel = kernels.int4_encode_keys if encode else kernels.int4_decode_keys
            else:
                units, group = L * T, vg // 2
                kernel = kernels.int4_encode_values if encode else kernels.int4_decode_values
            if encode:
                jobs.append((lambda a, b, k=kernel, w16=words, w=w, g=g, gr=group, c=codes, sc=scale, m=mn: k(
                    w16, w, *g, gr, a, b, c, sc, m), units))
            else:
                jobs.append((lambda a, b, k=kernel, w=w, g=g, gr=group, c=codes, sc=scale, m=mn: k(
                    c, sc, m, w, *g, gr, a, b), units))
        return jobs
