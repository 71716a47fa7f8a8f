"""The gRPC fallback packs small blocks into shared messages, against a real daemon and a real rogue
gRPC server: a Get answers 64 KiB blocks sixteen to a 1 MiB message with misses and large blocks on
their own, and a packed chunk whose sizes do not add up is refused by name before a byte of it
lands."""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.errors import InvalidArgument
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import PROTOCOL_VERSION

SMALL = KVLayout(model="test/packing", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8", block_tokens=16,
                 block_bytes=64 << 10)
LARGE = KVLayout(model="test/packing-large", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                 block_tokens=16, block_bytes=3 << 20)
MIB = 1 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_local_daemon(tmp_path_factory.mktemp("packing"), cpu_bytes="96MiB", nvme_bytes="0")
    yield d
    d.stop()


def chain(layout: KVLayout, n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return (ChainHasher(seed=seed).chain(np.arange(n * 16), 16),
            [rng.integers(0, 256, layout.block_bytes, dtype=np.uint8) for _ in range(n)])


def raw_get(daemon, ns_id: bytes, hashes: list[bytes], block_bytes: int) -> list[pb.GetChunk]:
    """The daemon's Get answer as a client of the bare protocol sees it."""
    with grpc.insecure_channel(daemon.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        return list(stub.Get(pb.GetRequest(namespace_id=ns_id, hashes=hashes, block_bytes=block_bytes,
                                           chunk_bytes=MIB), timeout=30))


def test_small_blocks_share_messages_and_misses_stand_alone(daemon):
    with daemon.client(transport="grpc") as c:
        ns = c.register_namespace(Namespace(SMALL, cache_salt="packing"))
        hashes, data = chain(SMALL, 40, seed=1)
        assert c.put(ns, hashes, data) == ["stored"] * 40
        c.delete(ns, [hashes[17]])
        chunks = raw_get(daemon, ns, hashes, SMALL.block_bytes)
        # 0-15 fill a 1 MiB message; the run before the miss ends at 16; the miss; 18-33; 34-39
        assert [(m.index, m.hit, len(m.sizes)) for m in chunks] == [
            (0, True, 16), (16, True, 1), (17, False, 0), (18, True, 16), (34, True, 6)]
        got = {}
        for m in chunks:
            for k, size in enumerate(m.sizes):
                got[m.index + k] = m.data[k * SMALL.block_bytes:(k + 1) * SMALL.block_bytes]
                assert size == SMALL.block_bytes
            assert not m.codecs   # raw blocks: no codec list
        assert sorted(got) == [i for i in range(40) if i != 17]
        assert all(got[i] == data[i].tobytes() for i in got)
        # and the client lands every block in its own buffer
        outs = [np.zeros(SMALL.block_bytes, np.uint8) for _ in hashes]
        assert c.get_into(ns, hashes, outs) == [None if i == 17 else SMALL.block_bytes for i in range(40)]
        assert all(np.array_equal(outs[i], data[i]) for i in range(40) if i != 17)
        assert not outs[17].any()


def test_blocks_larger_than_a_message_are_cut_into_chunks_of_their_own(daemon):
    with daemon.client(transport="grpc") as c:
        ns = c.register_namespace(Namespace(LARGE, cache_salt="packing"))
        hashes, data = chain(LARGE, 3, seed=2)
        assert c.put(ns, hashes, data) == ["stored"] * 3
        chunks = raw_get(daemon, ns, hashes, LARGE.block_bytes)
        assert [(m.index, m.offset, len(m.data)) for m in chunks] == [
            (i, k * MIB, MIB) for i in range(3) for k in range(3)]
        assert not any(m.sizes for m in chunks)
        outs = [np.zeros(LARGE.block_bytes, np.uint8) for _ in hashes]
        assert c.get_into(ns, hashes, outs) == [LARGE.block_bytes] * 3
        assert all(np.array_equal(o, d) for o, d in zip(outs, data))


# -- a rogue daemon whose packed chunks lie ------------------------------------------------------

class LyingDaemon(pb_grpc.KVStoreServicer):
    """Answers Handshake and RegisterNamespace like a daemon and every Get with ``chunks``."""

    def __init__(self, chunks: list[pb.GetChunk]) -> None:
        self.chunks = chunks
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_KVStoreServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Handshake(self, request, context):
        return pb.HandshakeResponse(server_version=PROTOCOL_VERSION, server_id="liar", lease_seconds=5.0,
                                    max_message_bytes=16 << 20, chunk_bytes=MIB)

    def RegisterNamespace(self, request, context):
        return pb.RegisterNamespaceResponse(namespace_id=b"n" * 16, block_bytes=SMALL.block_bytes, tenant="t")

    def Get(self, request, context):
        yield from self.chunks


BLOCK = SMALL.block_bytes


@pytest.mark.parametrize("lie, field", [
    (pb.GetChunk(index=0, hit=True, sizes=[BLOCK, BLOCK], data=b"\1" * (3 * BLOCK)), "sizes"),   # more data
    (pb.GetChunk(index=0, hit=True, sizes=[BLOCK, BLOCK], data=b"\1" * BLOCK), "sizes"),         # less data
    (pb.GetChunk(index=2, hit=True, sizes=[BLOCK, BLOCK], data=b"\1" * (2 * BLOCK)), "index"),   # past the end
    (pb.GetChunk(index=0, hit=True, sizes=[BLOCK], codecs=[0, 0], data=b"\1" * BLOCK), "sizes"),
    (pb.GetChunk(index=0, hit=True, sizes=[2 * BLOCK], data=b"\1" * (2 * BLOCK)), "outs"),       # a block too big
])
def test_a_packed_chunk_that_does_not_add_up_is_refused(lie, field):
    from kvstore.client import Client

    liar = LyingDaemon([lie])
    try:
        with Client(liar.address, transport="grpc", timeout_s=10) as c:
            ns = c.register_namespace(Namespace(SMALL))
            outs = [np.zeros(BLOCK, np.uint8) for _ in range(3)]
            with pytest.raises(InvalidArgument) as e:
                c.get_into(ns, [b"a" * 16, b"b" * 16, b"c" * 16], outs)
            assert e.value.field == field
            assert not any(o.any() for o in outs)   # refused before a byte of it landed
    finally:
        liar.server.stop(0)
