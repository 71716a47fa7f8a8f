"""The background saver: copies saved blocks out of the paged cache and sends them to the daemon,
so the engine waits neither for the copy nor for the network.

Two stages on two threads. The *gather* stage copies each batch of blocks out of vLLM's paged cache
into a buffer of its own; until it has, vLLM must not reuse those blocks, so the saver counts the
batches still to gather per request (the worker holds a finished request's blocks until its count
is zero, and waits for all of them before a preemption hands blocks to another request). The
*send* stage puts gathered batches to the daemon.

A finished request's batches are copied out by the engine's own thread (``finish``) if the gather
thread has not started them by the time the worker reports what finished. The gather thread needs
the GIL between its copies, and it can go without it for as long as the engine's thread keeps
stepping: on vLLM's CPU worker both threads are bound to one core, and while a finished request
waits to be reported the engine steps without pause (each empty step takes the GIL back at once
after every brief release, so the waiting thread is woken but never gets it). A prefill engine
that got no further request then held that request's copy, and so its hand-off, until its next
real step; the engine's thread copying the batch itself cannot wait on anything but the copy.

The send thread needs the GIL in the same way, between the steps of a put. A producer (P/D) names
its blocks to a decode engine that waits for them, so its worker also waits, at ``finish``, until a
finished request's batches are sent (at most ``SEND_WAIT_S``): blocked there it lets the GIL go for
as long as the put needs it, where vLLM's worker would otherwise spin (``sched_yield``) and take it
back after every brief release, and the put could wait for the engine's next real step.

Saves are best effort: when the send queue is full or the daemon is down (the handle's breaker is
open) a batch is dropped and counted, never retried — the engine recomputes what is missing.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from kvstore.client import NamespaceHandle
from kvstore.connectors.vllm.chunks import ChunkPacking
from kvstore.connectors.vllm.paged_blocks import PagedBlocks

logger = logging.getLogger("kvstore.connectors.vllm")

#: a save slower than this is logged: a decode engine waiting for it (P/D) waits as long
SLOW_SAVE_S = 1.0
#: the longest a producer's worker waits, as a request finishes, for its batches to be sent
SEND_WAIT_S = 1.0


class _Batch:
    """Blocks of one request queued for the gather stage; ``claimed`` once a thread copies them."""

    __slots__ = ("req_id", "block_ids", "hashes", "parent", "claimed")

    def __init__(self, req_id: str, block_ids: list[int], hashes: list[bytes], parent: bytes | None) -> None:
        self.req_id, self.block_ids, self.hashes, self.parent = req_id, block_ids, hashes, parent
        self.claimed = False


class SaveQueue:
    """Gathers and sends saved blocks on background threads; drops work when full or down."""

    def __init__(self, handle: NamespaceHandle, paged: PagedBlocks, max_pending: int,
                 stats_add: Callable[[str, int | float], None], packing: ChunkPacking | None = None) -> None:
        self.handle = handle
        self.paged = paged
        self.packing = packing   # N vLLM blocks per stored block: gathered, then repacked as one
        self.stats_add = stats_add
        self._to_gather: queue.Queue = queue.Queue()
        self._to_send: queue.Queue = queue.Queue(maxsize=max(1, max_pending))
        self._ungathered: collections.Counter[str] = collections.Counter()
        self._unsent: collections.Counter[str] = collections.Counter()   # per request: batches not yet put
        self._unclaimed: dict[str, list[_Batch]] = {}   # per request: batches no thread has started
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._gather_loop, name="kvstore-gather", daemon=True),
                         threading.Thread(target=self._send_loop, name="kvstore-save", daemon=True)]
        for t in self._threads:
            t.start()

    def submit(self, req_id: str, block_ids: list[int], hashes: list[bytes], parent: bytes | None) -> None:
        """Queue blocks of ``req_id`` for saving; they are read from the paged cache later."""
        if not self.handle.available():
            self.stats_add("save_skipped_blocks", len(hashes))
            return
        batch = _Batch(req_id, block_ids, hashes, parent)
        with self._cond:
            self._ungathered[req_id] += 1
            self._unsent[req_id] += 1
            self._unclaimed.setdefault(req_id, []).append(batch)
        self._to_gather.put(batch)

    def ungathered(self, req_id: str) -> int:
        """Batches of ``req_id`` whose blocks the saver has yet to copy out of the paged cache."""
        with self._cond:
            return self._ungathered.get(req_id, 0)

    def finish(self, req_id: str, timeout_s: float = 5.0, sent_within_s: float = 0.0) -> bool:
        """Copy out, on the calling thread, every batch of ``req_id`` the gather thread has not
        started, then wait (up to ``timeout_s``) for those it has; True once none is left. The
        worker calls this for a finished request, whose blocks vLLM holds until it is reported.
        With ``sent_within_s`` it then waits up to that long for them to be sent too (a producer's)."""
        with self._cond:
            mine = self._unclaimed.pop(req_id, [])
            for batch in mine:
                batch.claimed = True
        for batch in mine:
            self._gather(batch)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._ungathered.get(req_id, 0):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)   # lets go of the GIL: the gather thread ends its copy
            sent_by = time.monotonic() + sent_within_s
            while self._unsent.get(req_id, 0) and (left := sent_by - time.monotonic()) > 0:
                self._cond.wait(left)   # lets go of the GIL: the send thread ends its put
        return True

    def wait_gathered(self, timeout_s: float = 30.0) -> bool:
        """Block until every queued batch is copied out of the paged cache (before vLLM reuses blocks)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._ungathered:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def send(self, req_id: str, hashes: list[bytes], blocks, parent: bytes | None) -> None:
        """Queue blocks of ``req_id`` already copied out of the paged cache (``LayerSaves``) for
        the send stage; dropped and counted like any save when the daemon is down or the queue is full."""
        if not self.handle.available():
            self.stats_add("save_skipped_blocks", len(hashes))
            return
        if self.packing is not None:
            blocks = self.packing.to_chunks(blocks)
        with self._cond:
            self._unsent[req_id] += 1
        self._queue_send(req_id, hashes, blocks, parent)

    def _queue_send(self, req_id: str, hashes: list[bytes], blocks, parent: bytes | None) -> None:
        try:
            self._to_send.put_nowait((req_id, hashes, blocks, parent, time.monotonic()))
        except queue.Full:
            self.stats_add("save_dropped_blocks", len(hashes))
            self._sent(req_id)

    def _sent(self, req_id: str) -> None:
        """One batch of ``req_id`` is done with: stored, failed or dropped."""
        with self._cond:
            self._unsent[req_id] -= 1
            if self._unsent[req_id] <= 0:
                del self._unsent[req_id]
            self._cond.notify_all()

    def _gather_loop(self) -> None:
        while True:
            batch = self._to_gather.get()
            if batch is None:
                return
            with self._cond:
                if batch.claimed:        # finish() copied it out already
                    continue
                batch.claimed = True
                pending = self._unclaimed.get(batch.req_id, [])
                pending.remove(batch)
                if not pending:
                    self._unclaimed.pop(batch.req_id, None)
            self._gather(batch)

    def _gather(self, batch: _Batch) -> None:
        """Copy ``batch`` out of the paged cache and queue it for sending (either thread)."""
        blocks = None
        t0 = time.perf_counter()
        try:
            blocks = self.paged.host_buffer(len(batch.block_ids))   # page-locked on CUDA
            self.paged.gather(batch.block_ids, blocks)
            if self.packing is not None:
                blocks = self.packing.to_chunks(blocks)             # [hashes, chunk bytes]
        except Exception as e:  # noqa: BLE001
            logger.warning("kvstore connector: copying blocks of %s out failed: %s", batch.req_id, e)
            blocks = None
        self.stats_add("save_gather_seconds", time.perf_counter() - t0)
        with self._cond:
            self._ungathered[batch.req_id] -= 1
            if self._ungathered[batch.req_id] <= 0:
                del self._ungathered[batch.req_id]
            self._cond.notify_all()
        if blocks is None:
            self.stats_add("save_failed_blocks", len(batch.hashes))
            self._sent(batch.req_id)
            return
        self._queue_send(batch.req_id, batch.hashes, blocks, batch.parent)

    def _connect(self) -> None:
        """Agree the transport with the daemon (handshake, arena mapping) before the first save
        needs it: otherwise the first put pays it, seconds on a loaded host, while a decode
        engine may be waiting for that very put. A daemon not up yet is left to the first save."""
        started = time.monotonic()
        try:
            _ = self.handle.client.active_transport
        except Exception:  # noqa: BLE001 - the first save fails and counts it, as without this
            pass
        took = time.monotonic() - started
        if took > SLOW_SAVE_S:
            logger.warning("kvstore connector: agreeing the transport with the daemon took %.2fs", took)

    def _send_loop(self) -> None:
        self._connect()
        while True:
            item = self._to_send.get()
            if item is None:
                self._to_send.task_done()
                return
            req_id, hashes, blocks, parent, queued = item
            try:
                started = time.monotonic()
                arrays = [blocks[i].numpy() for i in range(len(hashes))]
                stored = self.handle.put(hashes, arrays, parent=parent)
                self.stats_add("saved_blocks" if stored else "save_failed_blocks", len(hashes))
                done = time.monotonic()
                if done - queued > SLOW_SAVE_S:   # a decode engine may be waiting for these
                    logger.warning("kvstore connector: a save of %d blocks ended %.2fs after it was queued "
                                   "(%.2fs waiting to be sent, %.2fs in the put, %s)", len(hashes), done - queued,
                                   started - queued, done - started, "stored" if stored else "not stored")
            finally:
                self._sent(req_id)
                self._to_send.task_done()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until queued saves are sent (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        self.wait_gathered(timeout_s)
        while self._to_send.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.drain()
        self._to_gather.put(None)
        try:
            self._to_send.put_nowait(None)
        except queue.Full:
            pass


class LayerSaves:
    """One step's saves copied out layer by layer, as the forward pass computes each layer
    (``save_mode: layer``): every saved block's layer-``i`` pages go into its row of one host
    buffer right after layer ``i``'s attention, so on CUDA the copies overlap the later layers and
    the blocks are out of vLLM's cache when the step ends. Complete once every layer was copied;
    the worker copies after the step instead when no layer was (a step without a forward pass) or
    only some were (an engine that skips ``save_kv_layer``: from then on, always). The buffer is
    taken at the first layer's copy, so a step without a forward pass costs nothing."""

    def __init__(self, transfers: list, paged: PagedBlocks) -> None:
        self.transfers = transfers
        self.paged = paged
        self._ids = [b for t in transfers for b in t.block_ids]
        self.rows: torch.Tensor | None = None
        self._idx: torch.Tensor | None = None
        self._copied: set[int] = set()

    def copy_layer(self, i: int) -> None:
        if self.rows is None:
            self.rows = self.paged.host_buffer(len(self._ids))   # page-locked on CUDA
            self._idx = torch.tensor(self._ids, dtype=torch.long, device=self.paged.device)
        self.paged.gather_layer(i, self._idx, self.rows)
        self._copied.add(i)

    @property
    def started(self) -> bool:
        return bool(self._copied)

    @property
    def complete(self) -> bool:
        return len(self._copied) == len(self.paged.layers)

    def batches(self):
        """``(transfer, its rows)`` for each saved request, once the copies have landed."""
        self.paged.settle()
        at = 0
        for t in self.transfers:
            yield t, self.rows[at:at + len(t.block_ids)]
            at += len(t.block_ids)
