"""``buffers.copy_each`` / ``copy_each_in``, the copy loops of same-host gets and puts: a run
large enough is copied by several threads taking parts of it in turn. Every block must land whole
in its own place, whatever the lengths, wherever the parts are cut, and however many threads take
part; a put's lease check, run before each part, stops the copy when it raises."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import buffers
from kvstore.keys import ChainHasher, KVLayout, Namespace


@pytest.fixture
def small_parts(monkeypatch):
    """Parts of 4 KiB and 3 threads, so runs of a few KiB are split as 8 MiB runs are."""
    monkeypatch.setattr(buffers, "COPY_PART_BYTES", 4096)
    monkeypatch.setattr(buffers, "COPY_THREADS", 3)


def run_copies(lengths: list[int], seed: int):
    rng = np.random.default_rng(seed)
    arena = rng.integers(0, 256, sum(lengths) + 4096, dtype=np.uint8)
    offsets = list(rng.permutation(len(lengths)))   # blocks sit in the arena in another order
    at, placed = 0, [0] * len(lengths)
    for k in offsets:
        placed[k] = at
        at += lengths[k]
    dsts = [np.zeros(n, dtype=np.uint8) for n in lengths]
    buffers.copy_each(arena, placed, lengths, dsts)
    return arena, placed, dsts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(1, 20_000), min_size=1, max_size=60), st.integers(0, 2**32 - 1))
def test_every_block_lands_whole_in_its_own_destination(small_parts, lengths, seed):
    arena, placed, dsts = run_copies(lengths, seed)
    for off, n, dst in zip(placed, lengths, dsts):
        assert np.array_equal(dst, arena[off:off + n])


def test_a_large_run_is_copied_by_several_threads(small_parts, monkeypatch):
    seen: set[str] = set()
    copy_run = buffers._copy_run

    def noting(*args):
        seen.add(threading.current_thread().name)
        copy_run(*args)
        time.sleep(0.001)   # a part takes a while, as an 8 MiB one does: on a loaded host the
        # calling thread could otherwise take every part before a pool thread is scheduled

    monkeypatch.setattr(buffers, "_copy_run", noting)
    arena, placed, dsts = run_copies([3000] * 200, seed=1)
    assert all(np.array_equal(d, arena[o:o + 3000]) for o, d in zip(placed, dsts))
    assert len(seen) > 1 and any(name.startswith("kvstore-copy") for name in seen)
    seen.clear()
    run_copies([3000], seed=2)   # under two parts' worth: this thread alone
    assert seen == {threading.current_thread().name}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(1, 20_000), min_size=1, max_size=60), st.integers(0, 2**32 - 1))
def test_every_block_lands_whole_in_its_own_place_in_the_arena(small_parts, lengths, seed):
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    arena = np.zeros(sum(lengths) + 4096, dtype=np.uint8)
    order, at, placed = rng.permutation(len(lengths)), 0, [0] * len(lengths)
    for k in order:
        placed[k] = at
        at += lengths[k]
    buffers.copy_each_in(arena, placed, srcs)
    for off, src in zip(placed, srcs):
        assert np.array_equal(arena[off:off + src.nbytes], src)
    assert not arena[at:].any()   # nothing written past the last block


def test_a_check_that_raises_stops_the_copy_in(small_parts):
    srcs = [np.full(4096, 7, dtype=np.uint8) for _ in range(60)]
    arena = np.zeros(60 * 4096, dtype=np.uint8)
    calls = []

    def running_out():
        calls.append(1)
        if len(calls) > 4:
            raise TimeoutError("the lease ran out")

    with pytest.raises(TimeoutError):
        buffers.copy_each_in(arena, [k * 4096 for k in range(60)], srcs, running_out)
    copied = int(np.count_nonzero(arena)) // 4096
    assert copied == 4   # the parts checked before it ran out; the other threads stopped too
    settled = arena.copy()
    time.sleep(0.05)
    assert np.array_equal(arena, settled)   # and no thread still copies once the caller hears of it


def test_a_copy_that_fails_stops_every_thread_before_it_raises(small_parts):
    arena = np.random.default_rng(3).integers(1, 256, 200 * 4096, dtype=np.uint8)
    dsts = [np.zeros(4096, dtype=np.uint8) for _ in range(200)]
    dsts[5] = np.zeros(4095, dtype=np.uint8)   # a destination of the wrong size: that part fails
    with pytest.raises(ValueError):
        buffers.copy_each(arena, [k * 4096 for k in range(200)], [4096] * 200, dsts)
    filled = sum(bool(d.any()) for d in dsts)
    assert filled < 5 + 3 * 2   # the parts before it, and at most a part or two per thread after
    settled = [d.copy() for d in dsts]
    time.sleep(0.05)
    assert all(np.array_equal(a, b) for a, b in zip(dsts, settled))   # nothing copies on afterwards


@pytest.mark.parametrize("block_bytes", [256 * 1024, 1024 * 1024])
def test_large_puts_and_gets_through_the_arena_read_back_exactly(daemon_factory, block_bytes):
    """The real path: runs of 24 MiB copied in and out by several threads of the client."""
    d = daemon_factory("--cpu-slot-bytes", str(block_bytes), cpu_bytes="96MiB", nvme_bytes="0")
    count = (24 << 20) // block_bytes
    layout = KVLayout(model="test/copies", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                      block_tokens=16, block_bytes=block_bytes)
    with d.client(transport="shm") as c:
        assert c.active_transport == "shm"
        ns = c.register_namespace(Namespace(layout, cache_salt="copies"))
        hashes = ChainHasher(seed=5).chain(np.arange(16 * count), 16)
        rng = np.random.default_rng(5)
        data = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(count)]
        assert c.put(ns, hashes, data) == ["stored"] * count
        outs = [np.zeros(block_bytes, dtype=np.uint8) for _ in range(count)]
        assert c.get_into(ns, hashes, outs) == [block_bytes] * count
        assert all(np.array_equal(o, b) for o, b in zip(outs, data))
        assert c.stats()["leases"] == 0
