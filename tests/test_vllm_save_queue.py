"""The vLLM connector's background saver (``connectors/vllm/saver.py``) against a real daemon, with
real paged KV tensors on the CPU: a finished request's blocks are copied out and saved even when
the gather thread cannot get the GIL while the engine's thread keeps stepping.

That is what stalled a prefill's hand-off on a quiet host (the real-model ``test_vllm_pd``): vLLM's
CPU worker binds its threads to one core, and while a finished request waits to be reported as
saved the engine steps without pause. Each step's thread gives the GIL up only briefly and takes
it back at once, so the gather thread, woken each time, never got it until the engine's next real
forward pass (11-30 s). Here the engine's thread is this test's thread, stepping in pure Python,
and the GIL's forced switch is put out of reach (``sys.setswitchinterval``): the gather thread
cannot run at all meanwhile, as on that host. The send thread is kept from the GIL the same way;
a producer's worker therefore waits at ``finish`` for the request's put.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.client import NamespaceHandle  # noqa: E402
from kvstore.connectors.vllm.paged_blocks import PagedBlocks  # noqa: E402
from kvstore.connectors.vllm.saver import SaveQueue  # noqa: E402
from kvstore.keys import ChainHasher, KVLayout, Namespace  # noqa: E402

LAYOUT = KVLayout(model="test/save-queue", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=16)
NUM_BLOCKS = 32


def _paged() -> PagedBlocks:
    """vLLM's CPU layout: per layer [num_blocks, K/V, block tokens, heads, head dim], random bytes."""
    g = torch.Generator().manual_seed(38)
    caches = {f"layer.{i}": torch.randint(-2**15, 2**15, (NUM_BLOCKS, 2, 16, 2, 64), generator=g,
                                          dtype=torch.int16).view(torch.bfloat16) for i in range(2)}
    return PagedBlocks(caches, list(caches), NUM_BLOCKS)


def _expected(paged: PagedBlocks, block_ids: list[int]) -> list[bytes]:
    return [b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in paged.layers)
            for b in block_ids]


def _assert_saved(paged: PagedBlocks, handle: NamespaceHandle, stats: dict, hashes: list[bytes],
                  block_ids: list[int]) -> None:
    """Once the saver drained, the daemon holds exactly the pages of ``block_ids`` under ``hashes``,
    in order, every one counted saved and none failed."""
    deadline = time.monotonic() + 10
    while not all(handle.exists(hashes)) and time.monotonic() < deadline:
        time.sleep(0.01)
    outs = [np.zeros(LAYOUT.block_bytes, dtype=np.uint8) for _ in hashes]
    assert handle.get_into(hashes, outs) == [LAYOUT.block_bytes] * len(hashes)
    assert [o.tobytes() for o in outs] == _expected(paged, block_ids)
    assert stats.get("saved_blocks") == len(hashes) and not stats.get("save_failed_blocks"), stats


def _saver(daemon_factory, salt: str):
    """A daemon, random paged KV, a handle on a namespace of its own and a ``SaveQueue`` over them,
    counting into ``stats``."""
    d = daemon_factory()
    paged = _paged()
    handle = NamespaceHandle(Namespace(LAYOUT, cache_salt=salt), url=d.url, timeout_s=5.0, name="saves")
    assert handle.register()
    stats: dict[str, float] = {}
    saver = SaveQueue(handle, paged, 8, lambda k, v: stats.__setitem__(k, stats.get(k, 0) + v))
    return paged, handle, saver, stats


def _steps_until(saver: SaveQueue, req_id: str, block_ids: list[int], hashes: list[bytes], done, **finish) -> int | None:
    """Submit ``req_id``'s blocks, then step as the engine's thread does with the GIL's forced
    switch out of reach: each empty step calls ``finish`` and asks ``done()``, letting the GIL go
    only where ``finish`` blocks. The first step after which ``done()`` held; None after 200."""
    switch = sys.getswitchinterval()
    try:
        sys.setswitchinterval(1000.0)
        saver.submit(req_id, block_ids, hashes, None)
        for step in range(200):
            saver.finish(req_id, **finish)
            if done():
                return step
        return None
    finally:
        sys.setswitchinterval(switch)


def test_a_finished_request_is_copied_out_by_the_stepping_thread_when_the_gather_thread_cannot_run(daemon_factory):
    paged, handle, saver, stats = _saver(daemon_factory, "save-queue")
    assert paged.block_bytes == LAYOUT.block_bytes
    block_ids = [3, 17, 5, 30, 9]
    hashes = ChainHasher(seed=38).chain(np.arange(16 * len(block_ids)), 16)
    # each step asks (as WorkerSide.get_finished does) whether the request's blocks are out of the paged cache
    reported_at = _steps_until(saver, "req-1", block_ids, hashes, lambda: saver.ungathered("req-1") == 0)
    assert reported_at == 0, f"still ungathered after 200 steps (step {reported_at})"
    # the copy went on to the daemon: exactly the pages of those blocks, in order
    saver.drain(10.0)
    _assert_saved(paged, handle, stats, hashes, block_ids)
    saver.close()
    handle.close()


def test_the_gather_thread_still_copies_batches_nobody_finishes(daemon_factory):
    """Without ``finish`` (a request still running), the gather thread copies each batch once,
    and a batch ``finish`` took is not copied again by it."""
    paged, handle, saver, stats = _saver(daemon_factory, "save-queue-2")
    chain = ChainHasher(seed=39).chain(np.arange(16 * 6), 16)
    saver.submit("running", [1, 2, 3], chain[:3], None)
    saver.submit("finished", [4, 5, 6], chain[3:], chain[2])
    assert saver.finish("finished")
    assert saver.wait_gathered(10.0) and saver.ungathered("running") == 0
    saver.drain(10.0)
    _assert_saved(paged, handle, stats, chain, [1, 2, 3, 4, 5, 6])
    saver.close()
    handle.close()


def test_a_producer_s_finished_request_is_in_the_daemon_when_finish_returns(daemon_factory):
    """A producer's worker waits at ``finish`` for the request's put (``sent_within_s``): blocked
    there it lets the GIL go, so the send thread, which the stepping thread otherwise keeps from
    running, stores the blocks before the request is reported. Without the wait the put would
    not start before the engine's next real forward pass (here: never, the switch out of reach)."""
    paged, handle, saver, stats = _saver(daemon_factory, "save-queue-3")
    block_ids = [7, 2, 11, 25]
    hashes = ChainHasher(seed=40).chain(np.arange(16 * len(block_ids)), 16)
    saved_at = _steps_until(saver, "prefill", block_ids, hashes, lambda: stats.get("saved_blocks") == len(hashes),
                            sent_within_s=10.0)
    assert saved_at == 0, f"not saved after 200 steps (step {saved_at}): {stats}"
    outs = [np.zeros(LAYOUT.block_bytes, dtype=np.uint8) for _ in hashes]
    assert handle.get_into(hashes, outs) == [LAYOUT.block_bytes] * len(hashes)
    assert [o.tobytes() for o in outs] == _expected(paged, block_ids)
    saver.close()
    handle.close()
