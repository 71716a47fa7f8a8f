"""What every codec implements, and the buffer plumbing they share.

A lossy codec sees a block as one or two tensors ``[layers, tokens, heads, head_dim]`` (K and V,
or a segment's / MLA latent's one tensor: ``layout.part_views``) and writes a fixed list of
*sections* (codes, scales, minima), each a dense tensor. Sections are laid out back to back,
16-byte aligned, after the header; their sizes follow from the layout and the codec's parameter
alone, so nothing but the header has to be parsed to find them. The same torch code runs on CPU
and CUDA: whatever device the input (for encode) or the ``out`` buffer (for decode) lives on is
where the arithmetic happens; on the CPU, bf16 blocks take the compiled kernels (``fast_cpu``)
when numba is installed and they are compiled (``compiled``: in the background, the torch code
meanwhile), byte-identical to the torch code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import numpy as np
import torch

from kvstore.buffers import as_byte_tensor
from kvstore.codecs import compiled
from kvstore.codecs import layout as kvlayout
from kvstore.codecs.codec import Codec
from kvstore.codecs.header import HEADER_BYTES, Header, make_header
from kvstore.codecs.refusal import Refused
from kvstore.errors import CodecError
from kvstore.keys import KVLayout

ALIGN = 16
#: bytes after a reference-encoded body for its finiteness check (see ``SectionCodec.quantize``)
CHECK_BYTES = 8

#: set False (or KVSTORE_CODECS_REFERENCE=1) to run only the torch reference implementation
USE_FAST = os.environ.get("KVSTORE_CODECS_REFERENCE", "") in ("", "0")


@functools.cache
def _fast_modules():
    try:
        from kvstore.codecs import fast_cpu, fast_runner
    except ImportError:  # numba not installed: the reference is complete on its own
        return None
    return fast_cpu, fast_runner


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


class SectionCodec(Codec):
    """A lossy codec whose body is a fixed list of tensors computed from the block's tensors."""

    lossy = True

    def sections(self, shape: kvlayout.BlockShape) -> list[Section]:
        raise NotImplementedError

    def quantize(self, x: torch.Tensor, shape: kvlayout.BlockShape, parts: dict[str, torch.Tensor],
                 check: torch.Tensor) -> None:
        """Quantise ``x`` (float32 ``[parts, L, T, H, D]``: K then V, or the one tensor; scratch, may
        be overwritten) into ``parts`` (the payload's sections, on ``x``'s device) with whole-block
        torch ops, and write into ``check`` (a float64 scalar) a number that is finite iff the block
        is: it crosses to the host with the payload, so encoding synchronises with the device once."""
        raise NotImplementedError

    def dequantize(self, parts: dict[str, torch.Tensor], shape: kvlayout.BlockShape,
                   block: torch.Tensor) -> None:
        """Write the block into ``block`` (flat, ``shape.dtype``, on ``parts``' device)."""
        raise NotImplementedError

    def fast_jobs(self, kernels, tensors: list, sections: dict[str, np.ndarray], shape: kvlayout.BlockShape,
                  encode: bool) -> list:
        """Compiled twin of ``quantize`` (``encode``) or ``dequantize``: one ``fast_runner`` job
        per tensor, in order. ``tensors``: (16-bit words, geometry) of each; ``sections``: the
        payload's sections as flat numpy arrays (16-bit floats as uint16 words)."""
        raise NotImplementedError

    def fast_ok(self, shape: kvlayout.BlockShape) -> bool:
        """Whether the compiled kernels handle this shape (bf16 on the CPU is checked already)."""
        return True

    def shape_of(self, layout: KVLayout) -> kvlayout.BlockShape:
        return _shape_for(self, layout)

    def check_shape(self, shape: kvlayout.BlockShape) -> None:
        """Codec-specific refusals (group sizes that do not divide, ...)."""

    def check_layout(self, layout: KVLayout) -> None:
        shape = self.shape_of(layout)
        if HEADER_BYTES + self.body_bytes(shape) >= layout.block_bytes:  # (encode_block still encodes)
            raise Refused("no_gain", f"{self.name}: a {layout.block_bytes}-byte block of this layout encodes to "
                          f"{HEADER_BYTES + self.body_bytes(shape)} bytes; store it raw")

    def body_bytes(self, shape: kvlayout.BlockShape) -> int:
        return _section_table(self, shape)[1]

    def fast_modules(self, shape: kvlayout.BlockShape, device: torch.device):
        """(kernels, runner) if the compiled kernels apply to this block and are compiled, else
        None: the torch reference, which gives the same bytes, runs while they compile."""
        if not USE_FAST or device.type != "cpu" or shape.dtype != torch.bfloat16 or not self.fast_ok(shape):
            return None
        return _fast_modules() if compiled.ready() else None   # (numba imported by then, not in this call)

    def encode(self, raw: torch.Tensor, layout: KVLayout) -> np.ndarray:
        shape = self.shape_of(layout)
        fast = self.fast_modules(shape, raw.device)
        payload = self._encode_reference(raw, shape) if fast is None else self._encode_fast(fast, raw, shape)
        payload[:HEADER_BYTES] = np.frombuffer(
            make_header(self.codec_id, self.param, layout, memoryview(payload[HEADER_BYTES:])), np.uint8)
        return payload

    def _encode_fast(self, fast, raw: torch.Tensor, shape: kvlayout.BlockShape) -> np.ndarray:
        kernels, runner = fast
        payload = np.empty(HEADER_BYTES + self.body_bytes(shape), dtype=np.uint8)
        sections = self._np_sections(payload[HEADER_BYTES:], shape, zero_padding=True)
        tensors = runner.Tensors(raw, shape, writing=False)
        bad = runner.run(self.fast_jobs(kernels, tensors.items, sections, shape, encode=True), shape.numel)
        for name, flag in zip(shape.part_names, bad):
            if flag:
                raise Refused("nonfinite", f"block contains NaN or Inf{_where(name)}; refusing to encode it")
        return payload

    def _encode_reference(self, raw: torch.Tensor, shape: kvlayout.BlockShape) -> np.ndarray:
        """The torch path, on ``raw``'s device: a fixed few whole-block ops (no per-layer or
        per-section loops, no host round trips); the payload is assembled on the device and
        crosses to the host in one copy (pinned memory from a CUDA device), the finiteness check
        riding in its last 8 bytes."""
        n = self.body_bytes(shape)
        on_host = raw.device.type == "cpu"
        if on_host:
            payload = np.empty(HEADER_BYTES + n + CHECK_BYTES, dtype=np.uint8)
            staged = torch.from_numpy(payload[HEADER_BYTES:])
        else:
            staged = torch.empty(n + CHECK_BYTES, dtype=torch.uint8, device=raw.device)
        x = torch.empty(kvlayout.canonical_shape(shape), dtype=torch.float32, device=raw.device)
        for view, i in kvlayout.kv_views(raw.view(shape.dtype), shape):
            x[i].copy_(view)
        self.quantize(x, shape, self._unpack(staged[:n], shape, zero_padding=True),
                      staged[n:].view(torch.float64)[0])
        if not on_host:
            host = torch.empty(HEADER_BYTES + n + CHECK_BYTES, dtype=torch.uint8,
                               pin_memory=raw.device.type == "cuda")
            host[HEADER_BYTES:].copy_(staged)  # the one synchronisation with the device
            payload = host.numpy()
        if not math.isfinite(payload[HEADER_BYTES + n:].view(np.float64)[0]):
            raise nonfinite_error(raw, shape)
        return payload[:HEADER_BYTES + n]

    def decode(self, header: Header, body: np.ndarray, layout: KVLayout, out: torch.Tensor) -> None:
        shape = self.shape_of(layout)
        fast = self.fast_modules(shape, out.device)
        if fast is None:
            host = as_byte_tensor(body, "payload")
            parts = self._unpack(host if out.device.type == "cpu" else to_device(host, out.device), shape)
            self.dequantize(parts, shape, out.view(shape.dtype))
            return
        kernels, runner = fast
        sections = self._np_sections(body, shape)
        tensors = runner.Tensors(out, shape, writing=True)
        runner.run(self.fast_jobs(kernels, tensors.items, sections, shape, encode=False), shape.numel)
        tensors.finish()

    @staticmethod
    def rows(parts: dict[str, torch.Tensor], names: tuple[str, ...]) -> torch.Tensor:
        """Sections ``names`` (same dtype and shape, evenly spaced in the body, as K and V's
        sections are) as one strided tensor ``[len(names), *shape]``: one op writes them all."""
        first = parts[names[0]]
        step = (parts[names[-1]].data_ptr() - first.data_ptr()) // first.element_size() // max(len(names) - 1, 1)
        for i, name in enumerate(names):
            t = parts[name]
            assert t.dtype == first.dtype and t.shape == first.shape and t.is_contiguous(), name
            assert t.data_ptr() == first.data_ptr() + i * step * first.element_size(), names
        return first.as_strided((len(names), *first.shape), (step, *first.stride()))

    def _check_body(self, body_bytes: int, shape: kvlayout.BlockShape) -> None:
        if body_bytes != self.body_bytes(shape):
            raise CodecError(f"payload body is {body_bytes} bytes; this layout needs {self.body_bytes(shape)}")

    def _unpack(self, body: torch.Tensor, shape: kvlayout.BlockShape,
                zero_padding: bool = False) -> dict[str, torch.Tensor]:
        self._check_body(body.numel(), shape)
        parts = {}
        for s, offset, nbytes, _ in _section_table(self, shape)[0]:
            parts[s.name] = body[offset:offset + nbytes].view(s.dtype).view(s.shape)
            if zero_padding and _aligned(nbytes) > nbytes:  # padding: deterministic bytes
                body[offset + nbytes:offset + _aligned(nbytes)] = 0
        return parts

    def _np_sections(self, body: np.ndarray, shape: kvlayout.BlockShape,
                     zero_padding: bool = False) -> dict[str, np.ndarray]:
        """The sections as flat numpy arrays for the compiled kernels (16-bit floats as uint16)."""
        self._check_body(body.size, shape)
        parts = {}
        for s, offset, nbytes, word in _section_table(self, shape)[0]:
            parts[s.name] = body[offset:offset + nbytes].view(word)
            if zero_padding and _aligned(nbytes) > nbytes:
                body[offset + nbytes:offset + _aligned(nbytes)] = 0
        return parts


@functools.lru_cache(maxsize=1024)
def _shape_for(codec: SectionCodec, layout: KVLayout) -> kvlayout.BlockShape:
    """The shape ``codec`` sees in blocks of ``layout`` (refusals raise, and are not cached)."""
    shape = kvlayout.parse(layout)
    codec.check_shape(shape)
    return shape


@functools.lru_cache(maxsize=1024)
def _section_table(codec: SectionCodec, shape: kvlayout.BlockShape) -> tuple[tuple, int]:
    """A codec's sections for ``shape``: ((section, byte offset in the body, bytes, numpy word
    type for the compiled kernels), ...), body bytes."""
    table, offset = [], 0
    for sec in codec.sections(shape):
        table.append((sec, offset, sec.nbytes, np.uint8 if sec.dtype == torch.uint8 else np.uint16))
        offset += _aligned(sec.nbytes)
    return tuple(table), offset


def _where(part_name: str) -> str:
    return f" in {part_name}" if part_name in ("K", "V") else ""


def nonfinite_error(raw: torch.Tensor, shape: kvlayout.BlockShape) -> Refused:
    """Why a block was refused: its first NaN/Inf, found only once a check said there is one."""
    for name, t in zip(shape.part_names, kvlayout.part_views(raw.view(shape.dtype), shape)):
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            first = [int(i) for i in bad.nonzero()[0].tolist()]
            return Refused("nonfinite", f"block contains NaN or Inf{_where(name)} (first at [layer, token, "
                           f"head, dim] = {first}); refusing to encode it")
    return Refused("nonfinite", "block contains NaN or Inf; refusing to encode it")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (CPU bytes) copied to ``device`` without blocking the host on CUDA: staged through
    pinned memory (a pageable copy waits for the transfer), whose block torch recycles only once
    the copy is done. Decode then queues its kernels behind it and returns."""
    if device.type != "cuda":
        return host.to(device)
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)

