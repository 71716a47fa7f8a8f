"""What every codec implements, and the buffer plumbing they share.

A lossy codec sees a block as K and V tensors ``[layers, tokens, heads, head_dim]`` (via
``layout.split_kv``) and writes a fixed list of *sections* (codes, scales, minima), each a
dense tensor. Sections are laid out back to back, 16-byte aligned, after the header; their
sizes follow from the layout and the codec's parameter alone, so nothing but the header has to
be parsed to find them. The same torch code runs on CPU and CUDA: whatever device the input (for
encode) or the ``out`` buffer (for decode) lives on is where the arithmetic happens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings

import numpy as np
import torch

from kvstore.codecs import layout as kvlayout
from kvstore.codecs.header import HEADER_BYTES, Header, make_header
from kvstore.errors import CodecError
from kvstore.keys import KVLayout

ALIGN = 16

#: set False (or KVSTORE_CODECS_REFERENCE=1) to run only the torch reference implementation
USE_FAST = os.environ.get("KVSTORE_CODECS_REFERENCE", "") in ("", "0")


@functools.cache
def _fast_module():
    try:
        from kvstore.codecs import fast_cpu
    except ImportError:  # numba not installed: the reference is complete on its own
        return None
    return fast_cpu


def fast_kernels(shape: "kvlayout.BlockShape", device: torch.device):
    """The compiled CPU kernels if they apply to this block (bf16, on the CPU), else None."""
    if not USE_FAST or device.type != "cpu" or shape.dtype != torch.bfloat16:
        return None
    return _fast_module()


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Codec:
    """One encoding. ``codec_id`` is stored with every block: never renumber or reuse one."""

    name: str = ""
    codec_id: int = -1
    param: int = 0          # stored in the header (group size, ...); decode checks it
    lossy: bool = False

    def check_layout(self, layout: KVLayout) -> None:
        """Raise ``CodecError`` if blocks of ``layout`` cannot be encoded (caller stores raw)."""

    def header_param(self, layout: KVLayout) -> int:
        """The parameter this codec writes in headers for ``layout`` (decode insists on it)."""
        return self.param

    def encode(self, raw: torch.Tensor, layout: KVLayout) -> np.ndarray:
        """Encode ``raw`` (flat uint8 tensor of ``layout.block_bytes``) into header + body."""
        raise NotImplementedError

    def decode(self, header: Header, body: torch.Tensor, layout: KVLayout, out: torch.Tensor) -> None:
        """Write the block into ``out`` (flat uint8, ``layout.block_bytes``, on any device)."""
        raise NotImplementedError


class SectionCodec(Codec):
    """A lossy codec whose body is a fixed list of tensors computed from K and V."""

    lossy = True

    def sections(self, shape: kvlayout.BlockShape) -> list[Section]:
        raise NotImplementedError

    def quantize(self, k: torch.Tensor, v: torch.Tensor, shape: kvlayout.BlockShape) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, parts: dict[str, torch.Tensor], shape: kvlayout.BlockShape,
                   k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        raise NotImplementedError

    def fast_encode(self, fast, k_src, v_src, parts: dict[str, torch.Tensor]) -> None:
        """Compiled twin of ``quantize``. ``k_src``/``v_src``: (block words, geometry) from
        ``fast_cpu.source``; writes straight into the payload's ``parts``."""
        raise NotImplementedError

    def fast_decode(self, fast, parts: dict[str, torch.Tensor], kv: int, words, geom) -> None:
        """Compiled twin of ``dequantize`` for K (kv=0) or V (kv=1), into (words, geometry)."""
        raise NotImplementedError

    def shape_of(self, layout: KVLayout) -> kvlayout.BlockShape:
        shape = kvlayout.parse(layout)
        self.check_shape(shape)
        return shape

    def check_shape(self, shape: kvlayout.BlockShape) -> None:
        """Codec-specific refusals (group sizes that do not divide, ...)."""

    def check_layout(self, layout: KVLayout) -> None:
        self.shape_of(layout)

    def body_bytes(self, shape: kvlayout.BlockShape) -> int:
        return sum(_aligned(s.nbytes) for s in self.sections(shape))

    def encode(self, raw: torch.Tensor, layout: KVLayout) -> np.ndarray:
        shape = self.shape_of(layout)
        payload = np.empty(HEADER_BYTES + self.body_bytes(shape), dtype=np.uint8)
        body = torch.from_numpy(payload[HEADER_BYTES:])
        fast = fast_kernels(shape, raw.device)
        if fast is not None:
            parts = self._unpack(body, shape, zero_padding=True)
            block = raw.view(torch.int16)
            k16, v16 = kvlayout.split_kv(block, shape)
            self.fast_encode(fast, fast.source(k16, block), fast.source(v16, block), parts)
        elif raw.device.type == "cpu":
            self._pack(self._reference_parts(raw, shape), shape, body)
        else:  # assemble on the device, cross to the host once
            staged = torch.empty(body.numel(), dtype=torch.uint8, device=raw.device)
            self._pack(self._reference_parts(raw, shape), shape, staged)
            body.copy_(staged)
        payload[:HEADER_BYTES] = np.frombuffer(
            make_header(self.codec_id, self.param, layout, memoryview(payload[HEADER_BYTES:])), np.uint8)
        return payload

    def _reference_parts(self, raw: torch.Tensor, shape: kvlayout.BlockShape) -> dict[str, torch.Tensor]:
        k, v = kvlayout.split_kv(raw.view(shape.dtype), shape)
        return self.quantize(k, v, shape)

    def decode(self, header: Header, body: torch.Tensor, layout: KVLayout, out: torch.Tensor) -> None:
        shape = self.shape_of(layout)
        parts = self._unpack(body, shape)
        fast = fast_kernels(shape, out.device)
        if fast is not None:
            block = out.view(torch.int16)
            k16, v16 = kvlayout.split_kv(block, shape)
            for view, i in ((k16, 0), (v16, 1)):
                words, geom, finish = fast.target(view, block)
                self.fast_decode(fast, parts, i, words, geom)
                finish()
            return
        k_out, v_out = kvlayout.split_kv(out.view(shape.dtype), shape)
        self.dequantize(parts, shape, k_out, v_out)

    def _pack(self, parts: dict[str, torch.Tensor], shape: kvlayout.BlockShape, body: torch.Tensor) -> None:
        offset = 0
        for s in self.sections(shape):
            t = parts[s.name]
            assert t.dtype == s.dtype and tuple(t.shape) == s.shape, (s, t.dtype, t.shape)
            body[offset:offset + s.nbytes].view(s.dtype).view(s.shape).copy_(t)
            body[offset + s.nbytes:offset + _aligned(s.nbytes)] = 0  # padding: deterministic bytes
            offset += _aligned(s.nbytes)

    def _unpack(self, body: torch.Tensor, shape: kvlayout.BlockShape,
                zero_padding: bool = False) -> dict[str, torch.Tensor]:
        parts, offset = {}, 0
        for s in self.sections(shape):
            parts[s.name] = body[offset:offset + s.nbytes].view(s.dtype).view(s.shape)
            if zero_padding:
                body[offset + s.nbytes:offset + _aligned(s.nbytes)] = 0
            offset += _aligned(s.nbytes)
        if offset != body.numel():
            raise CodecError(f"payload body is {body.numel()} bytes; this layout needs {offset}")
        return parts


def check_finite(lo: torch.Tensor, hi: torch.Tensor, what: str) -> None:
    """Refuse NaN/Inf. Called on per-group minima/maxima (which propagate NaN/Inf) so the check
    costs a pass over the small statistics, not over the block."""
    bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0].tolist()]
        raise CodecError(f"block contains NaN or Inf in {what} (first at statistics index {first}); "
                         "refusing to encode it")


def div_exact(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor``, correctly rounded on every device.

    Never write ``tensor / python_number`` in a codec: CUDA torch computes a division by a CPU
    scalar as ``x * (1 / divisor)`` (``div_true_kernel_cuda``), one rounding more, so whenever
    ``1 / divisor`` is inexact (1/448, 1/15) some quotients come out one ulp high, e.g.
    ``1.3125 / 448 = 0.0029296875`` (a bf16 value) but ``1.3125 * fl(1/448) = 0.0029296877``,
    which ``round_up`` then bumps to the next bf16. The CPU and ``fast_cpu`` divide exactly.
    A tensor / tensor division is a true IEEE division on both devices."""
    return x / torch.full_like(x, divisor)


def canonical_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` with -0.0 replaced by +0.0. Which zero a min/max reduction returns for a group
    holding both depends on the order it visits them (CPU vector lanes, CUDA thread blocks,
    the compiled kernels' loop); statistics computed from it must not."""
    return torch.where(x == 0, torch.zeros_like(x), x)


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32, >= 0) in ``dtype``, never smaller than ``x``: a stored scale must still
    cover the range it was computed for."""
    y = x.to(dtype)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) in ``dtype``, never larger than ``x``: a stored minimum must stay below
    every value of its group."""
    y = x.to(dtype)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, -math.inf)), y)


def as_byte_tensor(buf, field: str) -> torch.Tensor:
    """A flat uint8 torch view of ``buf`` (bytes-like, numpy array or tensor), copying nothing."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise CodecError(f"{field}: tensor must be contiguous")
        return buf.reshape(-1).view(torch.uint8)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise CodecError(f"{field}: array must be C-contiguous")
        arr = buf.reshape(-1).view(np.uint8)
    elif isinstance(buf, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(buf, dtype=np.uint8)
    else:
        raise CodecError(f"{field}: expected bytes, a numpy array or a torch tensor, "
                         f"got {type(buf).__name__}")
    with warnings.catch_warnings():  # read-only buffers are only ever read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)
