"""Remote fallback: blocks as streams of ~1 MiB protobuf chunks.

gRPC moves one large protobuf message several times slower than a stream of ~1 MiB ones, and
each message costs a send of its own, so Put sends the blocks back to back in messages of up to
``chunk_bytes`` (several small blocks to one; the first message also carries the header) and Get
answers with chunks that carry a block index: a piece of one block at an offset, or several
whole blocks with their sizes (``packed``, for clients that ask for it).

Both ends handle the data field by hand: a sender encodes the small fields with protobuf and
appends the data in one copy out of the caller's buffers (building and serializing a message
would copy it three times), and a receiver parses around it (``split_payload``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
from google.protobuf.message import DecodeError

from kvstore.proto import kvstore_pb2 as pb

DEFAULT_CHUNK_BYTES = 1 << 20


_PUT_CHUNK_HEADER = 1   # PutChunk.header's field number
_PUT_CHUNK_DATA = 2     # PutChunk.data's
_GET_CHUNK_DATA = 6     # GetChunk.data's
_MAX_FIELD_NUMBER = (1 << 29) - 1


def put_messages(header: pb.PutHeader, arrays: Sequence[np.ndarray],
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The Put stream, each message an encoded ``PutChunk``: the header in the first, then the
    blocks' bytes back to back. Blocks no larger than ``chunk_bytes`` share messages of up to
    ``chunk_bytes`` (the daemon cuts the stream into blocks by their sizes, so a message boundary
    means nothing to it; starting each message at a block boundary lets it store the blocks
    straight out of the message); a larger block is cut into ``chunk_bytes`` pieces of its own."""
    encoded_header = header.SerializeToString()
    prefix = [_field_head(_PUT_CHUNK_HEADER, len(encoded_header)) + encoded_header]   # consumed by the first
    parts: list[memoryview] = []
    size = 0

    def message() -> bytes:
        nonlocal parts, size
        out = b"".join((*prefix, _field_head(_PUT_CHUNK_DATA, size), *parts))
        prefix.clear()
        parts, size = [], 0
        return out

    for a in arrays:
        flat = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        if len(flat) > chunk_bytes:
            if parts:
                yield message()
            for off in range(0, len(flat), chunk_bytes):
                parts, size = [flat[off:off + chunk_bytes]], len(flat[off:off + chunk_bytes])
                yield message()
            continue
        if parts and size + len(flat) > chunk_bytes:
            yield message()
        parts.append(flat)
        size += len(flat)
    if parts:
        yield message()
    elif prefix:   # no bytes at all: the header alone
        yield prefix.pop()


def split_payload(raw: bytes, field: int) -> tuple[bytes, memoryview]:
    """An encoded message as the encoding of all its fields but ``field`` (a bytes field), and
    a view of that field's value where it arrived (the last occurrence, as protobuf reads it).
    protobuf's parse copies a message's payload, and so does every read of the field (and
    ``ByteSize``): parsing only the rest keeps the payload in place.

    ``field`` with another wire type than length-delimited stays in the rest, where protobuf
    skips it as it would. ``ValueError`` for bytes that are not a message (truncated, a bad
    varint, a field number out of range, a group or reserved wire type)."""
    view = memoryview(raw)
    end = len(view)
    rest: list[memoryview] = []
    data = view[0:0]
    pos = 0
    while pos < end:
        start = pos
        key, pos = _read_varint(view, pos)
        number, wire = key >> 3, key & 7
        if not 1 <= number <= _MAX_FIELD_NUMBER:
            raise ValueError(f"field number {number}")
        if wire == 2:
            n, pos = _read_varint(view, pos)
            if n > end - pos:
                raise ValueError("a length-delimited field runs past the end")
            pos += n
            if number == field:
                data = view[pos - n:pos]
                continue
        elif wire == 0:
            _, pos = _read_varint(view, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            if pos > end:
                raise ValueError("a fixed-size field runs past the end")
        else:
            raise ValueError(f"wire type {wire}")
        rest.append(view[start:pos])
    return b"".join(rest), data


def _parse(message_cls, encoded: bytes):
    try:
        return message_cls.FromString(encoded)
    except DecodeError as e:
        raise ValueError(f"{message_cls.DESCRIPTOR.name}: {e}") from None


class PutPiece(NamedTuple):
    """A ``PutChunk`` as the daemon reads it (``read_put_chunk``): its header if it carries one,
    and its data as a view into the received bytes. ``ByteSize`` is the message's size on the
    wire, as a protobuf message's would be (the call bridge budgets its batches by it)."""
    header: pb.PutHeader | None
    data: memoryview
    wire_bytes: int

    def ByteSize(self) -> int:  # noqa: N802 - protobuf's name, which the call bridge calls
        return self.wire_bytes


def read_put_chunk(raw: bytes) -> PutPiece:
    """An encoded ``PutChunk`` with its data left where it arrived (``split_payload``); every
    other field as protobuf reads it. ``ValueError`` for bytes that are not a ``PutChunk``."""
    rest, data = split_payload(raw, _PUT_CHUNK_DATA)
    chunk = _parse(pb.PutChunk, rest)
    return PutPiece(chunk.header if chunk.HasField("header") else None, data, len(raw))


class GetPiece(NamedTuple):
    """A ``GetChunk`` as the client reads it (``read_get_chunk``): every field but ``data`` in
    ``chunk``, and the data as a view into the received bytes."""
    chunk: pb.GetChunk
    data: memoryview


def read_get_chunk(raw: bytes) -> GetPiece:
    """An encoded ``GetChunk`` with its data left where it arrived (``split_payload``)."""
    rest, data = split_payload(raw, _GET_CHUNK_DATA)
    return GetPiece(_parse(pb.GetChunk, rest), data)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view):
            raise ValueError("a varint runs past the end")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise ValueError("a varint longer than 10 bytes")


def _field_head(field: int, size: int) -> bytes:
    """The key and length that go before the ``size`` bytes of length-delimited ``field``."""
    return _varint(field << 3 | 2) + _varint(size)


def get_messages(index: int, block: np.ndarray | None, codec: int = 0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """One block of a Get answer, each chunk as an encoded ``GetChunk`` (a miss is a single chunk
    with hit=False), encoded here rather than by gRPC on the event loop."""
    if block is None:
        yield pb.GetChunk(index=index, hit=False).SerializeToString()
        return
    size = block.nbytes
    if size == 0:
        yield pb.GetChunk(index=index, hit=True, codec=codec, size=0).SerializeToString()
        return
    flat = memoryview(np.ascontiguousarray(block).reshape(-1).view(np.uint8))
    for off in range(0, size, chunk_bytes):
        data = flat[off:off + chunk_bytes]
        head = pb.GetChunk(index=index, hit=True, codec=codec, size=size, offset=off).SerializeToString()
        yield b"".join((head, _field_head(_GET_CHUNK_DATA, len(data)), data))


def run_messages(first: int, blocks, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """A run of a packed Get answer (``block_reads.Run.blocks``: each block as its views and codec,
    or None for a miss), block ``first`` first, as encoded ``GetChunk`` messages: consecutive hits
    of up to ``chunk_bytes`` together share a packed chunk (``sizes``, ``codecs``), a larger
    block goes as ``get_messages`` cuts it, a miss as its own chunk. Each message is built before
    the next block is looked at, so the views need only stay valid for the run."""
    pack: list[tuple[int, list, int, int]] = []   # (index, views, size, codec)
    packed = 0

    def flush() -> bytes:
        nonlocal pack, packed
        codecs = [c for _, _, _, c in pack]
        head = pb.GetChunk(index=pack[0][0], hit=True, sizes=[n for _, _, n, _ in pack],
                           codecs=codecs if any(codecs) else []).SerializeToString()
        data = [v for _, views, _, _ in pack for v in views]
        out = b"".join((head, _field_head(_GET_CHUNK_DATA, packed), *data))
        pack, packed = [], 0
        return out

    for index, block in enumerate(blocks, first):
        if block is None:
            if pack:
                yield flush()
            yield from get_messages(index, None)
            continue
        views, codec = block
        size = sum(v.nbytes for v in views)
        if size > chunk_bytes:
            if pack:
                yield flush()
            yield from get_messages(index, views[0] if len(views) == 1 else np.concatenate(views), codec, chunk_bytes)
            continue
        if pack and packed + size > chunk_bytes:
            yield flush()
        pack.append((index, views, size, codec))
        packed += size
    if pack:
        yield flush()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class BlockSplitter:
    """Server side of Put: cut an incoming byte stream into blocks of ``block_bytes`` (or, for a
    put of client-encoded payloads, ``sizes[i]`` bytes each, none larger than a block).

    ``feed`` yields ``(index, block, gathered)`` each time a block is complete: a view of the
    message itself when a whole block sits in it at a block boundary (no copy; valid while the
    message is), else (``gathered``) a view of one pooled buffer the pieces were gathered in,
    valid only until the generator moves on. The caller feeds no more than the sizes add up to.
    """

    def __init__(self, block_bytes: int, buffer: np.ndarray, sizes: Sequence[int] | None = None) -> None:
        self.block_bytes = block_bytes
        self.buf = buffer[:block_bytes]
        self.sizes = sizes
        self.fill = 0
        self.index = 0

    def _size(self) -> int:
        return self.block_bytes if self.sizes is None else int(self.sizes[self.index])

    def feed(self, data: bytes) -> Iterator[tuple[int, np.ndarray, bool]]:
        src = np.frombuffer(data, dtype=np.uint8)
        pos = 0
        while self.fill == 0 and pos < len(src) and len(src) - pos >= self._size():  # aligned: no copy
            size = self._size()
            yield self.index, src[pos:pos + size], False
            self.index += 1
            pos += size
        while pos < len(src):
            size = self._size()
            take = min(size - self.fill, len(src) - pos)
            self.buf[self.fill:self.fill + take] = src[pos:pos + take]
            self.fill += take
            pos += take
            if self.fill == size:
                yield self.index, self.buf[:size], True
                self.index += 1
                self.fill = 0
