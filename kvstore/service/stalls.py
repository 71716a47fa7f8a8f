"""Calls that stopped making progress: registered while they wait on their peer, cut when idle.

A caller can stop sending (a request message that never comes, a Put stream that stops halfway,
a side-channel transfer that stalls) or stop reading (a Get it never drains). Each such call holds
something — a stream, a pinned window of the arena, a worker thread blocked on the side-channel
socket — so a handful of slowloris clients would starve everyone. Whoever waits on a peer
registers the call here and ``touch``es it on every sign of progress; the daemon's housekeeping
thread calls ``cancel_stalled`` and ends every call idle for longer than the bound. Time the
daemon itself spends on a call (storing a batch, reading blocks from disk, waiting for a deleted
block's last reader) is marked with ``Progress.working``: the caller is not the one stalling then,
so it is never cut for it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator

log = logging.getLogger("kvstore.service.stalls")


class Progress:
    """One watched call's signs of life: ``touch()`` when its peer moves, ``working()`` around
    the daemon's own work on it."""

    __slots__ = ("last", "busy")

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.busy = 0   # daemon work under way on the call (steps may nest on one thread)

    def touch(self) -> None:
        self.last = time.monotonic()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self.touch()   # the peer's bound starts again when the daemon is done

    def working_through(self, items: Iterable) -> Iterator:
        """``items`` with the daemon's work producing each one marked (e.g. blocks read from disk)."""
        it = iter(items)
        while True:
            with self.working():
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item


class StallWatch:
    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.cancelled = 0   # calls cut so far
        self._calls: dict[object, tuple[Progress, Callable[[], None], Callable[[], None] | None]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def watch(self, cancel: Callable[[], None],
              on_stall: Callable[[], None] | None = None) -> Iterator[Progress]:
        """Watch one call while the body runs; yields its ``Progress``. A stalled call gets
        ``on_stall()`` (e.g. drop its side-channel session, waking a blocked thread), then
        ``cancel()``."""
        key = object()
        progress = Progress()
        with self._lock:
            self._calls[key] = (progress, cancel, on_stall)
        try:
            yield progress
        finally:
            with self._lock:
                self._calls.pop(key, None)

    @property
    def open_calls(self) -> int:
        return len(self._calls)

    def cancel_stalled(self) -> int:
        """End every watched call idle for longer than the watch's bound."""
        idle_s, now = self.idle_s, time.monotonic()
        with self._lock:
            stalled = [(p, cancel, on_stall) for p, cancel, on_stall in self._calls.values()
                       if not p.busy and p.last < now - idle_s]
            for p, _, _ in stalled:
                p.last = now   # once per idle period, not on every tick
        if stalled:   # one line per sweep: a crowd of slowloris callers must not flood the log
            log.warning("cutting %d call(s) idle for more than %.1fs (stalled clients)", len(stalled), idle_s)
        for _, cancel, on_stall in stalled:
            if on_stall is not None:
                on_stall()
            cancel()
        self.cancelled += len(stalled)
        return len(stalled)
