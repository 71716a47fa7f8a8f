"""Transport pieces on their own: same-host proof, arena identity, chunking of Put streams."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.proto import kvstore_pb2 as pb
from kvstore.transport import chunks, shm


def test_nonce_proves_same_host_only_with_the_exact_nonce(tmp_path):
    nonce = os.urandom(16)
    path = shm.write_probe(str(tmp_path), nonce)
    assert not shm.nonce_is_local(path, os.urandom(16))       # someone else's probe
    assert not shm.nonce_is_local(str(tmp_path / "absent"), nonce)  # a path that is not here
    assert not shm.nonce_is_local("", nonce)
    assert shm.nonce_is_local(path, nonce)
    assert not os.path.exists(path)                             # consumed once read
    assert not shm.nonce_is_local(path, nonce)


def test_arena_map_refuses_a_file_with_another_identity(tmp_path):
    real, other = tmp_path / "arena", tmp_path / "impostor"
    for p in (real, other):
        p.write_bytes(b"\0" * 8192)
    st_real = os.stat(real)
    with pytest.raises(OSError, match="not the daemon's arena"):
        shm.ArenaMap(str(other), 8192, st_real.st_dev, st_real.st_ino)
    with pytest.raises(OSError, match="not the daemon's arena"):
        shm.ArenaMap(str(real), 16384, st_real.st_dev, st_real.st_ino)   # smaller than announced
    arena = shm.ArenaMap(str(real), 8192, st_real.st_dev, st_real.st_ino)
    src = np.arange(100, dtype=np.uint8)
    arena.copy_in([(4096, 60), (0, 40)], src)
    out = np.zeros(100, dtype=np.uint8)
    assert arena.copy_out([(4096, 60), (0, 40)], out) == 100 and np.array_equal(out, src)
    arena.close()


def test_reap_probes_removes_only_old_ones(tmp_path):
    old = shm.write_probe(str(tmp_path), b"x" * 16)
    os.utime(old, (0, 0))
    fresh = shm.write_probe(str(tmp_path), b"y" * 16)
    assert shm.reap_probes(str(tmp_path), older_than_s=30) == 1
    assert not os.path.exists(old) and os.path.exists(fresh)


@settings(max_examples=60, deadline=None)
@given(block_bytes=st.integers(1, 300), count=st.integers(1, 6), chunk=st.integers(1, 700))
def test_put_stream_chunking_round_trips(block_bytes, count, chunk):
    rng = np.random.default_rng(block_bytes * 1000 + count)
    blocks = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(count)]
    header = pb.PutHeader(namespace_id=b"n" * 16, hashes=[b"h"] * count)
    messages = [pb.PutChunk.FromString(m) for m in chunks.put_messages(header, blocks, chunk)]
    assert messages[0].header == header and not any(m.HasField("header") for m in messages[1:])
    assert all(len(m.data) <= chunk for m in messages)
    if block_bytes <= chunk:   # small blocks share messages, each starting at a block boundary
        per_message = chunk // block_bytes
        assert [len(m.data) for m in messages] == [block_bytes * min(per_message, count - k * per_message)
                                                  for k in range(-(-count // per_message))]
    else:   # a large block is cut into pieces of its own
        assert len(messages) == count * -(-block_bytes // chunk)
    splitter = chunks.BlockSplitter(block_bytes, np.zeros(block_bytes, dtype=np.uint8))
    got = []
    for m in messages:
        got += [(i, b.copy()) for i, b, _ in splitter.feed(m.data)]
    assert [i for i, _ in got] == list(range(count))
    assert all(np.array_equal(b, want) for (_, b), want in zip(got, blocks))


@settings(max_examples=60, deadline=None)
@given(block_bytes=st.integers(1, 300), sizes=st.lists(st.integers(1, 300), min_size=1, max_size=6),
       cuts=st.lists(st.integers(0, 1800), max_size=8))
def test_put_stream_of_encoded_payloads_splits_at_their_sizes(block_bytes, sizes, cuts):
    """Client-encoded payloads (each its own size, none over a block) come back one by one
    however the stream is cut into messages, even messages spanning several payloads."""
    sizes = [min(s, block_bytes) for s in sizes]
    rng = np.random.default_rng(sum(sizes))
    payloads = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
    stream = np.concatenate(payloads).tobytes()
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    splitter = chunks.BlockSplitter(block_bytes, np.zeros(block_bytes, dtype=np.uint8), sizes)
    got = []
    for a, b in zip(bounds, bounds[1:]):
        got += [(i, x.copy()) for i, x, _ in splitter.feed(stream[a:b])]
    assert [i for i, _ in got] == list(range(len(sizes)))
    assert all(np.array_equal(x, want) for (_, x), want in zip(got, payloads))


def test_get_messages_cover_a_block_exactly():
    """Encoded here, not by protobuf: what any protobuf reader parses as GetChunk messages."""
    block = np.arange(2500, dtype=np.uint32).view(np.uint8)
    msgs = [pb.GetChunk.FromString(m) for m in chunks.get_messages(3, block, 7, 4096)]
    assert [m.offset for m in msgs] == [0, 4096, 8192]
    assert b"".join(m.data for m in msgs) == block.tobytes()
    assert all(m.index == 3 and m.hit and m.codec == 7 and m.size == block.nbytes for m in msgs)
    assert chunks.get_messages(3, block, 7, 4096).__next__() == pb.GetChunk(
        index=3, hit=True, codec=7, size=block.nbytes, offset=0, data=block[:4096].tobytes()).SerializeToString()
    (miss,) = (pb.GetChunk.FromString(m) for m in chunks.get_messages(4, None))
    assert miss.index == 4 and not miss.hit
    (empty,) = (pb.GetChunk.FromString(m) for m in chunks.get_messages(5, np.zeros(0, np.uint8)))
    assert empty.hit and empty.size == 0


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 70_000), chunk=st.integers(1, 40_000), index=st.integers(0, 2**32 - 1))
def test_encoded_get_chunks_parse_back_at_any_size(size, chunk, index):
    """Data lengths whose varint takes 1 to 3 bytes, indexes up to the field's 32 bits."""
    block = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    msgs = [pb.GetChunk.FromString(m) for m in chunks.get_messages(index, block, 0, chunk)]
    assert b"".join(m.data for m in msgs) == block.tobytes()
    assert all(m.index == index and m.size == size for m in msgs)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.one_of(st.none(), st.integers(0, 5000)), min_size=1, max_size=12),
       chunk=st.integers(1, 9000), first=st.integers(0, 1000), pieces=st.integers(1, 3))
def test_packed_get_runs_parse_back_to_their_blocks(sizes, chunk, first, pieces):
    """A run (misses as None, blocks in one or several views) comes back block for block from
    what any protobuf reader parses; no message carries more than ``chunk`` bytes of data."""
    rng = np.random.default_rng(len(sizes) * 7 + chunk)
    blocks = [None if n is None else rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    run = [None if b is None else (np.array_split(b, pieces), 5 if i % 2 else 0) for i, b in enumerate(blocks)]
    got: dict[int, bytearray] = {}
    missed = []
    for raw in chunks.run_messages(first, run, chunk):
        m = pb.GetChunk.FromString(raw)
        assert len(m.data) <= chunk
        if not m.hit:
            missed.append(m.index)
        elif m.sizes:
            assert sum(m.sizes) == len(m.data) and len(m.codecs) in (0, len(m.sizes))
            at = 0
            for k, n in enumerate(m.sizes):
                assert (m.codecs[k] if m.codecs else 0) == (5 if (m.index - first + k) % 2 else 0)
                got[m.index + k] = bytearray(m.data[at:at + n])
                at += n
        else:
            got.setdefault(m.index, bytearray())[m.offset:m.offset + len(m.data)] = m.data
    assert missed == [first + i for i, b in enumerate(blocks) if b is None]
    assert sorted(got) == [first + i for i, b in enumerate(blocks) if b is not None]
    assert all(bytes(got[first + i]) == b.tobytes() for i, b in enumerate(blocks) if b is not None)


def _unknown_field(number: int, wire: int, value: int, payload: bytes) -> bytes:
    key = chunks._varint(number << 3 | wire)
    if wire == 0:
        return key + chunks._varint(value)
    if wire == 1:
        return key + value.to_bytes(8, "little")
    if wire == 5:
        return key + (value & 0xFFFFFFFF).to_bytes(4, "little")
    return key + chunks._varint(len(payload)) + payload


_headers = st.one_of(st.none(), st.builds(
    lambda ns, hashes, parent, bb, codec, sizes: pb.PutHeader(namespace_id=ns, hashes=hashes, parent=parent,
                                                              block_bytes=bb, codec=codec, sizes=sizes),
    st.binary(max_size=20), st.lists(st.binary(max_size=33), max_size=5), st.binary(max_size=33),
    st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.lists(st.integers(0, 2**64 - 1), max_size=4)))


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.tuples(_headers, st.one_of(st.none(), st.binary(max_size=3000))), min_size=1, max_size=3),
       unknown=st.lists(st.tuples(st.integers(3, 2**29 - 1), st.sampled_from([0, 1, 2, 5]), st.integers(0, 2**64 - 1),
                                  st.binary(max_size=40)), max_size=4))
def test_the_daemons_put_reader_reads_what_protobuf_reads(parts, unknown):
    """Messages as any protobuf writer may send them, concatenated (protobuf merges them: headers
    merge, the last data wins) and with unknown fields of every wire type: ``read_put_chunk``
    gives what ``PutChunk.FromString`` gives, the data as a view of the received bytes."""
    raw = b"".join(pb.PutChunk(header=h, data=d).SerializeToString() if h is not None
                   else pb.PutChunk(data=d).SerializeToString() if d is not None else b""
                   for h, d in parts) + b"".join(_unknown_field(*u) for u in unknown)
    want = pb.PutChunk.FromString(raw)
    got = chunks.read_put_chunk(raw)
    assert (got.header is not None) == want.HasField("header")
    if got.header is not None:
        assert got.header == want.header
    assert bytes(got.data) == want.data and got.ByteSize() == len(raw)
    if got.data.nbytes:
        assert got.data.obj is raw   # left where it arrived


@settings(max_examples=300, deadline=None)
@given(raw=st.one_of(st.binary(max_size=200), st.builds(lambda n, body: b"\x0a" + chunks._varint(n) + body,
                                                         st.integers(0, 60), st.binary(max_size=60))))
def test_the_put_reader_accepts_nothing_protobuf_refuses(raw):
    """Arbitrary bytes, and headers of arbitrary bytes: where the reader accepts them, protobuf
    does too and reads the same; everything else is a ValueError."""
    try:
        got = chunks.read_put_chunk(raw)
    except ValueError:
        return
    want = pb.PutChunk.FromString(raw)   # raises if the reader accepted what protobuf refuses
    assert bytes(got.data) == want.data
    assert (got.header is not None) == want.HasField("header") and (got.header is None or got.header == want.header)


_get_chunks = st.builds(
    lambda index, hit, codec, size, offset, data, sizes, codecs: pb.GetChunk(
        index=index, hit=hit, codec=codec, size=size, offset=offset, data=data, sizes=sizes, codecs=codecs),
    st.integers(0, 2**32 - 1), st.booleans(), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1), st.binary(max_size=3000), st.lists(st.integers(0, 2**64 - 1), max_size=4),
    st.lists(st.integers(0, 2**32 - 1), max_size=4))


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(_get_chunks, min_size=1, max_size=3),
       unknown=st.lists(st.tuples(st.integers(9, 2**29 - 1), st.sampled_from([0, 1, 2, 5]), st.integers(0, 2**64 - 1),
                                  st.binary(max_size=40)), max_size=4))
def test_the_clients_get_reader_reads_what_protobuf_reads(parts, unknown):
    """A Get answer as any daemon may encode it (concatenated messages merge: repeated fields
    append, the last scalar wins; unknown fields of every wire type): ``read_get_chunk`` gives
    every field as ``GetChunk.FromString`` does, the data as a view of the received bytes."""
    raw = b"".join(p.SerializeToString() for p in parts) + b"".join(_unknown_field(*u) for u in unknown)
    want = pb.GetChunk.FromString(raw)
    got = chunks.read_get_chunk(raw)
    assert bytes(got.data) == want.data
    want.ClearField("data")
    for field in ("index", "hit", "codec", "size", "offset", "sizes", "codecs"):
        assert getattr(got.chunk, field) == getattr(want, field), field
    if got.data.nbytes:
        assert got.data.obj is raw
