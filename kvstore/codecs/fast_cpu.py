"""Compiled (numba) CPU kernels for bf16 blocks: the same arithmetic as the torch reference in
``fp8.py`` / ``int4.py``, bit for bit, in one vectorised pass instead of a dozen torch ops.

Each kernel handles one tensor of a block (K, V, a K-only or V-only segment, an MLA latent) read
in place through its geometry ``(offset, T, H, D, stride_layer, stride_token, stride_head)`` in
elements (rows of ``D`` must be contiguous), over a range ``[u0, u1)`` of *units*: (layer, token)
rows, or (layer, key group) for INT4 keys, or layers for ``fp8_head``. ``fast_runner`` splits units
across threads. INT4 kernels read and write the block as 32-bit words (two bf16 values per word:
the low half is the even element, as INT4's nibbles pair them), so ``D`` and every offset and
stride are even there.

The inner loops are written for LLVM's vectoriser: 16/32-bit integer steps via ``bits``, ordered
integer keys for min/max, no data-dependent branches. No fastmath: a / b stays a true division and
a * b + c is never contracted to an FMA, exactly as torch computes them on CPU and CUDA. Every
rounding step mirrors the reference; tests/test_codecs.py checks payloads and decoded blocks are
byte-identical. The rotated codecs' kernels are ``fast_rotated``'s, built on the steps here
(``split_unit``, ``row_at``, ``abs_max16``, ``row_scale``, ``int4_stats``, ``q4``, ``int8_code``).
Used only when numba is importable, the block is bf16, the work is on the CPU and every kernel is
compiled (``compiled``).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import types

from kvstore.codecs.bits import (BF16_NONFINITE, F32_INF, KEY_NEG_INF, KEY_POS_INF, ONE, U16, U32, ZERO, add32, and16,
                                 and32, bf16_round_down, bf16_round_up, bf16_to_f32, bits_f32, e4m3_as_half, f32_bits,
                                 f32_to_bf16_bits, f32_to_e4m3, half_to_f32, key_to_f32, max16, min16, or32, order_key,
                                 plus_zero, shl32, shr32)
from kvstore.codecs.compiled import Kernel

E4M3_MAX = np.float32(448.0)
HALF_SCALE = np.float32(256.0)   # e4m3_as_half reads a code as value * 2**-8
LEVELS = np.float32(15.0)
_MAG = U16(0x7FFF)
_LOW4, _S4, _S16, _HIGH16 = U32(15), U32(4), U32(16), U32(0xFFFF0000)
_ROUND, _ONE32, _S8 = U32(0x7FFF), U32(1), U16(8)
_KEY_MAX, _KEY_MIN = np.int16(32767), np.int16(-32768)

_I = types.int64
_U8, _U16, _U32 = (types.Array(t, 1, "C") for t in (types.uint8, types.uint16, types.uint32))
# inputs are typed read-only, so read-only buffers (a payload from bytes) pass without a copy
_IN8, _IN16, _IN32 = (types.Array(t, 1, "C", readonly=True) for t in (types.uint8, types.uint16, types.uint32))
_GEOM = (_I, _I, _I, _I, _I, _I, _I)   # offset, T, H, D, stride_layer, stride_token, stride_head
_SIGNATURES = {
    "fp8_encode": types.int64(_IN16, *_GEOM, _I, _I, _U8, _U16),
    "fp8_head_encode": types.int64(_IN16, *_GEOM, _I, _I, _U8, _U16),
    "fp8_decode": types.none(_IN16, _IN16, types.boolean, _U32, *_GEOM, _I, _I),
    "int4_encode_keys": types.int64(_IN16, _IN32, *_GEOM, _I, _I, _I, _U8, _U16, _U16),
    "int4_encode_values": types.int64(_IN16, _IN32, *_GEOM, _I, _I, _I, _U8, _U16, _U16),
    "int4_decode_keys": types.none(_IN8, _IN16, _IN16, _U32, *_GEOM, _I, _I, _I),
    "int4_decode_values": types.none(_IN8, _IN16, _IN16, _U32, *_GEOM, _I, _I, _I),
    "int8_encode": types.int64(_IN16, *_GEOM, _I, _I, _U8, _U16),
    "int8_decode": types.none(_IN16, _IN16, _U32, *_GEOM, _I, _I),
}

KERNEL_NAMES = tuple(_SIGNATURES)   # what ``compiled.compile_all`` compiles here


def kernel(fn):
    """``fn`` as a kernel compiled for its one signature, in the background (``compiled``)."""
    return Kernel(fn, _SIGNATURES[fn.__name__])


@njit(inline="always")
def split_unit(u, n):
    """Unit ``u`` of ``n`` per layer -> (layer, index within the layer)."""
    l = u // n
    return l, u - l * n


@njit(inline="always")
def row_at(off, l, t, h, sl, st, sh):
    """Where row (layer, token, head) of a tensor starts in its block."""
    return off + l * sl + t * st + h * sh


# --- FP8 ----------------------------------------------------------------------------------------

@njit(inline="always")
def row_scale(amax, qmax):
    """(stored bf16 scale, divisor) of a row whose largest magnitude is ``amax`` (float32): the
    scale is amax / qmax rounded up, so no code saturates; a zero scale divides by 1."""
    s = bf16_round_up(amax / qmax)
    sf = bf16_to_f32(s)
    return s, (ONE if sf == ZERO else sf)


@njit(inline="always")
def e4m3_code(v, safe):
    """The reference clamps v / scale to +-448 first; for finite rows it never needs to (|v| <=
    amax and scale >= amax / 448 up to one float32 rounding, so |v / scale| < 464, which e4m3
    rounds to 448), and a row with NaN/Inf is refused whatever its codes."""
    return f32_to_e4m3(v / safe)


@njit(inline="always")
def code_row(x, codes, safe, D, code):
    """``codes[d] = code(x[d], safe)`` over a bf16 row."""
    for d in range(D):
        codes[d] = code(bf16_to_f32(x[d]), safe)


@njit(inline="always")
def abs_max16(x, D):
    m = U16(0)
    for d in range(D):
        m = max(m, and16(x[d], _MAG))
    return m


@njit(inline="always")
def scaled_rows_encode(src, off, T, H, D, sl, st, sh, u0, u1, codes, scales, qmax, code):
    """Units = (layer, token) rows u = l*T + t; one scale ``row_scale(amax, qmax)`` per (token,
    head), codes ``code(x, scale)``. codes [U*H*D], scales [U*H] of this tensor. Returns 1 if a
    NaN/Inf was met (then nothing is valid)."""
    bad = 0
    for u in range(u0, u1):
        l, t = split_unit(u, T)
        for h in range(H):
            row = row_at(off, l, t, h, sl, st, sh)
            x = src[row:row + D]
            m = abs_max16(x, D)
            if m >= BF16_NONFINITE:
                bad = 1
            s, safe = row_scale(bf16_to_f32(m), qmax)
            i = u * H + h
            scales[i] = s
            code_row(x, codes[i * D:(i + 1) * D], safe, D, code)
    return bad


@kernel
def fp8_encode(src, off, T, H, D, sl, st, sh, u0, u1, codes, scales):
    """e4m3 codes of ``x / scale``, scale = amax / 448 (``scaled_rows_encode``)."""
    return scaled_rows_encode(src, off, T, H, D, sl, st, sh, u0, u1, codes, scales, E4M3_MAX, e4m3_code)


@kernel
def fp8_head_encode(src, off, T, H, D, sl, st, sh, u0, u1, codes, scales):
    """Units = layers; one scale per (layer, head) over the block's T tokens. scales [L*H]."""
    bad = 0
    for l in range(u0, u1):
        for h in range(H):
            m = U16(0)
            for t in range(T):
                row = row_at(off, l, t, h, sl, st, sh)
                m = max(m, abs_max16(src[row:row + D], D))
            if m >= BF16_NONFINITE:
                bad = 1
            s, sf = row_scale(bf16_to_f32(m), E4M3_MAX)
            scales[l * H + h] = s
            for t in range(T):
                row = row_at(off, l, t, h, sl, st, sh)
                i = (l * T + t) * H + h
                code_row(src[row:row + D], codes[i * D:(i + 1) * D], sf, D, e4m3_code)
    return bad


@njit(inline="always")
def _bf16_high(x):
    """bf16 of ``x`` (round to nearest even) in the high half of a 32-bit word, low half zero."""
    b = f32_bits(x)
    return and32(add32(add32(b, _ROUND), and32(shr32(b, _S16), _ONE32)), _HIGH16)


@njit(inline="always")
def _fp8_pair(w, a, b):
    """Two e4m3 codes (a 16-bit word, even element in the low byte) -> two bf16 in a 32-bit word:
    (code as half) * a * b in float32 steps."""
    x0 = (half_to_f32(e4m3_as_half(np.uint8(w))) * a) * b
    x1 = (half_to_f32(e4m3_as_half(np.uint8(w >> _S8))) * a) * b
    return or32(shr32(_bf16_high(x0), _S16), _bf16_high(x1))


@kernel
def fp8_decode(codes, scales, per_head, out, off, T, H, D2, sl, st, sh, u0, u1):
    """Units = (layer, token) rows; codes read as 16-bit pairs, the block written as 32-bit words
    (geometry in words, ``D2`` = D/2). ``lut[c] * scale`` of the reference as ``(c as half) *
    (scale * 256)``: the same real product, rounded once (the half is exact and normal in float32,
    ``scale * 256`` exact unless it overflows, where the two factors go in one by one)."""
    for u in range(u0, u1):
        l, t = split_unit(u, T)
        for h in range(H):
            sf = bf16_to_f32(scales[l * H + h] if per_head else scales[u * H + h])
            k = sf * HALF_SCALE
            row = row_at(off, l, t, h, sl, st, sh)
            o = out[row:row + D2]
            i = u * H + h
            c = codes[i * D2:(i + 1) * D2]
            if k < F32_INF:
                for j in range(D2):
                    o[j] = _fp8_pair(c[j], k, ONE)
            else:
                for j in range(D2):
                    o[j] = _fp8_pair(c[j], sf, HALF_SCALE)


# --- INT4 ---------------------------------------------------------------------------------------

@njit(inline="always")
def int4_stats(lo, hi):
    """(min bf16, scale bf16, min as float, divisor) of a group from its smallest and largest
    value (float32)."""
    m = bf16_round_down(plus_zero(lo))
    mf = bf16_to_f32(m)
    s = bf16_round_up((plus_zero(hi) - mf) / LEVELS)
    sf = bf16_to_f32(s)
    return m, s, mf, (ONE if sf == ZERO else sf)


@njit(inline="always")
def _nonfinite(lo_key, hi_key):
    return 1 if (lo_key <= KEY_NEG_INF or hi_key >= KEY_POS_INF) else 0


@njit(inline="always")
def q4(v, mf, safe):
    return U32(np.int32(min(max(np.rint((v - mf) / safe), ZERO), LEVELS)))


@njit(inline="always")
def _pack(w, mf0, sf0, mf1, sf1):
    """One 32-bit word (two bf16) -> one byte of two codes (even element in the low nibble)."""
    q0 = q4(bits_f32(shl32(w, _S16)), mf0, sf0)
    q1 = q4(bits_f32(and32(w, _HIGH16)), mf1, sf1)
    return np.uint8(or32(q0, shl32(q1, _S4)))


@njit(inline="always")
def _unpack(b, sf0, mf0, sf1, mf1):
    """One byte of two codes -> one 32-bit word of two bf16: q * scale + min, as float32 steps."""
    lo = f32_to_bf16_bits(np.float32(and32(b, _LOW4)) * sf0 + mf0)
    hi = f32_to_bf16_bits(np.float32(shr32(b, _S4)) * sf1 + mf1)
    return or32(lo, shl32(hi, _S16))


@kernel
def int4_encode_values(src16, src, off, T, H, D2, sl, st, sh, vg2, u0, u1, codes, scale, mn):
    """Per token, groups of ``2*vg2`` dims. Units = (layer, token) rows. ``src`` (the block as
    32-bit words; ``src16`` the same as 16-bit words) and geometry in words (``D2`` = D/2).
    codes [U*H*D2]; scale/mn [U*H*groups]."""
    groups = D2 // vg2
    bad = 0
    for u in range(u0, u1):
        l, t = split_unit(u, T)
        for h in range(H):
            row = row_at(off, l, t, h, sl, st, sh)
            i = u * H + h
            for g in range(groups):
                a = row + g * vg2
                x = src16[2 * a:2 * (a + vg2)]
                lo, hi = _KEY_MAX, _KEY_MIN
                for j in range(2 * vg2):
                    k = order_key(x[j])
                    lo = min16(lo, k)
                    hi = max16(hi, k)
                bad |= _nonfinite(lo, hi)
                m, s, mf, sf = int4_stats(key_to_f32(lo), key_to_f32(hi))
                mn[i * groups + g] = m
                scale[i * groups + g] = s
                w = src[a:a + vg2]
                c = codes[i * D2 + g * vg2:i * D2 + (g + 1) * vg2]
                for j in range(vg2):
                    c[j] = _pack(w[j], mf, sf, mf, sf)
    return bad


@kernel
def int4_encode_keys(src16, src, off, T, H, D2, sl, st, sh, kg, u0, u1, codes, scale, mn):
    """Per channel, groups of ``kg`` tokens. Units = (layer, key group). Geometry in 32-bit
    words. codes [L*T*H*D2] ((layer, token, head) rows); scale/mn [U*H*D]."""
    groups = T // kg
    D = 2 * D2
    lo, hi = np.empty(D, np.int16), np.empty(D, np.int16)
    mf, sf = np.empty(D, np.float32), np.empty(D, np.float32)
    mq, sq = np.empty(D, np.uint16), np.empty(D, np.uint16)   # (stored apart: see below)
    sf0, mf0 = np.empty(D2, np.float32), np.empty(D2, np.float32)   # even channels
    sf1, mf1 = np.empty(D2, np.float32), np.empty(D2, np.float32)   # odd channels
    bad = 0
    for u in range(u0, u1):
        l, g = split_unit(u, groups)
        for h in range(H):
            lo[:] = _KEY_MAX
            hi[:] = _KEY_MIN
            for t in range(g * kg, (g + 1) * kg):
                row = row_at(off, l, t, h, sl, st, sh)
                x = src16[2 * row:2 * (row + D2)]
                for d in range(D):
                    k = order_key(x[d])
                    lo[d] = min16(lo[d], k)
                    hi[d] = max16(hi[d], k)
            for d in range(D):
                bad |= _nonfinite(lo[d], hi[d])
                mq[d], sq[d], mf[d], sf[d] = int4_stats(key_to_f32(lo[d]), key_to_f32(hi[d]))
            # Copied out after the loop: with both outputs in one payload buffer the loop above
            # stops vectorising (measured: 2x slower kernel).
            base = (u * H + h) * D
            mn[base:base + D] = mq
            scale[base:base + D] = sq
            for j in range(D2):
                mf0[j], sf0[j], mf1[j], sf1[j] = mf[2 * j], sf[2 * j], mf[2 * j + 1], sf[2 * j + 1]
            for t in range(g * kg, (g + 1) * kg):
                row = row_at(off, l, t, h, sl, st, sh)
                w = src[row:row + D2]
                i = (l * T + t) * H + h
                c = codes[i * D2:(i + 1) * D2]
                for j in range(D2):
                    c[j] = _pack(w[j], mf0[j], sf0[j], mf1[j], sf1[j])
    return bad


@kernel
def int4_decode_values(codes, scale, mn, out, off, T, H, D2, sl, st, sh, vg2, u0, u1):
    groups = D2 // vg2
    for u in range(u0, u1):
        l, t = split_unit(u, T)
        for h in range(H):
            row = row_at(off, l, t, h, sl, st, sh)
            i = u * H + h
            for g in range(groups):
                sf = bf16_to_f32(scale[i * groups + g])
                mf = bf16_to_f32(mn[i * groups + g])
                o = out[row + g * vg2:row + (g + 1) * vg2]
                c = codes[i * D2 + g * vg2:i * D2 + (g + 1) * vg2]
                for j in range(vg2):
                    o[j] = _unpack(U32(c[j]), sf, mf, sf, mf)


@kernel
def int4_decode_keys(codes, scale, mn, out, off, T, H, D2, sl, st, sh, kg, u0, u1):
    groups = T // kg
    sf0, mf0 = np.empty(D2, np.float32), np.empty(D2, np.float32)   # even channels
    sf1, mf1 = np.empty(D2, np.float32), np.empty(D2, np.float32)   # odd channels
    for u in range(u0, u1):
        l, g = split_unit(u, groups)
        for h in range(H):
            base = (u * H + h) * 2 * D2
            for j in range(D2):
                sf0[j] = bf16_to_f32(scale[base + 2 * j])
                mf0[j] = bf16_to_f32(mn[base + 2 * j])
                sf1[j] = bf16_to_f32(scale[base + 2 * j + 1])
                mf1[j] = bf16_to_f32(mn[base + 2 * j + 1])
            for t in range(g * kg, (g + 1) * kg):
                row = row_at(off, l, t, h, sl, st, sh)
                o = out[row:row + D2]
                i = (l * T + t) * H + h
                c = codes[i * D2:(i + 1) * D2]
                for j in range(D2):
                    o[j] = _unpack(U32(c[j]), sf0[j], mf0[j], sf1[j], mf1[j])




# --- INT8, symmetric, one scale per (token, head) row (``int8.py``) ------------------------------

INT8_MAX = np.float32(127.0)


@njit(inline="always")
def int8_code(v, safe):
    return np.uint8(np.int8(np.int32(min(max(np.rint(v / safe), -INT8_MAX), INT8_MAX))))


@kernel
def int8_encode(src, off, T, H, D, sl, st, sh, u0, u1, codes, scales):
    """int8 codes ``rint(x / scale)`` as int8 bits, scale = amax / 127 (``scaled_rows_encode``)."""
    return scaled_rows_encode(src, off, T, H, D, sl, st, sh, u0, u1, codes, scales, INT8_MAX, int8_code)


@njit(inline="always")
def _int8_pair(w, sf):
    """Two int8 codes (a 16-bit word, even element in the low byte) -> two bf16 in a 32-bit word:
    code * scale in float32 (exact: 7 by 8 significant bits), rounded to bf16."""
    x0 = np.float32(np.int8(np.uint8(w))) * sf
    x1 = np.float32(np.int8(np.uint8(w >> _S8))) * sf
    return or32(shr32(_bf16_high(x0), _S16), _bf16_high(x1))


@kernel
def int8_decode(codes, scales, out, off, T, H, D2, sl, st, sh, u0, u1):
    """Units = (layer, token) rows; codes read as 16-bit pairs, the block written as 32-bit words
    (geometry in words, ``D2`` = D/2)."""
    for u in range(u0, u1):
        l, t = split_unit(u, T)
        for h in range(H):
            i = u * H + h
            sf = bf16_to_f32(scales[i])
            row = row_at(off, l, t, h, sl, st, sh)
            o = out[row:row + D2]
            c = codes[i * D2:(i + 1) * D2]
            for j in range(D2):
                o[j] = _int8_pair(c[j], sf)
