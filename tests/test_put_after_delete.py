"""A put of a block deleted while a reader still holds it stores the new bytes (guarantee 23).

The deleted copy stays until its reader lets go (it is "doomed"); a put of the same hash that
came meanwhile was answered "exists", and the block vanished on the reader's unpin: the writer
was told it was stored, the next reader missed. Now the put waits for the reader, within a bound,
and refuses with ``BlockBusy`` (ABORTED) past it. Against real daemons, over every transport.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.client.shm_path import lease_slots
from kvstore.errors import BlockBusy
from kvstore.proto import kvstore_pb2 as pb

BLOCK = 64 << 10
LAYOUT = KVLayout(model="test/put-after-delete", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                  block_tokens=16, block_bytes=BLOCK)


def _block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def _counters(client) -> dict:
    return client.stats()["counters"]


def _held_by_a_reader(reader, ns: bytes, hashes: list[bytes]) -> int:
    """Store ``hashes`` (block i = ``_block(i)``) and pin them with a load lease; its id."""
    assert reader.put(ns, hashes, [_block(i) for i in range(len(hashes))])
    lease = reader.call("PrepareLoad", pb.PrepareLoadRequest(namespace_id=ns, hashes=hashes))
    assert len(lease_slots(lease)[0]) == len(hashes)
    return lease.lease_id


@pytest.mark.parametrize("transport", ["grpc", "bulk", "shm"])
def test_a_put_after_a_delete_waits_for_the_reader_and_stores_the_new_bytes(daemon_factory, transport):
    d = daemon_factory("--lease-seconds", "2")
    hashes = ChainHasher(seed=3).chain(np.arange(16 * 3), 16)
    with d.client(transport="shm") as reader, d.client(transport=transport) as writer:
        ns = reader.register_namespace(Namespace(LAYOUT))
        assert writer.register_namespace(Namespace(LAYOUT)) == ns
        lease_id = _held_by_a_reader(reader, ns, hashes)
        assert writer.delete(ns, hashes[1:2]) == 1          # doomed: the reader still holds it
        assert writer.get(ns, hashes[1:2]) == [None]

        release = threading.Timer(0.3, reader.call, ("CompleteLoad", pb.LeaseRequest(lease_id=lease_id)))
        release.start()
        started = time.monotonic()
        results = writer.put(ns, hashes, [_block(0), _block(100), _block(2)])
        waited = time.monotonic() - started
        release.join()

        assert results[0] == results[2] == "exists"
        assert results[1] == "stored"
        assert waited >= 0.2, f"the put did not wait for the reader ({waited:.3f}s)"
        assert writer.get(ns, hashes) == [_block(0).tobytes(), _block(100).tobytes(), _block(2).tobytes()]
        assert _counters(writer)["put_waited_for_delete"] == 1


def test_a_put_after_a_delete_waits_out_an_abandoned_lease(daemon_factory):
    """The reader never completes its load: its pin ends when the lease expires (1 s here)."""
    d = daemon_factory("--lease-seconds", "1")
    hashes = ChainHasher(seed=4).chain(np.arange(16 * 2), 16)
    with d.client(transport="shm") as reader, d.client(transport="grpc") as writer:
        ns = reader.register_namespace(Namespace(LAYOUT))
        writer.register_namespace(Namespace(LAYOUT))
        _held_by_a_reader(reader, ns, hashes)
        assert writer.delete(ns, hashes) == 2
        started = time.monotonic()
        assert writer.put(ns, hashes, [_block(7), _block(8)]) == ["stored", "stored"]
        assert time.monotonic() - started >= 0.5
        assert writer.get(ns, hashes) == [_block(7).tobytes(), _block(8).tobytes()]


def test_puts_waiting_on_deleted_blocks_are_bounded_and_refused_with_a_retryable_error(daemon_factory):
    """At most 4 puts wait at once (each holds a request thread); a fifth is refused at once with
    ``BlockBusy``, and one still held past the bound (3 s here) is refused too. Nothing is lost:
    a refused put stored nothing and says so; the block is put once the reader is gone."""
    d = daemon_factory("--lease-seconds", "30")
    hashes = ChainHasher(seed=5).chain(np.arange(16 * 6), 16)
    with d.client(transport="shm") as reader, d.client(transport="grpc") as writer:
        ns = reader.register_namespace(Namespace(LAYOUT))
        writer.register_namespace(Namespace(LAYOUT))
        lease_id = _held_by_a_reader(reader, ns, hashes)
        assert writer.delete(ns, hashes) == 6

        outcomes: dict[int, object] = {}

        def put(i: int) -> None:
            with d.client(transport="grpc") as c:
                c.register_namespace(Namespace(LAYOUT))
                try:
                    outcomes[i] = c.put(ns, hashes[i:i + 1], [_block(50 + i)], parent=hashes[i - 1] if i else None)
                except BlockBusy as e:
                    outcomes[i] = e

        waiting = [threading.Thread(target=put, args=(i,)) for i in range(4)]
        for t in waiting:
            t.start()
        time.sleep(1.0)
        started = time.monotonic()
        put(4)                                   # four already wait: refused at once
        assert isinstance(outcomes[4], BlockBusy) and outcomes[4].field == "hashes"
        assert time.monotonic() - started < 1.0
        for t in waiting:
            t.join()
        assert all(isinstance(outcomes[i], BlockBusy) for i in range(4)), outcomes   # past the 3 s bound
        assert writer.get(ns, hashes) == [None] * 6

        put(5)                                   # one alone: waits its 3 s, still held, refused
        assert isinstance(outcomes[5], BlockBusy)
        assert _counters(writer)["put_rejected_busy"] == 6

        reader.call("CompleteLoad", pb.LeaseRequest(lease_id=lease_id))
        assert writer.put(ns, hashes, [_block(60 + i) for i in range(6)]) == ["stored"] * 6
        assert writer.get(ns, hashes) == [_block(60 + i).tobytes() for i in range(6)]
