"""Compiled (numba) CPU kernels for ``int4_g64_out1``: the choice of each layer's kept token, its
keys' per-channel statistics without that token, and decode with the kept rows in place; the same
bytes as the torch reference in ``int4_out1.py``. Values are encoded by ``fast_cpu``'s
``int4_encode_values`` unchanged.

Kernels read and write one tensor of a block through its geometry in 32-bit words (``D2`` =
D/2), as ``fast_cpu``'s INT4 kernels, over a range ``[u0, u1)`` of units (layers for the keys,
(layer, token) rows for the values), which ``fast_runner`` splits across threads. The key encoder
takes three passes over a layer's keys (in cache): the two largest and two smallest values of each
(head, channel) (ordered keys), which give each extreme's gain and the statistics without the kept
token; each token's score (the gains of the extremes it holds); and the codes, as
``int4_encode_keys`` writes them.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import types

from kvstore.codecs.bits import BF16_NONFINITE, ONE, U16, U32, ZERO, and16, bf16_to_f32, key_to_f32, max16, min16, order_key
from kvstore.codecs.compiled import Kernel
from kvstore.codecs.fast_cpu import int4_nonfinite, int4_stats, pack4, row_at, unpack4

GAIN_STEPS = np.float32(65536.0)
_MAG = U16(0x7FFF)
_KEY_MAX, _KEY_MIN = np.int16(32767), np.int16(-32768)

_I = types.int64
_U8, _U16 = (types.Array(t, 1, "C") for t in (types.uint8, types.uint16))
_IN8, _IN16, _IN32 = (types.Array(t, 1, "C", readonly=True) for t in (types.uint8, types.uint16, types.uint32))
_U32 = types.Array(types.uint32, 1, "C")
_GEOM = (_I, _I, _I, _I, _I, _I, _I)   # offset, T, H, D2, stride_layer, stride_token, stride_head (32-bit words)
_SIGNATURES = {
    "int4_out1_encode_keys": types.int64(_IN16, _IN32, *_GEOM, _IN16, _I, _I, _I, _I, _I, _I,
                                         _U8, _U16, _U16, _U16, _U16, _U16),
    "int4_out1_decode_keys": types.none(_IN8, _IN16, _IN16, _IN32, _IN16, _U32, *_GEOM, _I, _I),
    "int4_out1_decode_values": types.none(_IN8, _IN16, _IN16, _IN32, _IN16, _U32, *_GEOM, _I, _I, _I),
}

KERNEL_NAMES = tuple(_SIGNATURES)   # what ``compiled.compile_all`` compiles here


@njit(inline="always")
def _gain(a, b, rng):
    """floor((a - b) / rng * 2^16) as an integer, 0 for an empty range (the reference's steps)."""
    q = np.floor(((a - b) / (rng if rng > ZERO else ONE)) * GAIN_STEPS)
    return np.int64(q) if rng > ZERO else np.int64(0)


@njit(inline="always")
def _copy_row(src16, row, D, kept, k0):
    """The bf16 row at 16-bit word ``row`` -> kept[k0:k0+D], a -0 as +0; 1 if it holds NaN/Inf."""
    bad = 0
    for d in range(D):
        w = src16[row + d]
        m = and16(w, _MAG)
        bad |= 1 if m >= BF16_NONFINITE else 0
        kept[k0 + d] = U16(0) if m == U16(0) else w
    return bad


def int4_out1_encode_keys(src16, src, off, T, H, D2, sl, st, sh, osrc16, ooff, osl, ost, osh, u0, u1,
                          codes, scale, mn, kept, okept, tok):
    """Units = layers. Per layer: the kept token (``int4_out1.kept_tokens``), its rows of this
    tensor and of the other one (``osrc16`` at 16-bit geometry ``ooff, osl, ost, osh``) into
    ``kept`` / ``okept`` ([L*H*D] each), then per (head, channel) INT4 statistics over the other
    tokens and codes for every token (the kept one's from token (t + 1) % T). codes
    [L*T*H*D2]; scale/mn [L*H*D]; tok [L]. Returns 1 if a NaN/Inf was met."""
    D = 2 * D2
    HD = H * D
    b0, b1 = np.empty(HD, np.int16), np.empty(HD, np.int16)   # largest, second largest (ordered keys)
    l0, l1 = np.empty(HD, np.int16), np.empty(HD, np.int16)   # smallest, second smallest
    ghi, glo = np.empty(HD, np.int32), np.empty(HD, np.int32)   # each (head, channel)'s gains
    score = np.empty(T, np.int64)
    mq, sq = np.empty(D, np.uint16), np.empty(D, np.uint16)
    mf, sf = np.empty(D, np.float32), np.empty(D, np.float32)
    sf0, mf0 = np.empty(D2, np.float32), np.empty(D2, np.float32)   # even channels
    sf1, mf1 = np.empty(D2, np.float32), np.empty(D2, np.float32)   # odd channels
    bad = 0
    for l in range(u0, u1):
        for k in range(HD):
            b0[k] = _KEY_MIN
            b1[k] = _KEY_MIN
            l0[k] = _KEY_MAX
            l1[k] = _KEY_MAX
        for t in range(T):   # the two largest and two smallest of each (head, channel)
            for h in range(H):
                row = row_at(off, l, t, h, sl, st, sh)
                x = src16[2 * row:2 * (row + D2)]
                hb0, hb1 = b0[h * D:(h + 1) * D], b1[h * D:(h + 1) * D]
                hl0, hl1 = l0[h * D:(h + 1) * D], l1[h * D:(h + 1) * D]
                for d in range(D):
                    v = order_key(x[d])
                    a = hb0[d]
                    hb1[d] = max16(hb1[d], min16(a, v))
                    hb0[d] = max16(a, v)
                    a = hl0[d]
                    hl1[d] = min16(hl1[d], max16(a, v))
                    hl0[d] = min16(a, v)
        for k in range(HD):
            top, low = key_to_f32(b0[k]), key_to_f32(l0[k])
            rng = top - low
            ghi[k] = _gain(top, key_to_f32(b1[k]), rng)
            glo[k] = _gain(key_to_f32(l1[k]), low, rng)
        # Each token's score: the gains of the extremes it holds. A tied extreme gains 0, so
        # crediting every token equal to it is crediting the reference's argmax.
        for t in range(T):
            s = np.int64(0)
            for h in range(H):
                row = row_at(off, l, t, h, sl, st, sh)
                x = src16[2 * row:2 * (row + D2)]
                hb0, hl0 = b0[h * D:(h + 1) * D], l0[h * D:(h + 1) * D]
                hg, lg = ghi[h * D:(h + 1) * D], glo[h * D:(h + 1) * D]
                acc = np.int32(0)
                for d in range(D):
                    v = order_key(x[d])
                    acc += (hg[d] if v == hb0[d] else np.int32(0)) + (lg[d] if v == hl0[d] else np.int32(0))
                s += acc
            score[t] = s
        keep = 0
        for t in range(1, T):
            if score[t] > score[keep]:
                keep = t
        tok[l] = U16(keep)
        for h in range(H):
            k0 = (l * H + h) * D
            bad |= _copy_row(src16, 2 * row_at(off, l, keep, h, sl, st, sh), D, kept, k0)
            bad |= _copy_row(osrc16, ooff + l * osl + keep * ost + h * osh, D, okept, k0)
        nb = keep + 1 if keep + 1 < T else 0
        for h in range(H):
            xk = src16[2 * row_at(off, l, keep, h, sl, st, sh):]
            for d in range(D):   # the others' extremes: the second where the kept token holds one
                k = h * D + d
                v = order_key(xk[d])
                hi = b1[k] if v == b0[k] else b0[k]
                lo = l1[k] if v == l0[k] else l0[k]
                bad |= int4_nonfinite(lo, hi)
                mq[d], sq[d], mf[d], sf[d] = int4_stats(lo, hi)
            base = (l * H + h) * D
            mn[base:base + D] = mq
            scale[base:base + D] = sq
            for j in range(D2):
                mf0[j], sf0[j], mf1[j], sf1[j] = mf[2 * j], sf[2 * j], mf[2 * j + 1], sf[2 * j + 1]
            for t in range(T):   # (the kept token's codes: its neighbour's, below)
                row = row_at(off, l, t, h, sl, st, sh)
                w = src[row:row + D2]
                i = (l * T + t) * H + h
                c = codes[i * D2:(i + 1) * D2]
                for j in range(D2):
                    c[j] = pack4(w[j], mf0[j], sf0[j], mf1[j], sf1[j])
            i = (l * T + keep) * H + h
            codes[i * D2:(i + 1) * D2] = codes[((l * T + nb) * H + h) * D2:((l * T + nb) * H + h + 1) * D2]
    return bad


def int4_out1_decode_keys(codes, scale, mn, kept, tok, out, off, T, H, D2, sl, st, sh, u0, u1):
    """Units = layers: ``int4_decode_keys`` over the block's tokens, the kept token's row from
    ``kept`` ([L*H*D2] 32-bit words)."""
    sf0, mf0 = np.empty(D2, np.float32), np.empty(D2, np.float32)   # even channels
    sf1, mf1 = np.empty(D2, np.float32), np.empty(D2, np.float32)   # odd channels
    for l in range(u0, u1):
        keep = np.int64(tok[l])
        for h in range(H):
            base = (l * H + h) * 2 * D2
            for j in range(D2):
                sf0[j] = bf16_to_f32(scale[base + 2 * j])
                mf0[j] = bf16_to_f32(mn[base + 2 * j])
                sf1[j] = bf16_to_f32(scale[base + 2 * j + 1])
                mf1[j] = bf16_to_f32(mn[base + 2 * j + 1])
            for t in range(T):
                row = row_at(off, l, t, h, sl, st, sh)
                o = out[row:row + D2]
                if t == keep:
                    k = kept[(l * H + h) * D2:(l * H + h + 1) * D2]
                    for j in range(D2):
                        o[j] = k[j]
                    continue
                i = (l * T + t) * H + h
                c = codes[i * D2:(i + 1) * D2]
                for j in range(D2):
                    o[j] = unpack4(U32(c[j]), sf0[j], mf0[j], sf1[j], mf1[j])


def int4_out1_decode_values(codes, scale, mn, kept, tok, out, off, T, H, D2, sl, st, sh, vg2, u0, u1):
    """Units = (layer, token) rows: ``int4_decode_values``, the kept token's rows from ``kept``."""
    groups = D2 // vg2
    for u in range(u0, u1):
        l = u // T
        t = u - l * T
        keep = t == np.int64(tok[l])
        for h in range(H):
            row = row_at(off, l, t, h, sl, st, sh)
            if keep:
                o = out[row:row + D2]
                k = kept[(l * H + h) * D2:(l * H + h + 1) * D2]
                for j in range(D2):
                    o[j] = k[j]
                continue
            i = u * H + h
            for g in range(groups):
                sf = bf16_to_f32(scale[i * groups + g])
                mf = bf16_to_f32(mn[i * groups + g])
                o = out[row + g * vg2:row + (g + 1) * vg2]
                c = codes[i * D2 + g * vg2:i * D2 + (g + 1) * vg2]
                for j in range(vg2):
                    o[j] = unpack4(U32(c[j]), sf, mf, sf, mf)


int4_out1_encode_keys = Kernel(int4_out1_encode_keys, _SIGNATURES["int4_out1_encode_keys"])
int4_out1_decode_keys = Kernel(int4_out1_decode_keys, _SIGNATURES["int4_out1_decode_keys"])
int4_out1_decode_values = Kernel(int4_out1_decode_values, _SIGNATURES["int4_out1_decode_values"])
