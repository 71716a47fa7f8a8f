"""The background saver: sends gathered blocks to the daemon so the engine never waits on a save.

Saves are best effort: when the queue is full or the daemon is down (the handle's breaker is
open) a batch is dropped and counted, never retried — the engine recomputes what is missing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from kvstore.client import NamespaceHandle


class SaveQueue:
    """Sends gathered blocks to the daemon on a background thread; drops work when full or down."""

    def __init__(self, handle: NamespaceHandle, max_pending: int, stats_add: Callable[[str, int], None]) -> None:
        self.handle = handle
        self.stats_add = stats_add
        self._q: queue.Queue = queue.Queue(maxsize=max(1, max_pending))
        self._thread = threading.Thread(target=self._run, name="kvstore-save", daemon=True)
        self._thread.start()

    def submit(self, hashes: list[bytes], blocks: torch.Tensor, parent: bytes | None) -> None:
        if not self.handle.available():
            self.stats_add("save_skipped_blocks", len(hashes))
            return
        try:
            self._q.put_nowait((hashes, blocks, parent))
        except queue.Full:
            self.stats_add("save_dropped_blocks", len(hashes))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            hashes, blocks, parent = item
            arrays = [blocks[i].numpy() for i in range(len(hashes))]
            stored = self.handle.put(hashes, arrays, parent=parent)
            self.stats_add("saved_blocks" if stored else "save_failed_blocks", len(hashes))
            self._q.task_done()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until queued saves are sent (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.drain()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
