"""Python's garbage collector as the daemon's callers feel it: every collection stops all threads.

Why: a full (generation 2) collection walks every container object the process holds, with the
GIL held, so every request in flight waits for it. Most of those objects are built once at
start-up (imported modules, gRPC's and numpy's, the tiers, an index recovered from NVMe) and live
for good, so walking them again and again finds nothing. Once the daemon serves, it moves them out
of the collector's sight (``gc.freeze``): later collections walk only what was made since. Every
collection's pause is timed (``gc.callbacks``) and shown per generation in ``kvstore stats`` and
the metrics, so a latency tail the collector causes can be told from one the disk causes.
"""

from __future__ import annotations

import gc
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

GENERATIONS = 3


class GcPauses:
    """Counts, total and longest pause of the collections of each generation since ``install``.
    The callback runs with the GIL held, one collection at a time: no lock is needed."""

    def __init__(self) -> None:
        self.count = [0] * GENERATIONS
        self.total_s = [0.0] * GENERATIONS
        self.max_s = [0.0] * GENERATIONS
        self.frozen = 0
        self._started = 0.0

    def install(self) -> None:
        if self._on_collect not in gc.callbacks:
            gc.callbacks.append(self._on_collect)

    def uninstall(self) -> None:
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)

    def freeze_startup_objects(self) -> int:
        """Collect once, then keep everything alive now out of later collections; how many objects.
        The pause figures start again from here: they describe serving, not start-up."""
        gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        self.count, self.total_s, self.max_s = [0] * GENERATIONS, [0.0] * GENERATIONS, [0.0] * GENERATIONS
        return self.frozen

    def _on_collect(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        g = info.get("generation", GENERATIONS - 1)
        self.count[g] += 1
        self.total_s[g] += pause
        self.max_s[g] = max(self.max_s[g], pause)

    def stats(self) -> dict:
        return {"frozen_objects": self.frozen,
                "generations": {str(g): {"collections": self.count[g],
                                         "pause_total_ms": round(self.total_s[g] * 1e3, 3),
                                         "pause_max_ms": round(self.max_s[g] * 1e3, 3)}
                                for g in range(GENERATIONS)}}


class GcPauseCollector(Collector):
    """``kvstore_gc_*`` for Prometheus, read from a ``GcPauses`` at scrape time."""

    def __init__(self, pauses: GcPauses) -> None:
        self.pauses = pauses

    def collect(self):
        p = self.pauses
        total = CounterMetricFamily("kvstore_gc_pause_seconds", "Time every thread stood still in garbage "
                                    "collections, by generation (2: full collections)", labels=["generation"])
        longest = GaugeMetricFamily("kvstore_gc_pause_max_seconds", "The longest collection pause since start, "
                                    "by generation", labels=["generation"])
        for g in range(GENERATIONS):
            total.add_metric([str(g)], p.total_s[g])
            longest.add_metric([str(g)], p.max_s[g])
        yield total
        yield longest
        yield GaugeMetricFamily("kvstore_gc_frozen_objects", "Objects made before serving began, kept out of "
                                "collections (gc.freeze)", value=p.frozen)
