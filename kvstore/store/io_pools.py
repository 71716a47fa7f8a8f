"""Thread pools for a store's slow-tier I/O: the disk reads and writes one call overlaps (each
waits on the device with the GIL released). Made on first use, so a store without a slow tier
starts no threads, and shared by every store in the process."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


class LazyPool:
    """A ``ThreadPoolExecutor`` of ``workers`` threads named ``name``, created by the first ``get``."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers, self.name = workers, name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            return self._pool
