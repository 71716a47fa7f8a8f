"""Compiled (numba) CPU kernels for bf16 blocks: the same arithmetic as the torch reference in
``fp8.py`` / ``int4.py``, bit for bit, in one pass instead of a dozen.

Eager torch spends most of its time on fp8<->float conversion and on materialising float32
copies; these kernels read the block's bf16 words in place (any layout whose head_dim rows are
contiguous; vllm_cpu's transposed keys are copied first), keep everything in registers, and write codes and statistics straight into the
payload. Every rounding step mirrors the reference (float32 division, round-half-even, bf16
round-to-nearest-even, e4m3 rounding as in c10), and tests/test_codecs.py checks payloads and
decoded blocks are byte-identical to the reference. No fastmath: a / b stays a true division
and a * b + c is never contracted to an FMA, exactly as torch computes them on CPU and CUDA.

Kernels are single-threaded and release the GIL; a block is split by layers across a small
thread pool (``torch.get_num_threads()`` wide), so there is no second OpenMP runtime spinning
against torch's, and concurrent requests from the daemon's threads simply run side by side.

Used only when numba is importable, the block is bf16 and the work is on the CPU; anything else
runs the torch reference. ``KVSTORE_CODECS_REFERENCE=1`` forces the reference everywhere.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

F32_INF = np.float32(np.inf)
E4M3_MAX = np.float32(448.0)
LEVELS = np.float32(15.0)
ONE = np.float32(1.0)
ZERO = np.float32(0.0)

#: e4m3fn code -> float32, taken from torch so decode is the reference conversion by definition
E4M3_TO_F32 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


_I = types.int64
_BLOCK = types.Array(types.uint16, 1, "C")       # the whole block's words
_GEOM = (_I, _I, _I, _I, _I, _I, _I, _I)        # offset, L, T, H, D, stride_l, stride_t, stride_h
_SIGNATURES = {
    "fp8_encode": types.int64(_BLOCK, *_GEOM, types.Array(types.uint8, 4, "C"),
                              types.Array(types.uint16, 3, "C"), types.boolean),
    "fp8_decode": types.none(types.Array(types.uint8, 4, "C"), types.Array(types.uint16, 3, "C"),
                             types.Array(types.float32, 1, "C"), _BLOCK, *_GEOM, types.boolean),
    "int4_encode_keys": types.int64(_BLOCK, *_GEOM, _I, types.Array(types.uint8, 1, "C"),
                                    types.Array(types.uint16, 4, "C"), types.Array(types.uint16, 4, "C")),
    "int4_encode_values": types.int64(_BLOCK, *_GEOM, _I, types.Array(types.uint8, 1, "C"),
                                      types.Array(types.uint16, 4, "C"), types.Array(types.uint16, 4, "C")),
    "int4_decode_keys": types.none(types.Array(types.uint8, 1, "C"), types.Array(types.uint16, 4, "C"),
                                   types.Array(types.uint16, 4, "C"), _BLOCK, *_GEOM, _I),
    "int4_decode_values": types.none(types.Array(types.uint8, 1, "C"), types.Array(types.uint16, 4, "C"),
                                     types.Array(types.uint16, 4, "C"), _BLOCK, *_GEOM, _I),
}


class _Lazy:
    """Compile a kernel on first call, for its one signature: every layout shares one
    machine-code version (and one on-disk cache entry). K/V rows (head_dim) must be contiguous
    in the block; the row stride of each other axis is a runtime argument."""

    def __init__(self, fn) -> None:
        self.fn, self.compiled = fn, None

    def __call__(self, *args):
        if self.compiled is None:
            self.compiled = njit(_SIGNATURES[self.fn.__name__], cache=True, nogil=True)(self.fn)
        return self.compiled(*args)


def kernel(fn):
    return _Lazy(fn)


@intrinsic
def _f32_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@njit(inline="always")
def bf16_to_f32(u):
    return _bits_f32(np.uint32(np.uint32(u) << np.uint32(16)))


@njit(inline="always")
def f32_to_bf16(f):
    """Round to nearest even (finite inputs), as c10::BFloat16."""
    b = np.int64(_f32_bits(f))
    return np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


@njit(inline="always")
def bf16_round_up(f):
    """bf16 >= f (f >= 0): torch.where(y < f, nextafter(y, inf), y)."""
    y = f32_to_bf16(f)
    if bf16_to_f32(y) < f:
        y = np.uint16(y + 1)
    return y


@njit(inline="always")
def bf16_round_down(f):
    """bf16 <= f: torch.where(y > f, nextafter(y, -inf), y)."""
    y = f32_to_bf16(f)
    if bf16_to_f32(y) > f:
        if y & 0x8000:
            y = np.uint16(y + 1)
        elif y == 0:
            y = np.uint16(0x8001)
        else:
            y = np.uint16(y - 1)
    return y


@njit(inline="always")
def f32_to_e4m3(f):
    """float32 in [-448, 448] -> e4m3fn code, round to nearest even (c10's algorithm)."""
    bits = np.int64(_f32_bits(f))
    sign = bits & 0x80000000
    bits ^= sign
    if bits < (121 << 23):  # below e4m3's smallest normal: let float addition do the rounding
        denorm = np.int64(141 << 23)
        r = np.int64(_f32_bits(_bits_f32(np.uint32(bits)) + _bits_f32(np.uint32(denorm)))) - denorm
    else:
        r = (bits - (120 << 23) + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    return np.uint8(r | (sign >> 24))


# --- FP8 ----------------------------------------------------------------------------------------

@kernel
def fp8_encode(src, off, L, T, H, D, sl, st, sh, codes, scales, per_head):
    """K or V rows at src[off + l*sl + t*st + h*sh + d]; codes uint8 [L,T,H,D]; scales uint16
    [L,T,H] or [L,1,H] (per head). Returns how many layers held NaN/Inf (then nothing is valid)."""
    bad = np.zeros(L, np.int64)
    for l in range(L):
        for h in range(H):
            if per_head:
                amax = ZERO
                for t in range(T):
                    row = off + l * sl + t * st + h * sh
                    for d in range(D):
                        a = abs(bf16_to_f32(src[row + d]))
                        if not a < F32_INF:
                            bad[l] = 1
                        amax = max(amax, a)
                s = bf16_round_up(amax / E4M3_MAX)
                scales[l, 0, h] = s
            for t in range(T):
                row = off + l * sl + t * st + h * sh
                if not per_head:
                    amax = ZERO
                    for d in range(D):
                        a = abs(bf16_to_f32(src[row + d]))
                        if not a < F32_INF:
                            bad[l] = 1
                        amax = max(amax, a)
                    s = bf16_round_up(amax / E4M3_MAX)
                    scales[l, t, h] = s
                sf = bf16_to_f32(s)
                if sf == ZERO:
                    sf = ONE
                for d in range(D):
                    x = bf16_to_f32(src[row + d]) / sf
                    codes[l, t, h, d] = f32_to_e4m3(min(max(x, -E4M3_MAX), E4M3_MAX))
    return bad.sum()


@kernel
def fp8_decode(codes, scales, lut, out, off, L, T, H, D, sl, st, sh, per_head):
    for l in range(L):
        for t in range(T):
            for h in range(H):
                sf = bf16_to_f32(scales[l, 0, h] if per_head else scales[l, t, h])
                row = off + l * sl + t * st + h * sh
                for d in range(D):
                    out[row + d] = f32_to_bf16(lut[codes[l, t, h, d]] * sf)


# --- INT4 ---------------------------------------------------------------------------------------

@njit(inline="always")
def _plus_zero(x):
    """-0.0 -> +0.0, as ``exact.canonical_zero`` (a min/max over +0 and -0 may return either)."""
    return ZERO if x == ZERO else x


@njit(inline="always")
def _quant4(v, mnf, safe):
    q = np.rint((v - mnf) / safe)
    return np.uint8(min(max(q, ZERO), LEVELS))


@kernel
def int4_encode_keys(src, off, L, T, H, D, sl, st, sh, kg, codes, scale, mn):
    """Keys, per channel over groups of kg tokens. codes uint8 [L*T*H*D/2] in [L,T,H,D] order;
    scale/mn uint16 [L, T/kg, H, D]."""
    bad = np.zeros(L, np.int64)
    for l in range(L):
        lo = np.empty(D, np.float32)
        hi = np.empty(D, np.float32)
        mnf = np.empty(D, np.float32)
        safe = np.empty(D, np.float32)
        for g in range(T // kg):
            for h in range(H):
                for d in range(D):
                    lo[d] = F32_INF
                    hi[d] = -F32_INF
                for t in range(g * kg, (g + 1) * kg):
                    row = off + l * sl + t * st + h * sh
                    for d in range(D):
                        v = bf16_to_f32(src[row + d])
                        if not abs(v) < F32_INF:
                            bad[l] = 1
                        lo[d] = min(lo[d], v)
                        hi[d] = max(hi[d], v)
                for d in range(D):
                    m = bf16_round_down(_plus_zero(lo[d]))
                    mnf[d] = bf16_to_f32(m)
                    s = bf16_round_up((_plus_zero(hi[d]) - mnf[d]) / LEVELS)
                    mn[l, g, h, d] = m
                    scale[l, g, h, d] = s
                    sf = bf16_to_f32(s)
                    safe[d] = ONE if sf == ZERO else sf
                for t in range(g * kg, (g + 1) * kg):
                    row = off + l * sl + t * st + h * sh
                    base = ((l * T + t) * H + h) * D // 2
                    for i in range(D // 2):
                        q0 = _quant4(bf16_to_f32(src[row + 2 * i]), mnf[2 * i], safe[2 * i])
                        q1 = _quant4(bf16_to_f32(src[row + 2 * i + 1]), mnf[2 * i + 1], safe[2 * i + 1])
                        codes[base + i] = q0 | (q1 << 4)
    return bad.sum()


@kernel
def int4_encode_values(src, off, L, T, H, D, sl, st, sh, vg, codes, scale, mn):
    """Values, per token over groups of vg dims. scale/mn uint16 [L, T, H, D/vg]."""
    bad = np.zeros(L, np.int64)
    for l in range(L):
        for t in range(T):
            for h in range(H):
                row = off + l * sl + t * st + h * sh
                base = ((l * T + t) * H + h) * D // 2
                for g in range(D // vg):
                    lo = F32_INF
                    hi = -F32_INF
                    for d in range(g * vg, (g + 1) * vg):
                        v = bf16_to_f32(src[row + d])
                        if not abs(v) < F32_INF:
                            bad[l] = 1
                        lo = min(lo, v)
                        hi = max(hi, v)
                    m = bf16_round_down(_plus_zero(lo))
                    mf = bf16_to_f32(m)
                    s = bf16_round_up((_plus_zero(hi) - mf) / LEVELS)
                    mn[l, t, h, g] = m
                    scale[l, t, h, g] = s
                    sf = bf16_to_f32(s)
                    sf = ONE if sf == ZERO else sf
                    for i in range(g * vg // 2, (g + 1) * vg // 2):
                        q0 = _quant4(bf16_to_f32(src[row + 2 * i]), mf, sf)
                        q1 = _quant4(bf16_to_f32(src[row + 2 * i + 1]), mf, sf)
                        codes[base + i] = q0 | (q1 << 4)
    return bad.sum()


@njit(inline="always")
def _dequant4(q, sf, mf):
    x = np.float32(q) * sf
    return f32_to_bf16(x + mf)


@kernel
def int4_decode_keys(codes, scale, mn, out, off, L, T, H, D, sl, st, sh, group):
    """Keys: stats [L, T/group, H, D] (per channel over ``group`` tokens)."""
    sf = np.empty(D, np.float32)
    mf = np.empty(D, np.float32)
    for l in range(L):
        for g in range(T // group):
            for h in range(H):
                for d in range(D):
                    sf[d] = bf16_to_f32(scale[l, g, h, d])
                    mf[d] = bf16_to_f32(mn[l, g, h, d])
                for t in range(g * group, (g + 1) * group):
                    row = off + l * sl + t * st + h * sh
                    base = ((l * T + t) * H + h) * D // 2
                    for i in range(D // 2):
                        byte = codes[base + i]
                        out[row + 2 * i] = _dequant4(byte & 0x0F, sf[2 * i], mf[2 * i])
                        out[row + 2 * i + 1] = _dequant4(byte >> 4, sf[2 * i + 1], mf[2 * i + 1])


@kernel
def int4_decode_values(codes, scale, mn, out, off, L, T, H, D, sl, st, sh, group):
    """Values: stats [L, T, H, D/group] (per token over ``group`` dims)."""
    for l in range(L):
        for t in range(T):
            for h in range(H):
                row = off + l * sl + t * st + h * sh
                base = ((l * T + t) * H + h) * D // 2
                for g in range(D // group):
                    s = bf16_to_f32(scale[l, t, h, g])
                    m = bf16_to_f32(mn[l, t, h, g])
                    for i in range(g * group // 2, (g + 1) * group // 2):
                        byte = codes[base + i]
                        out[row + 2 * i] = _dequant4(byte & 0x0F, s, m)
                        out[row + 2 * i + 1] = _dequant4(byte >> 4, s, m)


def words(t: torch.Tensor) -> np.ndarray:
    """A contiguous 16-bit torch tensor as a numpy uint16 array sharing memory."""
    return t.view(torch.int16).numpy().view(np.uint16)


def geometry(view: torch.Tensor, block: torch.Tensor) -> tuple[int, ...] | None:
    """(offset, L, T, H, D, stride_l, stride_t, stride_h) of a K or V view [L,T,H,D] inside the
    flat ``block`` it was cut from, in elements; None if its rows are not contiguous."""
    if view.stride(3) != 1 and view.shape[3] > 1:
        return None
    return (view.storage_offset() - block.storage_offset(), *view.shape, *view.stride()[:3])


def source(view: torch.Tensor, block: torch.Tensor) -> tuple[np.ndarray, tuple[int, ...]]:
    """(block words, geometry) to read K or V from; a contiguous copy if its rows are strided
    (vllm_cpu keys are stored transposed)."""
    geom = geometry(view, block)
    if geom is not None:
        return words(block), geom
    copy = view.contiguous()
    return words(copy.view(-1)), geometry(copy, copy.view(-1))


def target(view: torch.Tensor, block: torch.Tensor):
    """(block words, geometry, finish) to write K or V into; ``finish()`` copies a temporary
    back when the rows are strided."""
    geom = geometry(view, block)
    if geom is not None:
        return words(block), geom, lambda: None
    tmp = torch.empty(view.shape, dtype=view.dtype)
    return words(tmp.view(-1)), geometry(tmp, tmp.view(-1)), lambda: view.copy_(tmp)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _layer_chunks(L: int) -> list[tuple[int, int]]:
    n = max(1, min(torch.get_num_threads(), L))
    bounds = [L * i // n for i in range(n + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _sub(geom: tuple[int, ...], a: int, b: int) -> tuple[int, ...]:
    off, L, T, H, D, sl, st, sh = geom
    return (off + a * sl, b - a, T, H, D, sl, st, sh)


def by_layers(geom: tuple[int, ...], call) -> int:
    """Run ``call(a, b, sub_geometry)`` for layer ranges [a, b) on the pool; sum the results."""
    global _POOL
    chunks = _layer_chunks(geom[1])
    if len(chunks) == 1:
        return call(0, geom[1], geom) or 0
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < len(chunks):
            _POOL = ThreadPoolExecutor(max_workers=len(chunks), thread_name_prefix="kvstore-codec")
        pool = _POOL
    futures = [pool.submit(call, a, b, _sub(geom, a, b)) for a, b in chunks]
    return sum(f.result() or 0 for f in futures)
