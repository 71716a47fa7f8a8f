"""A lease is answered as a ``BlockTable`` (parallel arrays): read back by the client's
``lease_slots``, it says exactly what the store's lease says: each block's extents, whether it is
present already, its stored size and codec, and each extent's segment generation."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client.shm_path import lease_slots
from kvstore.errors import DaemonUnavailable
from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.proto import kvstore_pb2 as pb
from kvstore.service.lease_rpcs import LeaseRpcs
from kvstore.store import Store, StoreConfig
from kvstore.store.leases import Lease
from kvstore.tiers.cpu import CpuTier

SLOT = 64 * 1024
BLOCK = 2 * SLOT


class _Answering:
    """What ``LeaseRpcs._lease_response`` reads of its servicer: the store."""

    def __init__(self, store: Store) -> None:
        self.store = store


def slots(resp: pb.LeaseResponse) -> tuple[list, list]:
    blocks, pieces = lease_slots(resp)
    return blocks, list(pieces)


def answer(store: Store, lease: Lease, present_none: bool) -> pb.LeaseResponse:
    resp = LeaseRpcs._lease_response(_Answering(store), lease, 7, present_none, BLOCK)
    return pb.LeaseResponse.FromString(resp.SerializeToString())   # as the client receives it


@pytest.fixture
def make():
    """``make(segment_bytes)`` -> (store, namespace id); every store made is closed after the test."""
    stores = []

    def make_store(segment_bytes: int | None = None) -> tuple[Store, bytes]:
        store = Store([CpuTier(64 * BLOCK, slot_bytes=SLOT, segment_bytes=segment_bytes)], StoreConfig())
        stores.append(store)
        layout = KVLayout(model="test/table", num_layers=2, num_kv_heads=1, head_dim=64, dtype="bfloat16",
                          block_tokens=16, block_bytes=BLOCK)
        return store, store.register_namespace(Namespace(layout, tenant="a"))

    yield make_store
    for store in stores:
        store.close()


def churned(store: Store, ns: bytes) -> list[bytes]:
    """Blocks of ``ns``, and one-slot blocks of another namespace of the tenant put and every other
    one deleted, so the free slots lie apart and ``ns``'s next blocks take two extents each."""
    small = store.register_namespace(Namespace(KVLayout(model="test/table", num_layers=1, num_kv_heads=1,
                                                        head_dim=64, dtype="uint8", block_tokens=16,
                                                        block_bytes=SLOT), tenant="a"))
    hashes = ChainHasher().chain(list(range(16 * 8)), 16)
    store.put(ns, hashes, [np.full(BLOCK, i, dtype=np.uint8) for i in range(8)])
    singles = ChainHasher(seed=3).chain(list(range(16 * 32)), 16)
    store.put(small, singles, [np.zeros(SLOT, dtype=np.uint8)] * 32)
    store.delete(small, singles[::2])
    return hashes


def expected(store: Store, lease: Lease, present_none: bool) -> tuple[list, list]:
    """What the lease says, as ``lease_slots`` reads a table: per block (extents, size, codec,
    present), and every extent with its segment's generation."""
    arena = store.shared_arena()
    generation = arena.generation_at if arena.segmented else (lambda _off: 0)
    codecs = lease.codecs or [0] * len(lease.extents)
    sizes = lease.sizes or [BLOCK] * len(lease.extents)
    blocks = [(list(e or []), n, c, e is None and present_none) for e, n, c in zip(lease.extents, sizes, codecs)]
    pieces = [(off, length, generation(off)) for e in lease.extents for off, length in e or []]
    return blocks, pieces


def read(resp: pb.LeaseResponse) -> tuple[list, list]:
    blocks, pieces = slots(resp)
    return [(list(b.extents), b.size, b.codec, b.present) for b in blocks], [tuple(p) for p in pieces]


@pytest.mark.parametrize("segment_bytes", [None, 8 * SLOT])
def test_store_and_load_leases_read_back_exactly_from_their_table(make, segment_bytes):
    store, ns = make(segment_bytes)
    old = churned(store, ns)
    fresh = ChainHasher(seed=9).chain(list(range(16 * 6)), 16)
    hashes = [old[1], old[3]] + fresh + [old[5]]     # some present already
    lease = store.leases.prepare_store(ns, hashes)
    assert any(e is None for e in lease.extents) and any(e and len(e) > 1 for e in lease.extents)
    got = read(answer(store, lease, True))
    assert got == expected(store, lease, True)
    assert [b[3] for b in got[0]] == [e is None for e in lease.extents]
    if segment_bytes:
        assert {p[2] for p in got[1]} >= {1}
    store.leases.complete_store(lease.id)

    load = store.leases.prepare_load(ns, hashes)
    load.codecs = [0, 3] + [0] * (len(load.codecs) - 2)   # what an encoded copy would say
    load.sizes = [BLOCK, 1234] + load.sizes[2:]
    got = read(answer(store, load, False))
    assert got == expected(store, load, False)
    assert [(b[2], b[1]) for b in got[0][:2]] == [(0, BLOCK), (3, 1234)]
    store.leases.complete_load(load.id)


def test_an_empty_load_lease_is_no_blocks(make):
    store, ns = make()
    lease = store.leases.prepare_load(ns, ChainHasher().chain(list(range(16)), 16))
    assert slots(answer(store, lease, False)) == ([], [])


def test_an_inconsistent_table_is_refused_like_a_lost_daemon():
    resp = pb.LeaseResponse(lease_id=1, table=pb.BlockTable(extent_counts=[2], offsets=[0], lengths=[10], sizes=[10]))
    with pytest.raises(DaemonUnavailable):
        lease_slots(resp)


def test_a_lease_of_one_extent_blocks_reads_back_exactly(make):
    store, ns = make()
    hashes = ChainHasher().chain(list(range(16 * 5)), 16)
    store.put(ns, hashes[:2], [np.ones(BLOCK, dtype=np.uint8)] * 2)
    lease = store.leases.prepare_store(ns, hashes)
    assert all(e is None or len(e) == 1 for e in lease.extents)
    assert read(answer(store, lease, True)) == expected(store, lease, True)
    store.leases.abort_store(lease.id)


def test_present_blocks_beside_a_two_extent_block_read_back_exactly(make):
    """Extent counts 0 and 2 add up to one per block: not the one-extent-each case."""
    store, ns = make()
    churned(store, ns)
    hashes = ChainHasher(seed=11).chain(list(range(16 * 2)), 16)
    store.put(ns, hashes[:1], [np.ones(BLOCK, dtype=np.uint8)])
    lease = store.leases.prepare_store(ns, hashes)
    assert [0 if e is None else len(e) for e in lease.extents] == [0, 2]
    assert read(answer(store, lease, True)) == expected(store, lease, True)
    store.leases.abort_store(lease.id)
