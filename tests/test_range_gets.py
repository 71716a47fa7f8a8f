"""Byte-range gets (issue #13: a remote client fetches one layer's slice of each block, so a forward
pass can start on layer 0 while the rest is in flight), against real daemons over every transport:
the bytes are the block's, ranges that cross slot boundaries come out whole, blocks kept encoded or
only on NVMe are decoded / read first, and a range outside the block is refused by name."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from codec_blocks import chain as kv_chain
from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.client import AsyncClient, NamespaceHandle
from kvstore.errors import InvalidArgument
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.proto import kvstore_pb2 as pb

LAYOUT = KVLayout(model="test/range", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=512, layout="layer,kv,token,head,dim")   # 1 MiB: 4 layers, 4 slots of 256 KiB
LAYER = LAYOUT.block_bytes // LAYOUT.num_layers
RANGES = [(0, LAYER), (LAYER, LAYER), (3 * LAYER, LAYER), (LAYER // 2, LAYER), (12345, 3 * LAYER), (0, 1 << 20)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_local_daemon(tmp_path_factory.mktemp("range"), cpu_bytes="16MiB", nvme_bytes="64MiB")
    yield d
    d.stop()


def blocks(n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return ChainHasher(seed=seed).chain(np.arange(n * 512), 512), [
        rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("transport", ["shm", "bulk", "grpc"])
def test_a_range_get_brings_exactly_those_bytes_of_each_block(daemon, transport):
    with daemon.client(transport=transport) as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        hashes, data = blocks(6, seed=hash(transport) & 0xFFFF)
        c.put(ns, hashes[:5], data[:5])
        for offset, length in RANGES:
            outs = [np.zeros(length, np.uint8) for _ in hashes]
            got = c.get_into(ns, hashes, outs, byte_range=(offset, length))
            assert got == [length] * 5 + [None]
            for out, block in zip(outs[:5], data):
                assert np.array_equal(out, block[offset:offset + length])


def test_ranges_of_blocks_on_nvme_only_are_read_from_there(daemon):
    with daemon.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        hashes, data = blocks(24, seed=7)      # more than the 16 MiB CPU tier: the first ones demote
        for i in range(24):
            c.put(ns, hashes[i:i + 1], data[i:i + 1], parent=hashes[i - 1] if i else None)
        assert "nvme" in c.lookup(ns, hashes, lease=False).tiers
        outs = [np.zeros(LAYER, np.uint8) for _ in hashes]
        assert c.get_into(ns, hashes, outs, byte_range=(2 * LAYER, LAYER)) == [LAYER] * 24
        for out, block in zip(outs, data):
            assert np.array_equal(out, block[2 * LAYER:3 * LAYER])


def test_a_range_of_a_block_kept_encoded_is_a_range_of_its_decoded_bytes(tmp_path):
    pytest.importorskip("torch")
    config = tmp_path / "kvstore.yaml"
    config.write_text(f"codecs:\n  cpu: fp8\nshm_dir: {tmp_path}\n")
    d = start_local_daemon(tmp_path / "d", "--config", str(config), cpu_bytes="16MiB", nvme_bytes="0")
    try:
        for seed, transport in enumerate(("shm", "bulk", "grpc")):
            with d.client(transport=transport) as c:
                ns = c.register_namespace(Namespace(LAYOUT))
                hashes, data = kv_chain(LAYOUT, 3, seed=3 + seed)
                c.put(ns, hashes, data)
                whole = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in hashes]
                assert c.get_into(ns, hashes, whole) == [LAYOUT.block_bytes] * 3
                assert not np.array_equal(whole[0], data[0])          # lossy: the daemon kept it encoded
                outs = [np.zeros(LAYER, np.uint8) for _ in hashes]
                assert c.get_into(ns, hashes, outs, byte_range=(LAYER, LAYER)) == [LAYER] * 3
                for out, w in zip(outs, whole):
                    assert np.array_equal(out, w[LAYER:2 * LAYER])
    finally:
        d.stop()


def test_a_range_outside_the_block_is_refused_by_name(daemon):
    with daemon.client(transport="grpc") as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        hashes, data = blocks(1, seed=9)
        c.put(ns, hashes, data)
        for bad in ((0, 0), (-1, 10), (LAYOUT.block_bytes - 10, 11)):
            with pytest.raises(InvalidArgument, match="byte_range"):
                c.get_into(ns, hashes, [np.zeros(LAYOUT.block_bytes, np.uint8)], byte_range=bad)
        for offset, length in ((LAYOUT.block_bytes, 1), (5, 0)):   # what a client of another language might send
            with pytest.raises(grpc.RpcError) as refused:
                list(c.call("Get", pb.GetRequest(namespace_id=ns, hashes=hashes, block_bytes=LAYOUT.block_bytes,
                                                 range_offset=offset, range_bytes=length)))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith("range_bytes: ")


def test_the_connectors_handle_and_the_async_client_pass_ranges_on(daemon):
    hashes, data = blocks(2, seed=13)
    handle = NamespaceHandle(Namespace(LAYOUT), url=daemon.address)
    assert handle.put(hashes, data)
    outs = [np.zeros(LAYER, np.uint8) for _ in hashes]
    assert handle.get_into(hashes, outs, byte_range=(LAYER, LAYER)) == [LAYER] * 2
    assert np.array_equal(outs[1], data[1][LAYER:2 * LAYER])

    async def over_async():
        async with AsyncClient(daemon.address) as c:
            ns = await c.register_namespace(Namespace(LAYOUT))
            got = [np.zeros(100, np.uint8)]
            assert await c.get_into(ns, hashes[:1], got, byte_range=(7, 100)) == [100]
            return got[0]
    assert np.array_equal(asyncio.run(over_async()), data[0][7:107])
