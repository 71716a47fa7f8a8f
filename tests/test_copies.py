"""``buffers.copy_each``, the copy loop of every same-host get: a run large enough is copied by
several threads taking parts of it in turn. Every block must land in its own destination whole,
whatever the lengths, wherever the parts are cut, and however many threads take part."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import buffers


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

    monkeypatch.setattr(buffers, "_copy_run", noting)
    arena, placed, dsts = run_copies([3000] * 200, seed=1)
    assert all(np.array_equal(d, arena[o:o + 3000]) for o, d in zip(placed, dsts))
    assert len(seen) > 1 and any(name.startswith("kvstore-copy") for name in seen)
    seen.clear()
    run_copies([3000], seed=2)   # under two parts' worth: this thread alone
    assert seen == {threading.current_thread().name}
