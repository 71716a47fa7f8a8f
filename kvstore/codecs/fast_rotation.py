"""The Hadamard rotation of ``rotation.py`` inside the compiled CPU kernels (``fast_cpu``): the same
butterfly stages on float32 rows, bit for bit.

``rotation.rotate``'s stage ``s`` pairs the elements whose indices differ in bit ``s`` only and
writes their sum where that bit is 0 and their difference where it is 1 (constant geometry moves
them; the values are those of the in-place form with stride ``2**s``). Every output is therefore the
same IEEE sum or difference of the same two float32 values in any form that keeps the stage order.

A group of 64 (``rotation.MAX_SIZE``: head_dim 64, 128, 576) runs as LLVM vector code (intrinsics
below) on four 16-lane vectors held in registers from load to store: strides 1 to 8 inside each
vector (each lane adds its partner lane to itself times +1 or -1: ``y + x`` is ``x + y`` and
``x + (-y)`` is ``x - y`` exactly), strides 16 and 32 between whole vectors. The intrinsics also
widen the input (bf16, int8 or INT4 codes) and round the output to bf16 in registers: a row stored
by narrower writes and read back as 64-byte vectors waits for those writes, and a numba loop over
the stages takes several times the instructions. Kernels call them directly, indexing arrays rather
than slicing them: a slice or array passed into an inlined helper that branches costs reference
counting calls on every row. Smaller groups run the loops below.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvstore.codecs.bits import ONE, U32, bf16_to_f32, f32_to_bf16_bits, max32, min32, or32, order_key32, shl32

_F32, _I16, _I32, _I64 = ir.FloatType(), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V16, _W16 = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16)
_S16 = U32(16)
KEY32_MAX, KEY32_MIN = np.int32(2147483647), np.int32(-2147483648)
INV64 = np.float32(1 / 64)   # (a power of two: x / 64 exactly)


def _lanes(values, ty) -> ir.Constant:
    return ir.Constant(ir.VectorType(ty, len(values)), [ir.Constant(ty, v) for v in values])


def _splat(builder: ir.IRBuilder, x, ty=_F32):
    v = builder.insert_element(ir.Constant(ir.VectorType(ty, 16), ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, _lanes([0] * 16, _I32))


def _is_array(t, dtype) -> bool:
    return isinstance(t, types.Array) and t.dtype == dtype and t.ndim == 1 and t.layout == "C"


def _vectors(context, builder, ty, array, start, elem):
    """Pointers to the 4 consecutive 16-lane vectors of ``elem`` from ``array[start]``."""
    data = context.make_array(ty)(context, builder, array).data
    base = builder.bitcast(builder.gep(data, [start]), ir.VectorType(elem, 16).as_pointer())
    return [builder.gep(base, [ir.Constant(_I64, k)]) for k in range(4)]


def _in_vector_stage(builder: ir.IRBuilder, v, stride: int):
    """One stage of stride 1, 2, 4 or 8 on the 16 lanes of ``v``."""
    partner = builder.shuffle_vector(v, ir.Constant(_V16, ir.Undefined), _lanes([j ^ stride for j in range(16)], _I32))
    sign = _lanes([-1.0 if j & stride else 1.0 for j in range(16)], _F32)
    return builder.fadd(builder.fmul(v, sign), partner)   # (v * +-1 is exact: one rounding, the add's)


def _hadamard64(builder: ir.IRBuilder, v: list) -> list:
    """The six stages on 64 values held as four 16-lane vectors."""
    for stride in (1, 2, 4, 8):
        v = [_in_vector_stage(builder, x, stride) for x in v]
    v = [builder.fadd(v[0], v[1]), builder.fsub(v[0], v[1]), builder.fadd(v[2], v[3]), builder.fsub(v[2], v[3])]
    return [builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]), builder.fsub(v[0], v[2]), builder.fsub(v[1], v[3])]


def _key_extremes(builder: ir.IRBuilder, vectors) -> tuple:
    """(min, max) over the lanes of float32 vectors, as ``bits.order_key32`` keys (int32)."""
    sign, mag = (_splat(builder, ir.Constant(_I32, c), _I32) for c in (31, 0x7FFFFFFF))
    keys = []
    for v in vectors:
        b = builder.bitcast(v, _W16)
        keys.append(builder.xor(b, builder.and_(builder.ashr(b, sign), mag)))
    lo, hi = keys[0], keys[0]
    for k in keys[1:]:
        lo = builder.select(builder.icmp_signed("<", k, lo), k, lo)
        hi = builder.select(builder.icmp_signed(">", k, hi), k, hi)
    fn = ir.FunctionType(_I32, [_W16])
    module = builder.module
    return tuple(builder.call(cgutils.get_or_insert_function(module, fn, f"llvm.vector.reduce.{op}.v16i32"), [x])
                 for op, x in (("smin", lo), ("smax", hi)))


@intrinsic
def hadamard64_from_bf16(typingctx, x, start, scale, a, a_start):
    """``a[a_start:a_start + 64]`` = ``rotation.rotate`` of the bf16 values ``x[start:start + 64]``
    (16-bit words) each widened to float32 and multiplied by ``scale``; returns the ordered keys
    (``bits.order_key32``) of the smallest and largest of the 64 results."""
    if not (_is_array(x, types.uint16) and _is_array(a, types.float32)):
        return None

    def codegen(context, builder, signature, args):
        src = _vectors(context, builder, signature.args[0], args[0], args[1], _I16)
        dst = _vectors(context, builder, signature.args[3], args[3], args[4], _F32)
        scale, shift = _splat(builder, args[2]), _splat(builder, ir.Constant(_I32, 16), _I32)
        v = [builder.fmul(builder.bitcast(builder.shl(builder.zext(builder.load(p, align=2), _W16), shift), _V16),
                          scale) for p in src]
        v = _hadamard64(builder, v)
        for y, p in zip(v, dst):
            builder.store(y, p, align=4)
        return context.make_tuple(builder, signature.return_type, _key_extremes(builder, v))

    return types.UniTuple(types.int32, 2)(x, types.int64, types.float32, a, types.int64), codegen


def _hadamard64_split(builder: ir.IRBuilder, even: list, odd: list) -> tuple:
    """The six stages on 64 values held as their even elements (0, 2, .., 62: two 16-lane vectors)
    and odd ones: stage 0 pairs them lane by lane, stages 1 to 4 run inside each vector (element
    ``2j + c`` sits at lane ``j % 16`` of vector ``j // 16`` of its half ``c``), stage 5 pairs the two
    vectors of a half. The output in the same layout: even elements, odd elements."""
    v = [builder.fadd(even[0], odd[0]), builder.fadd(even[1], odd[1]),
         builder.fsub(even[0], odd[0]), builder.fsub(even[1], odd[1])]
    for stride in (1, 2, 4, 8):
        v = [_in_vector_stage(builder, x, stride) for x in v]
    return ([builder.fadd(v[0], v[1]), builder.fsub(v[0], v[1])],
            [builder.fadd(v[2], v[3]), builder.fsub(v[2], v[3])])


def _store_bf16(context, builder, ty, out, start, even: list, odd: list) -> None:
    """64 values (even and odd elements, as ``_hadamard64_split`` leaves them) rounded to bf16 (to
    nearest even, as ``bits.f32_to_bf16_bits``) into the 32 words ``out[start:start + 32]`` (two
    bf16 a word, the even element in the low half)."""
    words = context.make_array(ty)(context, builder, out).data
    base = builder.bitcast(builder.gep(words, [start]), _W16.as_pointer())
    shift, one, bias, high = (_splat(builder, ir.Constant(_I32, c), _I32) for c in (16, 1, 0x7FFF, 0xFFFF0000))

    def rounded(y):
        b = builder.bitcast(y, _W16)
        return builder.add(builder.add(b, bias), builder.and_(builder.lshr(b, shift), one))

    for k in range(2):
        word = builder.or_(builder.lshr(rounded(even[k]), shift), builder.and_(rounded(odd[k]), high))
        builder.store(word, builder.gep(base, [ir.Constant(_I64, k)]), align=4)


def _halves(builder, v) -> list:
    """A 32-lane vector as two 16-lane ones."""
    return [builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), _lanes(list(range(16 * k, 16 * k + 16)), _I32))
            for k in range(2)]


def _load_vector(context, builder, ty, array, start, elem, count):
    """``count`` elements from ``array[start]`` as one vector."""
    data = context.make_array(ty)(context, builder, array).data
    vty = ir.VectorType(elem, count)
    return builder.load(builder.bitcast(builder.gep(data, [start]), vty.as_pointer()), align=1)


@intrinsic
def hadamard64_split_from_bf16(typingctx, x, start, scale, a, a_start):
    """``hadamard64_from_bf16`` with the 64 results stored as ``_hadamard64_split`` leaves them:
    ``a[a_start + j]`` is result ``2j`` and ``a[a_start + 32 + j]`` result ``2j + 1`` (j < 32), so
    an INT4 code byte's two values sit 32 apart, not interleaved; same extremes returned."""
    if not (_is_array(x, types.uint16) and _is_array(a, types.float32)):
        return None

    def codegen(context, builder, signature, args):
        w = builder.bitcast(_load_vector(context, builder, signature.args[0], args[0], args[1], _I16, 64),
                            ir.VectorType(_I32, 32))   # (little-endian: the even bf16 is the low half)
        even = builder.shl(w, _lanes([16] * 32, _I32))
        odd = builder.and_(w, _lanes([0xFFFF0000] * 32, _I32))
        scale = _splat(builder, args[2])
        even, odd = ([builder.fmul(builder.bitcast(v, _V16), scale) for v in _halves(builder, h)] for h in (even, odd))
        v = [y for half in _hadamard64_split(builder, even, odd) for y in half]
        for y, p in zip(v, _vectors(context, builder, signature.args[3], args[3], args[4], _F32)):
            builder.store(y, p, align=4)
        return context.make_tuple(builder, signature.return_type, _key_extremes(builder, v))

    return types.UniTuple(types.int32, 2)(x, types.int64, types.float32, a, types.int64), codegen


@intrinsic
def hadamard64_to_bf16(typingctx, a, start, out, o_start):
    """``rotation.rotate`` of ``a[start:start + 64]`` (float32) rounded to bf16 pairs into the 32
    words ``out[o_start:o_start + 32]``."""
    if not (_is_array(a, types.float32) and _is_array(out, types.uint32)):
        return None

    def codegen(context, builder, signature, args):
        x = _load_vector(context, builder, signature.args[0], args[0], args[1], _F32, 64)
        pick = [builder.shuffle_vector(x, ir.Constant(x.type, ir.Undefined),
                                       _lanes([2 * (16 * k + j) + c for j in range(16)], _I32)) for c in (0, 1)
                for k in range(2)]
        even, odd = _hadamard64_split(builder, pick[:2], pick[2:])
        _store_bf16(context, builder, signature.args[2], args[2], args[3], even, odd)
        return context.get_dummy_value()

    return types.none(a, types.int64, out, types.int64), codegen


@intrinsic
def int8_hadamard64_to_bf16(typingctx, codes, start, scale, out, o_start):
    """The 64 int8 codes ``codes[start:start + 64]`` times ``scale`` (float32), rotated back and
    stored as ``hadamard64_to_bf16`` does."""
    if not (_is_array(codes, types.uint8) and scale == types.float32 and _is_array(out, types.uint32)):
        return None

    def codegen(context, builder, signature, args):
        w = builder.bitcast(_load_vector(context, builder, signature.args[0], args[0], args[1], ir.IntType(8), 64),
                            ir.VectorType(_I16, 32))   # (little-endian: the even code is the low byte)
        eight = _lanes([8] * 32, _I16)
        sf = _splat(builder, args[2])
        even, odd = ([builder.fmul(builder.sitofp(x, _V16), sf) for x in _halves(builder, h)]
                     for h in (builder.ashr(builder.shl(w, eight), eight), builder.ashr(w, eight)))
        even, odd = _hadamard64_split(builder, even, odd)
        _store_bf16(context, builder, signature.args[3], args[3], args[4], even, odd)
        return context.get_dummy_value()

    return types.none(codes, types.int64, types.float32, out, types.int64), codegen


@intrinsic
def int4_hadamard64_to_bf16(typingctx, codes, start, scale, mn, p0, out, o_start):
    """The 64 INT4 codes in the bytes ``codes[start:start + 32]`` (even element in the low nibble)
    as ``q * scale + min`` in float32 steps, rotated back and stored as ``hadamard64_to_bf16``
    does. ``scale`` and ``mn``: float32 (one group), or float32 arrays read from ``p0``, each 32
    values of the even elements then 32 of the odd ones."""
    per_element = _is_array(scale, types.float32) and _is_array(mn, types.float32)
    if not (_is_array(codes, types.uint8) and _is_array(out, types.uint32)
            and (per_element or (scale == types.float32 and mn == types.float32))):
        return None

    def codegen(context, builder, signature, args):
        i8 = ir.IntType(8)
        b = _load_vector(context, builder, signature.args[0], args[0], args[1], i8, 32)
        halves = [builder.and_(b, _lanes([15] * 32, i8)), builder.lshr(b, _lanes([4] * 32, i8))]
        if per_element:
            sf, mf = ([builder.load(p, align=4) for p in _vectors(context, builder, signature.args[i], args[i], args[4],
                                                                   _F32)] for i in (2, 3))
        else:
            sf, mf = [_splat(builder, args[2])] * 4, [_splat(builder, args[3])] * 4
        q = [x for h in halves for x in _halves(builder, h)]
        v = [builder.fadd(builder.fmul(builder.uitofp(x, _V16), s), m) for x, s, m in zip(q, sf, mf)]
        even, odd = _hadamard64_split(builder, v[:2], v[2:])
        _store_bf16(context, builder, signature.args[5], args[5], args[6], even, odd)
        return context.get_dummy_value()

    return types.none(codes, types.int64, scale, mn, types.int64, out, types.int64), codegen


@njit(inline="always")
def _stage(src, dst, D, n):
    """One constant-geometry stage on each n-group of ``src[:D]`` into ``dst``: the sum of each
    adjacent pair into the group's first half, the difference into its second."""
    half = n // 2
    for g in range(0, D, n):
        s = src[g:g + n]
        d = dst[g:g + n]
        for j in range(half):
            a = s[2 * j]
            b = s[2 * j + 1]
            d[j] = a + b
            d[j + half] = a - b


@njit(inline="always")
def rotate(a, b, D, n):
    """``rotation.rotate`` of ``a[:D]`` in place (``b``: scratch of D), as loops."""
    k = 1
    while k < n:
        _stage(a, b, D, n)
        k *= 2
        if k < n:
            _stage(b, a, D, n)
            k *= 2
        else:
            for j in range(D):
                a[j] = b[j]


@njit(inline="always")
def rotate64_from_bf16(src, x0, a, a0, D):
    """``rotation.rotate_for_encode`` (n = 64) of the bf16 row ``src[x0:x0 + D]`` into
    ``a[a0:a0 + D]`` (float32); the ordered keys (``bits.order_key32``) of its extremes."""
    lo, hi = KEY32_MAX, KEY32_MIN
    for g in range(0, D, 64):
        k0, k1 = hadamard64_from_bf16(src, x0 + g, INV64, a, a0 + g)
        lo, hi = min32(lo, k0), max32(hi, k1)
    return lo, hi


@njit(inline="always")
def load_rotated(x, a, b, D, n):
    """A bf16 row ``x`` -> ``H_n (x / n)`` in ``a`` (float32; ``b``: scratch of D):
    ``rotation.rotate_for_encode`` for any ``n`` (``rotate64_from_bf16`` is the fast one)."""
    inv = ONE / np.float32(n)
    for d in range(D):
        a[d] = bf16_to_f32(x[d]) * inv
    rotate(a, b, D, n)


@njit(inline="always")
def extremes(a, D):
    """The ordered keys (``bits.order_key32``) of the smallest and largest of ``a[:D]``."""
    lo, hi = KEY32_MAX, KEY32_MIN
    for d in range(D):
        k = order_key32(a[d])
        lo, hi = min32(lo, k), max32(hi, k)
    return lo, hi


@njit(inline="always")
def rotate_to_bf16(a, b, D, n, out, o0):
    """``rotation.rotate`` of float32 ``a[:D]`` (``b``: scratch) rounded to bf16 pairs in the
    32-bit words ``out[o0:o0 + D/2]`` (even element in the low half)."""
    if n == 64:
        for g in range(0, D, 64):
            hadamard64_to_bf16(a, g, out, o0 + g // 2)
    else:
        rotate(a, b, D, n)
        for j in range(D // 2):
            out[o0 + j] = or32(f32_to_bf16_bits(a[2 * j]), shl32(f32_to_bf16_bits(a[2 * j + 1]), _S16))
