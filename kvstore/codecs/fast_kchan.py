"""Compiled (numba) CPU kernels for ``int8_kchan``'s keys: INT8 with one scale per (layer, head,
channel) over the block's tokens, the same arithmetic as the torch reference in ``int8_kchan.py``,
bit for bit. Its values are plain ``int8`` rows and run ``fast_cpu``'s ``int8_encode`` /
``int8_decode``.

Kernels read and write one tensor of a block in place through its geometry ``(offset, T, H, D,
stride_layer, stride_token, stride_head)`` (rows of ``D`` contiguous), over a range ``[u0, u1)``
of units = (layer, head) pairs, which ``fast_runner`` splits across threads. Decode writes the
block as 32-bit words (two bf16 per word, the even element in the low half), so ``D`` and every
offset and stride are even there. Inner loops run along the channel axis: one scale per lane, no
data-dependent branches, no fastmath (a true division, no FMA), as in ``fast_cpu``.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import types

from kvstore.codecs.bits import (BF16_NONFINITE, ONE, U16, U32, ZERO, add32, and16, and32, bf16_round_up, bf16_to_f32,
                                 f32_bits, or32, shr32)

INT8_MAX = np.float32(127.0)
_MAG = U16(0x7FFF)
_S8 = U16(8)
_S16, _ROUND, _ONE32, _HIGH16 = U32(16), U32(0x7FFF), U32(1), U32(0xFFFF0000)

_I = types.int64
_U8, _U16, _U32 = (types.Array(t, 1, "C") for t in (types.uint8, types.uint16, types.uint32))
_IN16 = types.Array(types.uint16, 1, "C", readonly=True)
_GEOM = (_I, _I, _I, _I, _I, _I, _I)   # offset, T, H, D, stride_layer, stride_token, stride_head
_SIGNATURES = {
    "int8_kchan_encode_keys": types.int64(_IN16, *_GEOM, _I, _I, _U8, _U16),
    "int8_kchan_decode_keys": types.none(_IN16, _IN16, _U32, *_GEOM, _I, _I),
}

KERNEL_NAMES = tuple(_SIGNATURES)   # what ``codecs.warm_up`` compiles here


class _Lazy:
    """Compile a kernel on first call, for its one signature (cached on disk). Releases the GIL."""

    def __init__(self, fn) -> None:
        self.fn, self.compiled = fn, None
        self.__name__ = fn.__name__

    def __call__(self, *args):
        if self.compiled is None:
            self.compiled = njit(_SIGNATURES[self.fn.__name__], cache=True, nogil=True, error_model="numpy")(self.fn)
        return self.compiled(*args)


@njit(inline="always")
def _code(v, safe):
    """rint(v / scale) clamped to +-127, as int8 bits (torch: div, round half-even, clamp)."""
    return np.uint8(np.int8(np.int32(min(max(np.rint(v / safe), -INT8_MAX), INT8_MAX))))


@njit(inline="always")
def _bf16_bits_high(x):
    """bf16 of ``x`` (round to nearest even) in the high half of a 32-bit word, low half zero."""
    b = f32_bits(x)
    return and32(add32(add32(b, _ROUND), and32(shr32(b, _S16), _ONE32)), _HIGH16)


@njit(inline="always")
def _pair(w, s0, s1):
    """Two int8 codes (a 16-bit word, even element in the low byte) of channels with scales
    ``s0``, ``s1`` -> two bf16 in a 32-bit word: code * scale in float32 (exact), rounded."""
    x0 = np.float32(np.int8(np.uint8(w))) * s0
    x1 = np.float32(np.int8(np.uint8(w >> _S8))) * s1
    return or32(shr32(_bf16_bits_high(x0), _S16), _bf16_bits_high(x1))


def int8_kchan_encode_keys(src, off, T, H, D, sl, st, sh, u0, u1, codes, scales):
    """Units = (layer, head); per channel ``scale = amax over the T tokens / 127`` rounded up to
    bf16, codes ``rint(x / scale)``. codes [L*T*H*D] ((layer, token, head) rows); scales
    [L*H*D]. Returns 1 if a NaN/Inf was met (then nothing is valid)."""
    m = np.empty(D, np.uint16)
    sq = np.empty(D, np.uint16)   # (stored after the loop: writing the payload in it stops vectorising)
    safe = np.empty(D, np.float32)
    bad = 0
    for u in range(u0, u1):
        l = u // H
        h = u - l * H
        for d in range(D):
            m[d] = 0
        for t in range(T):
            row = off + l * sl + t * st + h * sh
            x = src[row:row + D]
            for d in range(D):
                m[d] = max(m[d], and16(x[d], _MAG))
        for d in range(D):
            bad |= 1 if m[d] >= BF16_NONFINITE else 0
            s = bf16_round_up(bf16_to_f32(m[d]) / INT8_MAX)
            sq[d] = s
            sf = bf16_to_f32(s)
            safe[d] = ONE if sf == ZERO else sf
        scales[u * D:(u + 1) * D] = sq
        for t in range(T):
            row = off + l * sl + t * st + h * sh
            x = src[row:row + D]
            i = (l * T + t) * H + h
            c = codes[i * D:(i + 1) * D]
            for d in range(D):
                c[d] = _code(bf16_to_f32(x[d]), safe[d])
    return bad


def int8_kchan_decode_keys(codes, scales, out, off, T, H, D2, sl, st, sh, u0, u1):
    """Units = (layer, head); codes read as 16-bit pairs, the block written as 32-bit words
    (geometry in words, ``D2`` = D/2), each channel times its own scale."""
    s0, s1 = np.empty(D2, np.float32), np.empty(D2, np.float32)   # even, odd channels
    for u in range(u0, u1):
        l = u // H
        h = u - l * H
        base = u * 2 * D2
        for j in range(D2):
            s0[j] = bf16_to_f32(scales[base + 2 * j])
            s1[j] = bf16_to_f32(scales[base + 2 * j + 1])
        for t in range(T):
            row = off + l * sl + t * st + h * sh
            o = out[row:row + D2]
            i = (l * T + t) * H + h
            c = codes[i * D2:(i + 1) * D2]
            for j in range(D2):
                o[j] = _pair(c[j], s0[j], s1[j])


int8_kchan_encode_keys = _Lazy(int8_kchan_encode_keys)
int8_kchan_decode_keys = _Lazy(int8_kchan_decode_keys)
