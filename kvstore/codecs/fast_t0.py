"""Compiled (numba) CPU kernels for ``int4_g64_t0``'s first token: each (layer, head)'s token-0 row
copied between the block and the payload's ``first`` section, the same bytes as the torch
reference in ``int4_t0.py`` (a -0 stored as +0). The other tokens run ``fast_cpu``'s INT4 kernels.

Kernels read and write one tensor of a block in place through its geometry (offset, L, H, D,
stride_layer, stride_head, in 16-bit words; rows of ``D`` contiguous), all of its layers in one
call: the rows are one token in ``T`` of the block. No data-dependent branches, as in ``fast_cpu``.
"""

from __future__ import annotations

from numba.core import types

from kvstore.codecs.bits import BF16_NONFINITE, U16, and16
from kvstore.codecs.compiled import Kernel

_MAG = U16(0x7FFF)
_ZERO = U16(0)

_I = types.int64
_U16 = types.Array(types.uint16, 1, "C")
_IN16 = types.Array(types.uint16, 1, "C", readonly=True)
_GEOM = (_I, _I, _I, _I, _I, _I)   # offset, L, H, D, stride_layer, stride_head
_SIGNATURES = {
    "first_rows_encode": types.int64(_IN16, *_GEOM, _U16),
    "first_rows_decode": types.none(_IN16, _U16, *_GEOM),
}

KERNEL_NAMES = tuple(_SIGNATURES)   # what ``compiled.compile_all`` compiles here


def first_rows_encode(src, off, L, H, D, sl, sh, first):
    """Token 0's rows -> ``first`` ([L, H, D]), each -0 as +0. Returns 1 if a NaN/Inf was met."""
    bad = 0
    for l in range(L):
        for h in range(H):
            row = off + l * sl + h * sh
            x = src[row:row + D]
            o = first[(l * H + h) * D:(l * H + h + 1) * D]
            for d in range(D):
                m = and16(x[d], _MAG)
                bad |= 1 if m >= BF16_NONFINITE else 0
                o[d] = _ZERO if m == _ZERO else x[d]
    return bad


def first_rows_decode(first, out, off, L, H, D, sl, sh):
    """``first`` ([L, H, D]) -> token 0's rows."""
    for l in range(L):
        for h in range(H):
            row = off + l * sl + h * sh
            o = out[row:row + D]
            f = first[(l * H + h) * D:(l * H + h + 1) * D]
            for d in range(D):
                o[d] = f[d]


first_rows_encode = Kernel(first_rows_encode, _SIGNATURES["first_rows_encode"])
first_rows_decode = Kernel(first_rows_decode, _SIGNATURES["first_rows_decode"])
