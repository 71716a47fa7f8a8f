"""The self-describing header in front of every encoded (non-raw) payload.

Decode needs only the namespace's layout and this header: which codec and version wrote the
payload, its parameter (group size, element size), the block shape and dtype it was encoded
from, and an xxh3-64 of the body. A truncated, corrupted or foreign payload is therefore a
``CodecError`` — never a block of plausible-looking garbage handed to an engine.

Wire format (little-endian, 48 bytes, body follows)::

    magic "KVCD" | version u8 | codec id u8 | dtype code u8 | reserved u8 | param u16 | pad 2
    layers u32 | tokens u32 | heads u32 | dim u32 | body length u64 | body xxh3-64 u64 | crc32 u32
"""

from __future__ import annotations

import dataclasses
import struct
import zlib

import xxhash

from kvstore.errors import CodecError
from kvstore.keys import KVLayout

MAGIC = b"KVCD"
VERSION = 1
_FORMAT = struct.Struct("<4sBBBBHxxIIIIQQ")
_CRC = struct.Struct("<I")
HEADER_BYTES = _FORMAT.size + _CRC.size  # 48

#: stable codes for KVLayout.dtype names (stored in headers: never renumber)
DTYPE_CODES = {"bfloat16": 1, "float16": 2, "float32": 3, "float8_e4m3fn": 4, "float8_e5m2": 5,
               "int8": 6, "uint8": 7}
_DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}


@dataclasses.dataclass(frozen=True)
class Header:
    codec_id: int
    param: int
    dtype: str
    layers: int
    tokens: int
    heads: int
    dim: int
    body_len: int
    body_hash: int
    version: int = VERSION

    def pack(self) -> bytes:
        head = _FORMAT.pack(MAGIC, self.version, self.codec_id, DTYPE_CODES[self.dtype], 0,
                            self.param, self.layers, self.tokens, self.heads, self.dim,
                            self.body_len, self.body_hash)
        return head + _CRC.pack(zlib.crc32(head))

    def check_layout(self, layout: KVLayout) -> None:
        """Refuse a payload encoded from a different block shape than ``layout`` describes."""
        want = (layout.dtype, layout.num_layers, layout.block_tokens, layout.num_kv_heads,
                layout.head_dim)
        got = (self.dtype, self.layers, self.tokens, self.heads, self.dim)
        if want != got:
            raise CodecError(f"payload was encoded for (dtype, layers, tokens, heads, dim)={got}, "
                             f"but the layout says {want}")


def make_header(codec_id: int, param: int, layout: KVLayout, body: memoryview) -> bytes:
    return Header(codec_id, param, layout.dtype, layout.num_layers, layout.block_tokens,
                  layout.num_kv_heads, layout.head_dim, len(body), body_hash(body)).pack()


def body_hash(body: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(body)


def parse_header(payload: memoryview) -> Header:
    """Read and validate the header of ``payload`` (a byte view of the whole payload)."""
    if len(payload) < HEADER_BYTES:
        raise CodecError(f"payload is {len(payload)} bytes, shorter than the {HEADER_BYTES}-byte "
                         "codec header: truncated")
    head = bytes(payload[:_FORMAT.size])
    magic, version, codec_id, dtype_code, _, param, L, T, H, D, body_len, hsh = _FORMAT.unpack(head)
    if magic != MAGIC:
        raise CodecError(f"payload does not start with the codec magic {MAGIC!r} (got {magic!r}): "
                         "not an encoded block")
    (crc,) = _CRC.unpack(bytes(payload[_FORMAT.size:HEADER_BYTES]))
    if crc != zlib.crc32(head):
        raise CodecError("codec header checksum mismatch: header corrupted")
    if version != VERSION:
        raise CodecError(f"codec header version {version} is not supported by this build "
                         f"(supports {VERSION})")
    dtype = _DTYPE_NAMES.get(dtype_code)
    if dtype is None:
        raise CodecError(f"codec header names unknown dtype code {dtype_code}")
    if len(payload) != HEADER_BYTES + body_len:
        raise CodecError(f"payload body is {len(payload) - HEADER_BYTES} bytes, header says "
                         f"{body_len}: truncated or padded")
    return Header(codec_id, param, dtype, L, T, H, D, body_len, hsh, version)


def verify_body(header: Header, body: memoryview) -> None:
    if body_hash(body) != header.body_hash:
        raise CodecError("codec payload body checksum mismatch: payload corrupted")
