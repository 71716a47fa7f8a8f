"""Bit-exact scalar steps for the compiled CPU kernels (``fast_cpu``), written so LLVM vectorises
the loops that call them.

Numba widens every integer operation to 64 bits (uint32 & uint32 is a uint64), which halves or
quarters the SIMD lanes of a loop; the intrinsics here keep 16- and 32-bit arithmetic at its
width. The conversions mirror the torch reference exactly: bf16 round-to-nearest-even as
c10::BFloat16, e4m3fn rounding as c10's ``fp8e4m3fn_from_fp32_value``, and e4m3 -> float32 by way
of an IEEE half (exact, and the hardware widening handles the e4m3 subnormals, where a float32
multiply by a subnormal operand would stall this CPU tens of cycles). Imports nothing from kvstore.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


def _binary(op: str, width: int):
    ty = types.uint32 if width == 32 else types.uint16

    @intrinsic
    def fn(typingctx, a, b):
        def codegen(context, builder, signature, args):
            return getattr(builder, op)(args[0], args[1])
        return ty(ty, ty), codegen
    return fn


and32, or32, xor32, add32, sub32, shl32, shr32, ashr32 = (_binary(op, 32) for op in ("and_", "or_", "xor", "add", "sub",
                                                                                 "shl", "lshr", "ashr"))
and16, xor16, shl16, ashr16 = (_binary(op, 16) for op in ("and_", "xor", "shl", "ashr"))


def _extreme(predicate: str):
    @intrinsic
    def fn(typingctx, a, b):
        def codegen(context, builder, signature, args):
            return builder.select(builder.icmp_signed(predicate, args[0], args[1]), args[0], args[1])
        return types.int16(types.int16, types.int16), codegen
    return fn


#: min / max of int16 at 16 bits (numba's min/max widen them: a quarter of the SIMD lanes)
min16, max16 = _extreme("<"), _extreme(">")


def _extreme32(predicate: str, signed: bool):
    ty = types.int32 if signed else types.uint32

    @intrinsic
    def fn(typingctx, a, b):
        def codegen(context, builder, signature, args):
            compare = builder.icmp_signed if signed else builder.icmp_unsigned
            return builder.select(compare(predicate, args[0], args[1]), args[0], args[1])
        return ty(ty, ty), codegen
    return fn


#: min / max of int32 (and max of uint32) at 32 bits: integer reductions vectorise, where a float
#: max may not be reordered (NaN) and stays scalar
min32, max32, umax32 = _extreme32("<", True), _extreme32(">", True), _extreme32(">", False)


@intrinsic
def f32_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def half_to_f32(typingctx, x):
    """A 16-bit word read as an IEEE half, widened to float32 (exact)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


U16, U32 = np.uint16, np.uint32
_S16, _ONE, _ROUND, _ZERO32 = U32(16), U32(1), U32(0x7FFF), U32(0)
_BF16_SIGN, _NEG_TINY = U32(0x8000), U32(0x8001)
F32_INF = np.float32(np.inf)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
#: |bf16| bit patterns at or above this are Inf or NaN
BF16_NONFINITE = U16(0x7F80)


@njit(inline="always")
def bf16_to_f32(u):
    return bits_f32(shl32(U32(u), _S16))


@njit(inline="always")
def f32_to_bf16_bits(f):
    """float32 -> bf16 bits (in a uint32), round to nearest even, as c10::BFloat16 for
    non-NaN input."""
    b = f32_bits(f)
    return shr32(add32(add32(b, _ROUND), and32(shr32(b, _S16), _ONE)), _S16)


@njit(inline="always")
def bf16_round_up(f):
    """bf16 >= f (f >= 0, finite): torch.where(y < f, nextafter(y, inf), y), branch-free."""
    y = f32_to_bf16_bits(f)
    return U16(add32(y, _ONE) if bits_f32(shl32(y, _S16)) < f else y)


@njit(inline="always")
def bf16_round_down(f):
    """bf16 <= f (finite): torch.where(y > f, nextafter(y, -inf), y), branch-free."""
    y = f32_to_bf16_bits(f)
    below = add32(y, _ONE) if and32(y, _BF16_SIGN) != _ZERO32 else (_NEG_TINY if y == _ZERO32 else sub32(y, _ONE))
    return U16(below if bits_f32(shl32(y, _S16)) > f else y)


# --- ordered keys: min/max of bf16 words as 16-bit integer compares (vectorise; exact) ---------

_SIGN_RUN, _MAG = U16(15), U16(0x7FFF)


@njit(inline="always")
def order_key(w):
    """An int16 whose order is the bf16 value order (-0 sorts just below +0; NaN outside +-Inf)."""
    return np.int16(xor16(w, and16(ashr16(w, _SIGN_RUN), _MAG)))


@njit(inline="always")
def key_to_f32(k):
    """Inverse of ``order_key``, as the bf16 value widened to float32."""
    w = U16(k)
    return bf16_to_f32(xor16(w, and16(ashr16(w, _SIGN_RUN), _MAG)))


_ABS32, _S31 = U32(0x7FFFFFFF), U32(31)


@njit(inline="always")
def order_key32(f):
    """An int32 whose order is the float32 value order (-0 sorts just below +0)."""
    b = f32_bits(f)
    return np.int32(xor32(b, and32(ashr32(b, _S31), _ABS32)))


@njit(inline="always")
def key32_to_f32(k):
    """Inverse of ``order_key32``."""
    b = U32(k)
    return bits_f32(xor32(b, and32(ashr32(b, _S31), _ABS32)))


@njit(inline="always")
def abs_bits32(f):
    """|f|'s bits: their unsigned order is the order of |f| (for non-NaN f)."""
    return and32(f32_bits(f), _ABS32)


#: ordered keys of -Inf and +Inf: finite values lie strictly between
KEY_NEG_INF, KEY_POS_INF = np.int16(-32641), np.int16(32640)


@njit(inline="always")
def plus_zero(x):
    """-0.0 -> +0.0, as ``exact.canonical_zero``."""
    return ZERO if x == ZERO else x


# --- e4m3fn ------------------------------------------------------------------------------------

_E4M3_SHIFT, _E4M3_MASK = U16(7), U16(0xBF80)
_DENORM_LIMIT, _DENORM_MAGIC = U32(121 << 23), U32(141 << 23)
_REBIAS, _HALF_ULP, _S20, _SIGN = U32(120 << 23), U32(0x7FFFF), U32(20), U32(0x80000000)
_S24 = U32(24)


@njit(inline="always")
def e4m3_as_half(c):
    """The e4m3fn code ``c`` as IEEE half bits worth ``value * 2**-8``: sign to bit 15, the 7
    exponent+mantissa bits to bits 13..7 (both formats' subnormals line up). Codes 0x7F/0xFF
    (NaN, never written by the encoder) read as 480 * 2**-8."""
    return and16(shl16(U16(np.int16(np.int8(c))), _E4M3_SHIFT), _E4M3_MASK)


@njit(inline="always")
def f32_to_e4m3(f):
    """float32 in [-448, 448] -> e4m3fn code, round to nearest even (c10's algorithm)."""
    b = f32_bits(f)
    sign = and32(b, _SIGN)
    mag = xor32(b, sign)
    denorm = sub32(f32_bits(bits_f32(mag) + bits_f32(_DENORM_MAGIC)), _DENORM_MAGIC)
    normal = shr32(add32(add32(sub32(mag, _REBIAS), _HALF_ULP), and32(shr32(mag, _S20), U32(1))), _S20)
    r = denorm if mag < _DENORM_LIMIT else normal
    return np.uint8(or32(r, shr32(sign, _S24)))
