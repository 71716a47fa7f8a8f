"""Lossless codecs: ``raw`` (identity, no header) and ``zstd`` (byte planes + zstd).

``zstd`` does not need to interpret the layout, so it accepts any layout and dtype (MLA too).
It first splits elements into byte planes (all first bytes, then all second bytes, ...): the
sign/exponent bytes of bf16/fp16 KV are highly repetitive, the mantissa bytes are noise, and
zstd does much better on them apart. The header's parameter holds the plane count (element
size). Whether it pays for itself is measured in benchmarks/bench_codecs.py.
"""

from __future__ import annotations

import numpy as np
import torch
import zstandard

from kvstore.codecs.base import Codec
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

    def encode(self, raw: torch.Tensor, layout: KVLayout) -> np.ndarray:
        planes = self.header_param(layout)
        data = raw.cpu().numpy()
        if planes > 1:
            data = np.ascontiguousarray(data.reshape(-1, planes).T)
        body = zstandard.ZstdCompressor(level=self.level).compress(data)
        header = make_header(self.codec_id, planes, layout, memoryview(body))
        payload = np.empty(HEADER_BYTES + len(body), dtype=np.uint8)
        payload[:HEADER_BYTES] = np.frombuffer(header, np.uint8)
        payload[HEADER_BYTES:] = np.frombuffer(body, np.uint8)
        return payload

    def decode(self, header: Header, body: np.ndarray, layout: KVLayout, out: torch.Tensor) -> None:
        planes = header.param  # decode_block has checked it against header_param()
        try:
            data = zstandard.ZstdDecompressor().decompress(body,
                                                           max_output_size=layout.block_bytes)
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd payload does not decompress: {e}") from e
        if len(data) != layout.block_bytes:
            raise CodecError(f"zstd payload decompressed to {len(data)} bytes, the block is "
                             f"{layout.block_bytes}")
        arr = np.frombuffer(data, np.uint8)
        if planes > 1:
            arr = arr.reshape(planes, -1).T
        if out.device.type == "cpu":
            out.numpy().reshape(arr.shape)[...] = arr
        else:
            out.copy_(torch.from_numpy(np.ascontiguousarray(arr).reshape(-1)))
