"""The thread budget: every pool of worker threads the daemon starts is sized here, in one place,
from the cores this process may run on (``os.sched_getaffinity``, which a container's cpuset or
``taskset`` narrows), so no pool is sized for a machine the process does not have. ``kvstore stats``
shows it (``server.threads``).

Pools of threads that wait on a disk or a socket with the GIL released (gRPC handlers, same-host
lease calls, slow-tier reads and writes) may outnumber the cores: their size is a queue depth,
with a floor that keeps a small machine's disk busy. Pools that compute (a large copy split into
parts, a codec's kernels) get at most one thread per core. A pool that not every process needs
is a ``LazyPool``: a store without a slow tier starts no threads.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor


@dataclasses.dataclass(frozen=True)
class ThreadBudget:
    cores: int         # the cores this process may run on
    rpc: int           # gRPC request threads (the ``workers`` setting, where given, instead)
    local_calls: int   # same-host lease calls served at once (``transport.local_calls``)
    slow_reads: int    # disk or network reads one store call keeps in flight (``store.reads``)
    disk_writes: int   # disk writes one put keeps in flight (``store.puts``)
    copy: int          # threads one large arena copy is split across (``buffers.copy_each``)
    codec: int         # threads one large block's encode or decode is split across (``codecs.fast_runner``)
    http: int          # requests of the HTTP port (``/metrics``, ``/v1/route``) answered at once

    @classmethod
    def for_cores(cls, cores: int) -> ThreadBudget:
        io = min(16, max(4, cores))
        return cls(cores=cores, rpc=min(64, max(16, 4 * cores)), local_calls=io, slow_reads=io, disk_writes=io,
                   copy=min(4, cores), codec=cores, http=min(4, io))

    def with_rpc(self, rpc: int | None) -> ThreadBudget:
        """This budget with ``rpc`` request threads (None: as sized here)."""
        return self if rpc is None else dataclasses.replace(self, rpc=rpc)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


#: this process's budget
BUDGET = ThreadBudget.for_cores(len(os.sched_getaffinity(0)))


class LazyPool:
    """A ``ThreadPoolExecutor`` of ``workers`` threads named ``name``, created by the first ``get``
    and shared by every caller in the process."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers, self.name = workers, name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            return self._pool
