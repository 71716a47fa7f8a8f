"""Lossless codecs: ``raw`` (identity, no header) and ``zstd`` (byte planes + zstd).

``zstd`` does not need to interpret the layout, so it accepts any layout and dtype (MLA too).
It first splits elements into byte planes (all first bytes, then all second bytes, ...): the
sign/exponent bytes of bf16/fp16 KV are highly repetitive, the mantissa bytes are noise, and
zstd does much better on them apart. The header's parameter holds the plane count (element
size). Whether it pays for itself is measured in benchmarks/bench_codecs.py.

Both work on host bytes with numpy alone: they run in the core install, without torch.
"""

from __future__ import annotations

import numpy as np
import zstandard

from kvstore.codecs.codec import Codec
from kvstore.codecs.header import HEADER_BYTES, Header, make_header
from kvstore.errors import CodecError
from kvstore.keys import DTYPE_SIZES, KVLayout


class RawCodec(Codec):
    """Identity. A raw block is stored exactly as given, without a header."""

    name, codec_id = "raw", 0


class ZstdCodec(Codec):
    def __init__(self, name: str, codec_id: int, level: int = 1) -> None:
        self.name, self.codec_id, self.level = name, codec_id, level

    def header_param(self, layout: KVLayout) -> int:
        return DTYPE_SIZES[layout.dtype]  # byte planes

    def encode(self, raw: np.ndarray, layout: KVLayout) -> np.ndarray:
        planes = self.header_param(layout)
        data = raw
        if planes > 1:
            data = np.ascontiguousarray(data.reshape(-1, planes).T)
        body = zstandard.ZstdCompressor(level=self.level).compress(data)
        header = make_header(self.codec_id, planes, layout, memoryview(body))
        payload = np.empty(HEADER_BYTES + len(body), dtype=np.uint8)
        payload[:HEADER_BYTES] = np.frombuffer(header, np.uint8)
        payload[HEADER_BYTES:] = np.frombuffer(body, np.uint8)
        return payload

    def check_body(self, body: np.ndarray, layout: KVLayout) -> None:
        declared_size(body, layout.block_bytes)

    def decode(self, header: Header, body: np.ndarray, layout: KVLayout, out) -> None:
        planes = header.param  # decode_block has checked it against header_param()
        data = bounded_decompress(body, layout.block_bytes)
        if len(data) != layout.block_bytes:
            raise CodecError(f"zstd payload decompressed to {len(data)} bytes, the block is "
                             f"{layout.block_bytes}")
        arr = np.frombuffer(data, np.uint8)
        if planes > 1:
            arr = arr.reshape(planes, -1).T
        if isinstance(out, np.ndarray):
            out.reshape(arr.shape)[...] = arr
        elif out.device.type == "cpu":
            out.numpy().reshape(arr.shape)[...] = arr
        else:   # a device tensor (torch is installed, or there would be none)
            import torch
            out.copy_(torch.from_numpy(np.ascontiguousarray(arr).reshape(-1)))


def bounded_decompress(body: np.ndarray, limit: int) -> bytes:
    """Decompress one zstd frame into at most ``limit`` bytes, never allocating more.

    A frame names its content size and window, and ``ZstdDecompressor.decompress`` allocates what
    the frame declares before ``max_output_size`` is consulted, so a few KiB that declare a GiB
    would cost a GiB. Here a frame that declares another size than ``limit`` is refused from its
    header alone, the window the decoder may allocate is capped near ``limit``, and the output is
    streamed in pieces that together never pass ``limit + 1`` bytes."""
    declared_size(body, limit)
    window = max(1 << 10, 1 << (limit - 1).bit_length())   # the encoder never needs a wider one
    pieces, got = [], 0
    try:
        with zstandard.ZstdDecompressor(max_window_size=window).stream_reader(body) as reader:
            while got <= limit:
                piece = reader.read(limit + 1 - got)
                if not piece:
                    break
                pieces.append(piece)
                got += len(piece)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd payload does not decompress: {e}") from e
    if got > limit:
        raise CodecError(f"zstd payload decompresses past the {limit}-byte block: refused")
    return b"".join(pieces)


def declared_size(body: np.ndarray, limit: int) -> int:
    """The size the zstd frame in ``body`` declares (-1: it does not say); ``CodecError`` unless
    that is ``limit`` or unsaid."""
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd payload has no valid frame header: {e}") from e
    if declared not in (-1, limit):   # -1: unsaid; then the streaming cap of bounded_decompress decides
        raise CodecError(f"zstd payload declares {declared} bytes, the block is {limit}: refused unread")
    return declared
