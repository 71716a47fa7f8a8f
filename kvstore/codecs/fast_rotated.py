"""Compiled (numba) CPU kernels for the rotated codecs (``int8`` and ``int4`` with a Hadamard
rotation, ``rotation.py``): each (token, head) row, or each key row, is rotated in float32
(``fast_rotation``) before the same statistics and codes as ``fast_cpu``'s unrotated kernels, and
rotated back on decode; bit for bit the torch reference (tests/test_codecs.py checks).

Geometry, units and word views are as in ``fast_cpu``. Statistics come from float32 ordered-key
extremes, since a rotated row is float32, not bf16.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import types

from kvstore.codecs.bits import (BF16_NONFINITE, U32, abs_bits32, and32, bf16_to_f32, bits_f32, key32_to_f32, max32,
                                 min32, or32, order_key32, shl32, shr32, umax32)
from kvstore.codecs.compiled import Kernel
from kvstore.codecs.fast_cpu import INT8_MAX, abs_max16, int4_stats, int8_code, q4, row_at, row_scale, split_unit
from kvstore.codecs.fast_rotation import (INV64, KEY32_MAX, KEY32_MIN, extremes, hadamard64_split_from_bf16,
                                            int4_hadamard64_to_bf16, int8_hadamard64_to_bf16, load_rotated,
                                            rotate64_from_bf16, rotate_to_bf16)

_LOW4, _S4 = U32(15), U32(4)

_I = types.int64
_U8, _U16, _U32 = (types.Array(t, 1, "C") for t in (types.uint8, types.uint16, types.uint32))
_IN8, _IN16 = (types.Array(t, 1, "C", readonly=True) for t in (types.uint8, types.uint16))
_GEOM = (_I, _I, _I, _I, _I, _I, _I)   # offset, T, H, D, stride_layer, stride_token, stride_head
_SIGNATURES = {
    "int8_rot_encode": types.int64(_IN16, *_GEOM, _I, _I, _I, _U8, _U16),
    "int8_rot_decode": types.none(_IN8, _IN16, _U32, *_GEOM, _I, _I, _I),
    "int4_encode_values_rot": types.int64(_IN16, *_GEOM, _I, _I, _I, _I, _U8, _U16, _U16),
    "int4_decode_values_rot": types.none(_IN8, _IN16, _IN16, _U32, *_GEOM, _I, _I, _I, _I),
    "int4_encode_keys_rot": types.int64(_IN16, *_GEOM, _I, _I, _I, _I, _U8, _U16, _U16),
    "int4_decode_keys_rot": types.none(_IN8, _IN16, _IN16, _U32, *_GEOM, _I, _I, _I, _I),
}

KERNEL_NAMES = tuple(_SIGNATURES)   # what ``compiled.compile_all`` compiles here


def kernel(fn):
    """``fn`` as a kernel compiled for its one signature, in the background (``compiled``)."""
    return Kernel(fn, _SIGNATURES[fn.__name__])


@njit(inline="always")
def _row_nonfinite(x, D):
    """1 if the bf16 row ``x[:D]`` holds a NaN/Inf, else 0."""
    return 1 if abs_max16(x, D) >= BF16_NONFINITE else 0


@kernel
def int8_rot_encode(src, off, T, H, D, sl, st, sh, n, u0, u1, codes, scales):
    """``int8_encode`` of each (token, head) row after ``rotation.rotate_for_encode``: scale
    ``amax / 127`` of the rotated row (rounded up to bf16), codes ``rint(y / scale)``."""
    a, b = np.empty(D, np.float32), np.empty(D, np.float32)
    bad = 0
    for u in range(u0, u1):
        l, t = split_unit(u, T)
        for h in range(H):
            row = row_at(off, l, t, h, sl, st, sh)
            x = src[row:row + D]
            bad |= _row_nonfinite(x, D)
            if n == 64:
                lo, hi = rotate64_from_bf16(src, row, a, 0, D)
            else:
                load_rotated(x, a, b, D, n)
                lo, hi = extremes(a, D)
            m = umax32(abs_bits32(key32_to_f32(lo)), abs_bits32(key32_to_f32(hi)))   # (the largest |y|)
            s, safe = row_scale(bits_f32(m), INT8_MAX)
            i = u * H + h
            scales[i] = s
            c = codes[i * D:(i + 1) * D]
            for d in range(D):
                c[d] = int8_code(a[d], safe)
    return bad


@kernel
def int8_rot_decode(codes, scales, out, off, T, H, D2, sl, st, sh, n, u0, u1):
    """code * scale in float32, rotated back (``rotation.rotate``), rounded to bf16; the block
    written as 32-bit words (geometry in words, ``D2`` = D/2)."""
    D = 2 * D2
    a, b = np.empty(D, np.float32), np.empty(D, np.float32)
    for u in range(u0, u1):
        l, t = split_unit(u, T)
        for h in range(H):
            i = u * H + h
            sf = bf16_to_f32(scales[i])
            row = row_at(off, l, t, h, sl, st, sh)
            if n == 64:
                for g in range(0, D, 64):
                    int8_hadamard64_to_bf16(codes, i * D + g, sf, out, row + g // 2)
                continue
            c = codes[i * D:(i + 1) * D]
            for d in range(D):
                a[d] = np.float32(np.int8(c[d])) * sf
            rotate_to_bf16(a, b, D, n, out, row)


@kernel
def int4_encode_values_rot(src, off, T, H, D, sl, st, sh, vg, n, u0, u1, codes, scale, mn):
    """``int4_encode_values`` of each (token, head) row after ``rotation.rotate_for_encode``:
    groups of ``vg`` rotated dims, statistics from float32 extremes. Geometry in elements."""
    a, b = np.empty(D, np.float32), np.empty(D, np.float32)
    groups = D // vg
    D2, vg2 = D // 2, vg // 2
    fast = n == 64 and vg == 64
    bad = 0
    for u in range(u0, u1):
        l, t = split_unit(u, T)
        for h in range(H):
            row = row_at(off, l, t, h, sl, st, sh)
            x = src[row:row + D]
            bad |= _row_nonfinite(x, D)
            if not fast:
                load_rotated(x, a, b, D, n)
            i = u * H + h
            for g in range(groups):
                y = a[g * vg:(g + 1) * vg]
                if fast:   # (y: the even elements, then the odd ones)
                    lo, hi = hadamard64_split_from_bf16(src, row + g * 64, INV64, a, g * 64)
                else:
                    lo, hi = extremes(y, vg)
                m, s, mf, safe = int4_stats(key32_to_f32(lo), key32_to_f32(hi))
                mn[i * groups + g] = m
                scale[i * groups + g] = s
                c = codes[i * D2 + g * vg2:i * D2 + (g + 1) * vg2]
                if fast:
                    for j in range(32):
                        c[j] = np.uint8(or32(q4(y[j], mf, safe), shl32(q4(y[32 + j], mf, safe), _S4)))
                    continue
                for j in range(vg2):
                    c[j] = np.uint8(or32(q4(y[2 * j], mf, safe), shl32(q4(y[2 * j + 1], mf, safe), _S4)))
    return bad


@kernel
def int4_decode_values_rot(codes, scale, mn, out, off, T, H, D2, sl, st, sh, vg, n, u0, u1):
    """q * scale + min in float32 steps, rotated back, rounded to bf16 (geometry in words)."""
    D = 2 * D2
    a, b = np.empty(D, np.float32), np.empty(D, np.float32)
    groups = D // vg
    vg2 = vg // 2
    for u in range(u0, u1):
        l, t = split_unit(u, T)
        for h in range(H):
            i = u * H + h
            row = row_at(off, l, t, h, sl, st, sh)
            if n == 64 and vg == 64:
                for g in range(groups):
                    int4_hadamard64_to_bf16(codes, (i * groups + g) * 32, bf16_to_f32(scale[i * groups + g]),
                                            bf16_to_f32(mn[i * groups + g]), 0, out, row + g * 32)
                continue
            for g in range(groups):
                sf = bf16_to_f32(scale[i * groups + g])
                mf = bf16_to_f32(mn[i * groups + g])
                c = codes[i * D2 + g * vg2:i * D2 + (g + 1) * vg2]
                y = a[g * vg:(g + 1) * vg]
                for j in range(vg2):
                    w = U32(c[j])
                    y[2 * j] = np.float32(and32(w, _LOW4)) * sf + mf
                    y[2 * j + 1] = np.float32(shr32(w, _S4)) * sf + mf
            rotate_to_bf16(a, b, D, n, out, row)


@kernel
def int4_encode_keys_rot(src, off, T, H, D, sl, st, sh, kg, n, u0, u1, codes, scale, mn):
    """``int4_encode_keys`` of the rotated rows: per channel of the rotated rows, groups of ``kg``
    tokens, statistics from float32 extremes. Units = (layer, key group); geometry in elements."""
    groups = T // kg
    D2 = D // 2
    rows = np.empty(kg * D, np.float32)
    b = np.empty(D, np.float32)
    lo, hi = np.empty(D, np.int32), np.empty(D, np.int32)
    mf, sf = np.empty(D, np.float32), np.empty(D, np.float32)
    mq, sq = np.empty(D, np.uint16), np.empty(D, np.uint16)
    bad = 0
    for u in range(u0, u1):
        l, g = split_unit(u, groups)
        for h in range(H):
            lo[:] = KEY32_MAX
            hi[:] = KEY32_MIN
            for k in range(kg):
                row = row_at(off, l, g * kg + k, h, sl, st, sh)
                x = src[row:row + D]
                bad |= _row_nonfinite(x, D)
                y = rows[k * D:(k + 1) * D]
                if n == 64:
                    rotate64_from_bf16(src, row, rows, k * D, D)
                else:
                    load_rotated(x, y, b, D, n)
                for d in range(D):
                    key = order_key32(y[d])
                    lo[d] = min32(lo[d], key)
                    hi[d] = max32(hi[d], key)
            for d in range(D):
                mq[d], sq[d], mf[d], sf[d] = int4_stats(key32_to_f32(lo[d]), key32_to_f32(hi[d]))
            base = (u * H + h) * D
            mn[base:base + D] = mq
            scale[base:base + D] = sq
            for k in range(kg):
                y = rows[k * D:(k + 1) * D]
                i = (l * T + g * kg + k) * H + h
                c = codes[i * D2:(i + 1) * D2]
                for j in range(D2):
                    c[j] = np.uint8(or32(q4(y[2 * j], mf[2 * j], sf[2 * j]),
                                         shl32(q4(y[2 * j + 1], mf[2 * j + 1], sf[2 * j + 1]), _S4)))
    return bad


@kernel
def int4_decode_keys_rot(codes, scale, mn, out, off, T, H, D2, sl, st, sh, kg, n, u0, u1):
    """q * scale + min per channel in float32 steps, each row rotated back, rounded to bf16
    (geometry in 32-bit words)."""
    groups = T // kg
    D = 2 * D2
    a, b = np.empty(D, np.float32), np.empty(D, np.float32)
    sf, mf = np.empty(D, np.float32), np.empty(D, np.float32)
    sf_split, mf_split = np.empty(D, np.float32), np.empty(D, np.float32)   # (int4_hadamard64_to_bf16's order)
    for u in range(u0, u1):
        l, g = split_unit(u, groups)
        for h in range(H):
            base = (u * H + h) * D
            for d in range(D):
                sf[d] = bf16_to_f32(scale[base + d])
                mf[d] = bf16_to_f32(mn[base + d])
            if n == 64:
                for d in range(D):
                    p = d - d % 64 + (d % 2) * 32 + (d % 64) // 2
                    sf_split[p], mf_split[p] = sf[d], mf[d]
            for k in range(kg):
                t = g * kg + k
                i = (l * T + t) * H + h
                row = row_at(off, l, t, h, sl, st, sh)
                if n == 64:
                    for p in range(0, D, 64):
                        int4_hadamard64_to_bf16(codes, i * D2 + p // 2, sf_split, mf_split, p, out, row + p // 2)
                    continue
                c = codes[i * D2:(i + 1) * D2]
                for j in range(D2):
                    w = U32(c[j])
                    a[2 * j] = np.float32(and32(w, _LOW4)) * sf[2 * j] + mf[2 * j]
                    a[2 * j + 1] = np.float32(shr32(w, _S4)) * sf[2 * j + 1] + mf[2 * j + 1]
                rotate_to_bf16(a, b, D, n, out, row)
