"""Remote fallback: blocks as streams of ~1 MiB protobuf chunks.

One large protobuf message moves at ~0.3 GB/s here, 1 MiB chunks at ~2 GB/s (shared/notes), so
Put sends the blocks back to back cut into ``chunk_bytes`` pieces (the first message also carries
the header) and Get answers with per-block chunks that carry their block index and offset.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvstore.proto import kvstore_pb2 as pb

DEFAULT_CHUNK_BYTES = 1 << 20


def put_messages(header: pb.PutHeader, arrays: Sequence[np.ndarray],
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.PutChunk]:
    """The Put stream: header first, then every block's bytes in ``chunk_bytes`` pieces."""
    first = True
    for a in arrays:
        for off in range(0, a.nbytes, chunk_bytes):
            data = a[off:off + chunk_bytes].tobytes()
            if first:
                yield pb.PutChunk(header=header, data=data)
                first = False
            else:
                yield pb.PutChunk(data=data)
    if first:
        yield pb.PutChunk(header=header)


_GET_CHUNK_DATA = 6   # GetChunk.data's field number


def get_messages(index: int, block: np.ndarray | None, codec: int = 0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """One block of a Get answer, each chunk as an encoded ``GetChunk`` (a miss is a single chunk
    with hit=False). Encoded here, not by gRPC: the small fields go through protobuf and the data
    is appended as field 6 in one copy out of the block, where building a message and serializing
    it would copy it three times (and serialize on the event loop)."""
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
        yield b"".join((head, _varint(_GET_CHUNK_DATA << 3 | 2), _varint(len(data)), data))


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

    ``feed`` yields ``(index, block)`` each time a block is complete: a view of the message itself
    when a whole block sits in it at a block boundary (no copy), else a view of one pooled buffer
    the pieces were gathered in. Either view is only valid until the next ``feed``. The caller
    feeds no more than the sizes add up to.
    """

    def __init__(self, block_bytes: int, buffer: np.ndarray, sizes: Sequence[int] | None = None) -> None:
        self.block_bytes = block_bytes
        self.buf = buffer[:block_bytes]
        self.sizes = sizes
        self.fill = 0
        self.index = 0

    def _size(self) -> int:
        return self.block_bytes if self.sizes is None else int(self.sizes[self.index])

    def feed(self, data: bytes) -> Iterator[tuple[int, np.ndarray]]:
        src = np.frombuffer(data, dtype=np.uint8)
        pos = 0
        while self.fill == 0 and pos < len(src) and len(src) - pos >= self._size():  # aligned: no copy
            size = self._size()
            yield self.index, src[pos:pos + size]
            self.index += 1
            pos += size
        while pos < len(src):
            size = self._size()
            take = min(size - self.fill, len(src) - pos)
            self.buf[self.fill:self.fill + take] = src[pos:pos + take]
            self.fill += take
            pos += take
            if self.fill == size:
                yield self.index, self.buf[:size]
                self.index += 1
                self.fill = 0
