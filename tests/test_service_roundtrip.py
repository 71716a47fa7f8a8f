"""Round trips through a real daemon over every transport, byte for byte."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore import AsyncClient, ChainHasher, KVLayout, Namespace
from kvstore.errors import InvalidArgument, LayoutMismatch, UnknownNamespace, WrongBlockSize

LAYOUT = KVLayout(model="test/model", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)


def _blocks(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def _chain(n: int, salt: int) -> list[bytes]:
    return ChainHasher("xxh3_128", seed=salt).chain(np.arange(16 * n), 16)


@pytest.mark.parametrize("transport", ["auto", "shm", "bulk", "grpc"])
def test_put_get_byte_identical(kv_daemon, transport):
    with kv_daemon.client(transport=transport) as c:
        expected = {"auto": "shm", "shm": "shm", "bulk": "bulk", "grpc": "grpc"}[transport]
        assert c.active_transport == expected
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt=f"rt-{transport}"))
        hashes = _chain(12, salt=1)
        blocks = _blocks(12, LAYOUT.block_bytes, seed=2)
        assert c.put(ns, hashes, blocks) == ["stored"] * 12
        assert c.put(ns, hashes[:3], blocks[:3]) == ["exists"] * 3
        lk = c.lookup(ns, hashes)
        assert lk.num_hit == 12 and set(lk.tiers) == {"cpu"}
        outs = [np.zeros(LAYOUT.block_bytes, dtype=np.uint8) for _ in range(13)]
        sizes = c.get_into(ns, hashes + [b"\x01" * 16], outs)
        assert sizes == [LAYOUT.block_bytes] * 12 + [None]
        for out, want in zip(outs, blocks):
            assert np.array_equal(out, want)
        assert c.get(ns, hashes[5:6])[0] == blocks[5].tobytes()


def test_large_blocks_cross_chunk_boundaries(kv_daemon):
    """3 MiB + 5 bytes: not a multiple of the 1 MiB chunk; gRPC and bulk must reassemble exactly."""
    layout = KVLayout(model="test/big", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                      block_tokens=1, block_bytes=3 * (1 << 20) + 5)
    blocks = _blocks(3, layout.block_bytes, seed=3)
    hashes = _chain(3, salt=4)
    for i, transport in enumerate(["grpc", "bulk", "shm"]):
        with kv_daemon.client(transport=transport) as c:
            ns = c.register_namespace(Namespace(layout, cache_salt=f"big-{i}"))
            c.put(ns, hashes, blocks)
            for t2 in ["grpc", "bulk", "shm"]:
                with kv_daemon.client(transport=t2) as r:
                    r.register_namespace(Namespace(layout, cache_salt=f"big-{i}"))
                    got = r.get(ns, hashes)
                    assert [g == b.tobytes() for g, b in zip(got, blocks)] == [True] * 3, (transport, t2)


@pytest.mark.parametrize("transport", ["shm", "bulk", "grpc"])
def test_gaps_lookup_exists_delete(kv_daemon, transport):
    with kv_daemon.client(transport=transport) as c:
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt=f"gaps-{transport}"))
        hashes = _chain(6, salt=5)
        blocks = _blocks(6, LAYOUT.block_bytes, seed=6)
        c.put(ns, hashes, blocks)
        assert c.delete(ns, [hashes[2]]) == 1
        assert c.lookup(ns, hashes).num_hit == 2
        assert c.exists(ns, hashes) == [True, True, False, True, True, True]
        got = c.get(ns, hashes)  # a hole in the middle: later blocks still come back
        assert got[2] is None and got[3] == blocks[3].tobytes() and got[5] == blocks[5].tobytes()
        lks = c.lookup_many(ns, [hashes, hashes[3:], [b"\x09" * 16]])
        assert [lk.num_hit for lk in lks] == [2, 3, 0]


def test_blocks_demoted_to_nvme_come_back_over_every_transport(daemon_factory):
    """A 1 MiB CPU tier holds 4 of these blocks: the rest live on NVMe and are promoted on read."""
    d = daemon_factory(cpu_bytes="1MiB", nvme_bytes="64MiB")
    layout = KVLayout(model="test/demote", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                      block_tokens=1, block_bytes=256 << 10)
    hashes = _chain(24, salt=11)
    blocks = _blocks(24, layout.block_bytes, seed=12)
    with d.client() as c:
        ns = c.register_namespace(Namespace(layout))
        c.put(ns, hashes, blocks)
        assert c.stats()["tiers"]["nvme"]["blocks"] >= 20
    for transport in ("grpc", "bulk", "shm"):
        with d.client(transport=transport) as c:
            c.register_namespace(Namespace(layout))
            for i in range(0, 24, 3):  # 3 blocks (768 KiB) per call: fits the 1 MiB arena
                assert c.get(ns, hashes[i:i + 3]) == [b.tobytes() for b in blocks[i:i + 3]], (transport, i)


def test_torch_tensor_blocks(kv_daemon):
    torch = pytest.importorskip("torch")
    with kv_daemon.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt="torch"))
        t = torch.randn(LAYOUT.block_bytes // 2, dtype=torch.bfloat16)
        h = _chain(1, salt=7)
        c.put(ns, h, [t])
        out = torch.empty_like(t)
        assert c.get_into(ns, h, [out]) == [LAYOUT.block_bytes]
        assert torch.equal(out, t)


@pytest.mark.parametrize("transport", ["shm", "bulk", "grpc"])
def test_a_destination_a_copy_would_hide_is_refused_by_name(kv_daemon, transport):
    """A strided array or tensor cannot be written in place: the get refuses it (naming the
    buffer) rather than fill a contiguous copy and report the block delivered."""
    torch = pytest.importorskip("torch")
    with kv_daemon.client(transport=transport) as c:
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt=f"strided-{transport}"))
        h = _chain(2, salt=9)
        c.put(ns, h, _blocks(2, LAYOUT.block_bytes, seed=9))
        strided = np.zeros((LAYOUT.block_bytes, 2), np.uint8)[:, 0]
        tensor = torch.zeros(LAYOUT.block_bytes, 2, dtype=torch.uint8)[:, 1]
        frozen = np.zeros(LAYOUT.block_bytes, np.uint8)
        frozen.flags.writeable = False
        for i, bad in ((1, strided), (1, tensor), (0, frozen)):
            outs = [np.zeros(LAYOUT.block_bytes, np.uint8), np.zeros(LAYOUT.block_bytes, np.uint8)]
            outs[i] = bad
            with pytest.raises(InvalidArgument, match=rf"outs\[{i}\]"):
                c.get_into(ns, h, outs)
        assert not strided.any() and not tensor.any()


def test_layout_mismatch_refused(kv_daemon):
    with kv_daemon.client(transport="grpc") as c:
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt="mismatch"))
        other = KVLayout(model="test/model", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                         block_tokens=16)
        ns_other = c.register_namespace(Namespace(other, cache_salt="mismatch"))
        assert ns_other != ns  # another layout never shares a namespace
        with pytest.raises(WrongBlockSize):  # refused before anything moves
            c.put(ns, _chain(1, salt=8), [np.zeros(LAYOUT.block_bytes + 2, np.uint8)])
    # A client that believes the namespace has another block size is refused by the daemon.
    for transport in ("grpc", "bulk", "shm"):
        with kv_daemon.client(transport=transport) as c2:
            c2._block_bytes[ns] = other.block_bytes
            with pytest.raises(LayoutMismatch, match="block_bytes"):
                c2.get_into(ns, _chain(1, salt=8), [np.zeros(other.block_bytes, np.uint8)])
    with kv_daemon.client() as c3:
        with pytest.raises(UnknownNamespace):
            c3.lookup(b"\x00" * 16, _chain(1, salt=8))
        with pytest.raises(InvalidArgument, match="layout.dtype"):
            c3.register_namespace(_bad_dtype_namespace())


def _bad_dtype_namespace() -> Namespace:
    """A namespace whose layout names an unknown dtype (built around KVLayout's own validation,
    as a client in another language could send it)."""
    import dataclasses
    bad = object.__new__(KVLayout)
    for f in dataclasses.fields(KVLayout):
        object.__setattr__(bad, f.name, getattr(LAYOUT, f.name))
    object.__setattr__(bad, "dtype", "float7")
    ns = object.__new__(Namespace)
    for name, value in (("layout", bad), ("tenant", ""), ("cache_salt", "")):
        object.__setattr__(ns, name, value)
    return ns


def test_async_client(kv_daemon):
    async def main():
        async with AsyncClient(kv_daemon.address) as c:
            ns = await c.register_namespace(Namespace(LAYOUT, cache_salt="async"))
            hashes = _chain(4, salt=9)
            blocks = _blocks(4, LAYOUT.block_bytes, seed=10)
            await c.put(ns, hashes, blocks)
            lookups = await asyncio.gather(*(c.lookup(ns, hashes) for _ in range(16)))
            assert {lk.num_hit for lk in lookups} == {4}
            got = await c.get(ns, hashes)
            assert got == [b.tobytes() for b in blocks]
            assert await c.health()
    asyncio.run(main())


@pytest.mark.parametrize("transport", ["shm", "bulk", "grpc"])
def test_a_hash_the_daemon_cannot_take_is_refused_naming_it(kv_daemon, transport):
    """A batch with one hash of no bytes, or of more than 64, is refused whole, naming that hash's
    index; nothing of it is stored."""
    with kv_daemon.client(transport=transport) as c:
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt=f"width-{transport}"))
        h = _chain(4, salt=11)
        blocks = _blocks(4, LAYOUT.block_bytes, seed=11)
        for bad in (b"", b"\x01" * 65):
            with pytest.raises(InvalidArgument, match=r"hashes\[2\]"):
                c.put(ns, h[:2] + [bad] + h[3:], blocks)
        assert c.lookup(ns, h, lease=False).num_hit == 0
        assert c.put(ns, h, blocks) == ["stored"] * 4
