"""Compiled (numba) CPU kernels for ``int8_kchan``'s keys: INT8 with one scale per (layer, head,
channel) over the block's tokens, the same arithmetic as the torch reference in ``int8_kchan.py``,
bit for bit. Its values are plain ``int8`` rows and run ``fast_cpu``'s ``int8_encode`` /
``int8_decode``.

Kernels read and write one tensor of a block in place through its geometry ``(offset, T, H, D,
stride_layer, stride_token, stride_head)`` (rows of ``D`` contiguous), over a range ``[u0, u1)``
of units (layers for encode, (layer, token) rows for decode), which ``fast_runner`` splits across
threads, in 16-bit words.
Inner loops run along the channel axis: one scale per lane, no data-dependent branches, no
fastmath (a true division, no FMA), as in ``fast_cpu``.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import types

from kvstore.codecs.bits import BF16_NONFINITE, ONE, U16, ZERO, and16, bf16_round_up, bf16_to_f32, f32_to_bf16_bits
from kvstore.codecs.compiled import Kernel

INT8_MAX = np.float32(127.0)
_MAG = U16(0x7FFF)

_I = types.int64
_U8, _U16 = (types.Array(t, 1, "C") for t in (types.uint8, types.uint16))
_IN8, _IN16 = (types.Array(t, 1, "C", readonly=True) for t in (types.uint8, types.uint16))
_GEOM = (_I, _I, _I, _I, _I, _I, _I)   # offset, T, H, D, stride_layer, stride_token, stride_head
_SIGNATURES = {
    "int8_kchan_encode_keys": types.int64(_IN16, *_GEOM, _I, _I, _U8, _U16),
    "int8_kchan_decode_keys": types.none(_IN8, _IN16, _U16, *_GEOM, _I, _I),
}

KERNEL_NAMES = tuple(_SIGNATURES)   # what ``compiled.compile_all`` compiles here


@njit(inline="always")
def _code(v, safe):
    """rint(v / scale) clamped to +-127, as int8 bits (torch: div, round half-even, clamp)."""
    return np.uint8(np.int8(np.int32(min(max(np.rint(v / safe), -INT8_MAX), INT8_MAX))))


def int8_kchan_encode_keys(src, off, T, H, D, sl, st, sh, u0, u1, codes, scales):
    """Units = layers; per (head, channel) ``scale = amax over the T tokens / 127`` rounded up to
    bf16, codes ``rint(x / scale)``. Rows are visited in (token, head) order, as they lie in most
    layouts. codes [L*T*H*D] ((layer, token, head) rows); scales [L*H*D]. Returns 1 if a NaN/Inf
    was met (then nothing is valid)."""
    HD = H * D
    m = np.empty(HD, np.uint16)
    sq = np.empty(HD, np.uint16)   # (copied into the payload after the loop, as fast_cpu's INT4 key kernel does)
    safe = np.empty(HD, np.float32)
    bad = 0
    for l in range(u0, u1):
        for k in range(HD):
            m[k] = 0
        for t in range(T):
            for h in range(H):
                row = off + l * sl + t * st + h * sh
                x = src[row:row + D]
                mh = m[h * D:(h + 1) * D]
                for d in range(D):
                    mh[d] = max(mh[d], and16(x[d], _MAG))
        for k in range(HD):
            bad |= 1 if m[k] >= BF16_NONFINITE else 0
            q = bf16_round_up(bf16_to_f32(m[k]) / INT8_MAX)
            sq[k] = q
            sf = bf16_to_f32(q)
            safe[k] = ONE if sf == ZERO else sf
        scales[l * HD:(l + 1) * HD] = sq
        for t in range(T):
            for h in range(H):
                row = off + l * sl + t * st + h * sh
                x = src[row:row + D]
                i = (l * T + t) * H + h
                c = codes[i * D:(i + 1) * D]
                sf = safe[h * D:(h + 1) * D]
                for d in range(D):
                    c[d] = _code(bf16_to_f32(x[d]), sf[d])
    return bad


def int8_kchan_decode_keys(codes, scales, out, off, T, H, D, sl, st, sh, u0, u1):
    """Units = (layer, token) rows, as ``fast_cpu.int8_decode``: each channel's code * its scale
    in float32 (exact: 7 by 8 significant bits), rounded to bf16."""
    for u in range(u0, u1):
        l = u // T
        t = u - l * T
        for h in range(H):
            row = off + l * sl + t * st + h * sh
            o = out[row:row + D]
            i = u * H + h
            c = codes[i * D:(i + 1) * D]
            s = scales[(l * H + h) * D:(l * H + h + 1) * D]
            for d in range(D):
                o[d] = U16(f32_to_bf16_bits(np.float32(np.int8(c[d])) * bf16_to_f32(s[d])))


int8_kchan_encode_keys = Kernel(int8_kchan_encode_keys, _SIGNATURES["int8_kchan_encode_keys"])
int8_kchan_decode_keys = Kernel(int8_kchan_decode_keys, _SIGNATURES["int8_kchan_decode_keys"])
