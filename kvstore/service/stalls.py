"""Calls that stopped making progress: registered while they wait on their peer, cut when idle.

A caller can stop sending (a request message that never comes, a Put stream that stops halfway,
a side-channel transfer that stalls) or stop reading (a Get it never drains). Each such call holds
something — a stream, a pinned window of the arena, a worker thread blocked on the side-channel
socket — so a handful of slowloris clients would starve everyone. Whoever waits on a peer
registers the call here and ``touch``es it on every sign of progress; the daemon's housekeeping
thread calls ``cancel_stalled`` and ends every call idle for longer than the bound.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("kvstore.service.stalls")


class StallWatch:
    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.cancelled = 0   # calls cut so far
        self._calls: dict[object, tuple[list[float], Callable[[], None], Callable[[], None] | None]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def watch(self, cancel: Callable[[], None],
              on_stall: Callable[[], None] | None = None) -> Iterator[Callable[[], None]]:
        """Watch one call while the body runs; yields ``touch()``. A stalled call gets
        ``on_stall()`` (e.g. drop its side-channel session, waking a blocked thread), then
        ``cancel()``."""
        key = object()
        last = [time.monotonic()]

        def touch() -> None:
            last[0] = time.monotonic()

        with self._lock:
            self._calls[key] = (last, cancel, on_stall)
        try:
            yield touch
        finally:
            with self._lock:
                self._calls.pop(key, None)

    @property
    def open_calls(self) -> int:
        return len(self._calls)

    def cancel_stalled(self, idle_s: float | None = None) -> int:
        """End every watched call idle for longer than ``idle_s`` (default: the watch's bound)."""
        idle_s = self.idle_s if idle_s is None else idle_s
        now = time.monotonic()
        with self._lock:
            stalled = [(cancel, on_stall) for last, cancel, on_stall in self._calls.values() if last[0] < now - idle_s]
            for last, _, _ in self._calls.values():
                if last[0] < now - idle_s:
                    last[0] = now   # once per idle period, not on every tick
        if stalled:   # one line per sweep: a crowd of slowloris callers must not flood the log
            log.warning("cutting %d call(s) idle for more than %.1fs (stalled clients)", len(stalled), idle_s)
        for cancel, on_stall in stalled:
            if on_stall is not None:
                on_stall()
            cancel()
        self.cancelled += len(stalled)
        return len(stalled)
