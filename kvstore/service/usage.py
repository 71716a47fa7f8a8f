"""How each namespace is used: blocks asked and found by lookups, and when it was last looked up.

A prefix cache is judged by its lookups (an engine asks how much of a prompt is cached before it
loads anything), so that is what is counted, once per client call, after fleet completion: the
hit ratio ``kvstore ns list`` shows and the per-namespace metrics export. Only namespaces a caller
was allowed to name are recorded, so the table is bounded by the namespace registry. Counters
start at zero with the daemon.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict


@dataclasses.dataclass
class Usage:
    lookup_blocks: int = 0   # blocks asked
    lookup_hits: int = 0     # of those, found (the leading run of each chain)
    last_used: float = 0.0   # unix time of the last lookup


class NamespaceUsage:
    """Per-namespace lookup counters, written from worker threads."""

    def __init__(self) -> None:
        self._usage: defaultdict[bytes, Usage] = defaultdict(Usage)
        self._lock = threading.Lock()

    def looked_up(self, namespace_id: bytes, asked: int, found: int) -> None:
        with self._lock:
            usage = self._usage[namespace_id]
            usage.lookup_blocks += asked
            usage.lookup_hits += found
            usage.last_used = time.time()

    def snapshot(self) -> dict[bytes, Usage]:
        with self._lock:
            return {ns: dataclasses.replace(u) for ns, u in self._usage.items()}

    def forget(self, namespace_id: bytes) -> None:
        with self._lock:
            self._usage.pop(namespace_id, None)
